"""Data parallelism in a step's estimate (FSDP, HSDP, DDP): the bytes each device sends in the
shard group's all-gathers and reduce-scatters and the replicas' all-reduce, their seconds, how
FSDP hides them under compute, and the roofline threshold that says which of the two bounds
the step (pure arithmetic, see step_time)."""

import functools
from dataclasses import dataclass

from titanlite.estimate.communication import mesh_link, ring_bytes
from titanlite.estimate.compute import RankWork
from titanlite.estimate.hardware import Hardware
from titanlite.metrics.flops import param_counts
from titanlite.models.llama.args import LlamaArgs
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan


def regathered_params(args: LlamaArgs, reshard_after_forward: str, experts_only: bool = False) -> int:
    """Parameters all-gathered a second time in backward, per micro-batch:

    always  -> all of them (FULL_SHARD / ZeRO-3: every unit freed after forward)
    default -> all - last block - root (titanlite keeps the last block, which backward
               needs first, and the root unsharded after forward, so that neither is
               gathered twice in a row)
    never   -> 0 (SHARD_GRAD_OP / ZeRO-2: forward's gathered weights stay)

    The FSDP units are one per block plus the root (embedding, final norm, output); their
    sizes are counted on the model (metrics.flops.param_counts). ``experts_only``: of the
    routed experts' weights alone (which, under expert parallelism, FSDP gathers over its own
    smaller group), the root holding none.
    """
    counts = param_counts(args)
    blocks, root = (counts.experts, 0) if experts_only else (counts.blocks, counts.root)
    if reshard_after_forward == "always":
        return sum(blocks) + root
    if reshard_after_forward == "default":
        return sum(blocks[:-1])
    return 0


def fsdp_bytes(
    params: int, regathered: int, param_bytes: int, reduce_bytes: int, dp_shard: int, micro_batches: int
) -> tuple[float, float]:
    """Per-device (all-gather, reduce-scatter) bytes in one step of the shard group:

        all-gather     = micro_batches x (params + regathered) x param_bytes x (s - 1) / s
        reduce-scatter = micro_batches x params x reduce_bytes x (s - 1) / s

    Every micro-batch gathers every parameter for its forward (FSDP reshards after each
    backward) and, unless resharding is "never", again for its backward; every
    micro-batch reduce-scatters its gradients (titanlite only skips the replicate
    all-reduce on early micro-batches). With reshard "always" and one dtype that is
    3 collectives per layer within the shard group, each moving one model's worth.
    """
    gather = micro_batches * ring_bytes((params + regathered) * param_bytes, dp_shard)
    scatter = micro_batches * ring_bytes(params * reduce_bytes, dp_shard)
    return gather, scatter


def replicate_all_reduce_bytes(params: int, reduce_bytes: int, dp_shard: int, dp_replicate: int) -> float:
    """Per-device bytes of the all-reduce across replicas (HSDP, DDP), once per step:

        2 x (params / s) x reduce_bytes x (r - 1) / r

    Each device all-reduces only its gradient shard (1/s of the model) with the devices
    holding the same shard in the other replicas: one all-reduce at the end of the step.
    """
    return 2 * ring_bytes(params / dp_shard * reduce_bytes, dp_replicate)


def fsdp_traffic(
    params: float, regathered: float, shards: int, scatters: int, *, param_bytes: int, reduce_bytes: int, gathers: int
) -> tuple[float, float]:
    """Per-device (all-gather, reduce-scatter) bytes of one step for ``params`` sharded over
    ``shards`` ranks, gathered ``gathers`` times (plus ``regathered`` in each backward) and
    reduce-scattered ``scatters`` times (fsdp_bytes)."""
    gather, _ = fsdp_bytes(params, regathered, param_bytes, reduce_bytes, shards, gathers)
    _, scatter = fsdp_bytes(params, 0, param_bytes, reduce_bytes, shards, scatters)
    return gather, scatter


@dataclass(frozen=True)
class DataParallelTraffic:
    """FSDP's and the replicas' collectives over one optimizer step, on one device."""

    all_gather_bytes: float  # FSDP parameter all-gathers (forward + backward re-gathers)
    reduce_scatter_bytes: float  # FSDP gradient reduce-scatters
    all_reduce_bytes: float  # HSDP/DDP gradient all-reduce across replicas
    all_gather_s: float
    reduce_scatter_s: float
    all_reduce_s: float
    shard_link: str  # "intra-node", "inter-node" or "none" (a group of one)
    expert_shard_link: str  # the link FSDP gathers and reduces the experts over (the shard group's without EP)
    replicate_link: str
    heavy_bw: float  # bytes/s of the link the heavy traffic runs over: the shard group's, or the replicas' for DDP

    @property
    def seconds(self) -> float:
        return self.all_gather_s + self.reduce_scatter_s + self.all_reduce_s


def data_parallel_traffic(
    model_args: LlamaArgs,
    work: RankWork,
    pipeline: PipelinePlan | None,
    dims: ParallelDims,
    hardware: Hardware,
    *,
    grad_accum_steps: int,
    param_bytes: int,
    reduce_bytes: int,
    reshard_after_forward: str,
) -> DataParallelTraffic:
    """FSDP and the replicas move each device's 1/t of its stages' dense weights (all of those TP
    holds whole: estimate.held_whole) over the shard group, and its n_experts / ep experts
    (which TP does not split by features) over the s / (ep / t) ranks holding the same ones (the
    shard group without EP). Without a pipeline every accumulation step gathers (and, unless
    resharding is "never", gathers again in backward); under PP each stage's parameters are
    gathered once per accumulation step, unless "always" frees them after each micro-batch's
    forward."""
    r, t, ep = dims.dp_replicate, dims.tp, dims.ep
    s = dims.dp_shard * dims.cp  # FSDP shards over dp_shard x cp: cp ranks hold the same weights
    if pipeline is None:
        regathered = regathered_params(model_args, reshard_after_forward)
        regathered_experts = regathered_params(model_args, reshard_after_forward, experts_only=True)
        gathers = grad_accum_steps
    else:
        always = reshard_after_forward == "always"
        regathered, regathered_experts = (work.params, work.experts) if always else (0, 0)
        gathers = grad_accum_steps * (pipeline.microbatches if always else 1)
    dense, expert_shards = work.params - work.experts, dims.expert_fsdp
    # Of the dense weights, TP splits all but those it holds whole (estimate.held_whole); the
    # regathered ones are taken to be held whole in the same share.
    dense_per_tp_rank = (dense - work.held.params) / t + work.held.params
    regathered_per_tp_rank = (regathered - regathered_experts) * dense_per_tp_rank / dense
    traffic = functools.partial(fsdp_traffic, param_bytes=param_bytes, reduce_bytes=reduce_bytes, gathers=gathers)
    scatters = grad_accum_steps  # every accumulation step reduce-scatters, however often it gathers
    dense_gather_b, dense_scatter_b = traffic(dense_per_tp_rank, regathered_per_tp_rank, s, scatters)
    expert_gather_b, expert_scatter_b = traffic(work.experts / ep, regathered_experts / ep, expert_shards, scatters)
    # A rank's shard of the experts is n_experts / ep of them over the expert_shards ranks: as
    # much as experts x (ep / t) / ep spread over all s shard ranks.
    reduce_b = replicate_all_reduce_bytes(dense_per_tp_rank + work.experts * dims.ep_shard / ep, reduce_bytes, s, r)
    shard_link, shard_bw = mesh_link(hardware, dims, "shard")
    expert_shard_link, expert_shard_bw = mesh_link(hardware, dims, "expert_shard")
    replicate_link, replicate_bw = mesh_link(hardware, dims, "replicate")
    # Shard- and replicate-group collectives are added, not overlapped with each other:
    # FSDP issues the all-reduce after each unit's reduce-scatter, and when both groups
    # are inter-node they share the same network cards.
    return DataParallelTraffic(
        all_gather_bytes=dense_gather_b + expert_gather_b,
        reduce_scatter_bytes=dense_scatter_b + expert_scatter_b,
        all_reduce_bytes=reduce_b,
        all_gather_s=dense_gather_b / shard_bw + expert_gather_b / expert_shard_bw,
        reduce_scatter_s=dense_scatter_b / shard_bw + expert_scatter_b / expert_shard_bw,
        all_reduce_s=reduce_b / replicate_bw,
        shard_link=shard_link,
        expert_shard_link=expert_shard_link if ep > 1 else shard_link,
        replicate_link=replicate_link,
        heavy_bw=shard_bw if s > 1 else replicate_bw,
    )


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


def threshold_tokens_per_device(peak_flops: float, bandwidth: float) -> float:
    """The roofline threshold, the compute-to-communication ratio (data parallelism and FSDP alike):

        tokens per device > C / W   =>   compute-bound

    C = peak FLOP/s of one device, W = bytes/s it sends (per direction). It follows from
    4 backward FLOPs per parameter per token against 4 bytes per bf16 parameter in an
    all-reduce (2 x 2 bytes): the per-token FLOPs and the per-parameter bytes cancel.
    """
    return peak_flops / bandwidth
