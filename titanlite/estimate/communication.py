"""What every parallelism's communication in a step's estimate shares: the bytes a rank sends
in a ring collective, the link a mesh dimension's groups run over, and what one kind of
collective adds to a step (pure arithmetic, see step_time; each parallelism's bytes are in
data_parallel, tensor_parallel, expert_parallel and pipeline)."""

import math
from dataclasses import dataclass

from titanlite.estimate.hardware import Hardware
from titanlite.parallel.parallel_dims import ParallelDims, ep_shard_ranks


@dataclass(frozen=True)
class Traffic:
    """One parallelism's collectives over one optimizer step, on one device."""

    sent_bytes: float  # what the device sends, summed over the step
    link: str  # "intra-node", "inter-node" or "none" (a group of one)
    bandwidth: float  # bytes/s of that link; infinite for a group of one

    @property
    def seconds(self) -> float:
        return self.sent_bytes / self.bandwidth


def ring_bytes(total_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``total_bytes``:

        total_bytes x (n - 1) / n

    Each rank owns 1/n of the data and must pass on the other n - 1 pieces. An
    all-reduce (reduce-scatter then all-gather) is twice this. n = 1 sends nothing.
    """
    return total_bytes * (group_size - 1) / group_size


def _group_size(dp_replicate: int, dp_shard: int, tp: int, dim: str, pp: int, ep: int, cp: int = 1) -> int:
    """Ranks in one group of mesh dimension ``dim`` (see group_spans_nodes). FSDP's shard group
    is dp_shard x cp under context parallelism."""
    return {
        "pp": pp,
        "replicate": dp_replicate,
        "shard": dp_shard * cp,
        "cp": cp,
        "tp": tp,
        "ep": ep,
        "expert_shard": dp_shard * cp // ep_shard_ranks(ep, tp),
    }[dim]


def group_spans_nodes(
    dp_replicate: int, dp_shard: int, tp: int, gpus_per_node: int, dim: str, pp: int = 1, ep: int = 1, cp: int = 1
) -> bool:
    """Whether any group of mesh dimension ``dim`` ("pp", "replicate", "shard", "cp", "tp", "ep"
    or "expert_shard") has ranks on two nodes. Ranks fill the (pp, replicate, shard, tp) mesh row
    by row, rank = ((h x r + i) x s + j) x t + k, and nodes hold consecutive ranks: a TP group
    is t consecutive ranks, a shard group has stride t, a replicate group stride s x t, a
    pipeline stride r x s x t. Expert parallelism takes the tp ranks of e = ep / t shard ranks
    (ep alone without TP), the inner part of the shard index (j = j' x e + i): an EP group is
    ep consecutive ranks (stride 1), and the expert_shard group FSDP shards the experts over
    (the s / e shard ranks holding the same experts) has stride e x t.
    A group spans nodes when its first and last rank sit on different nodes (the ranks between
    them lie between). One straddling group is enough: a collective waits for its slowest group.
    Under context parallelism the mesh is (pp, replicate, shard, cp, tp): a cp group has stride
    t, and FSDP's shard group, dp_shard x cp flattened, is s x c ranks of stride t, so above s
    stands for s x c.
    """
    size = _group_size(dp_replicate, dp_shard, tp, dim, pp, ep, cp)
    shard = dp_shard * cp
    stride = {
        "pp": dp_replicate * shard * tp,
        "replicate": shard * tp,
        "shard": tp,
        "cp": tp,
        "tp": 1,
        "ep": 1,
        "expert_shard": ep_shard_ranks(ep, tp) * tp,
    }[dim]
    span = (size - 1) * stride
    firsts = (rank for rank in range(pp * dp_replicate * shard * tp) if rank // stride % size == 0)
    return any(first // gpus_per_node != (first + span) // gpus_per_node for first in firsts)


def link(hardware: Hardware, group_size: int, spans_nodes: bool) -> tuple[str, float]:
    """(name, bytes/s) of the link a group's collective runs over: none for a group of one,
    inter-node when the group spans nodes, intra-node otherwise."""
    if group_size == 1:
        return "none", math.inf
    if spans_nodes:
        return "inter-node", hardware.inter_node_bw
    return "intra-node", hardware.intra_node_bw


def mesh_link(hardware: Hardware, dims: ParallelDims, dim: str) -> tuple[str, float]:
    """(name, bytes/s) of the link the collectives of mesh dimension ``dim`` run over in the
    layout ``dims`` (group_spans_nodes, link)."""
    r, s, t, pp, ep, cp = dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.ep, dims.cp
    spans = group_spans_nodes(r, s, t, hardware.gpus_per_node, dim, pp=pp, ep=ep, cp=cp)
    return link(hardware, _group_size(r, s, t, dim, pp, ep, cp), spans)


def traffic(hardware: Hardware, dims: ParallelDims, dim: str, sent_bytes: float) -> Traffic:
    """``sent_bytes`` sent over the link of mesh dimension ``dim`` (mesh_link)."""
    name, bandwidth = mesh_link(hardware, dims, dim)
    return Traffic(sent_bytes, name, bandwidth)
