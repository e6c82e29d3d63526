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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduler, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, functools.partial(wsd_factor, total_steps=total_steps, config=config))
