"""The files of a checkpoint: step folders, their DCP metadata, and writing a folder atomically.

A complete checkpoint is a ``step-N`` folder holding DCP's ``.metadata``. Saves go to
``.step-N.partial`` and deletions to ``.step-N.deleting`` first, so that a save or a purge
killed half-way never leaves a ``step-N`` that is missing files.
"""

import dataclasses
import os
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.errors import one_line

STEP_FOLDER = re.compile(r"^step-(\d+)$")
# What interrupted saves and purges leave behind; only names the manager creates.
LEFTOVER_FOLDER = re.compile(r"\.step-\d+\.(partial|deleting)")
# DCP reports a failure on any rank as a CheckpointException, which is a BaseException.
DCP_FAILURES = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or written; the message names the path."""


# --- errors ------------------------------------------------------------------------------


def first_failure(error: BaseException) -> tuple[int | None, BaseException]:
    """The rank and the exception behind an error; DCP wraps every rank's failure."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = sorted(error.failures.items())[0]
        if isinstance(failure, tuple):  # (exception, its stack frames)
            failure = failure[0]
        return rank, failure
    return None, error


def describe_failure(error: BaseException) -> str:
    """One line for an error, with DCP's per-rank failures unpacked (not their tracebacks)."""
    rank, failure = first_failure(error)
    where = "" if rank is None else f"on rank {rank}: "
    return f"{where}{type(failure).__name__}: {one_line(failure)}"


# --- step folders ------------------------------------------------------------------------


def complete_steps(folder: Path) -> dict[int, Path]:
    """step -> folder for every complete checkpoint (a step-N folder with DCP metadata)."""
    if not folder.is_dir():
        return {}
    steps = {}
    for entry in folder.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps[int(match.group(1))] = entry
    return dict(sorted(steps.items()))


def stored_keys(path: Path) -> list[str]:
    """Every key a checkpoint holds, flattened as DCP stores them ('model_args.args.dim')."""
    try:
        return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys())
    except DCP_FAILURES as error:  # unreadable or corrupt metadata
        raise CheckpointError(
            f"{path / '.metadata'}: cannot read the checkpoint metadata ({describe_failure(error)})"
        ) from None


def top_level_names(path: Path) -> set[str]:
    """The first component of every key in a checkpoint: part names and model weight names."""
    return {key.split(".", 1)[0] for key in stored_keys(path)}


def stored_prefixes(path: Path) -> set[str]:
    """Every key of a checkpoint and every dotted prefix of one ('model_args', 'model_args.args', ...)."""
    prefixes = set()
    for key in stored_keys(path):
        parts = key.split(".")
        prefixes.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return prefixes


def delete_step_folder(step_folder: Path) -> None:
    """Delete a step folder. Renamed first, so a deletion killed half-way never leaves a
    step-N that is missing files; the leftover is cleaned up at the next start."""
    doomed = step_folder.with_name(f".{step_folder.name}.deleting")
    os.replace(step_folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def leftover_folders(folder: Path) -> list[Path]:
    """What interrupted saves and purges left in `folder`."""
    if not folder.is_dir():
        return []
    return [entry for entry in folder.iterdir() if LEFTOVER_FOLDER.fullmatch(entry.name)]


def read_checkpoint_metadata(step_dir: Path):
    """DCP's metadata of a step folder; ValueError, one line naming the folder, if it has none."""
    if not step_dir.is_dir():
        raise ValueError(f"{step_dir}: no such checkpoint folder")
    if not (step_dir / ".metadata").is_file():
        raise ValueError(f"{step_dir}: not a checkpoint folder (no .metadata)")
    try:
        return FileSystemReader(str(step_dir)).read_metadata()
    except Exception as error:  # corrupt or unreadable metadata
        raise ValueError(f"{step_dir}: cannot read the checkpoint metadata ({type(error).__name__})") from None


class FileNamingReader(FileSystemReader):
    """DCP's filesystem reader, reading file by file so that an error names its file."""

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:
                path = Path(self.path) / name
                text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                raise CheckpointError(f"{path}: cannot be read, the file is damaged ({text})") from error
        return super().read_data(dataclasses.replace(plan, items=[]), planner)


def single_process(call, *args, **kwargs):
    """Run a dcp.save/dcp.load call without DCP's warning that no process group exists:
    one process working alone is what the conversion tools do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return call(*args, **kwargs)


# --- writing a whole folder atomically ----------------------------------------------------


def check_output(out_dir: Path) -> None:
    """Refuse an output folder that exists and is not empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir}: the output folder already exists and is not empty")


def _temporary_sibling(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    return temporary


def _publish(temporary: Path, out_dir: Path) -> None:
    check_output(out_dir)  # it may have appeared meanwhile
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(temporary, out_dir)


def write_atomically(out_dir: Path, write) -> None:
    """Run write(folder) on a temporary sibling folder and rename it to out_dir at the end;
    on any failure the temporary folder is removed and out_dir is left untouched."""
    out_dir = Path(out_dir)
    check_output(out_dir)
    temporary = _temporary_sibling(out_dir)
    try:
        write(temporary)
        _publish(temporary, out_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def write_model_checkpoint(state: dict, out_dir: Path) -> Path:
    """Write ``state`` (weights and the model description) from this one process as the
    DCP checkpoint out_dir/step-0, which checkpoint.initial_load_path starts a run from;
    atomically, as write_atomically does. Returns step-0."""

    def write(folder: Path) -> None:
        writer = FileSystemWriter(str(folder / "step-0"), sync_files=True)
        single_process(dcp.save, state, storage_writer=writer, no_dist=True)

    write_atomically(out_dir, write)
    return Path(out_dir) / "step-0"
