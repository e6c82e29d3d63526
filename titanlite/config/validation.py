"""Range and consistency rules, checked once the TOML file and the command line are merged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from titanlite.config.job_config import CHECKPOINT_PARTS, JobConfig
from titanlite.config.schema import ConfigError, get_value

COMPILE_COMPONENTS = ("model", "loss")


def _is_selective_ac_option(option: str) -> bool:
    return option == "op" or (option.isascii() and option.isdigit() and int(option) >= 1)


def _minus_one_or_positive(number: int) -> bool:
    return number == -1 or number >= 1


# (key, what is allowed, check). Every key listed here must exist in job_config.py.
RANGE_RULES: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("training.steps",                              ">= 1",                    lambda v: v >= 1),
    ("training.local_batch_size",                   ">= 1",                    lambda v: v >= 1),
    ("training.global_batch_size",                  "-1 or >= 1",              _minus_one_or_positive),
    ("training.seq_len",                            ">= 1",                    lambda v: v >= 1),
    ("training.max_norm",                           ">= 0",                    lambda v: v >= 0),
    ("training.gc_freq",                            ">= 1",                    lambda v: v >= 1),
    ("optimizer.lr",                                "> 0",                     lambda v: v > 0),
    ("optimizer.beta1",                             "in [0, 1)",               lambda v: 0 <= v < 1),
    ("optimizer.beta2",                             "in [0, 1)",               lambda v: 0 <= v < 1),
    ("optimizer.eps",                               "> 0",                     lambda v: v > 0),
    ("optimizer.weight_decay",                      ">= 0",                    lambda v: v >= 0),
    ("lr_scheduler.warmup_steps",                   ">= 0",                    lambda v: v >= 0),
    ("lr_scheduler.decay_ratio",                    "in [0, 1] or unset",      lambda v: v is None or 0 <= v <= 1),
    ("lr_scheduler.min_lr_factor",                  "in [0, 1]",               lambda v: 0 <= v <= 1),
    ("parallelism.data_parallel_replicate_degree",  "-1 or >= 1",              _minus_one_or_positive),
    ("parallelism.data_parallel_shard_degree",      "-1 or >= 1",              _minus_one_or_positive),
    ("activation_checkpoint.selective_ac_option",   "'op' or a positive integer", _is_selective_ac_option),
    ("compile.components",                          "a subset of model, loss", lambda v: set(v) <= set(COMPILE_COMPONENTS)),
    ("checkpoint.interval",                         ">= 1",                    lambda v: v >= 1),
    ("checkpoint.keep_latest_k",                    ">= 0",                    lambda v: v >= 0),
    ("checkpoint.keep_every",                       ">= 0",                    lambda v: v >= 0),
    ("checkpoint.load_step",                        "-1 or >= 0",              lambda v: v >= -1),
    ("checkpoint.exclude_from_loading",             f"a subset of {', '.join(CHECKPOINT_PARTS)}", lambda v: set(v) <= set(CHECKPOINT_PARTS)),
    ("checkpoint.stop_save_seconds",                ">= 1",                    lambda v: v >= 1),
    ("ema.decay",                                   "in [0, 1)",               lambda v: 0 <= v < 1),
    ("metrics.log_freq",                            ">= 1",                    lambda v: v >= 1),
    ("metrics.peak_tflops",                         ">= 0",                    lambda v: v >= 0),
    ("validation.local_batch_size",                 "-1 or >= 1",              _minus_one_or_positive),
    ("validation.seq_len",                          "-1 or >= 1",              _minus_one_or_positive),
    ("validation.freq",                             ">= 1",                    lambda v: v >= 1),
    ("validation.steps",                            "-1 or >= 1",              _minus_one_or_positive),
    ("profiling.profile_freq",                      ">= 1",                    lambda v: v >= 1),
    ("comm.init_timeout_seconds",                   ">= 1",                    lambda v: v >= 1),
    ("comm.train_timeout_seconds",                  ">= 1",                    lambda v: v >= 1),
    ("comm.trace_buf_size",                         ">= 0",                    lambda v: v >= 0),
    ("training.skip_nonfinite_steps",               ">= 0",                    lambda v: v >= 0),
    ("data.prefetch",                               ">= 0",                    lambda v: v >= 0),
)  # fmt: skip


def _check_one_inferred_degree(config: JobConfig) -> None:
    # -1 means "whatever is left of the world size", which only one degree can take.
    inferred = [
        f"parallelism.{f.name}"
        for f in dataclasses.fields(config.parallelism)
        if f.name.endswith("_degree") and getattr(config.parallelism, f.name) == -1
    ]
    if len(inferred) > 1:
        raise ConfigError(f"at most one parallelism degree may be -1, got -1 for {' and '.join(inferred)}")


# Datasets that read no path: a path given to one of them would be silently ignored.
DATASETS_WITHOUT_PATH = ("python_stdlib",)
DATASETS_NEEDING_PATH = ("prepared", "text", "huggingface")


def _check_dataset_path(section: str, dataset: str, dataset_path: str | None) -> None:
    if dataset in DATASETS_NEEDING_PATH and dataset_path is None:
        raise ConfigError(f"{section}.dataset_path must be set when {section}.dataset is '{dataset}'")
    if dataset in DATASETS_WITHOUT_PATH and dataset_path is not None:
        # The list of names in this message is part of its fixed wording (tests match it).
        raise ConfigError(
            f"{section}.dataset_path ({dataset_path}) is set, but {section}.dataset '{dataset}' reads no path; "
            f"unset it, or pick the dataset that reads it (prepared, text, huggingface, c4, c4_test)"
        )


def _check_dataset_has_path(config: JobConfig) -> None:
    _check_dataset_path("training", config.training.dataset, config.training.dataset_path)


def _check_validation(config: JobConfig) -> None:
    validation = config.validation
    if not validation.enable:
        return
    _check_dataset_path("validation", validation.dataset, validation.dataset_path)
    if validation.seq_len > config.training.seq_len:
        raise ConfigError(
            f"validation.seq_len ({validation.seq_len}) must not exceed training.seq_len ({config.training.seq_len}), "
            "the length the model's position tables are built for"
        )


def _check_hf_seed(config: JobConfig) -> None:
    checkpoint = config.checkpoint
    if not checkpoint.initial_load_in_hf:
        return
    if checkpoint.initial_load_path is None:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")
    if not checkpoint.initial_load_model_only:
        raise ConfigError(
            "checkpoint.initial_load_model_only must be true with checkpoint.initial_load_in_hf "
            "(a Hugging Face folder holds weights only)"
        )


def _check_load_step(config: JobConfig) -> None:
    # Without checkpoint.enable the run's own checkpoint folder is never read, so the step
    # would be ignored and the run would silently start from scratch.
    checkpoint = config.checkpoint
    if checkpoint.load_step >= 0 and not checkpoint.enable:
        raise ConfigError(
            f"checkpoint.load_step ({checkpoint.load_step}) needs checkpoint.enable "
            "(it picks a step-N folder of the run's own checkpoint folder)"
        )


# Run in this order after the ranges; the first broken rule is the one reported.
CONSISTENCY_RULES: tuple[Callable[[JobConfig], None], ...] = (
    _check_one_inferred_degree,
    _check_dataset_has_path,
    _check_hf_seed,
    _check_load_step,
    _check_validation,
)


def validate(config: JobConfig) -> None:
    """Raise ConfigError for the first value out of its allowed range, then for the first
    broken rule between keys."""
    for key, allowed, is_allowed in RANGE_RULES:
        value = get_value(config, key)
        if not is_allowed(value):
            raise ConfigError(f"{key} must be {allowed}, got {value!r}")
    for check in CONSISTENCY_RULES:
        check(config)
