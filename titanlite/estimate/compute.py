"""The compute side of a step's estimate: the FLOPs one device does per token (the model's,
and what activation checkpointing recomputes; its pp rank's stages only; 1/t of them under
tensor parallelism, the MoE layers' included, whose tokens TP splits) and the seconds they
take (pure arithmetic, see step_time)."""

import functools
import math
from dataclasses import dataclass

from titanlite.estimate.held_whole import HeldWhole, held_whole
from titanlite.estimate.pipeline import rank_totals, stage_params
from titanlite.metrics.flops import attention_flops_per_token, flops_per_token, model_on_meta, param_counts
from titanlite.models.llama.args import LlamaArgs
from titanlite.parallel.pipeline import PipelinePlan


def recompute_fraction(n_layers: int, ac_mode: str, selective_ac_option: str) -> float:
    """Fraction of blocks whose forward activation checkpointing runs twice:

    none          -> 0
    full          -> 1 (every block)
    selective N   -> ceil(n_layers / N) / n_layers (blocks 0, N, 2N, ... as parallelize.py wraps them)
    selective op  -> 0 (matmul and attention outputs are saved; only elementwise
                     ops are recomputed, which FLOP counts ignore)
    """
    if ac_mode == "none" or (ac_mode == "selective" and selective_ac_option == "op"):
        return 0.0
    if ac_mode == "full":
        return 1.0
    every = int(selective_ac_option)
    return math.ceil(n_layers / every) / n_layers


def recompute_flops(args: LlamaArgs, model_flops_per_token: int, fraction: float) -> float:
    """Extra FLOPs per token from recomputation: that fraction of the blocks' forward,

        fraction x (F - 6 x head) / 3,   head = final norm + output projection parameters

    F is metrics.flops.flops_per_token; removing the output layer (and final norm) leaves
    the blocks' forward + backward, and the forward is 2 of its 6 FLOPs per weight (and
    a third of attention's). Full AC is therefore a little under +1 forward (8/6 of F):
    the output projection, outside the blocks, is never recomputed. The final norm's and the
    output's parameters are counted on the model (metrics.flops.param_counts).
    """
    blocks = model_flops_per_token - 6 * param_counts(args).head
    return fraction * blocks / 3


def device_flops_per_token(work: "RankWork", tp: int) -> float:
    """FLOPs one device does per token of its data-parallel rank's batch, recomputation
    included: TP splits them over its t ranks, the dense matrices by their features and
    the MoE layers by their tokens (each TP rank routes its own slice of the sequence through
    router and experts held whole: parallel/moe_tensor_parallel.py), all but those of the
    attention modules TP holds whole (W, estimate.held_whole), which every TP rank runs on the
    whole micro-batch:

        (F + R - W) / t + W
    """
    return (work.flops + work.recompute_flops - work.held_flops) / tp + work.held_flops


def compute_seconds(flops_per_token_done: float, tokens: int, peak_flops: float, efficiency: float) -> float:
    """Time for the FLOPs one device does in a step:

    (model FLOPs + recomputed FLOPs) per token x tokens per device / (peak x efficiency)
    """
    return flops_per_token_done * tokens / (peak_flops * efficiency)


def compute_time(work: "RankWork", tp: int, tokens: int, peak_flops: float, efficiency: float) -> float:
    """Seconds of the FLOPs one device does in a step, ``tokens`` being its data-parallel
    rank's tokens over the step: compute_seconds of device_flops_per_token."""
    return compute_seconds(device_flops_per_token(work, tp), tokens, peak_flops, efficiency)


@dataclass(frozen=True)
class RankWork:
    """What the busiest pp rank does per token (the whole model without PP)."""

    flops: float  # model FLOPs per token of its stages (forward + backward)
    recompute_flops: float  # forward FLOPs activation checkpointing redoes in them
    params: int  # parameters of its stages
    blocks: int  # transformer blocks of its stages
    experts: int = 0  # routed experts' weights of its stages (all of them, not only a token's top_k)
    moe_layers: int = 0  # MoE layers of its stages
    moe_flops: float = 0.0  # of flops, its MoE layers' (routers and top_k experts): TP splits them by token
    moe_recompute_flops: float = 0.0  # of recompute_flops, its MoE layers'
    held: HeldWhole = HeldWhole()  # the weights of its stages that TP holds whole (estimate.held_whole)
    held_flops: float = 0.0  # of flops + recompute_flops, the held-whole attention modules' (TP does not split them)


@functools.lru_cache(maxsize=64)
def _stage_counts(args: LlamaArgs, plan: PipelinePlan | None) -> tuple[list | None, tuple[HeldWhole, ...]]:
    """(each stage's parameters, what TP holds whole in each stage), counted on one model built
    on meta; without a pipeline (None, what TP holds whole in the whole model)."""
    model = model_on_meta(args)
    if plan is None:
        return None, (held_whole(model),)
    held = tuple(
        sum((held_whole(model.get_submodule(name)) for name in names), HeldWhole()) for names in plan.stage_modules
    )
    return stage_params(model, plan), held


def held_flops(held: HeldWhole, fraction: float) -> float:
    """FLOPs per token of the attention weights TP holds whole: 6 per weight, and a forward's 2
    again for the ``fraction`` of blocks checkpointing recomputes."""
    return (6 + 2 * fraction) * held.attention


def rank_work(args: LlamaArgs, seq_len: int, fraction: float, plan: PipelinePlan | None, tp: int = 1) -> RankWork:
    """The busiest rank's share of the model, each stage counted on the model itself: per token,

        FLOPs      = 6 x (stage parameters - embedding - idle experts) + attention per block x blocks
        recompute  = fraction x (6 x (block parameters - idle experts) + attention per block x blocks) / 3
        MoE        = 6 x the MoE layers' active weights, and fraction x 2 x them recomputed

    summed over the rank's stages, where the idle experts are the routed experts' weights a token
    skips (all but its top_k in each MoE layer: metrics.flops.active_params) and the MoE layers'
    active weights their routers and top_k experts (metrics.flops.active_moe_params); the
    busiest rank does the most FLOPs per device under ``tp`` (device_flops_per_token). Without a
    pipeline the whole model (metrics.flops.flops_per_token, recompute_flops)."""
    model_flops = flops_per_token(args, seq_len)
    if plan is None:
        counts = param_counts(args)
        recompute = recompute_flops(args, model_flops, fraction)
        moe_layers = sum(1 for experts in counts.experts if experts)
        moe_flops = 6 * counts.moe_active
        (held,) = _stage_counts(args, None)[1]
        return RankWork(
            model_flops,
            recompute,
            counts.total,
            args.n_layers,
            sum(counts.experts),
            moe_layers,
            moe_flops,
            fraction * moe_flops / 3,
            held,
            held_flops(held, fraction),
        )
    attention_per_block = attention_flops_per_token(args, seq_len) / args.n_layers
    stages, stage_held = _stage_counts(args, plan)
    flops = rank_totals(
        plan, [6 * (st.total - st.embedding - st.idle_experts) + attention_per_block * st.blocks for st in stages]
    )
    recompute = rank_totals(
        plan,
        [fraction * (6 * (st.block_params - st.idle_experts) + attention_per_block * st.blocks) / 3 for st in stages],
    )
    moe_flops = rank_totals(plan, [6 * st.moe_active for st in stages])
    params, blocks, experts, moe_layers = (
        int(max(rank_totals(plan, [getattr(st, name) for st in stages])))
        for name in ("total", "blocks", "experts", "moe_layers")
    )
    rank_held = [sum((stage_held[stage] for stage in plan.rank_stages(rank)), HeldWhole()) for rank in range(plan.pp)]
    works = [
        RankWork(
            flops[rank],
            recompute[rank],
            params,
            blocks,
            experts,
            moe_layers,
            moe,
            fraction * moe / 3,
            rank_held[rank],
            held_flops(rank_held[rank], fraction),
        )
        for rank, moe in enumerate(moe_flops)
    ]
    return max(works, key=lambda work: device_flops_per_token(work, tp))
