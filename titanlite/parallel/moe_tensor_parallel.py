"""A mixture-of-experts feed-forward (titanlite/models/moe/) under tensor parallelism: each TP
rank routes its own slice of the sequence, so the layer's work and its all-to-all bytes are
split over the tp ranks instead of repeated on each.

The layer is not split by features as a dense feed-forward is: the router and the experts
(the shared experts too, where a model has them) are held whole on every TP rank (or, with
expert parallelism, the routed ones split by expert over ep ranks that include the tp ranks:
parallel_dims.py). What TP splits is the tokens:
  - with sequence parallelism the residual stream between the blocks is already split along
    the sequence, and the layer takes its input as that local piece and gives its output back
    in the same layout: no collective at all;
  - without it the stream is whole on every rank: the layer takes the rank's slice of the
    sequence (a local cut, no exchange) and all-gathers its output whole again; backward, the
    output's gradient is cut alike and the input's gradient all-gathered. Each TP rank still
    routes 1/tp of the tokens, for one all-gather of the block's activations each way.
    Refusing MoE + TP without sequence parallelism instead would break configs that run today.

A weight held whole on every rank but used on different tokens gets a different gradient on
each: each is a partial sum, and the whole gradient is their sum over tp. The layer multiplies
by the weights' local tensors, whose gradients are marked Partial over tp; the same reduction
that sums the norms' gradients under sequence parallelism then sums them (FSDP before its
reduce-scatter, or titanlite.parallel.grad_norm's _grads_in_parameter_layout without FSDP).
The layer's routing, sorting and counting code stay plain tensors. The balancing losses'
terms (token counts, mean probabilities, per-sequence statistics, the z-loss) are summed over
tp after the forward, in one all-reduce for all the layers (MoE.sum_over_token_ranks, used by
titanlite.models.moe.add_load_balancing_loss), so that every rank computes the whole
forward's losses, as one process does; the expert bias's token counts are summed over tp by
the load balancer (load_balance.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Shard, distribute_module
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titanlite.models.moe import GroupedExperts, MoE, router_logits, swiglu_experts


def moe_tensor_parallel_plan(moe: MoE, tp_mesh: DeviceMesh, stream) -> dict:
    """The block plan's entry for ``moe``, its feed-forward, on ``tp_mesh`` (``stream``: the
    residual stream's placement, Shard(1) with sequence parallelism, else Replicate). Here the
    router and experts become Replicate DTensors on ``tp_mesh`` multiplied by their local
    tensors, and the layer learns that its tokens are split over tp. Experts already split by
    expert parallelism (not a GroupedExperts) keep their own mesh."""
    distribute_module(moe.gate, tp_mesh)  # every parameter Replicate
    # The same modules, multiplying by the local tensors: their parameter names, and so the
    # checkpoint's, and their init_weights stay as they are (FSDP swaps classes alike).
    moe.gate.__class__ = _RouterOnLocalWeight
    if isinstance(moe.experts, GroupedExperts):
        distribute_module(moe.experts, tp_mesh)
        moe.experts.__class__ = _ExpertsOnLocalWeights
    for linear in _dense_linears(moe):
        distribute_module(linear, tp_mesh)
        linear.__class__ = _LinearOnLocalWeight
    split_tokens_over(moe, tp_mesh)
    return {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(stream,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(stream,),
            use_local_output=True,
        )
    }


def _local_weight(weight: torch.Tensor) -> torch.Tensor:
    """The local tensor of a weight held whole by every TP rank (a Replicate DTensor), whose
    gradient, from this rank's tokens only, is marked a partial sum over tp."""
    return weight.to_local(grad_placements=[Partial()])


class _RouterOnLocalWeight(nn.Linear):
    """The MoE router (an nn.Linear without bias) on its weight's local tensor, in float32 as
    the layer's own router computes (router_logits: a bf16 product would round the scores
    enough to change close choices)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return router_logits(x, _local_weight(self.weight))


def _dense_linears(moe: MoE) -> list[nn.Linear]:
    """The layer's other linear maps, beside the router and the routed experts: the shared
    experts every token meets (DeepSeek-V3's), held whole and run on this rank's tokens
    like the routed ones."""
    routed = set(moe.experts.modules()) | {moe.gate}
    return [module for module in moe.modules() if isinstance(module, nn.Linear) and module not in routed]


class _LinearOnLocalWeight(nn.Linear):
    """An nn.Linear without bias on its weight's local tensor (this rank's tokens only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _local_weight(self.weight))


class _ExpertsOnLocalWeights(GroupedExperts):
    """GroupedExperts whose stacked weights are DTensors held whole by every TP rank, run on
    this rank's rows only."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return swiglu_experts(x, counts, *_local_expert_weights(self), self.use_grouped_mm)


# Eager also inside a compiled block. The float32 loop over experts breaks the graph after the
# weights are taken local, and a compiled piece that hands a DTensor's local tensor across a
# break marks the very tensor the DTensor holds as requiring grad (torch 2.13): the next call
# recompiles, so per-op AC's recomputation met another graph than its forward and failed
# ("aten._unsafe_view.default ... not found in storage"). Taken eagerly, they are fresh views.
@torch.compiler.disable
def _local_expert_weights(experts: GroupedExperts) -> tuple[torch.Tensor, ...]:
    return tuple(_local_weight(weight) for weight in (experts.w1, experts.w2, experts.w3))


class _SumOverRanks(torch.autograd.Function):
    """The sum of x over ``group``'s ranks; its gradient passes through unchanged. Every rank
    computes the same loss from the sum, so the gradient each rank gets for its own x is the
    loss's gradient for the sum; summing it over the ranks as well would count it tp times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        total = x.clone()
        # In place, finished when it returns: nothing is left pending (see expert_parallel.py).
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SumOverRanks:
    """A differentiable sum over the ranks of every group in ``groups`` in turn (_SumOverRanks),
    as a callable to hand to the MoE layer."""

    def __init__(self, groups: list):
        self.groups = groups

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            x = _SumOverRanks.apply(x, group)
        return x


def split_tokens_over(moe: MoE, mesh: DeviceMesh) -> None:
    """Tell ``moe`` that the ranks of the 1-D ``mesh`` (tp, or cp: each holds its own part of
    every sequence) share its forward's tokens equally, besides any ranks it already shares
    them with: its balancing losses' terms are then summed over all of them."""
    moe.token_ranks *= mesh.size()
    before = moe.sum_over_token_ranks.groups if moe.sum_over_token_ranks is not None else []
    moe.sum_over_token_ranks = SumOverRanks([*before, mesh.get_group()])
