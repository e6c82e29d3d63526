"""Expert parallelism for one mixture-of-experts layer (titanlite/models/moe/).

The experts of a MoE layer are split over the ranks of an ``ep`` mesh dimension: each rank
keeps n_experts / ep of them, as DTensors placed Shard(0) over that dimension, so a
checkpoint sees the whole stacked [n_experts, ...] weight and can be resharded to any other
EP degree. The router stays replicated. One forward on a rank:

  route its own tokens (the layer's router, unchanged)
  -> count the (token, expert) pairs per expert and sort the pairs by expert (unchanged)
  -> exchange the counts with every rank (an all-to-all of n_experts integers)
  -> send each pair's row to the rank owning its expert (an all-to-all of uneven sizes)
  -> run the local experts on what arrived (the layer's grouped GEMM, or its exact loop)
  -> send the results back (the reverse all-to-all)
  -> put them back in token order and weight them by the gates (unchanged)

Dropless: there is no capacity, a rank receives however many rows the others route to its
experts. The one host sync is the split sizes of the uneven all-to-all: all_to_all_single
takes them as Python lists (gloo and NCCL both need them on the host to size the transfer),
so the per-rank totals of the exchanged counts are read once per layer and forward; the
backward reuses them. Everything else stays on the device (the grouped GEMM path never reads
a count; the loop fallback reads its local counts, as it does without EP).

The all-to-alls are the in-place ``dist.all_to_all_single`` inside a small autograd function
whose backward is the reverse all-to-all, not the functional-collective version: the
in-place one returns after the collective has finished, and leaves no pending work whose
last reference a gloo thread drops late (see exit_process in distributed.py for why such a
late release aborts a process at exit).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.models.moe import GroupedExperts, MoE, swiglu_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class _AllToAll(torch.autograd.Function):
    """Rows of x go out in blocks of ``input_splits`` (block r to rank r) and come in as
    blocks of ``output_splits`` (block r from rank r). The gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of x's rows with uneven split sizes."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallelExperts(nn.Module):
    """A MoE layer's experts, n_experts / ep of them on each rank of the ``ep`` mesh, with the
    same parameter names (w1, w2, w3) and the same call as the layer's own experts module:
    rows sorted by (global) expert and the per-expert counts of this rank's tokens in, each
    row's expert output out, in the same order."""

    def __init__(self, experts: nn.Module, n_experts: int, ep_mesh: DeviceMesh):
        super().__init__()
        self.ep_mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.n_local = n_experts // self.ep
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            # src_data_rank=None: every rank holds the same whole weight, each keeps its block.
            sharded = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        self.use_grouped_mm = experts.use_grouped_mm

    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        """Always eager, also inside a compiled block (which then breaks its graph here): the
        exchange reads its split sizes on the host and runs in-place collectives, and FSDP's
        hooks on this module (its own unit) must run outside compiled code."""
        return super().__call__(*args, **kwargs)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # received_counts[r, j]: rows rank r sends for this rank's local expert j.
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        received_counts = received_counts.view(self.ep, self.n_local)
        send_splits, receive_splits = self._split_sizes(counts, received_counts, rows.shape[0])
        received = all_to_all(rows, receive_splits, send_splits, self.group)
        # Arrived grouped by source rank, then by local expert: regroup by local expert.
        local_expert = torch.arange(self.n_local, device=rows.device).repeat(self.ep)
        row_expert = local_expert.repeat_interleave(received_counts.reshape(-1), output_size=sum(receive_splits))
        order = torch.argsort(row_expert, stable=True)
        local_out = self._run_local_experts(received[order], received_counts.sum(0))
        back_in_arrival_order = local_out[torch.argsort(order)]
        return all_to_all(back_in_arrival_order, send_splits, receive_splits, self.group)

    def _split_sizes(self, counts: torch.Tensor, received_counts: torch.Tensor, n_rows: int) -> list[list[int]]:
        """(rows sent to each rank, rows received from each rank): the only host sync, the
        uneven all-to-all's split sizes. Fake tensors (the memory estimator's) hold no
        values to read: an even load is assumed there, every rank sending n_rows / ep rows
        to each rank, as the estimator models it."""
        if is_fake(counts):
            even = [n_rows // self.ep + (rank < n_rows % self.ep) for rank in range(self.ep)]
            return [even, even]
        return torch.stack([counts.view(self.ep, self.n_local).sum(1), received_counts.sum(1)]).tolist()

    def _run_local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (getattr(self, name).to_local() for name in EXPERT_WEIGHTS)
        return swiglu_experts(x, counts, w1, w2, w3, self.use_grouped_mm)

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        # Draws each whole weight from the generator and keeps this rank's block
        # (models/init.py), so the starting weights do not depend on the EP degree.
        GroupedExperts.init_weights(self, out_std, generator)


def apply_expert_parallel(moe: MoE, ep_mesh: DeviceMesh) -> None:
    """Shard ``moe``'s experts over the 1-D ``ep_mesh`` in place: its experts module becomes an
    ExpertParallelExperts holding this rank's n_experts / ep experts (DTensors, Shard(0)), the
    router and the rest of the layer stay as they are. The layer's weights must already be
    the same on every rank of ``ep_mesh`` (each rank keeps its own block, nothing is sent)."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D ep mesh, got {ep_mesh.ndim} dimensions")
    n_experts, ep = moe.args.n_experts, ep_mesh.size()
    if n_experts % ep:
        raise ValueError(f"expert_parallel_degree ({ep}) must divide the MoE layer's n_experts ({n_experts})")
    if isinstance(moe.experts, ExpertParallelExperts):
        raise ValueError("the MoE layer's experts are already sharded (DTensors); apply expert parallelism once")
    moe.experts = ExpertParallelExperts(moe.experts, n_experts, ep_mesh)


def expert_parallel_summary(parts: list[nn.Module], expert_fsdp: int, replicas: int) -> str | None:
    """How this rank holds the experts of the model ``parts`` it runs, in one line for the
    start-up log, or None when none of their experts are split by expert parallelism.
    ``expert_fsdp``: the ranks FSDP shards each rank's experts over; ``replicas``: dp_replicate."""
    layers = [module for part in parts for module in part.modules() if isinstance(module, ExpertParallelExperts)]
    if not layers:
        return None
    first = layers[0]
    replicated = f", replicated {replicas} times" if replicas > 1 else ""
    return (
        f"expert parallelism: {first.n_local} of {first.n_local * first.ep} experts per rank in each of "
        f"{len(layers)} MoE layer(s), over ep {first.ep}; experts FSDP-sharded over {expert_fsdp} rank(s){replicated}"
    )
