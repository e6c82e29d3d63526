"""Job configuration: the JobConfig dataclasses and the TOML/command-line parser.

job_config.py holds JobConfig, whose fields are the sections; each section's keys, defaults,
docstrings and allowed ranges are in the file of its concern (job.py, model.py, training.py,
optimizer.py, parallelism.py, quantize.py, checkpoint.py, metrics.py; the shared ranges in
ranges.py);
parser.py reads the TOML file and the command line and writes --help and TOML;
torchtitan_compat.py maps torchtitan 0.2 keys (tables in torchtitan_keys.py);
validation.py checks the merged config; schema.py holds what those share.
"""

from titanlite.config.checkpoint import CHECKPOINT_PARTS, Checkpoint
from titanlite.config.job import Comm, Debug, Job
from titanlite.config.job_config import JobConfig
from titanlite.config.metrics import Metrics, Profiling
from titanlite.config.model import Model
from titanlite.config.optimizer import EMA, LRScheduler, Optimizer
from titanlite.config.parallelism import ActivationCheckpoint, Compile, Parallelism
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
from titanlite.config.training import RAW_DATASETS, TRAINING_DATASETS, Data, Training, Validation
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
