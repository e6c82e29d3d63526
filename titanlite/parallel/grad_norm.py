"""Gradient-norm clipping that sees the whole model, not one rank's shard."""

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients to a global norm and return that norm (before clipping).

    Under FSDP each gradient is a DTensor holding only this rank's shard. The norm of
    those local pieces alone would differ per rank and understate the true norm, so the
    partial norms are reduced over the mesh (``full_tensor``) before clipping.
    ``max_norm <= 0`` only measures.
    """
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm
