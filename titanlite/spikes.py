"""Loss spikes skipped on the device: a step whose loss or gradient norm stands far above those
of the recent accepted steps is not applied, as a non-finite step is not (titanlite.nonfinite).

The test is OLMo-core's rule: with the last ``size`` accepted steps as the window, a step is a
spike when its loss over the global batch or its global gradient norm exceeds the window's mean
plus ``sigmas`` standard deviations, once half a window was accepted. Everything lives on the
device and is computed from values every rank holds alike (the all-reduced loss, the global
norm), so all ranks skip the same steps and the host never waits for the decision: it reads the
flags with the non-finite ones, at its usual read points.

Skipped steps, spikes and non-finite ones, never enter the window: a spike would widen the
standard deviation and let the next spike through, and a run of them would become the "normal"
the later steps are compared with.
"""

import torch
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.config.training import Training
from titanlite.metrics import tags

LOSS, GRAD_NORM = 0, 1  # the window's rows


class SpikeWindow(Stateful):
    """The last ``size`` accepted steps' loss and gradient norm in a ring on the device, the
    count of accepted steps and of skipped spikes: the checkpoint's "spike_window", so that a
    resumed run skips exactly the steps the uninterrupted run skips."""

    def __init__(self, size: int, sigmas: float, device: torch.device):
        self.size, self.sigmas = size, sigmas
        self.active_after = size // 2  # accepted steps before the test starts
        self.values = torch.zeros(2, size, device=device)  # [LOSS, GRAD_NORM] x slot, float32
        self.accepted = torch.zeros((), dtype=torch.int64, device=device)  # slot of the next: accepted % size
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # spike steps skipped so far
        # The last step's [spike flag, loss, z-score], for the host's reads.
        self.last = torch.zeros(3, device=device)
        self._slots = torch.arange(size, device=device)

    @torch.no_grad()
    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
        """Whether to skip the step (a flag on the device): non-finite, or a spike. Then the
        step enters the window unless skipped. ``loss`` is the global batch's, alike on every
        rank. No operator here makes the host wait."""
        step = torch.stack([loss.float(), grad_norm.float()])
        mean, std = self.statistics()
        spike = (step > mean + self.sigmas * std).any() & (self.accepted >= self.active_after) & ~nonfinite
        skip = nonfinite | spike
        slot = (self._slots == self.accepted % self.size) & ~skip
        self.values.copy_(torch.where(slot, step[:, None], self.values))
        self.accepted += (~skip).long()
        self.skipped += spike.long()
        self.last = torch.stack([spike.float(), step[LOSS], self.z_score(step, mean, std)])
        return skip

    def statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's mean and (sample) standard deviation of the loss and of the gradient
        norm, over the slots filled so far (std 0 until two are)."""
        filled = (self._slots < self.accepted).float()
        count = filled.sum()
        mean = (self.values * filled).sum(1) / count.clamp(min=1)
        squares = ((self.values - mean[:, None]) * filled).square().sum(1)
        return mean, (squares / (count - 1).clamp(min=1)).sqrt()

    @staticmethod
    def z_score(step: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """The larger of the loss's and the gradient norm's distance above the window's
        mean, in its standard deviations (0 where the window has no spread yet)."""
        return torch.where(std > 0, (step - mean) / std.clamp(min=torch.finfo(std.dtype).tiny), 0.0).amax()

    def metrics(self) -> dict[str, float]:
        """The logged step's z-score and the spike steps skipped so far (one read of the
        device, at a log step, where the host reads the loss anyway)."""
        z_score, skipped = torch.stack([self.last[2], self.skipped.float()]).tolist()
        return {tags.SPIKE_Z_SCORE: z_score, tags.SPIKE_SKIPPED: skipped}

    def state_dict(self) -> dict:
        return {"values": self.values, "accepted": self.accepted, "skipped": self.skipped}

    def load_state_dict(self, state_dict: dict) -> None:
        # (DCP refuses a checkpoint whose window has another size before this runs.)
        for name in ("values", "accepted", "skipped"):
            getattr(self, name).copy_(state_dict[name])


def spike_window(training: Training, device: torch.device) -> SpikeWindow | None:
    """The run's window when training.skip_spike_steps is on."""
    return SpikeWindow(training.spike_window, training.spike_sigmas, device) if training.skip_spike_steps else None
