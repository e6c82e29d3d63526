"""Checkpoints as atomic step folders written with torch.distributed.checkpoint (DCP).

On disk, ``{dump_folder}/{checkpoint.folder}/step-N/`` holds DCP's ``.metadata`` and one
``__R_0.distcp`` file per writing rank. A save goes to ``.step-N.partial`` and is renamed
to ``step-N`` only after every rank's data and the metadata are on disk and fsync'd, so a
``step-N`` folder is always complete; anything else in the folder is never loaded.

In object storage (checkpoint.folder a URL), which has no rename of a folder, a save writes
``step-N/`` in place and rank 0 commits it by writing the ``.committed`` marker last; a step
without it is never loaded, and is removed once a later step is committed (not earlier: a
save may still be writing it).

The manager saves a dict of Stateful objects by name and knows nothing about what they
are, with one layout rule: the entries of the "model" object are stored at the top level
of the checkpoint (not under "model."), so that model-only checkpoints and full ones name
weights the same way.

With ``checkpoint.verify_integrity``, rank 0 also writes ``.manifest.json`` (every file's
size and SHA-256) into the folder before the rename; a load checks the sizes whenever a
manifest exists and the checksums when the option is on. Every load also checks each file
against the byte ranges DCP's ``.metadata`` records, so a truncated file is named.
"""

import logging
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint.files import (
    DCP_FAILURES,
    CheckpointError,
    complete_steps,
    delete_step_folder,
    describe_failure,
    first_failure,
    folder_step,
    leftover_folders,
    publish,
    reader_for,
    remove_folder,
    save_folder,
    stored_keys,
    stored_prefixes,
    writer_for,
)
from titanlite.checkpoint.manifest import write_manifest
from titanlite.checkpoint.stager import close_stager, keep_open_between_saves
from titanlite.checkpoint.states import plain_tensors
from titanlite.checkpoint.steps import MODEL, plan_load, purge_old_steps
from titanlite.config import Checkpoint, Comm
from titanlite.dtypes import DTYPES
from titanlite.parallel import first_error_on_any_rank, is_collective_failure
from titanlite.storage import ObjectPath, checkpoint_folder

logger = logging.getLogger("titanlite")


def _drop_unstored(container: dict, key: str, name: str, stored: set[str]) -> None:
    """Remove container[key] (stored under ``name``) when the checkpoint lacks it, and
    likewise each entry of it, recursively, that the checkpoint lacks."""
    if name not in stored:
        del container[key]
    elif isinstance(container[key], dict):
        for inner in list(container[key]):
            _drop_unstored(container[key], inner, f"{name}.{inner}", stored)


class CheckpointManager:
    def __init__(
        self,
        states: dict[str, Stateful],
        config: Checkpoint,
        dump_folder: str,
        timeout_seconds: int = Comm.init_timeout_seconds,
        shared_by_groups: bool = False,
    ):
        """`states` maps part names (model, optimizer, dataloader, ...) to Stateful objects.
        `timeout_seconds` bounds each collective of a save or load (comm.init_timeout_seconds:
        ranks wait there for the slowest writer, so the shorter train timeout does not fit).
        `shared_by_groups`: fault-tolerant replica groups write to the folder in turn, so a
        group starting up must not take another's save in progress for a leftover."""
        self.states = states
        self.config = config
        self.folder = checkpoint_folder(dump_folder, config.folder)
        self.in_object_storage = isinstance(self.folder, ObjectPath)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.in_use = config.enable or config.initial_load_path is not None
        # A process group of its own, created once: saves in flight talk over it from a
        # background thread without interleaving with the training collectives.
        # Without a timeout of its own it would get PyTorch's 30-minute default for gloo, and a
        # rank dead during a save would hold the others that long.
        self.process_group = None
        if dist.is_initialized() and self.in_use:
            self.process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titanlite-checkpoint")
        self._in_flight: Future | None = None
        self._in_flight_step = 0
        # The newest step whose save succeeded (on every rank), for the save on a stop signal.
        self._saved_step: int | None = None
        self._staging: Future | None = None
        self._stager = None
        # With continue_on_save_error: what went wrong with the newest settled save, None
        # when it succeeded. The trainer reads it after the run's final save.
        self.failed_save: str | None = None
        if config.async_mode == "async_with_pinned_mem":
            cuda = torch.cuda.is_available()
            # Kept across saves so its CPU buffers are allocated once and reused. Staging
            # runs in a background thread (on any device) while the next forward and
            # backward run; the trainer waits for it only before changing the weights.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
                )
            )
            keep_open_between_saves(self._stager)  # torch before 2.13 closes it after each save
        if self.process_group is None:
            # One process saves alone on purpose; DCP warns about that at every save and load.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.shared_by_groups = shared_by_groups
        # In object storage a step without its marker may be a save still being written (by a
        # process of an earlier launch that has not died yet): removed only after a later commit.
        if self.rank == 0 and config.enable and not shared_by_groups and not self.in_object_storage:
            self._remove_leftovers()

    # --- saving ------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or step == last_step)

    def _collect(self, parts: list[str], model_dtype: torch.dtype | None = None) -> dict:
        collected = {}
        for name in parts:
            state = plain_tensors(self.states[name].state_dict())  # never a pickled tensor subclass
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
            state = self._collect([MODEL], DTYPES[self.config.export_dtype])
        else:
            state = self._collect(list(self.states))
        written, final = save_folder(self.folder, step), self.folder / f"step-{step}"
        if self.in_object_storage and self.rank == 0:
            # Written in place: what a killed (or superseded) save of this step left goes first;
            # the other ranks write only once rank 0 has joined DCP's planning, below.
            delete_step_folder(final)
        writer = writer_for(written, self.config.uploads_per_node)
        if sync or self.config.async_mode == "disabled":
            try:
                dcp.save(state, storage_writer=writer, process_group=self.process_group)
                self._publish(written, final)
            except DCP_FAILURES as error:
                self._settle(step, error)
            else:
                self._settle(step, None)
            return
        # DCP's writer processes join a process group of their own, built from the default
        # one; a single process without a group writes from a thread instead.
        in_process = self.config.async_mode == "async_with_pinned_mem" and self.process_group is not None
        checkpointer = AsyncCheckpointerType.PROCESS if in_process else AsyncCheckpointerType.THREAD
        self.order_staging_after_compute()
        try:
            response = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.process_group,
                async_checkpointer_type=checkpointer,
                async_stager=self._stager,
            )
        except DCP_FAILURES as error:  # planning or staging failed before the write began
            self._settle(step, error)
            return
        if isinstance(response, AsyncSaveResponse):
            self._staging, upload = response.staging_completion, response.upload_completion
        else:
            upload = response  # staging already finished inside async_save
        self._in_flight = self._writes.submit(self._publish_when_written, upload, written, final)
        self._in_flight_step = step

    def save_at_stop(self, step: int) -> None:
        """The save on a stop signal after `step`: the quickest that leaves a full checkpoint
        to resume from exactly, since the launcher kills the ranks checkpoint.stop_save_seconds
        after the signal. Every rank must call it.

        A save of an earlier step still being written on some rank is waited for and is the
        last one: writing this step after it would take a whole write longer, while the steps
        trained since it began, fewer than that write lasts, are trained again after a resume
        with the same result. Otherwise the save issued for this step is waited for, or this
        step is saved synchronously. A save in flight that fails is replaced by a synchronous
        save of this step (a stop signal also reaches the writer processes of
        async_with_pinned_mem, which then die with the save they were writing)."""
        in_flight = self._in_flight
        if in_flight is not None and self._in_flight_step != step and self.on_any_rank(not in_flight.done()):
            last = self._in_flight_step
            logger.warning(
                "stop signal received at step %d: the save of step %d, still being written, is the last "
                "one (a resume trains steps %d to %d again, to the same result); exiting",
                step,
                last,
                last + 1,
                step,
            )
        else:
            last = step
            logger.warning("stop signal received: saving step %d and exiting", step)
        try:
            self.wait()
        except CheckpointError as error:
            failure = str(error)
        else:
            failure = self.failed_save  # with continue_on_save_error
        if self._saved_step == last:
            return
        if failure is not None:
            logger.warning("%s; saving step %d for the stop instead", failure, step)
        self.save(step, sync=True)

    def fail_if_not_saved(self, which: str) -> None:
        """continue_on_save_error lets training go on past a failed save, trusting a later
        one; the run's final save (``which``) has none after it, so its failure fails the run.
        An exit status of 0 would tell a scheduler or a job chain that the final state is on disk."""
        if self.failed_save is not None:
            raise CheckpointError(
                f"{self.failed_save} ({which}: nothing later can make up for it, "
                "so the run fails even with checkpoint.continue_on_save_error)"
            )

    def on_any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank. Over the default group: a save in flight may be
        using the checkpoint group from its background thread."""
        if self.process_group is None:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _publish_when_written(self, upload: Future, written: Path | ObjectPath, final: Path | ObjectPath):
        upload.result()
        self._publish(written, final)

    def _publish(self, written: Path | ObjectPath, final: Path | ObjectPath) -> None:
        """Rank 0 makes a fully written save visible as step-N (renamed into place, or in object
        storage committed by its marker), then purges old ones. DCP returns on rank 0 only after
        every rank's data and the metadata are written."""
        if self.rank != 0:
            return
        if self.config.verify_integrity:
            write_manifest(written)
        publish(written, final)
        logger.info("checkpoint saved: %s", final)
        try:
            # What a save killed at an older step left: in a folder that replica groups share,
            # or in object storage, only once a later step is committed.
            if self.shared_by_groups or self.in_object_storage:
                self._remove_leftovers(older_than=folder_step(final))
            self._purge()
        except DCP_FAILURES as error:  # the new checkpoint is saved; only old ones stay
            logger.warning("could not delete old checkpoints in %s: %s", self.folder, describe_failure(error))

    def _settle(self, step: int, error: BaseException | None, agree: bool = True) -> None:
        """After a save ended: if it failed on any rank, rank 0 removes its partial folder and
        every rank raises CheckpointError (or, with continue_on_save_error, logs and goes on).
        With `agree`, the ranks first share their outcome (a failure in rank 0's publishing is
        seen by it alone), so that all of them stop or go on together."""
        if error is not None and is_collective_failure(error):
            # A peer died or hangs: the group cannot agree on anything any more, and no
            # training collective will succeed either. The trainer reports it as such.
            raise error
        text = None if error is None else describe_failure(error)
        if agree and self.process_group is not None:
            text = first_error_on_any_rank(text, self.process_group)
        self.failed_save = None
        if text is None:
            self._saved_step = step
            return
        written = save_folder(self.folder, step)
        if self.rank == 0:
            remove_folder(written)
        what = f"what it wrote to {written.name}" if self.in_object_storage else f"its partial folder {written.name}"
        message = (
            f"saving checkpoint step-{step} in {self.folder} failed {text} "
            f"({what} was removed; earlier checkpoints are untouched)"
        )
        if not self.config.continue_on_save_error:
            raise CheckpointError(message) from error
        newest = next(reversed(complete_steps(self.folder)), None)
        on_disk = f"the newest checkpoint on disk is {'none' if newest is None else f'step-{newest}'}"
        self.failed_save = f"{message}; {on_disk}"
        logger.error(
            "CHECKPOINT NOT SAVED: %s. Training goes on (checkpoint.continue_on_save_error); %s", message, on_disk
        )

    def order_staging_after_compute(self) -> None:
        """With pinned-memory staging on CUDA, the stager copies from a thread on a CUDA stream
        of its own, which does not wait for the compute stream: without this the copy could
        read weights and moments the optimizer step is still writing. A save point may wait
        for the device. (With wait_for_staging, the guard against a torn async save.)"""
        if self._stager is not None and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # cuda-only

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state; call before changing weights.
        A copy that failed is not raised here: the save's write fails with it, and wait()
        settles that failure like any other (DCP itself reports a copy that failed before
        async_save returned only through the write)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                staging.result()
            except DCP_FAILURES:
                pass  # the write, waiting on the same copy, fails with the same error

    def wait(self, agree: bool = True) -> None:
        """Block until the save in flight is on disk (and published); a failed one is
        settled as in a synchronous save. Every rank must call it, unless not `agree`."""
        self.wait_for_staging()
        if self._in_flight is None:
            return
        in_flight, self._in_flight = self._in_flight, None
        try:
            in_flight.result()
        except DCP_FAILURES as error:
            self._settle(self._in_flight_step, error, agree)
        else:
            self._settle(self._in_flight_step, None, agree)

    def close(self) -> None:
        # No exchange with the other ranks: close() also runs on a rank leaving with an
        # error. A normal run's last save is synchronous and has settled already.
        try:
            self.wait(agree=False)
        finally:
            self._writes.shutdown()
            if self._stager is not None:
                close_stager(self._stager)

    # --- purging -----------------------------------------------------------------------

    def _purge(self) -> None:
        purge_old_steps(self.folder, self.config.keep_latest_k, self.config.keep_every)

    def _remove_leftovers(self, older_than: int | None = None) -> None:
        """Remove what interrupted saves and purges left behind (only names we create), or
        only those of steps before `older_than`."""
        for entry in leftover_folders(self.folder):
            if older_than is not None and folder_step(entry) >= older_than:
                continue
            remove_folder(entry)
            logger.info("removed an incomplete checkpoint folder: %s", entry)

    # --- loading -----------------------------------------------------------------------

    def _agree(self, decide):
        """Run `decide` on rank 0 only and give every rank its result (or its error): ranks
        listing a shared filesystem themselves could see different folders."""
        outcome = [None]
        if self.rank == 0:
            try:
                outcome[0] = ("ok", decide())
            except CheckpointError as error:
                outcome[0] = ("error", str(error))
            except DCP_FAILURES as error:  # e.g. a permission error: the others must not wait for it
                outcome[0] = ("error", f"{self.folder}: {describe_failure(error)}")
        if self.process_group is not None:
            dist.broadcast_object_list(outcome, src=0, group=self.process_group)
        status, value = outcome[0]
        if status == "error":
            raise CheckpointError(value)
        return value

    def _refuse_other_model(self, path: Path) -> None:
        """Before any weight is read, a checkpoint of another model is refused by what it
        recorded (a model state that can tell, as ModelState does)."""
        refuse = getattr(self.states[MODEL], "refuse_other_model", None)
        if refuse is not None:
            refuse(path, self.folder)

    def _dcp_load(self, state: dict, path: Path) -> None:
        try:
            dcp.load(state, storage_reader=reader_for(path), process_group=self.process_group)
        except DCP_FAILURES as error:
            rank, failure = first_failure(error)
            if isinstance(failure, CheckpointError):  # a damaged file, named by the reader
                raise CheckpointError(f"{failure} (on rank {rank})" if rank is not None else str(failure)) from error
            raise CheckpointError(f"{path}: loading failed {describe_failure(error)}") from error

    def _skip_absent_records(self, state: dict, path: Path) -> None:
        """Ask only for the model part's non-tensor entries (its description) that the
        checkpoint holds: checkpoints written by other tools, torchtitan's among them, hold
        the weights alone, and older ones lack entries added since (tokenizer_path). Likewise
        the entries a state lists in its ``entries_added_later``: a checkpoint written before
        them must still resume, and the state's load_state_dict gives them a default. A
        missing tensor is still an error."""
        stored = stored_prefixes(path)
        for key in [k for k, v in state.items() if k not in self.states and not isinstance(v, torch.Tensor)]:
            _drop_unstored(state, key, key, stored)
        for name, stateful in self.states.items():
            for key in getattr(stateful, "entries_added_later", ()):
                if key in state.get(name, {}) and f"{name}.{key}" not in stored:
                    del state[name][key]

    def _stored_names(self, state: dict, path: Path) -> dict[str, str]:
        """The model's weights that the checkpoint holds under another torchtitan spelling
        (a later torchtitan's checkpoint, given as initial_load_path): name -> stored name."""
        weights = [k for k, v in state.items() if k not in self.states and isinstance(v, torch.Tensor)]
        stored_names = getattr(self.states[MODEL], "stored_names", None)
        return {} if stored_names is None else stored_names(weights, set(stored_keys(path)))

    def load(self) -> list[str]:
        """Load the checkpoint to resume from, if any, into the (already sharded) states.
        Returns the names of the parts loaded (none for a fresh start)."""
        if not self.in_use:
            return []
        self.wait()
        plan = self._agree(lambda: plan_load(self.folder, self.config, list(self.states), self._refuse_other_model))
        if plan is None:
            return []
        path, parts = plan
        state = self._collect(parts)
        self._skip_absent_records(state, path)
        renamed = self._stored_names(state, path) if MODEL in parts else {}
        for name, stored in renamed.items():
            state[stored] = state.pop(name)
        self._dcp_load(state, path)  # fills the tensors in place, under whichever name
        for name, stored in renamed.items():
            state[name] = state.pop(stored)
        for name in parts:
            part = {k: v for k, v in state.items() if k not in self.states} if name == MODEL else state[name]
            try:
                self.states[name].load_state_dict(part)
            except (ValueError, KeyError, RuntimeError) as error:
                raise CheckpointError(f"{path}: cannot load '{name}': {' '.join(str(error).split())[:300]}") from error
        logger.info("loaded checkpoint %s (%s)", path, ", ".join(parts))
        return parts
