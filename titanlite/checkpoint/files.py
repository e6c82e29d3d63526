"""The files of a checkpoint: step folders, their DCP metadata, and writing a folder atomically.

In a local folder, a complete checkpoint is a ``step-N`` folder holding DCP's ``.metadata``.
Saves go to ``.step-N.partial`` and deletions to ``.step-N.deleting`` first, so that a save or
a purge killed half-way never leaves a ``step-N`` that is missing files.

Object storage has no rename of a folder: a save writes ``step-N/`` in place and commits it by
writing the ``.committed`` marker last, after every rank's files, DCP's ``.metadata`` and the
manifest; a deletion removes the marker first. A ``step-N/`` without its marker (a save or a
deletion killed half-way) is never loaded and is removed by a later purge.
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
from titanlite.files import fsync_path
from titanlite.storage import ObjectPath, location, redact

STEP_FOLDER = re.compile(r"^step-(\d+)$")
# What interrupted saves and purges leave behind; only names the manager creates.
LEFTOVER_FOLDER = re.compile(r"\.step-\d+\.(partial|deleting)")
# DCP reports a failure on any rank as a CheckpointException, which is a BaseException.
DCP_FAILURES = (Exception, CheckpointException)
# The object written last into a step folder in object storage: the step is complete.
COMMITTED = ".committed"


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
    """One line for an error, with DCP's per-rank failures unpacked (not their tracebacks), and
    no credential of the environment in it (a storage backend's error may quote a request)."""
    rank, failure = first_failure(error)
    where = "" if rank is None else f"on rank {rank}: "
    return redact(f"{where}{type(failure).__name__}: {one_line(failure)}")


# --- step folders ------------------------------------------------------------------------


def is_complete(step_folder: Path | ObjectPath) -> bool:
    """Whether a step folder holds a whole checkpoint: DCP's metadata in a local folder (whose
    rename committed it), the commit marker in object storage."""
    return (step_folder / (COMMITTED if isinstance(step_folder, ObjectPath) else ".metadata")).is_file()


def complete_steps(folder: Path | ObjectPath) -> dict[int, Path | ObjectPath]:
    """step -> folder for every complete checkpoint (see is_complete)."""
    if not folder.is_dir():
        return {}
    steps = {}
    for entry in folder.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and is_complete(entry):
            steps[int(match.group(1))] = entry
    return dict(sorted(steps.items()))


class NamingReads:
    """DCP's reader, reading file by file so that an error names its file, and each file front
    to back: DCP reads in plan order, which jumps back and forth in a file (the writer stores the
    largest tensors first), while a reader of object storage keeps only the last few blocks it
    fetched (object_io.py) and fetches again any it has dropped."""

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:
                text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                raise CheckpointError(f"{self.path}/{name}: cannot be read, the file is damaged ({text})") from error
        return super().read_data(dataclasses.replace(plan, items=[]), planner)


class FileNamingReader(NamingReads, FileSystemReader):
    """DCP's filesystem reader; an error names its file."""


def reader_for(path: Path | ObjectPath):
    """DCP's reader for a step folder, local or in object storage; an error names its file."""
    if isinstance(path, ObjectPath):
        from titanlite.checkpoint.object_io import ObjectNamingReader

        return ObjectNamingReader(str(path))
    return FileNamingReader(str(path))


def stored_keys(path: Path | ObjectPath) -> list[str]:
    """Every key a checkpoint holds, flattened as DCP stores them ('model_args.args.dim')."""
    try:
        return list(reader_for(path).read_metadata().state_dict_metadata.keys())
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


def delete_step_folder(step_folder: Path | ObjectPath) -> None:
    """Delete a step folder. Renamed first (in object storage: its commit marker deleted
    first), so a deletion killed half-way never leaves a step-N that counts as complete and
    is missing files; the leftover is cleaned up later."""
    if isinstance(step_folder, ObjectPath):
        (step_folder / COMMITTED).remove()
        step_folder.remove(recursive=True)
        return
    doomed = step_folder.with_name(f".{step_folder.name}.deleting")
    os.replace(step_folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def leftover_folders(folder: Path | ObjectPath) -> list[Path | ObjectPath]:
    """What interrupted saves and purges left in `folder` (in object storage: step folders
    without their commit marker, which a save may still be writing)."""
    if not folder.is_dir():
        return []
    if isinstance(folder, ObjectPath):
        return [entry for entry in folder.iterdir() if STEP_FOLDER.match(entry.name) and not is_complete(entry)]
    return [entry for entry in folder.iterdir() if LEFTOVER_FOLDER.fullmatch(entry.name)]


def folder_step(entry: Path | ObjectPath) -> int:
    """The step a step folder or a leftover of one is named after."""
    return int(re.search(r"\d+", entry.name).group())


def remove_folder(folder: Path | ObjectPath) -> None:
    """Delete a folder and everything in it; gone already is fine."""
    if isinstance(folder, ObjectPath):
        folder.remove(recursive=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def read_checkpoint_metadata(step_dir: Path | ObjectPath):
    """DCP's metadata of a step folder; ValueError, one line naming the folder, if it has none
    (in object storage, also if it has no commit marker: a save that did not finish)."""
    if not step_dir.is_dir():
        raise ValueError(f"{step_dir}: no such checkpoint folder")
    if not (step_dir / ".metadata").is_file():
        raise ValueError(f"{step_dir}: not a checkpoint folder (no .metadata)")
    if not is_complete(step_dir):
        raise ValueError(f"{step_dir}: the save did not finish (no {COMMITTED} marker); it is never loaded")
    try:
        return reader_for(step_dir).read_metadata()
    except Exception as error:  # corrupt or unreadable metadata
        raise ValueError(f"{step_dir}: cannot read the checkpoint metadata ({type(error).__name__})") from None


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


def write_model_checkpoint(state: dict, out_dir: str | Path) -> Path | ObjectPath:
    """Write ``state`` (weights and the model description) from this one process as the
    DCP checkpoint out_dir/step-0, which checkpoint.initial_load_path starts a run from;
    atomically, as write_atomically does (in object storage: committed by its marker, and
    removed on a failure). Returns step-0."""
    out_dir = location(out_dir)
    if isinstance(out_dir, ObjectPath):
        check_output(out_dir)
        step = out_dir / "step-0"
        try:
            single_process(dcp.save, state, storage_writer=writer_for(step), no_dist=True)
            commit(step)
        except BaseException:
            remove_folder(out_dir)
            raise
        return step

    def write(folder: Path) -> None:
        single_process(dcp.save, state, storage_writer=writer_for(folder / "step-0"), no_dist=True)

    write_atomically(out_dir, write)
    return out_dir / "step-0"


# --- writing a step folder ---------------------------------------------------------------


def writer_for(step_folder: Path | ObjectPath, uploads_per_node: int = 0):
    """DCP's writer for a step folder. Local files are fsync'd before the folder is renamed
    into place. In object storage a file is durable once its upload completes (an fsync
    there falls back to a host-wide os.sync()), so none is asked for; at most
    ``uploads_per_node`` ranks of a node upload at once (0: no limit)."""
    if isinstance(step_folder, ObjectPath):
        from titanlite.checkpoint.object_io import ObjectWriter

        return ObjectWriter(str(step_folder), uploads_per_node)
    return FileSystemWriter(str(step_folder), sync_files=True)


def save_folder(folder: Path | ObjectPath, step: int) -> Path | ObjectPath:
    """Where a save of `step` writes: a partial folder renamed into place when done, or in
    object storage the step folder itself."""
    return folder / (f"step-{step}" if isinstance(folder, ObjectPath) else f".step-{step}.partial")


def publish(written: Path | ObjectPath, final: Path | ObjectPath) -> None:
    """Make a fully written save (in `written`, from save_folder) the complete step folder
    `final`: in object storage by its commit marker, locally by renaming it into place, with
    the data, the folder and the rename fsync'd."""
    if isinstance(final, ObjectPath):
        commit(final)
        return
    fsync_path(written)
    if final.exists():
        # Only after resuming from an older step (load_step): the newer trajectory's
        # checkpoint of this step is superseded.
        delete_step_folder(final)
    os.replace(written, final)
    fsync_path(final.parent)


def commit(step_folder: Path | ObjectPath) -> None:
    """Mark a step folder in object storage complete: called after every rank's files, DCP's
    .metadata and the manifest are written, the marker is the last object of the step."""
    (step_folder / COMMITTED).write_text("{}\n")
