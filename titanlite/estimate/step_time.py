"""An analytic model of one training step under FSDP / HSDP / DDP, with or without tensor
parallelism: compute time, communication time, which of the two bounds the step, and the
throughput and MFU that follow. Pure arithmetic: nothing is built, nothing runs on a device.

The roofline rule it reproduces (data parallelism and FSDP alike, since an all-reduce
is an all-gather plus a reduce-scatter): a step is compute-bound when the tokens each
device processes per collective round exceed

    C / W = peak FLOP/s of one device / bytes per second one device sends,

because compute grows with the tokens per device while the weight traffic does not.
On an H100 that is 989e12 / 450e9 ~ 2,198 tokens when the FSDP group sits inside one
NVLink node, but 989e12 / 50e9 ~ 19,780 tokens once the group spans nodes over
400 Gb/s InfiniBand; HSDP keeps the heavy, per-layer FSDP traffic on NVLink and sends
only one all-reduce of the gradient shard per step across nodes.

Assumptions (each is also stated where it is used):
  * Ring collectives: an all-gather or reduce-scatter of S bytes over n ranks makes
    every rank send S x (n-1)/n bytes; an all-reduce twice that.
  * A collective runs at the per-direction bandwidth of its slowest link: the
    intra-node one when every group of that mesh dimension fits in one node, the
    inter-node one otherwise.
  * FSDP overlaps communication with compute (prefetching the next unit's all-gather,
    reduce-scattering while the previous unit's backward runs), so a step takes
    max(compute, communication) plus the part that nothing can hide.
  * Tensor parallelism splits every matmul (and attention, by heads) over the t ranks of a
    TP group, which see the same batch: each device does 1/t of its data-parallel rank's
    FLOPs and holds 1/t of the weights FSDP gathers. An MoE feed-forward is the exception:
    every TP rank holds it whole (router and experts) and runs it on all of its data-parallel
    rank's tokens, the same work on each (parallelize._whole_moe_plan), so its FLOPs are not
    divided by t; MFU counts them once per token (useful work), not t times. TP's collectives
    sit between the matmuls that need their results, so they add to the compute time (async
    TP, which overlaps them with the matmuls in compiled code, is taken as hiding them entirely).
    TP groups are consecutive ranks, inside a node whenever t divides the GPUs per node.
  * Compute runs at `efficiency` x peak on every FLOP, recomputed ones included.
  * Pipeline parallelism over p ranks (the outermost mesh dimension, so across nodes once a
    stage's ranks fill a node): each rank computes its stages only, and the step is the
    busiest rank's compute stretched by the pipeline bubble b (PipelinePlan.bubble):

        pipelined = compute / (1 - b),   b = (p - 1) / (m + p - 1) / (stages per rank)

    i.e. (m + p - 1) micro-batch slots for m micro-batches' work. The activations sent between
    stages overlap compute except while the pipeline fills and drains (one activation per
    stage boundary each way, per accumulation step). FSDP under PP gathers each stage's
    parameters once per accumulation step and reduce-scatters once (titanlite's default keeps
    them gathered across micro-batches).
"""

import functools
import math
import typing
from dataclasses import dataclass, replace

from titanlite.config import Training
from titanlite.dtypes import DTYPES
from titanlite.estimate.communication import (
    expert_all_to_all_bytes,
    fsdp_bytes,
    group_spans_nodes,
    link,
    recomputed_collective_blocks,
    regathered_params,
    replicate_all_reduce_bytes,
    tensor_parallel_bytes,
)
from titanlite.estimate.hardware import Hardware, get_hardware
from titanlite.estimate.pipeline import (
    boundary_activation_bytes,
    rank_send_bytes,
    rank_totals,
    stage_params,
)
from titanlite.metrics.flops import attention_flops_per_token, flops_per_token, mfu, model_on_meta, param_counts
from titanlite.models.llama.args import LlamaArgs
from titanlite.parallel import tensor_parallel_problem
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan

# Fraction of the peak a well-tuned bf16 transformer step reaches on its matmuls
# (attention and elementwise kernels included). Llama pretraining on H100/A100 with
# FSDP reports roughly 40-55% MFU; 0.5 sits in that range. Override per run.
DEFAULT_EFFICIENCY = 0.5

RESHARD_POLICIES = ("default", "always", "never")
AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class StepTimeEstimate:
    """What one optimizer step costs on each device. Bytes are those one device sends,
    summed over the step (all micro-batches); seconds are per step."""

    strategy: str  # "single process", "FSDP", "DDP", "HSDP", "TP", "FSDP + TP", ... (ParallelDims.strategy)
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int  # ranks each layer is split over; tokens and FLOPs below are per device
    hardware: Hardware
    efficiency: float
    # compute
    flops_per_token: int  # model FLOPs (forward + backward), what MFU counts
    recompute_flops_per_token: float  # forward FLOPs redone by activation checkpointing (the busiest pp rank's)
    tokens_per_device_per_micro_batch: float  # the data-parallel rank's tokens / tp
    tokens_per_device_per_step: float
    compute_s: float
    redundant_compute_s: float  # of compute_s, the MoE work the other TP ranks repeat (0 without TP or MoE)
    # communication
    all_gather_bytes: float  # FSDP parameter all-gathers (forward + backward re-gathers)
    reduce_scatter_bytes: float  # FSDP gradient reduce-scatters
    all_reduce_bytes: float  # HSDP/DDP gradient all-reduce across replicas
    tp_bytes: float  # TP's activation collectives (and the logits' with or without loss parallel)
    shard_link: str  # "intra-node", "inter-node" or "none" (a group of one)
    replicate_link: str
    tp_link: str
    all_gather_s: float
    reduce_scatter_s: float
    all_reduce_s: float
    tp_s: float
    comm_s: float  # all of it: data-parallel and TP
    exposed_comm_s: float  # communication no compute can hide (TP's, unless async, and FSDP's ends)
    overlapped: bool  # data-parallel communication assumed to run under compute
    sequence_parallel: bool
    loss_parallel: bool
    async_tp: bool
    # pipeline parallelism (pp 1: no pipeline, every figure below zero or None)
    pp: int
    schedule: str | None  # the pipeline schedule, None without PP
    microbatches: int  # pipeline micro-batches per accumulation step (1 without PP)
    bubble: float  # idle fraction of the pipelined compute (PipelinePlan.bubble)
    pp_bytes: float  # activations and their gradients the busiest rank sends to other stages
    pp_link: str
    pp_s: float
    pp_exposed_s: float  # the sends while the pipeline fills and drains, which nothing hides
    # expert parallelism (ep 1: no all-to-all; the experts' FSDP traffic is in the shard group's)
    ep: int  # ranks each MoE layer's experts are split over (a split of the shard group)
    ep_bytes: float  # the all-to-alls' bytes (token rows to their experts and back, and the counts)
    ep_link: str
    ep_s: float
    expert_shard_link: str  # the link FSDP gathers and reduces the experts over (the shard group's without EP)
    step_s: float
    # verdict
    verdict: str  # "compute-bound" or "communication-bound"
    threshold_tokens_per_device: float | None  # the compute-to-communication ratio C / W; None with no communication
    break_even_tokens_per_device: float  # per micro-batch, where compute equals the data-parallel communication
    tokens_per_second_per_device: float
    mfu_percent: float

    def describe(self) -> str:
        """A few human-readable lines, for a command-line report."""
        hw = self.hardware
        threshold = "n/a" if self.threshold_tokens_per_device is None else f"{self.threshold_tokens_per_device:,.0f}"
        tp = f" x {self.tp} TP" if self.tp > 1 else ""
        pp = f"PP {self.pp} ({self.schedule}, {self.microbatches} micro-batches) x " if self.pp > 1 else ""
        pipeline = (
            [
                f"pipeline bubble {self.bubble:.1%}; {self.pp_bytes / 1e9:.2f} GB sent between stages over "
                f"{self.pp_link} -> {self.pp_s * 1e3:.1f} ms ({self.pp_exposed_s * 1e3:.1f} ms exposed)"
            ]
            if self.pp > 1
            else []
        )
        experts = (
            [
                f"EP {self.ep}: all-to-all {self.ep_bytes / 1e9:.2f} GB over {self.ep_link} -> "
                f"{self.ep_s * 1e3:.1f} ms; experts gathered and reduced over {self.expert_shard_link}"
            ]
            if self.ep > 1
            else []
        )
        return "\n".join(
            [
                f"{self.strategy}: {pp}{self.dp_replicate} replica(s) x {self.dp_shard} shard(s){tp} "
                f"on {self.world_size} {hw.name}",
                f"compute {self.compute_s * 1e3:.1f} ms ({self.tokens_per_device_per_step:,.0f} tokens/device/step, "
                f"{self.efficiency:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s{self._redundant_note()})",
                f"all-gather {self.all_gather_bytes / 1e9:.2f} GB + reduce-scatter "
                f"{self.reduce_scatter_bytes / 1e9:.2f} GB over {self.shard_link} -> "
                f"{(self.all_gather_s + self.reduce_scatter_s) * 1e3:.1f} ms; all-reduce "
                f"{self.all_reduce_bytes / 1e9:.2f} GB over {self.replicate_link} -> {self.all_reduce_s * 1e3:.1f} ms; "
                f"TP {self.tp_bytes / 1e9:.2f} GB over {self.tp_link} -> {self.tp_s * 1e3:.1f} ms",
                *pipeline,
                *experts,
                f"{self.verdict}: {self.tokens_per_device_per_micro_batch:,.0f} tokens/device/micro-batch vs "
                f"C/W = {threshold} (break-even in this model {self.break_even_tokens_per_device:,.0f})",
                f"step {self.step_s * 1e3:.1f} ms -> {self.tokens_per_second_per_device:,.0f} tokens/s/device, "
                f"MFU {self.mfu_percent:.1f}%",
            ]
        )

    def _redundant_note(self) -> str:
        if not self.redundant_compute_s:
            return ""
        return f"; {self.redundant_compute_s * 1e3:.1f} ms of it the MoE layers every TP rank repeats"


# --- formulas: one small function each ------------------------------------------------------


def threshold_tokens_per_device(peak_flops: float, bandwidth: float) -> float:
    """The roofline threshold, the compute-to-communication ratio (data parallelism and FSDP alike):

        tokens per device > C / W   =>   compute-bound

    C = peak FLOP/s of one device, W = bytes/s it sends (per direction). It follows from
    4 backward FLOPs per parameter per token against 4 bytes per bf16 parameter in an
    all-reduce (2 x 2 bytes): the per-token FLOPs and the per-parameter bytes cancel.
    """
    return peak_flops / bandwidth


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
    included: TP splits everything over its t ranks but the MoE layers, which each of them
    runs whole on every token (parallelize._whole_moe_plan):

        (F + R - F_moe - R_moe) / t + F_moe + R_moe
    """
    moe = work.moe_flops + work.moe_recompute_flops
    return (work.flops + work.recompute_flops - moe) / tp + moe


def compute_seconds(flops_per_token_done: float, tokens: int, peak_flops: float, efficiency: float) -> float:
    """Time for the FLOPs one device does in a step:

    (model FLOPs + recomputed FLOPs) per token x tokens per device / (peak x efficiency)
    """
    return flops_per_token_done * tokens / (peak_flops * efficiency)


def overlapped_step_seconds(compute_s: float, comm_s: float, n_units: int) -> tuple[float, float]:
    """(step seconds, exposed communication seconds) with FSDP's overlap:

        exposed = comm / n_units
        step    = max(compute, comm) + exposed

    Prefetching hides each unit's all-gather under the previous unit's compute, and each
    reduce-scatter under the next unit's backward, except at the ends of the step: the
    first unit's all-gather and the last unit's reduce-scatter (and all-reduce) have
    nothing to hide behind. That is taken as one unit's average share of the traffic.
    """
    exposed = comm_s / n_units
    return max(compute_s, comm_s) + exposed, exposed


def break_even_tokens(
    comm_s: float, micro_batches: int, flops_per_token_done: float, peak_flops: float, efficiency: float
) -> float:
    """Tokens per device per micro-batch at which compute time equals communication time:

        comm per micro-batch x peak x efficiency / FLOPs done per token

    With bf16 parameters and gradients, reshard "always", no recomputation, efficiency 1
    and a large group this is the roofline's C / W (to within the embedding's share of the
    parameters and attention's share of the FLOPs): 6 bytes and 6 FLOPs per parameter.
    """
    return comm_s / micro_batches * peak_flops * efficiency / flops_per_token_done


def pipelined_seconds(critical_s: float, bubble: float, sends_s: float, exposed_sends_s: float) -> float:
    """One rank's compute (and what waits inside it) with pipeline parallelism:

        max(critical / (1 - bubble), sends) + exposed sends

    m micro-batches take m + p - 1 slots (p - 1 of them idle) on every rank, i.e. the
    compute divided by 1 - bubble; the sends to other stages run beside the compute except
    while the pipeline fills and drains. Without PP, bubble and sends are 0."""
    return max(critical_s / (1 - bubble), sends_s) + exposed_sends_s


def fsdp_traffic(
    params: float, regathered: float, shards: int, scatters: int, *, param_bytes: int, reduce_bytes: int, gathers: int
) -> tuple[float, float]:
    """Per-device (all-gather, reduce-scatter) bytes of one step for ``params`` sharded over
    ``shards`` ranks, gathered ``gathers`` times (plus ``regathered`` in each backward) and
    reduce-scattered ``scatters`` times (communication.fsdp_bytes)."""
    gather, _ = fsdp_bytes(params, regathered, param_bytes, reduce_bytes, shards, gathers)
    _, scatter = fsdp_bytes(params, 0, param_bytes, reduce_bytes, shards, scatters)
    return gather, scatter


@dataclass(frozen=True)
class RankWork:
    """What the busiest pp rank does per token (the whole model without PP)."""

    flops: float  # model FLOPs per token of its stages (forward + backward)
    recompute_flops: float  # forward FLOPs activation checkpointing redoes in them
    params: int  # parameters of its stages
    blocks: int  # transformer blocks of its stages
    experts: int = 0  # routed experts' weights of its stages (all of them, not only a token's top_k)
    moe_layers: int = 0  # MoE layers of its stages
    moe_flops: float = 0.0  # of flops, its MoE layers' (routers and top_k experts): TP does not split them
    moe_recompute_flops: float = 0.0  # of recompute_flops, its MoE layers'


@functools.lru_cache(maxsize=64)
def _stage_params(args: LlamaArgs, plan: PipelinePlan):
    return stage_params(model_on_meta(args), plan)


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
        return RankWork(
            model_flops,
            recompute,
            counts.total,
            args.n_layers,
            sum(counts.experts),
            moe_layers,
            moe_flops,
            fraction * moe_flops / 3,
        )
    attention_per_block = attention_flops_per_token(args, seq_len) / args.n_layers
    stages = _stage_params(args, plan)
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
    works = [
        RankWork(flops[rank], recompute[rank], params, blocks, experts, moe_layers, moe, fraction * moe / 3)
        for rank, moe in enumerate(moe_flops)
    ]
    return max(works, key=lambda work: device_flops_per_token(work, tp))


# --- validation -----------------------------------------------------------------------------


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _resolve_layout(
    dp_replicate: int, dp_shard: int, world_size: int | None, tp: int = 1, pp: int = 1, ep: int = 1
) -> ParallelDims:
    """Degrees to ParallelDims: the data-parallel ones positive or -1 (at most one -1, which
    needs world_size), tp, pp and ep positive; ParallelDims.resolve reports a product that does
    not match the world size, or an ep that does not divide the shard degree."""
    for name, degree in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if isinstance(degree, bool) or not isinstance(degree, int) or (degree < 1 and degree != -1):
            raise ValueError(f"{name} must be a positive integer or -1, got {degree!r}")
    _positive_int("tp", tp)
    _positive_int("pp", pp)
    _positive_int("ep", ep)
    if dp_replicate == -1 and dp_shard == -1:
        raise ValueError("dp_replicate and dp_shard cannot both be -1; set one of them")
    if world_size is None:
        if -1 in (dp_replicate, dp_shard):
            raise ValueError("a degree of -1 (take the ranks left over) needs world_size")
        world_size = dp_replicate * dp_shard * tp * pp
    _positive_int("world_size", world_size)
    return ParallelDims.resolve(dp_replicate, dp_shard, world_size, tp, pp, ep)


def _check_experts(model_args, ep: int) -> None:
    """One ValueError when the model's experts cannot be split over ``ep`` ranks."""
    n_experts = getattr(model_args, "n_experts", 0)
    if ep > 1 and not n_experts:
        raise ValueError(f"parallelism.expert_parallel_degree ({ep}) needs a mixture-of-experts model")
    if n_experts % ep:
        raise ValueError(f"parallelism.expert_parallel_degree ({ep}) must divide the model's n_experts ({n_experts})")


def _precision_choices(field_name: str) -> tuple[str, ...]:
    """The dtype names the config accepts for training.``field_name``, in DTYPES' order."""
    allowed = typing.get_args(Training.__annotations__[field_name])
    return tuple(name for name in DTYPES if name in allowed)


def _check_choices(
    ac_mode: str,
    selective_ac_option: str,
    reshard_after_forward: str,
    param_dtype: str,
    reduce_dtype: str,
    efficiency: float,
) -> None:
    """One clear ValueError per bad option, naming the choices."""
    for name, value, choices in (
        ("reshard_after_forward", reshard_after_forward, RESHARD_POLICIES),
        ("ac_mode", ac_mode, AC_MODES),
        ("param_dtype", param_dtype, _precision_choices("mixed_precision_param")),
        ("reduce_dtype", reduce_dtype, _precision_choices("mixed_precision_reduce")),
    ):
        if value not in choices:
            raise ValueError(f"{name} '{value}' is not known (choose from {', '.join(choices)})")
    if ac_mode == "selective" and selective_ac_option != "op":
        if not (selective_ac_option.isdigit() and int(selective_ac_option) >= 1):
            raise ValueError(f"selective_ac_option must be 'op' or a positive integer, got {selective_ac_option!r}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")


# --- the estimate ---------------------------------------------------------------------------


def estimate_step_time(
    model_args: LlamaArgs,
    *,
    seq_len: int,
    local_batch_size: int,
    hardware: Hardware | str,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    world_size: int | None = None,
    tp: int = 1,
    grad_accum_steps: int = 1,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    ac_mode: str = "selective",
    selective_ac_option: str = "2",
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    async_tp: bool = False,
    efficiency: float = DEFAULT_EFFICIENCY,
    gpus_per_node: int | None = None,
    pipeline: PipelinePlan | None = None,
    ep: int = 1,
) -> StepTimeEstimate:
    """Estimate one optimizer step. Defaults follow the job config's (bf16 parameters,
    fp32 reductions, reshard "default", selective AC every 2nd block, no TP; with TP,
    sequence parallel and loss parallel on, async TP off; no pipeline).

    local_batch_size is the sequences of one data-parallel rank's micro-batch, which all tp
    ranks of its group (and, with ``pipeline``, all pp ranks of its pipeline) see; the
    pipeline splits it into pipeline.microbatches micro-batches. ``ep``: expert parallelism's
    degree, a split of the dp_shard ranks (an MoE model's experts, n_experts / ep per rank,
    FSDP-sharded over the dp_shard / ep ranks left). hardware: a Hardware or a
    table name ("h100"). gpus_per_node overrides the hardware's. world_size may be left out
    when neither degree is -1. Raises ValueError with a one-line message for any inconsistent input.
    """
    for name, value in (
        ("seq_len", seq_len),
        ("local_batch_size", local_batch_size),
        ("grad_accum_steps", grad_accum_steps),
    ):
        _positive_int(name, value)
    _check_choices(ac_mode, selective_ac_option, reshard_after_forward, param_dtype, reduce_dtype, efficiency)
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if gpus_per_node is not None:
        _positive_int("gpus_per_node", gpus_per_node)
        hw = replace(hw, gpus_per_node=gpus_per_node)
    pp = 1 if pipeline is None else pipeline.pp
    dims = _resolve_layout(dp_replicate, dp_shard, world_size, tp, pp, ep)
    r, s, t = dims.dp_replicate, dims.dp_shard, dims.tp
    # An MoE feed-forward is held whole by TP: only attention's sizes must split.
    problem = tensor_parallel_problem(model_args, t, split_ffn=not getattr(model_args, "n_experts", 0))
    if problem is not None:
        raise ValueError(problem)
    _check_experts(model_args, ep)

    # compute: a TP group shares its data-parallel rank's tokens, each device 1/t of the FLOPs
    # of its pipeline rank's stages (the whole model without PP) but all of their MoE layers';
    # the busiest rank sets the pace
    model_flops = flops_per_token(model_args, seq_len)
    fraction = recompute_fraction(model_args.n_layers, ac_mode, selective_ac_option)
    work = rank_work(model_args, seq_len, fraction, pipeline, t)
    micro_tokens = local_batch_size * seq_len  # per data-parallel rank
    rank_tokens = micro_tokens * grad_accum_steps  # through each device's stages, its TP group's alike
    seconds = functools.partial(compute_seconds, tokens=rank_tokens, peak_flops=hw.peak_flops, efficiency=efficiency)
    compute_s = seconds(device_flops_per_token(work, t))
    redundant_s = seconds((work.moe_flops + work.moe_recompute_flops) * (1 - 1 / t))
    stage_tokens = rank_tokens / t  # each device's share of its data-parallel rank's tokens

    # communication: FSDP and the replicas move each device's 1/t of its stages' dense weights
    # over the shard group, and its n_experts / ep experts (which TP does not split) over the
    # s / ep ranks holding the same ones
    p_bytes, g_bytes = DTYPES[param_dtype].itemsize, DTYPES[reduce_dtype].itemsize
    if pipeline is None:
        regathered = regathered_params(model_args, reshard_after_forward)
        regathered_experts = regathered_params(model_args, reshard_after_forward, experts_only=True)
        gathers = grad_accum_steps
    else:  # gathered once per accumulation step, unless "always" frees them after each forward
        always = reshard_after_forward == "always"
        regathered, regathered_experts = (work.params, work.experts) if always else (0, 0)
        gathers = grad_accum_steps * (pipeline.microbatches if always else 1)
    dense, expert_shards = work.params - work.experts, s // ep
    traffic = functools.partial(fsdp_traffic, param_bytes=p_bytes, reduce_bytes=g_bytes, gathers=gathers)
    scatters = grad_accum_steps  # every accumulation step reduce-scatters, however often it gathers
    dense_gather_b, dense_scatter_b = traffic(dense / t, (regathered - regathered_experts) / t, s, scatters)
    expert_gather_b, expert_scatter_b = traffic(work.experts / ep, regathered_experts / ep, expert_shards, scatters)
    gather_b, scatter_b = dense_gather_b + expert_gather_b, dense_scatter_b + expert_scatter_b
    reduce_b = replicate_all_reduce_bytes(dense / t + work.experts / ep, g_bytes, s, r)
    recomputed_blocks = recomputed_collective_blocks(work.blocks, ac_mode, selective_ac_option)
    tp_b = grad_accum_steps * tensor_parallel_bytes(
        replace(model_args, n_layers=work.blocks),
        micro_tokens,
        p_bytes,
        t,
        sequence_parallel,
        loss_parallel,
        recomputed_blocks,
        work.moe_layers,
    )
    spans = functools.partial(group_spans_nodes, r, s, t, hw.gpus_per_node, pp=pp, ep=ep)
    shard_link, shard_bw = link(hw, s, spans("shard"))
    expert_shard_link, expert_shard_bw = link(hw, expert_shards, spans("expert_shard"))
    ep_link, ep_bw = link(hw, ep, spans("ep"))
    replicate_link, replicate_bw = link(hw, r, spans("replicate"))
    tp_link, tp_bw = link(hw, t, spans("tp"))
    pp_link, pp_bw = link(hw, pp, spans("pp"))
    # Shard- and replicate-group collectives are added, not overlapped with each other:
    # FSDP issues the all-reduce after each unit's reduce-scatter, and when both groups
    # are inter-node they share the same network cards.
    gather_s = dense_gather_b / shard_bw + expert_gather_b / expert_shard_bw
    scatter_s = dense_scatter_b / shard_bw + expert_scatter_b / expert_shard_bw
    reduce_s = reduce_b / replicate_bw
    data_parallel_s, tp_s = gather_s + scatter_s + reduce_s, tp_b / tp_bw
    ep_b = grad_accum_steps * moe_all_to_all_bytes(
        model_args, work, micro_tokens, p_bytes, ep, ac_mode, selective_ac_option
    )
    ep_s = ep_b / ep_bw
    bubble, pp_b, pp_exposed_b = 0.0, 0.0, 0.0
    if pipeline is not None:
        bubble = pipeline.bubble
        microbatch_size = local_batch_size // pipeline.microbatches
        boundary = boundary_activation_bytes(microbatch_size, seq_len, model_args.dim, t, sequence_parallel, p_bytes)
        pp_b = max(rank_send_bytes(pipeline, rank, boundary, grad_accum_steps) for rank in range(pp))
        # filling and draining: one activation forward and one gradient back per boundary
        pp_exposed_b = 2 * (pipeline.num_stages - 1) * boundary * grad_accum_steps
    pp_s, pp_exposed_s = pp_b / pp_bw, pp_exposed_b / pp_bw
    comm_s = data_parallel_s + tp_s + pp_s + ep_s

    # TP's collectives wait between matmuls (unless async TP hides them), and the experts wait
    # for their rows (the all-to-alls are on the critical path); the pipeline's bubble
    # stretches them with the compute; FSDP's communication overlaps all of it.
    critical_s = (max(compute_s, tp_s) if async_tp else compute_s + tp_s) + ep_s
    pipelined_s = pipelined_seconds(critical_s, bubble, pp_s, pp_exposed_s)
    step_s, exposed_s = overlapped_step_seconds(pipelined_s, data_parallel_s, work.blocks + 1)
    device_tokens = stage_tokens / pp  # the tokens a device's share of the model processes
    tokens_per_s = device_tokens / step_s
    # The threshold C / W uses the link that carries the heavy data-parallel traffic: the FSDP
    # shard group, or the replicate group for pure DDP.
    heavy_bw = shard_bw if s > 1 else replicate_bw
    return StepTimeEstimate(
        strategy=dims.strategy,
        dp_replicate=r,
        dp_shard=s,
        world_size=dims.world_size,
        tp=t,
        hardware=hw,
        efficiency=efficiency,
        flops_per_token=model_flops,
        recompute_flops_per_token=work.recompute_flops,
        tokens_per_device_per_micro_batch=micro_tokens / t,
        tokens_per_device_per_step=device_tokens,
        compute_s=compute_s,
        redundant_compute_s=redundant_s,
        all_gather_bytes=gather_b,
        reduce_scatter_bytes=scatter_b,
        all_reduce_bytes=reduce_b,
        tp_bytes=tp_b,
        shard_link=shard_link,
        replicate_link=replicate_link,
        tp_link=tp_link,
        all_gather_s=gather_s,
        reduce_scatter_s=scatter_s,
        all_reduce_s=reduce_s,
        tp_s=tp_s,
        comm_s=comm_s,
        exposed_comm_s=exposed_s + (0.0 if async_tp else tp_s) + pp_exposed_s + ep_s,
        overlapped=True,
        step_s=step_s,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        async_tp=async_tp,
        pp=pp,
        schedule=None if pipeline is None else pipeline.schedule,
        microbatches=1 if pipeline is None else pipeline.microbatches,
        bubble=bubble,
        pp_bytes=pp_b,
        pp_link=pp_link,
        pp_s=pp_s,
        pp_exposed_s=pp_exposed_s,
        ep=ep,
        ep_bytes=ep_b,
        ep_link=ep_link,
        ep_s=ep_s,
        expert_shard_link=expert_shard_link if ep > 1 else shard_link,
        # Compute-bound when the compute time exceeds the communication time.
        verdict="compute-bound" if compute_s > comm_s else "communication-bound",
        threshold_tokens_per_device=(
            None if math.isinf(heavy_bw) else threshold_tokens_per_device(hw.peak_flops, heavy_bw)
        ),
        break_even_tokens_per_device=break_even_tokens(
            data_parallel_s, grad_accum_steps, t * device_flops_per_token(work, t), hw.peak_flops, efficiency
        ),
        tokens_per_second_per_device=tokens_per_s,
        mfu_percent=mfu(tokens_per_s, model_flops, hw.peak_flops),
    )


def moe_all_to_all_bytes(
    model_args,
    work: RankWork,
    micro_tokens: float,
    activation_bytes: int,
    ep: int,
    ac_mode: str,
    selective_ac_option: str,
) -> float:
    """Per-device all-to-all bytes of one micro-batch through the busiest rank's MoE layers
    (communication.expert_all_to_all_bytes): the tokens entering a MoE layer on a device are all
    of the data-parallel rank's micro-batch, whatever the TP degree (every TP rank runs the MoE
    layer whole on them, sequence parallel or not, and exchanges them with the EP ranks of its
    own TP index); the layers activation checkpointing re-runs are its recomputed blocks' share
    of the MoE layers. 0 for a dense model or ep 1."""
    if ep == 1 or not work.moe_layers:
        return 0.0
    recomputed_blocks = recomputed_collective_blocks(work.blocks, ac_mode, selective_ac_option)
    recomputed_moe = recomputed_blocks * work.moe_layers // work.blocks
    return expert_all_to_all_bytes(
        micro_tokens,
        model_args.top_k,
        model_args.dim,
        activation_bytes,
        model_args.n_experts,
        ep,
        work.moe_layers,
        recomputed_moe,
    )


def estimate_for_job_config(
    job_config,
    world_size: int,
    hardware: Hardware | str,
    efficiency: float = DEFAULT_EFFICIENCY,
    gpus_per_node: int | None = None,
) -> StepTimeEstimate:
    """estimate_step_time with every input read from a JobConfig: model flavor, seq_len,
    local and global batch (hence the accumulation steps), degrees (TP's with its sequence,
    loss and async options, the pipeline's stages and schedule), mixed precision, reshard policy
    and activation checkpointing.
    world_size is the number of GPUs the run would have; a layout that does not multiply to
    it is a ValueError."""
    # The registry behind these pulls in every model.
    from titanlite.parallel.pipeline import plan_pipeline
    from titanlite.plan import run_model_args, tokenizer_for_estimate
    from titanlite.registry import get_model_spec

    training, parallelism, ac = job_config.training, job_config.parallelism, job_config.activation_checkpoint
    dims = _resolve_layout(
        parallelism.data_parallel_replicate_degree,
        parallelism.data_parallel_shard_degree,
        world_size,
        parallelism.tensor_parallel_degree,
        parallelism.pipeline_parallel_degree,
        parallelism.expert_parallel_degree,
    )
    _positive_int("training.local_batch_size", training.local_batch_size)
    _, accumulation = dims.batch_plan(training.local_batch_size, training.global_batch_size)
    model_args = run_model_args(job_config, tokenizer_for_estimate(job_config)[0])
    pipeline = None
    if dims.pp > 1:
        model_cls = get_model_spec(job_config.model.name).model_cls
        pipeline = plan_pipeline(parallelism, model_cls, model_args, training.local_batch_size)
    return estimate_step_time(
        model_args,
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        hardware=hardware,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        world_size=dims.world_size,
        tp=dims.tp,
        grad_accum_steps=accumulation,
        param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        reshard_after_forward=parallelism.fsdp_reshard_after_forward,
        ac_mode=ac.mode,
        selective_ac_option=ac.selective_ac_option,
        sequence_parallel=parallelism.enable_sequence_parallel,
        loss_parallel=not parallelism.disable_loss_parallel,
        async_tp=parallelism.enable_async_tensor_parallel,
        efficiency=efficiency,
        gpus_per_node=gpus_per_node,
        pipeline=pipeline,
        ep=dims.ep,
    )
