"""Job configuration: the JobConfig dataclasses and the TOML/command-line parser.

job_config.py holds the sections, keys, defaults, docstrings and allowed ranges;
parser.py reads the TOML file and the command line and writes --help and TOML;
torchtitan_compat.py maps torchtitan 0.2 keys (tables in torchtitan_keys.py);
validation.py checks the merged config; schema.py holds what those share.
"""

from titanlite.config.job_config import (
    CHECKPOINT_PARTS,
    EMA,
    RAW_DATASETS,
    TRAINING_DATASETS,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Data,
    Debug,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from titanlite.config.parser import (
    format_help,
    parse_args,
    parse_args_or_exit,
    parse_args_with_warnings,
    show_config_warnings,
    to_dict,
    to_toml,
    value_text,
)
from titanlite.config.schema import ConfigError, field_docstrings
from titanlite.config.validation import validate

__all__ = [
    "CHECKPOINT_PARTS",
    "RAW_DATASETS",
    "TRAINING_DATASETS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Data",
    "Debug",
    "EMA",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "field_docstrings",
    "format_help",
    "parse_args",
    "parse_args_or_exit",
    "parse_args_with_warnings",
    "show_config_warnings",
    "to_dict",
    "to_toml",
    "validate",
    "value_text",
]
