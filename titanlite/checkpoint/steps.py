"""Choosing among a run's step folders: which ones a purge keeps, and which checkpoint a
run starts from, which of its parts it loads, and (in the preflight) whether it holds the
model the run builds."""

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from titanlite.checkpoint.description import ModelDescription, refuse_other_model
from titanlite.checkpoint.files import (
    COMMITTED,
    DCP_FAILURES,
    CheckpointError,
    complete_steps,
    delete_step_folder,
    is_complete,
    top_level_names,
)
from titanlite.checkpoint.manifest import check_data_files, verify_manifest
from titanlite.config import CHECKPOINT_PARTS, Checkpoint
from titanlite.files import fsync_path
from titanlite.storage import ObjectPath, checkpoint_folder, location

logger = logging.getLogger("titanlite")


def _part(name: str) -> str:
    """`name`, checked against config.CHECKPOINT_PARTS, the one list of part names."""
    if name not in CHECKPOINT_PARTS:
        raise ImportError(f"'{name}' is not one of config.CHECKPOINT_PARTS {CHECKPOINT_PARTS}")
    return name


# The parts with rules of their own: the model's entries are stored at the top level of a
# checkpoint, and only a checkpoint with a train_state can resume a run.
MODEL, TRAIN_STATE = _part("model"), _part("train_state")


def is_resumable(path: Path) -> bool:
    return TRAIN_STATE in top_level_names(path)


def purge_old_steps(folder: Path, keep_latest: int, keep_every: int) -> None:
    """Delete all but the newest `keep_latest` step folders (0: keep all), sparing multiples
    of `keep_every` and the newest one a run can resume from."""
    steps = list(complete_steps(folder))
    if keep_latest == 0 or len(steps) <= keep_latest:
        return
    # A model-only save (the last one, say) cannot resume a run: the newest checkpoint
    # that can is kept whatever its age.
    resumable = next((s for s in reversed(steps) if is_resumable(folder / f"step-{s}")), None)
    for step in steps[:-keep_latest]:
        if (keep_every and step % keep_every == 0) or step == resumable:
            continue
        delete_step_folder(folder / f"step-{step}")
        logger.info("checkpoint deleted (keep_latest_k=%d): step-%d", keep_latest, step)


def _set_aside_newer_than(folder: Path, load_step: int, steps: dict[int, Path]) -> None:
    """Resuming from an older step abandons the checkpoints after it. Left in place they
    would be resumed from next time and purged in the new run's place, so they are
    moved (never deleted) into a folder that is not a step folder."""
    newer = [path for step, path in steps.items() if step > load_step]
    if not newer:
        return
    aside = folder / f"abandoned-after-step-{load_step}-{time.strftime('%Y%m%d-%H%M%S')}"
    if isinstance(folder, ObjectPath):  # no rename: copied (server-side), then deleted
        for path in newer:
            path.copy_to(aside / path.name, last=COMMITTED)
            delete_step_folder(path)
    else:
        aside.mkdir()
        for path in newer:
            os.replace(path, aside / path.name)
        fsync_path(folder)
    logger.warning("resuming from step %d: moved the %d newer checkpoint(s) to %s", load_step, len(newer), aside)


def _load_step_source(folder: Path, load_step: int, steps: dict[int, Path]) -> Path:
    """The step folder checkpoint.load_step names."""
    if load_step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise CheckpointError(
            f"checkpoint.load_step {load_step}: no complete step-{load_step} in {folder} (complete steps: {available})"
        )
    if not is_resumable(steps[load_step]):
        raise CheckpointError(
            f"checkpoint.load_step {load_step}: {steps[load_step]} holds model weights only and cannot "
            "resume a run; start from its weights with checkpoint.initial_load_path instead"
        )
    return steps[load_step]


def resume_source(folder: Path, config: Checkpoint) -> tuple[Path, bool] | None:
    """The checkpoint to start from and whether to load the model only. Only looks: the
    preflight asks it too, and the newer steps a load_step abandons stay where they are."""
    steps = complete_steps(folder) if config.enable else {}
    if config.load_step >= 0:
        return _load_step_source(folder, config.load_step, steps), False
    # Newest first; a model-only save (e.g. the last one) cannot resume training.
    for _, path in reversed(steps.items()):
        if is_resumable(path):
            return path, False
        logger.info("skipping %s for resume: it holds model weights only", path)
    if config.initial_load_path and not config.initial_load_in_hf:  # HF: the trainer seeds
        path = location(config.initial_load_path)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint.initial_load_path {path}: not a checkpoint folder (no .metadata)")
        if not is_complete(path):
            raise CheckpointError(
                f"checkpoint.initial_load_path {path}: the save did not finish (no {COMMITTED} marker); "
                "it is never loaded"
            )
        return path, config.initial_load_model_only
    return None


def parts_in(path: Path, part_names: set[str]) -> set[str]:
    """The parts a checkpoint holds; top-level names that are no part are model weights."""
    names = top_level_names(path)
    parts = names & part_names
    if names - part_names:
        parts.add(MODEL)
    return parts


def check_files(path: Path, checksums: bool) -> None:
    """Catch damaged files before DCP reads them (a truncated shard, and with a manifest
    any change of size, or of content with `checksums`), naming the file."""
    start = time.perf_counter()
    try:
        if verify_manifest(path, checksums):
            logger.info(
                "%s matches its integrity manifest (%s, %.2f s)",
                path,
                "sizes and sha256" if checksums else "sizes",
                time.perf_counter() - start,
            )
        elif checksums:
            logger.warning(
                "%s has no integrity manifest (saved without checkpoint.verify_integrity): loading it unverified",
                path,
            )
        check_data_files(path)
    except CheckpointError as error:
        raise CheckpointError(f"{error}; to resume from an earlier checkpoint, set checkpoint.load_step") from None


def loads_model(config: Checkpoint, model_only: bool) -> bool:
    """Whether a start from a checkpoint (`model_only`: from its weights alone) loads them."""
    return model_only or MODEL not in config.exclude_from_loading


def plan_load(
    folder: Path, config: Checkpoint, part_names: list[str], check_model: Callable[[Path], None] | None = None
) -> tuple[Path, list[str]] | None:
    """The checkpoint to start from and the parts (of `part_names`, in order) to load from it,
    or None. `check_model(path)` may refuse the checkpoint when its model part is loaded;
    only once every check passed are the steps newer than a load_step set aside."""
    source = resume_source(folder, config)
    if source is None:
        return None
    path, model_only = source
    available = parts_in(path, set(part_names))
    check_files(path, config.verify_integrity)
    wanted = [MODEL] if model_only else [n for n in part_names if n not in config.exclude_from_loading]
    missing = [name for name in wanted if name not in available]
    if MODEL in missing:
        raise CheckpointError(f"{path}: the checkpoint holds no model weights")
    if check_model is not None and loads_model(config, model_only):
        check_model(path)
    for name in missing:
        logger.warning("%s holds no '%s'; it starts fresh", path, name)
    if config.load_step >= 0:
        _set_aside_newer_than(folder, config.load_step, complete_steps(folder))
    return path, [name for name in wanted if name in available]


def refuse_start_from_other_model(config: Checkpoint, dump_folder: str, ours: ModelDescription) -> None:
    """The preflight's look at the checkpoint a run would start from, in one process before
    any rank starts: CheckpointError when it records another model than `ours` (or when
    load_step or initial_load_path names none, as the ranks would say). A description that
    cannot be read is left to the ranks' load, whose checks name the damaged file."""
    if not (config.enable or config.initial_load_path is not None):
        return
    folder = checkpoint_folder(dump_folder, config.folder)
    source = resume_source(folder, config)
    if source is None or not loads_model(config, model_only=source[1]):
        return
    try:
        refuse_other_model(source[0], ours, folder)
    except CheckpointError:
        raise
    except DCP_FAILURES as error:
        logger.debug("preflight: the model description of %s could not be read (%s)", source[0], error)
