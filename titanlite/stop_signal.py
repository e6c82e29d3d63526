"""A stop signal (SIGTERM from a scheduler preempting the job, SIGINT from a terminal),
remembered so that the training loop can finish its step, save and exit cleanly instead
of dying mid-step."""

import logging
import signal
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlite")


class StopSignal:
    """Whether, and when, this process got a stop signal."""

    def __init__(self):
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic() at the first stop signal

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._remember)
        signal.signal(signal.SIGINT, self._remember)

    def _remember(self, signum, frame) -> None:
        if self.signum is None:
            self.received_at = time.monotonic()
        self.signum = signum

    @property
    def received(self) -> bool:
        return self.signum is not None

    def on_any_rank(self) -> bool:
        """Whether any rank got one: a collective, which every rank must call together."""
        flag = torch.tensor([1 if self.received else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a CPU tensor: no wait on the GPU
        return bool(flag.item())

    def agreed(self, due: bool) -> bool:
        """Whether any rank got one, where ``due``: the ranks compare flags (on_any_rank) at
        the same steps only; a single process tells its own at every one."""
        if not dist.is_initialized():
            return self.received
        return due and self.on_any_rank()

    def report_time(self, grace_seconds: int) -> None:
        """Say how much of the launchers' grace after the signal the stop used, the figure
        to size checkpoint.stop_save_seconds by."""
        if self.received_at is None:  # the signal reached other ranks only
            return
        took = time.monotonic() - self.received_at
        # A shared filesystem's write speed varies from save to save: ask for time to spare.
        tight = took > grace_seconds / 2
        (logger.warning if tight else logger.info)(
            "stop signal: saved %.1f s after it, of the %d s the launchers give (checkpoint.stop_save_seconds)%s",
            took,
            grace_seconds,
            "; raise it to leave room" if tight else "",
        )
