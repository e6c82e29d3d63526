"""Pipeline parallelism in the estimates, by arithmetic on the pipeline plan
(titanlite.parallel.pipeline.PipelinePlan): how many micro-batches' activations each pp rank
holds at its peak, how the model's parameters and FLOPs split over the ranks, and the bytes
the stages send each other, and how the bubble and those sends stretch a rank's compute in
the step time. The bubble itself is PipelinePlan.bubble_at (titanlite.parallel.bubble).

In-flight micro-batches, read from torch.distributed.pipelining's schedules (p pp ranks,
v stages per rank, m micro-batches per accumulation step, rank r; a "chunk" is one
micro-batch through one stage):

    GPipe            m on every rank: all forwards run before the first backward.
    1F1B             min(m, p - r): rank r runs p - r forwards before its first backward and
                     then alternates backward-first, so stage 0 holds p and the last stage 1.
    LoopedBFS        m x v: every stage runs all its forwards before any backward.
    Interleaved1F1B  min(m x v, w + 1) chunks, w = (v - 1) x k + 2 x (p - 1 - r) the schedule's
                     warm-up forwards (k micro-batches per round: p, or m when m < p), then one
                     forward before each backward; rank 0 with m >= p holds v p + p - 1 chunks.
    InterleavedZeroBubble  the same with w = (v - 1) x k + (p - 1 - r). Its split backward keeps
                     a chunk's inputs until the weight gradient runs, shortly after; not counted.
    ZBVZeroBubble, DualPipeV  (the V: rank r holds stages r and 2p - 1 - r) min(m, 2p - r - 1)
                     chunks of its first stage and min(m, r + 1) of its second: ZBV's warm-up,
                     after which each forward is followed by its backward. DualPipeV is taken
                     to hold the same.

A rank with several stages holds that many chunks of its largest stage's activations, an
upper bound when its stages differ in size.
"""

import math
from dataclasses import dataclass

import torch

from titanlite.metrics.flops import active_moe_params, idle_expert_params, routed_expert_params
from titanlite.models.moe import MoE
from titanlite.parallel.bubble import BACKWARD_PER_FORWARD
from titanlite.parallel.pipeline import PipelinePlan


def in_flight_microbatches(plan: PipelinePlan, pp_rank: int) -> int:
    """Chunks (micro-batch x stage) whose activations pp rank ``pp_rank`` holds at its peak
    (see the module docstring)."""
    p, m, v, r = plan.pp, plan.microbatches, plan.stages_per_rank, pp_rank
    schedule = plan.schedule
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, p - r)
    if schedule == "LoopedBFS":
        return m * v
    if plan.style == "v":
        return min(m, 2 * p - r - 1) + min(m, r + 1)
    per_round = m // max(1, m // p)  # torch's micro-batches per round
    hops = (2 if schedule == "Interleaved1F1B" else 1) * (p - 1 - r)
    return min(m * v, (v - 1) * per_round + hops + 1)


@dataclass(frozen=True)
class StageParams:
    """Parameters of one stage, counted on the model itself."""

    total: int
    embedding: int  # of the token embedding (a lookup, no FLOPs)
    blocks: int  # transformer blocks the stage holds
    block_params: int  # the parameters of those blocks
    idle_experts: int = 0  # of its MoE layers' experts, the weights one token skips (no FLOPs)
    experts: int = 0  # its MoE layers' routed experts' weights (what expert parallelism splits)
    moe_layers: int = 0  # its MoE layers (each dispatches its tokens by all-to-all under EP)
    moe_active: int = 0  # of its MoE layers, the weights a token meets (routers and top_k experts)


def stage_params(model: torch.nn.Module, plan: PipelinePlan, embedding: str = "tok_embeddings") -> list[StageParams]:
    """Each stage's parameters, counted on ``model`` (a whole model, e.g. on meta) from the
    modules plan.stage_modules names; ``embedding`` is the name of the model's token lookup."""
    counts = []
    for modules in plan.stage_modules:
        parts = [model.get_submodule(name) for name in modules]
        sizes = {name: sum(p.numel() for p in part.parameters()) for name, part in zip(modules, parts, strict=True)}
        block_names = [name for name in modules if name.startswith("layers.")]
        counts.append(
            StageParams(
                total=sum(sizes.values()),
                embedding=sizes.get(embedding, 0),
                blocks=len(block_names),
                block_params=sum(sizes[name] for name in block_names),
                idle_experts=sum(idle_expert_params(part) for part in parts),
                experts=sum(routed_expert_params(part) for part in parts),
                moe_layers=sum(isinstance(layer, MoE) for part in parts for layer in part.modules()),
                moe_active=sum(active_moe_params(part) for part in parts),
            )
        )
    return counts


def rank_totals(plan: PipelinePlan, per_stage: list[float]) -> list[float]:
    """A per-stage figure summed over the stages of each pp rank (index: pp rank)."""
    return [sum(per_stage[stage] for stage in plan.rank_stages(rank)) for rank in range(plan.pp)]


def boundary_activation_bytes(
    microbatch_size: int, seq_len: int, dim: int, tp: int, sequence_parallel: bool, activation_bytes: int
) -> int:
    """Bytes of the activation one device sends across one stage boundary for one micro-batch:

        microbatch_size x seq_len / tp x dim x activation_bytes   (sequence parallel)
        microbatch_size x seq_len x dim x activation_bytes        (otherwise: every TP rank
                                                                   holds, and sends, it whole)

    The gradient sent back in backward has the same size."""
    seq = math.ceil(seq_len / tp) if sequence_parallel else seq_len
    return microbatch_size * seq * dim * activation_bytes


def rank_send_bytes(plan: PipelinePlan, pp_rank: int, boundary_bytes: int, accumulation: int) -> int:
    """Bytes pp rank ``pp_rank`` sends to other stages in one optimizer step: for every
    micro-batch, each of its stages but the last sends its output forward and each but the
    first sends its input's gradient backward."""
    last = plan.num_stages - 1
    sends = sum((stage != last) + (stage != 0) for stage in plan.rank_stages(pp_rank))
    return sends * plan.microbatches * accumulation * boundary_bytes


def pipeline_send_bytes(
    pipeline: PipelinePlan | None,
    *,
    local_batch_size: int,
    seq_len: int,
    dim: int,
    tp: int,
    sequence_parallel: bool,
    activation_bytes: int,
    grad_accum_steps: int,
) -> tuple[float, float]:
    """(bytes the busiest pp rank sends to other stages over one optimizer step, of them those
    nothing hides): while the pipeline fills and drains, one activation forward and one
    gradient back per stage boundary and accumulation step. Nothing without a pipeline."""
    if pipeline is None:
        return 0.0, 0.0
    microbatch = local_batch_size // pipeline.microbatches
    boundary = boundary_activation_bytes(microbatch, seq_len, dim, tp, sequence_parallel, activation_bytes)
    sent = max(rank_send_bytes(pipeline, rank, boundary, grad_accum_steps) for rank in range(pipeline.pp))
    return sent, 2 * (pipeline.num_stages - 1) * boundary * grad_accum_steps


def backward_per_forward(flops: float, recompute_flops: float) -> float:
    """A chunk's backward over its forward, for the bubble (PipelinePlan.bubble_at): of the
    model FLOPs F a third are the forward's and two thirds the backward's, and the R FLOPs
    activation checkpointing recomputes run in the backward,

        (2 F / 3 + R) / (F / 3) = 2 + 3 R / F,

    rounded to 0.01 so that the bubble's cache meets few distinct values."""
    return round(BACKWARD_PER_FORWARD + 3 * recompute_flops / flops, 2)


def pipelined_seconds(critical_s: float, bubble: float, sends_s: float, exposed_sends_s: float) -> float:
    """One rank's compute (and what waits inside it) with pipeline parallelism:

        max(critical / (1 - bubble), sends) + exposed sends

    the bubble being the idle share of the step on the busiest rank (PipelinePlan.bubble_at),
    its compute is 1 - bubble of the step; the sends to other stages run beside the compute
    except while the pipeline fills and drains. Without PP, bubble and sends are 0."""
    return max(critical_s / (1 - bubble), sends_s) + exposed_sends_s
