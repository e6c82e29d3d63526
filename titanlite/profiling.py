"""Step profiling: torch.profiler traces and CUDA memory snapshots, every ``profile_freq`` steps.

    with profiler_context(job_config.profiling, job_config.job.dump_folder, rank, start_step=trainer.step) as profiler:
        while step < steps:
            train_step()
            profiler.step()          # exactly once per training step, after it

Traces go to ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<rank>_trace.json`` (open them
in chrome://tracing or Perfetto); snapshots go to
``<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle``
(open them at pytorch.org/memory_viz). With both features off the profiler does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

logger = logging.getLogger(__name__)

# Allocator events kept for a snapshot; enough for several steps of a large model.
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Traces the last step of every window of ``profile_freq`` steps and/or dumps memory snapshots.

    Steps are numbered like the trainer's: the first step after ``start_step`` is ``start_step + 1``,
    so a resumed run traces the same step numbers as an uninterrupted one. Step ``s`` is traced
    when ``s % profile_freq == 0``; the step before it warms the profiler up (its overhead stays out
    of the trace), and the first steps of a run are never traced unless the window is that short.

    Args:
        profile_freq: window length in steps (>= 1).
        rank: this process's rank, used in the file names.
        traces_folder: where traces go; None disables tracing.
        memory_snapshot_folder: where snapshots go; None disables them (they also need CUDA).
        start_step: the step already completed when profiling starts (a resumed run's step).
    """

    def __init__(
        self,
        profile_freq: int,
        rank: int,
        traces_folder: str | None = None,
        memory_snapshot_folder: str | None = None,
        start_step: int = 0,
    ):
        if isinstance(profile_freq, bool) or not isinstance(profile_freq, int) or profile_freq < 1:
            raise ValueError(f"profiling.profile_freq: expected a positive int, got {profile_freq!r}")
        self.profile_freq = profile_freq
        self.rank = rank
        self.traces_folder = traces_folder
        self.memory_snapshot_folder = _memory_snapshots_possible(memory_snapshot_folder)
        self.current_step = start_step  # the last completed step
        self._start_step = start_step
        self._torch_profiler: torch.profiler.profile | None = None
        self._in_step = False

    @property
    def enabled(self) -> bool:
        return self.traces_folder is not None or self.memory_snapshot_folder is not None

    # --- context manager ---------------------------------------------------------------------

    def __enter__(self) -> Profiler:
        if self.traces_folder is not None:
            self._torch_profiler = torch.profiler.profile(
                activities=_activities(),
                schedule=self._schedule,
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self._torch_profiler.__enter__()
        if self.memory_snapshot_folder is not None:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)  # cuda-only
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            if self._torch_profiler is not None:
                self._torch_profiler.__exit__(*exc_info)
                self._torch_profiler = None
        finally:
            if self.memory_snapshot_folder is not None:
                torch.cuda.memory._record_memory_history(enabled=None)  # stop recording; cuda-only

    # --- per step ----------------------------------------------------------------------------

    def step(self) -> None:
        """Mark the end of one training step: saves its trace / snapshot when it closes a window."""
        self.current_step += 1
        if self._torch_profiler is not None:
            # The trace of the step just finished is written from inside this call.
            self._in_step = True
            try:
                with warnings.catch_warnings():
                    # Each trace holding only its own step is the point; torch warns about it once.
                    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
                    self._torch_profiler.step()
            finally:
                self._in_step = False
        if self.memory_snapshot_folder is not None and self.current_step % self.profile_freq == 0:
            self._dump_memory_snapshot()

    def _schedule(self, calls: int) -> ProfilerAction:
        """The action for the step that runs after ``calls`` calls of ``step()``."""
        upcoming = self._start_step + calls + 1
        position = upcoming % self.profile_freq
        if position == 0:
            return ProfilerAction.RECORD_AND_SAVE
        if position == self.profile_freq - 1:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _save_trace(self, torch_profiler: torch.profiler.profile) -> None:
        if not self._in_step:
            # Leaving the context while a recording step was scheduled: that step never ran,
            # and its name would overwrite the trace of the step before it.
            return
        path = _iteration_file(self.traces_folder, self.current_step, f"rank{self.rank}_trace.json")
        began = time.perf_counter()
        torch_profiler.export_chrome_trace(path)
        logger.info(
            "profiler trace of step %d saved to %s in %.2f s", self.current_step, path, time.perf_counter() - began
        )

    def _dump_memory_snapshot(self) -> None:
        path = _iteration_file(
            self.memory_snapshot_folder, self.current_step, f"rank{self.rank}_memory_snapshot.pickle"
        )
        torch.cuda.memory._dump_snapshot(path)  # cuda-only
        logger.info("memory snapshot of step %d saved to %s", self.current_step, path)


def _activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)  # cuda-only
    return activities


def _iteration_file(folder: str, step: int, file_name: str) -> str:
    """``folder/iteration_<step>/file_name``, creating the step's folder."""
    step_folder = os.path.join(folder, f"iteration_{step}")
    os.makedirs(step_folder, exist_ok=True)
    return os.path.join(step_folder, file_name)


_warned_no_cuda = False


def _memory_snapshots_possible(folder: str | None) -> str | None:
    """``folder`` when snapshots can be taken; None (after one warning per process) without CUDA,
    since only the CUDA caching allocator records the history a snapshot is made of."""
    global _warned_no_cuda
    if folder is None or torch.cuda.is_available():
        return folder
    if not _warned_no_cuda:
        logger.warning("profiling.enable_memory_snapshot needs CUDA; no memory snapshots will be taken")
        _warned_no_cuda = True
    return None


@contextlib.contextmanager
def profiler_context(profiling_config, dump_folder: str, rank: int, start_step: int = 0) -> Iterator[Profiler]:
    """A Profiler for a ``Profiling`` config section, entered for the ``with`` block.

    Call ``step()`` on it once after every training step; ``start_step`` is the step the run
    resumes from (0 for a fresh run). With profiling and snapshots off it does nothing.
    """
    traces_folder = memory_snapshot_folder = None
    if profiling_config.enable_profiling:
        traces_folder = os.path.join(dump_folder, profiling_config.save_traces_folder)
    if profiling_config.enable_memory_snapshot:
        memory_snapshot_folder = os.path.join(dump_folder, profiling_config.save_memory_snapshot_folder)
    profiler = Profiler(profiling_config.profile_freq, rank, traces_folder, memory_snapshot_folder, start_step)
    if profiler.enabled:
        logger.info(
            "profiling every %d steps: traces in %s, memory snapshots in %s",
            profiler.profile_freq,
            profiler.traces_folder,
            profiler.memory_snapshot_folder,
        )
    with profiler:
        yield profiler
