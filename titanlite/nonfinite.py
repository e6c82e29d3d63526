"""Steps whose gradients came out NaN or inf: none is applied, and the host learns of them
in batches, so that it does not wait for the device at every step."""

import logging

import torch

from titanlite.errors import NonFiniteError

logger = logging.getLogger("titanlite")

# Steps between the host's reads of what the device decided (the steps' non-finite flags)
# and of the ranks' stop signals; they are also read at every log step and save point.
# Between reads the CPU queues work ahead of the GPU instead of waiting for it each step.
SYNC_EVERY = 10


class SpikeError(RuntimeError):
    """More loss spikes in a row than training.spike_max_in_a_row allows."""


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """Apply the optimizer's update unless ``nonfinite`` (a flag on the device) is set."""
    if optimizer.defaults.get("fused"):
        # The fused kernel reads the flag on the device and then leaves the weights, the
        # moments and the step count alone: the host does not wait for the norm.
        optimizer.found_inf = nonfinite.float()
        optimizer.step()
    elif not nonfinite.item():  # the other kernels cannot skip by themselves: one wait per step
        optimizer.step()


class UnreadSteps:
    """The steps the host has not read yet, and how many non-finite (or spike) ones in a row it
    skipped."""

    def __init__(self, skip_limit: int, spike_limit: int = 0):
        self.skip_limit = skip_limit  # training.skip_nonfinite_steps
        self.spike_limit = spike_limit  # training.spike_max_in_a_row (0: no limit)
        self.in_a_row = self.spikes_in_a_row = 0
        # (step, its numbers on the device: [non-finite flag, gradient norm, loss share] and, with
        # spike skipping, the window's [spike flag, global loss, z-score]).
        self._steps: list[tuple[int, torch.Tensor]] = []

    def add(
        self,
        step: int,
        nonfinite: torch.Tensor,
        grad_norm: torch.Tensor,
        loss_share: torch.Tensor,
        spike: torch.Tensor | None = None,
    ) -> None:
        numbers = [nonfinite.float(), grad_norm.float(), loss_share.float()]
        self._steps.append((step, torch.cat([torch.stack(numbers), *([] if spike is None else [spike])])))

    def read(self, current_step: int) -> None:
        """Read the flags of the steps since the last read (one wait for the device) and act
        on them in order: warn about each skipped step, or raise NonFiniteError at the first
        one past ``skip_limit`` (``spike_limit`` for spikes) in a row. The trainer calls this
        before every log line and save, so a checkpoint never follows a step that should have
        stopped the run."""
        if not self._steps:
            return
        steps = [step for step, _ in self._steps]
        rows = torch.stack([numbers for _, numbers in self._steps]).tolist()
        self._steps = []
        for step, (nonfinite, norm, share, *spike) in zip(steps, rows, strict=True):
            if spike and spike[0]:
                self._spike_skipped(step, norm, *spike[1:], current_step)
            elif nonfinite:
                self._nonfinite_skipped(step, norm, share, current_step)
            else:
                self.in_a_row = self.spikes_in_a_row = 0

    def _nonfinite_skipped(self, step: int, norm: float, share: float, current_step: int) -> None:
        what = f"gradient norm {norm}, this rank's loss share {share}"
        if self.in_a_row < self.skip_limit:
            self.in_a_row += 1
            logger.warning(
                "step %d skipped, the weights are unchanged: %s (%d in a row, at most %d)",
                step,
                what,
                self.in_a_row,
                self.skip_limit,
            )
            return
        raise NonFiniteError(
            f"step {step}: {what}; its update was not applied, so every checkpoint holds finite weights"
            f"{_later(step, current_step)} (training.skip_nonfinite_steps skips such steps instead)"
        )

    def _spike_skipped(self, step: int, norm: float, loss: float, z_score: float, current_step: int) -> None:
        """A finite step skipped as a spike: neither resets nor adds to the non-finite count."""
        self.spikes_in_a_row += 1
        what = f"loss {loss:.4f}, gradient norm {norm:.4f}, {z_score:.1f} standard deviations above the window"
        if self.spike_limit and self.spikes_in_a_row > self.spike_limit:
            raise SpikeError(
                f"step {step}: a loss spike again ({what}), {self.spikes_in_a_row} in a row; the loss has left the "
                f"window's range for good{_later(step, current_step)} (training.spike_max_in_a_row)"
            )
        logger.warning("step %d skipped as a loss spike, the weights are unchanged: %s", step, what)


def _later(step: int, current_step: int) -> str:
    return "" if step == current_step else f"; found at step {current_step}, and no step after it was saved"
