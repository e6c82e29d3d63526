"""Random initialisation that does not depend on how a parameter is sharded.

PyTorch's sharded (DTensor) random ops only reproduce single-device values on CUDA,
and not at all on CPU. So each parameter is drawn whole from one generator, in the
model's fixed order, and every rank keeps the part it owns. A run's starting weights
then depend on the seed alone, never on the parallel layout. The price is one full
parameter of temporary memory at a time, at start-up only.
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def _fill_whole(param: torch.Tensor, draw: Callable[[torch.Tensor], None], generator: torch.Generator) -> None:
    full = torch.empty(param.shape, dtype=param.dtype, device=generator.device)
    draw(full)
    full = full.to(param.device)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the same full tensor, so each
        # cuts out its own shard locally instead of receiving it from rank 0.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


@torch.no_grad()
def fill_normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    _fill_whole(param, lambda t: t.normal_(0.0, std, generator=generator), generator)


@torch.no_grad()
def fill_trunc_normal_(param: torch.Tensor, std: float, generator: torch.Generator, cutoff: float = 2.0) -> None:
    """Normal(0, std) with values beyond cutoff * std redrawn."""

    def draw(t: torch.Tensor) -> None:
        torch.nn.init.trunc_normal_(t, std=std, a=-cutoff * std, b=cutoff * std, generator=generator)

    _fill_whole(param, draw, generator)
