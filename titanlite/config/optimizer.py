"""The [optimizer], [lr_scheduler] and [ema] sections: how the weights are updated, at which
rate, and their moving average."""

from dataclasses import dataclass
from typing import Literal

from titanlite.config.ranges import FRACTION, FRACTION_BELOW_ONE, FRACTION_OR_UNSET, POSITIVE, at_least, ranged


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""

    lr: float = ranged(POSITIVE, default=8e-4)
    """Peak learning rate."""

    beta1: float = ranged(FRACTION_BELOW_ONE, default=0.9)
    """Adam's first-moment decay."""

    beta2: float = ranged(FRACTION_BELOW_ONE, default=0.95)
    """Adam's second-moment decay."""

    eps: float = ranged(POSITIVE, default=1e-8)
    """Adam's denominator epsilon."""

    weight_decay: float = ranged(at_least(0), default=0.1)
    """Decoupled weight decay (applied to every parameter)."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: fused (one kernel for all tensors, on CUDA and CPU; it also skips a non-finite step on the
    device, with no wait), foreach (multi-tensor) or for-loop; the last two make the host wait for the gradient norm
    every step."""


@dataclass
class LRScheduler:
    warmup_steps: int = ranged(at_least(0), default=200)
    """Steps of linear warmup from near zero to the peak learning rate."""

    decay_ratio: float | None = ranged(FRACTION_OR_UNSET, default=None)
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); unset means decay over every step after
    warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = ranged(FRACTION, default=0.0)
    """Learning rate at the end of decay, as a fraction of the peak."""


@dataclass
class EMA:
    enable: bool = False
    """Keep an exponential moving average of the weights, sharded like them and saved in checkpoints."""

    decay: float = ranged(FRACTION_BELOW_ONE, default=0.9999)
    """Weight of the old average at each step: ema = decay * ema + (1 - decay) * weights."""
