"""Checkpoints as atomic step folders written with torch.distributed.checkpoint (DCP).

On disk, ``{dump_folder}/{checkpoint.folder}/step-N/`` holds DCP's ``.metadata`` and one
``__R_0.distcp`` file per writing rank. A save goes to ``.step-N.partial`` and is renamed
to ``step-N`` only after every rank's data and the metadata are on disk and fsync'd, so a
``step-N`` folder is always complete; anything else in the folder is never loaded.

The manager saves a dict of Stateful objects by name and knows nothing about what they
are, with one layout rule: the entries of the "model" object are stored at the top level
of the checkpoint (not under "model."), so that model-only checkpoints and full ones name
weights the same way.
"""

import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.config import Checkpoint

logger = logging.getLogger("titanlite")

MODEL = "model"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
# DCP reports a failure on any rank as a CheckpointException, which is a BaseException.
_FAILURES = (Exception, CheckpointException)
# Dtypes a model-only save or an export may cast the weights to, by config name.
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or written; the message names the path."""


def _describe(error: BaseException) -> str:
    """One line for an error, with DCP's per-rank failures unpacked (not their tracebacks)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = sorted(error.failures.items())[0]
        if isinstance(failure, tuple):  # (exception, its stack frames)
            failure = failure[0]
        error_text = f"on rank {rank}: {type(failure).__name__}: {failure}"
    else:
        error_text = f"{type(error).__name__}: {error}"
    return " ".join(error_text.split())[:500]


def _fsync_folder(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def complete_steps(folder: Path) -> dict[int, Path]:
    """step -> folder for every complete checkpoint (a step-N folder with DCP metadata)."""
    if not folder.is_dir():
        return {}
    steps = {}
    for entry in folder.iterdir():
        match = _STEP_FOLDER.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps[int(match.group(1))] = entry
    return dict(sorted(steps.items()))


def top_level_names(path: Path) -> set[str]:
    """The first component of every key in a checkpoint: part names and model weight names."""
    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
    except _FAILURES as error:  # unreadable or corrupt metadata
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata ({error})") from None
    return {key.split(".", 1)[0] for key in keys}


class CheckpointManager:
    def __init__(self, states: dict[str, Stateful], config: Checkpoint, dump_folder: str):
        """`states` maps part names (model, optimizer, dataloader, ...) to Stateful objects."""
        self.states = states
        self.config = config
        self.folder = Path(dump_folder) / config.folder
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.in_use = config.enable or config.initial_load_path is not None
        # A process group of its own, created once: saves in flight talk over it from a
        # background thread without interleaving with the training collectives.
        self.process_group = dist.new_group(backend="gloo") if dist.is_initialized() and self.in_use else None
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titanlite-checkpoint")
        self._in_flight: Future | None = None
        self._staging: Future | None = None
        self._stager = None
        if config.async_mode == "async_with_pinned_mem":
            cuda = torch.cuda.is_available()
            # Kept across saves so its CPU buffers are allocated once and reused. Staging
            # runs in a background thread (on any device) while the next forward and
            # backward run; the trainer waits for it only before changing the weights.
            self._stager = DefaultStager(
                StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda)
            )
        if self.process_group is None:
            # One process saves alone on purpose; DCP warns about that at every save and load.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        if self.rank == 0 and config.enable:
            self._remove_leftovers()

    # --- saving ------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or step == last_step)

    def _collect(self, parts: list[str], model_dtype: torch.dtype | None = None) -> dict:
        collected = {}
        for name in parts:
            state = self.states[name].state_dict()
            if name == MODEL:
                if model_dtype is not None:
                    state = {k: v.to(model_dtype) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                collected.update(state)
            else:
                collected[name] = state
        return collected

    def save(self, step: int, model_only: bool = False, sync: bool = False) -> None:
        """Save everything (or only the model weights, cast to export_dtype) as step-N.
        At most one save is in flight: an earlier one is waited for first."""
        self.wait()
        if model_only:
            state = self._collect([MODEL], EXPORT_DTYPES[self.config.export_dtype])
        else:
            state = self._collect(list(self.states))
        partial = self.folder / f".step-{step}.partial"
        final = self.folder / f"step-{step}"
        writer = FileSystemWriter(str(partial), sync_files=True)
        if sync or self.config.async_mode == "disabled":
            dcp.save(state, storage_writer=writer, process_group=self.process_group)
            self._publish(partial, final)
            return
        # DCP's writer processes join a process group of their own, built from the default
        # one; a single process without a group writes from a thread instead.
        in_process = self.config.async_mode == "async_with_pinned_mem" and self.process_group is not None
        checkpointer = AsyncCheckpointerType.PROCESS if in_process else AsyncCheckpointerType.THREAD
        response = dcp.async_save(
            state, storage_writer=writer, process_group=self.process_group,
            async_checkpointer_type=checkpointer, async_stager=self._stager,
        )
        if isinstance(response, AsyncSaveResponse):
            self._staging, upload = response.staging_completion, response.upload_completion
        else:
            upload = response  # staging already finished inside async_save
        self._in_flight = self._writes.submit(self._publish_when_written, upload, partial, final)

    def _publish_when_written(self, upload: Future, partial: Path, final: Path) -> None:
        upload.result()
        self._publish(partial, final)

    def _publish(self, partial: Path, final: Path) -> None:
        """Rank 0 makes a fully written save visible as step-N, then purges old ones.
        DCP returns on rank 0 only after every rank's data and the metadata are written."""
        if self.rank != 0:
            return
        _fsync_folder(partial)
        if final.exists():
            # Only after resuming from an older step (load_step): the newer trajectory's
            # checkpoint of this step is superseded.
            self._delete(final)
        os.replace(partial, final)
        _fsync_folder(self.folder)
        logger.info("checkpoint saved: %s", final)
        self._purge()

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state; call before changing weights."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def wait(self) -> None:
        """Block until the save in flight is on disk (and published)."""
        self.wait_for_staging()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            try:
                in_flight.result()
            except _FAILURES as error:
                raise CheckpointError(f"saving a checkpoint in {self.folder} failed {_describe(error)}") from error

    def close(self) -> None:
        self.wait()
        self._writes.shutdown()
        if self._stager is not None:
            self._stager.close()

    # --- purging -----------------------------------------------------------------------

    def _purge(self) -> None:
        keep_latest = self.config.keep_latest_k
        steps = list(complete_steps(self.folder))
        if keep_latest == 0 or len(steps) <= keep_latest:
            return
        every = self.config.keep_every
        # A model-only save (the last one, say) cannot resume a run: the newest checkpoint
        # that can is kept whatever its age.
        resumable = next((s for s in reversed(steps) if self._is_resumable(self.folder / f"step-{s}")), None)
        for step in steps[:-keep_latest]:
            if (every and step % every == 0) or step == resumable:
                continue
            self._delete(self.folder / f"step-{step}")
            logger.info("checkpoint deleted (keep_latest_k=%d): step-%d", keep_latest, step)

    def _delete(self, step_folder: Path) -> None:
        # Renamed first, so a deletion killed half-way never leaves a step-N that is
        # missing files; the leftover is cleaned up at the next start.
        doomed = step_folder.with_name(f".{step_folder.name}.deleting")
        os.replace(step_folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def _is_resumable(path: Path) -> bool:
        return "train_state" in top_level_names(path)

    def _remove_leftovers(self) -> None:
        """Remove what interrupted saves and purges left behind (only names we create)."""
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if re.fullmatch(r"\.step-\d+\.(partial|deleting)", entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("removed an incomplete checkpoint folder: %s", entry)

    # --- loading -----------------------------------------------------------------------

    def _resume_source(self) -> tuple[Path, bool] | None:
        """The checkpoint to start from and whether to load the model only."""
        steps = complete_steps(self.folder) if self.config.enable else {}
        load_step = self.config.load_step
        if load_step >= 0:
            if load_step not in steps:
                available = ", ".join(map(str, steps)) or "none"
                raise CheckpointError(
                    f"checkpoint.load_step {load_step}: no complete step-{load_step} in {self.folder} "
                    f"(complete steps: {available})"
                )
            if not self._is_resumable(steps[load_step]):
                raise CheckpointError(
                    f"checkpoint.load_step {load_step}: {steps[load_step]} holds model weights only and cannot "
                    "resume a run; start from its weights with checkpoint.initial_load_path instead"
                )
            self._set_aside_newer_than(load_step, steps)
            return steps[load_step], False
        # Newest first; a model-only save (e.g. the last one) cannot resume training.
        for step, path in reversed(steps.items()):
            if self._is_resumable(path):
                return path, False
            logger.info("skipping %s for resume: it holds model weights only", path)
        if self.config.initial_load_path and not self.config.initial_load_in_hf:  # HF: the trainer seeds
            path = Path(self.config.initial_load_path)
            if not (path / ".metadata").is_file():
                raise CheckpointError(f"checkpoint.initial_load_path {path}: not a checkpoint folder (no .metadata)")
            return path, self.config.initial_load_model_only
        return None

    def _set_aside_newer_than(self, load_step: int, steps: dict[int, Path]) -> None:
        """Resuming from an older step abandons the checkpoints after it. Left in place they
        would be resumed from next time and purged in the new run's place, so they are
        moved (never deleted) into a folder that is not a step folder."""
        newer = [path for step, path in steps.items() if step > load_step]
        if not newer:
            return
        aside = self.folder / f"abandoned-after-step-{load_step}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for path in newer:
            os.replace(path, aside / path.name)
        _fsync_folder(self.folder)
        logger.warning("resuming from step %d: moved the %d newer checkpoint(s) to %s", load_step, len(newer), aside)

    def _parts_in(self, path: Path) -> set[str]:
        """The parts a checkpoint holds; top-level names that are no part are model weights."""
        names = top_level_names(path)
        parts = names & set(self.states)
        if names - set(self.states):
            parts.add(MODEL)
        return parts

    def _agree(self, decide):
        """Run `decide` on rank 0 only and give every rank its result (or its error): ranks
        listing a shared filesystem themselves could see different folders."""
        outcome = [None]
        if self.rank == 0:
            try:
                outcome[0] = ("ok", decide())
            except CheckpointError as error:
                outcome[0] = ("error", str(error))
            except _FAILURES as error:  # e.g. a permission error: the others must not wait for it
                outcome[0] = ("error", f"{self.folder}: {_describe(error)}")
        if self.process_group is not None:
            dist.broadcast_object_list(outcome, src=0, group=self.process_group)
        status, value = outcome[0]
        if status == "error":
            raise CheckpointError(value)
        return value

    def _plan_load(self) -> tuple[Path, list[str]] | None:
        """The checkpoint to start from and the parts to load from it, or None."""
        source = self._resume_source()
        if source is None:
            return None
        path, model_only = source
        available = self._parts_in(path)
        wanted = [MODEL] if model_only else [n for n in self.states if n not in self.config.exclude_from_loading]
        missing = [name for name in wanted if name not in available]
        if MODEL in missing:
            raise CheckpointError(f"{path}: the checkpoint holds no model weights")
        for name in missing:
            logger.warning("%s holds no '%s'; it starts fresh", path, name)
        return path, [name for name in wanted if name in available]

    def load(self) -> list[str]:
        """Load the checkpoint to resume from, if any, into the (already sharded) states.
        Returns the names of the parts loaded (none for a fresh start)."""
        if not self.in_use:
            return []
        self.wait()
        plan = self._agree(self._plan_load)
        if plan is None:
            return []
        path, parts = plan
        state = self._collect(parts)
        try:
            dcp.load(state, storage_reader=FileSystemReader(str(path)), process_group=self.process_group)
        except _FAILURES as error:
            raise CheckpointError(f"{path}: loading failed {_describe(error)}") from error
        for name in parts:
            part = {k: v for k, v in state.items() if k not in self.states} if name == MODEL else state[name]
            try:
                self.states[name].load_state_dict(part)
            except (ValueError, KeyError, RuntimeError) as error:
                raise CheckpointError(f"{path}: cannot load '{name}': {' '.join(str(error).split())[:300]}") from error
        logger.info("loaded checkpoint %s (%s)", path, ", ".join(parts))
        return parts
