"""Checks of a merged JobConfig: each value against the range written beside its field in
its section's file, then the rules that tie several keys together."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

from titanlite.config.fault_tolerance import fault_tolerance_problem
from titanlite.config.job_config import JobConfig
from titanlite.config.parallelism import PIPELINE_SCHEDULES, canonical_schedule
from titanlite.config.quantize import quantize_problem
from titanlite.config.ranges import Range, field_range
from titanlite.config.schema import ConfigError, section_classes, section_of
from titanlite.config.training import DatasetNeedingPath, DatasetWithoutPath, PreparedDataset
from titanlite.errors import unknown_name
from titanlite.storage import is_url, scheme, url_problem

# A dataset that reads no path would silently ignore one; one that needs a path has nothing to read without it.
DATASETS_WITHOUT_PATH = get_args(DatasetWithoutPath)
DATASETS_NEEDING_PATH = get_args(Literal[PreparedDataset, DatasetNeedingPath])


def ranged_values(config: JobConfig) -> Iterator[tuple[str, Any, Range]]:
    """('section.key', value, allowed range) for every field that has a range, in field order."""
    for section_name in section_classes():
        section = section_of(config, section_name)
        for config_field in dataclasses.fields(section):
            allowed = field_range(config_field)
            if allowed is not None:
                yield f"{section_name}.{config_field.name}", getattr(section, config_field.name), allowed


def _check_ranges(config: JobConfig) -> None:
    for key, value, allowed in ranged_values(config):
        if not allowed.check(value):
            raise ConfigError(f"{key} must be {allowed.text}, got {value!r}")


def _check_one_inferred_degree(config: JobConfig) -> None:
    # -1 means "whatever is left of the world size", which only one degree can take.
    inferred = [
        f"parallelism.{f.name}"
        for f in dataclasses.fields(config.parallelism)
        if f.name.endswith("_degree") and getattr(config.parallelism, f.name) == -1
    ]
    if len(inferred) > 1:
        raise ConfigError(f"at most one parallelism degree may be -1, got -1 for {' and '.join(inferred)}")


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


def _check_locations(config: JobConfig) -> None:
    """Run files (logs, TensorBoard, traces) are written to a local or shared folder; a checkpoint
    folder or initial_load_path may be a storage URL, checked here without touching the network
    (the launchers' preflight then lists the bucket). A URL taken for a relative path would write
    a local folder named after the scheme ("s3:") with no error."""
    dump_folder = config.job.dump_folder
    if is_url(dump_folder):  # the scheme alone is named: the rest may hold credentials
        raise ConfigError(
            f"job.dump_folder is a URL ({scheme(dump_folder)}://...), but logs, TensorBoard and traces are written "
            "to a local or shared folder: give a path (checkpoint.folder may be a URL)"
        )
    checkpoint = config.checkpoint
    for key, value in (("folder", checkpoint.folder), ("initial_load_path", checkpoint.initial_load_path)):
        problem = url_problem(value) if is_url(value) else None
        if problem is not None:
            raise ConfigError(f"checkpoint.{key}: {problem}")
    if checkpoint.initial_load_in_hf and is_url(checkpoint.initial_load_path):
        raise ConfigError(
            "checkpoint.initial_load_path with initial_load_in_hf is a local Hugging Face folder: "
            f"download the model first (a {scheme(checkpoint.initial_load_path)}:// URL was given)"
        )


def _check_pipeline_schedule(config: JobConfig) -> None:
    schedule = config.parallelism.pipeline_parallel_schedule
    if canonical_schedule(schedule) is None:
        key = "parallelism.pipeline_parallel_schedule"
        raise ConfigError(unknown_name(key, schedule, PIPELINE_SCHEDULES))


def _check_quantize(config: JobConfig) -> None:
    problem = quantize_problem(config.model.converters, config.quantize.linear.float8)
    if problem is not None:
        raise ConfigError(problem)


def _check_fault_tolerance(config: JobConfig) -> None:
    problem = fault_tolerance_problem(config.fault_tolerance)
    if problem is not None:
        raise ConfigError(problem)


# Run in this order after the ranges; the first broken rule is the one reported.
CONSISTENCY_RULES: tuple[Callable[[JobConfig], None], ...] = (
    _check_quantize,
    _check_one_inferred_degree,
    _check_pipeline_schedule,
    _check_dataset_has_path,
    _check_locations,
    _check_hf_seed,
    _check_load_step,
    _check_validation,
    _check_fault_tolerance,
)


def validate(config: JobConfig) -> None:
    """Raise ConfigError for the first value out of its allowed range, then for the first
    broken rule between keys."""
    _check_ranges(config)
    for check in CONSISTENCY_RULES:
        check(config)
