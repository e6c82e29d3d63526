"""Job configuration: the JobConfig dataclasses and the TOML/command-line parser."""

from titanlite.config.job_config import (
    ActivationCheckpoint,
    Comm,
    Compile,
    Debug,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
)
from titanlite.config.manager import (
    ConfigError,
    format_help,
    parse_args,
    parse_args_or_exit,
    to_dict,
    to_toml,
    validate,
)

__all__ = [
    "ActivationCheckpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Debug",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Training",
    "format_help",
    "parse_args",
    "parse_args_or_exit",
    "to_dict",
    "to_toml",
    "validate",
]
