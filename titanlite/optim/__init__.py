"""Optimizer and learning-rate schedule built from the [optimizer] and [lr_scheduler] sections."""

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config import LRScheduler, Optimizer

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizer(parameters, config: Optimizer) -> torch.optim.Optimizer:
    kernel = {
        "for-loop": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
    }[config.implementation]
    return _OPTIMIZERS[config.name](
        parameters,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        **kernel,
    )


def wsd_factor(step: int, total_steps: int, config: LRScheduler) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based) of warmup-stable-decay.

    Warmup rises linearly and never starts at zero; the stable phase holds the peak;
    the decay phase covers the last `decay_ratio` of all steps (every step after warmup
    when unset) and would reach `min_lr_factor` one step after the last, so that the
    final step still learns when the minimum is zero.
    """
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total_steps - warmup if config.decay_ratio is None else round(total_steps * config.decay_ratio)
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start or total_steps <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (total_steps - decay_start + 1))
    shape = {
        "linear": 1.0 - progress,
        "sqrt": 1.0 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[config.decay_type]
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * shape


class RunSchedule(LambdaLR):
    """The run's learning-rate schedule: the peak rate times ``wsd_factor`` at each step.

    A checkpoint gives it only its position. The schedule itself (steps, warmup, decay,
    peak rate) is the resuming run's config, so the first resumed step already runs at the
    new schedule's rate; LambdaLR's own load would keep the checkpoint's peak rates, and the
    optimizer the rate the old schedule set for that step."""

    def load_state_dict(self, state_dict: dict) -> None:
        own_peaks = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = own_peaks
        rates = [peak * factor(self.last_epoch) for peak, factor in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self._last_lr = rates  # what step() records for get_last_lr()


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduler, total_steps: int) -> RunSchedule:
    return RunSchedule(optimizer, functools.partial(wsd_factor, total_steps=total_steps, config=config))
