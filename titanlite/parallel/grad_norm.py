"""Gradient-norm clipping that sees the whole model, not one rank's shard."""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _scale_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every gradient by ``scale`` in place, on its local tensor: scaling is the same
    on every element, whatever the placement, so DTensor need not find a sharding for it.
    For a foreach multiply over hundreds of DTensors that search costs seconds (it grows
    with the mesh's dimensions: half the estimator's simulated step on a 5-D mesh), and it
    cannot take DTensors of different meshes in one call (the experts' under EP)."""
    by_device_and_dtype: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        by_device_and_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_device_and_dtype.items():
        torch._foreach_mul_(group, scale.to(device))


def _copies(grad: torch.Tensor, stages: int) -> int:
    """How many ranks hold this rank's piece of ``grad``: every rank of its pipeline stage for
    a plain tensor, which nothing split (``stages`` pipeline stages each hold other
    parameters); for a DTensor, the sizes of the mesh dimensions it is replicated over, times
    the copies of its whole mesh in the stage, for a mesh that leaves out some of the stage's
    dimensions (none does today: the experts' ep mesh takes all the tp ranks, and FSDP adds
    the data-parallel ranks EP leaves)."""
    ranks_per_stage = dist.get_world_size() // stages if dist.is_initialized() else 1
    if not isinstance(grad, DTensor):
        return ranks_per_stage
    copies = ranks_per_stage // grad.device_mesh.size()
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient is still a partial sum over mesh dimension {dim}; reduce it first")
        if placement.is_replicate():
            copies *= grad.device_mesh.size(dim)
    return copies


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0, stages: int = 1) -> torch.Tensor:
    """The norm of all of ``grads`` together, the same on every rank, with one all-reduce.

    Gradients are split in different ways on one mesh (FSDP shards over the data-parallel
    dimensions, TP over ``tp``, some only over one of them, some over none), so each rank
    adds up its own pieces' |g|^p, divided by the number of ranks holding the same piece,
    and the sum over all ranks counts every element of every gradient exactly once. Under
    pipeline parallelism (``stages`` > 1) each stage's ranks hold other gradients, and the
    sum over all ranks adds the stages' together.
    """
    if not grads:
        return torch.zeros(())
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    # CPU kernels add a tensor's squares one after another in the output's dtype: in float32
    # the norm of a 4 M-element gradient comes out about 1e-4 low, and a layout that splits
    # the tensor rounds differently from one that does not (FSDP 2 against one process read
    # 1e-4 apart). Summed in float64 both agree to float32's last bit. CUDA's kernel sums in a
    # tree and is accurate in float32; bf16 gradients are measured in float32 either way.
    accumulate = torch.float64 if local[0].device.type == "cpu" else torch.float32
    norms = torch._foreach_norm(local, norm_type, dtype=accumulate)
    if math.isinf(norm_type):
        total = torch.stack(norms).max().float()
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    # Python numbers, not a tensor: nothing is copied to the device for them.
    powered = torch._foreach_div(torch._foreach_pow(norms, norm_type), [float(_copies(grad, stages)) for grad in grads])
    total = torch.stack(powered).sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.pow(1.0 / norm_type).float()


def _grads_in_parameter_layout(parameters: list[torch.nn.Parameter]) -> None:
    """Put every gradient into its parameter's layout, once, before the norm and the
    optimizer read it. Without FSDP (which reduces into the parameter's layout) two kinds
    differ under tensor parallelism:
    - partial sums: a norm's weight, whole on every TP rank, gets from each rank the
      gradient of its slice of the sequence only (sequence parallel); they are summed here;
    - whole gradients of split parameters: DTensor's embedding backward has no
      vocabulary-split rule, so the vocabulary-split embedding gets its gradient whole on
      every TP rank. Its slice is taken here (no communication) and copied, so that the
      whole gradient is freed instead of staying alive under a view."""
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
            continue
        in_layout = grad.redistribute(param.device_mesh, param.placements)
        local = in_layout.to_local()
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            in_layout = DTensor.from_local(
                local.clone(),
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        param.grad = in_layout


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0, stages: int = 1
) -> torch.Tensor:
    """Clip gradients to the global norm and return that norm (before clipping); every rank
    gets the same norm, so all clip alike. ``max_norm <= 0`` only measures. ``stages``: the
    pipeline stages, each holding its own parameters."""
    parameters = list(parameters)
    _grads_in_parameter_layout(parameters)
    total_norm = total_grad_norm([p.grad for p in parameters if p.grad is not None], norm_type, stages)
    if max_norm > 0:  # as torch.nn.utils.clip_grads_with_norm_ scales
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        _scale_([p.grad for p in parameters if p.grad is not None], scale)
    return total_norm
