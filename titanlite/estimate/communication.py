"""The communication side of a training step's estimate: how many bytes each device sends in
FSDP's and the replicas' collectives, and over which link (pure arithmetic, see step_time)."""

import math

from titanlite.estimate.hardware import Hardware
from titanlite.metrics.flops import param_counts
from titanlite.models.llama.args import LlamaArgs


def ring_bytes(total_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``total_bytes``:

        total_bytes x (n - 1) / n

    Each rank owns 1/n of the data and must pass on the other n - 1 pieces. An
    all-reduce (reduce-scatter then all-gather) is twice this. n = 1 sends nothing.
    """
    return total_bytes * (group_size - 1) / group_size


def regathered_params(args: LlamaArgs, reshard_after_forward: str) -> int:
    """Parameters all-gathered a second time in backward, per micro-batch:

    always  -> all of them (FULL_SHARD / ZeRO-3: every unit freed after forward)
    default -> all - last block - root (titanlite keeps the last block, which backward
               needs first, and the root unsharded after forward, so that neither is
               gathered twice in a row)
    never   -> 0 (SHARD_GRAD_OP / ZeRO-2: forward's gathered weights stay)

    The FSDP units are one per block plus the root (embedding, final norm, output); their
    sizes are counted on the model (metrics.flops.param_counts).
    """
    counts = param_counts(args)
    if reshard_after_forward == "always":
        return counts.total
    if reshard_after_forward == "default":
        return counts.total - counts.blocks[-1] - counts.root
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


def group_spans_nodes(dp_replicate: int, dp_shard: int, gpus_per_node: int, dim: str) -> bool:
    """Whether any group of mesh dimension ``dim`` ("shard" or "replicate") has ranks on
    two nodes. Ranks fill the (replicate, shard) mesh row by row, rank = i x s + j, and
    nodes hold consecutive ranks, so a group spans nodes when its first and last rank
    sit on different nodes: shard groups are s consecutive ranks, replicate groups have
    stride s. One straddling group is enough: a collective waits for its slowest group.
    """
    g = gpus_per_node
    if dim == "shard":
        firsts, span = range(0, dp_replicate * dp_shard, dp_shard), dp_shard - 1
    else:
        firsts, span = range(dp_shard), (dp_replicate - 1) * dp_shard
    return any(first // g != (first + span) // g for first in firsts)


def link(hardware: Hardware, group_size: int, spans_nodes: bool) -> tuple[str, float]:
    """(name, bytes/s) of the link a group's collective runs over: none for a group of one,
    inter-node when the group spans nodes, intra-node otherwise."""
    if group_size == 1:
        return "none", math.inf
    if spans_nodes:
        return "inter-node", hardware.inter_node_bw
    return "intra-node", hardware.intra_node_bw
