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
    """The steps the host has not read yet, and how many non-finite ones in a row it skipped."""

    def __init__(self, skip_limit: int):
        self.skip_limit = skip_limit  # training.skip_nonfinite_steps
        self.in_a_row = 0
        # (step, non-finite flag, gradient norm, loss share), all but the step on the device.
        self._steps: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, nonfinite: torch.Tensor, grad_norm: torch.Tensor, loss_share: torch.Tensor) -> None:
        self._steps.append((step, nonfinite, grad_norm, loss_share))

    def read(self, current_step: int) -> None:
        """Read the flags of the steps since the last read (one wait for the device) and act
        on them in order: warn about each skipped step, or raise NonFiniteError at the first
        one past ``skip_limit`` in a row. The trainer calls this before every log line and
        save, so a checkpoint never follows a step that should have stopped the run."""
        if not self._steps:
            return
        steps = [step for step, *_ in self._steps]
        columns = zip(*(unread[1:] for unread in self._steps), strict=True)
        flags, norms, shares = (torch.stack(column).tolist() for column in columns)
        self._steps = []
        for step, nonfinite, norm, share in zip(steps, flags, norms, shares, strict=True):
            if not nonfinite:
                self.in_a_row = 0
                continue
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
                continue
            later = "" if step == current_step else f"; found at step {current_step}, and no step after it was saved"
            raise NonFiniteError(
                f"step {step}: {what}; its update was not applied, so every checkpoint holds finite weights"
                f"{later} (training.skip_nonfinite_steps skips such steps instead)"
            )
