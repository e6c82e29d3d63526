"""The communication side of a training step's estimate: how many bytes each device sends in
FSDP's, the replicas' and tensor parallelism's collectives, and over which link (pure
arithmetic, see step_time)."""

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


def recomputed_collective_blocks(n_layers: int, ac_mode: str, selective_ac_option: str) -> int:
    """Blocks whose forward TP collectives activation checkpointing issues a second time:

    none          -> 0
    full          -> every block
    selective N   -> ceil(n_layers / N) (blocks 0, N, 2N, ... as parallelize.py wraps them)
    selective op  -> every block: only matmul and attention outputs are saved, so recomputing
                     the norms' inputs and outputs re-runs the collectives between them

    Unlike recomputed FLOPs (step_time.recompute_fraction), per-op checkpointing saves none of
    the communication.
    """
    if ac_mode == "none":
        return 0
    if ac_mode == "full" or selective_ac_option == "op":
        return n_layers
    return math.ceil(n_layers / int(selective_ac_option))


def tensor_parallel_bytes(
    args: LlamaArgs,
    tokens: int,
    activation_bytes: int,
    tp: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    recomputed_blocks: int,
    moe_blocks: int = 0,
) -> float:
    """Per-device bytes of tensor parallelism's collectives in one micro-batch (forward and
    backward) over the TP group, for ``tokens`` tokens (the data-parallel rank's micro-batch,
    which every rank of its TP group sees), each rank sending ``ring_bytes`` of:

        a = tokens x dim x activation_bytes      one [batch, seq, dim] activation, whole
        blocks     8 a per block: with sequence parallel an all-gather of the sequence before
                   attention and before the FFN and a reduce-scatter after wo and after w2, and
                   the same four reversed in backward; without it an all-reduce (2 a) after wo
                   and after w2 in forward and before the column-wise inputs in backward: the
                   same bytes
        MoE blocks 6 a (sequence parallel) or 4 a instead, for the ``moe_blocks`` of the blocks
                   whose feed-forward is an MoE layer, which TP holds whole
                   (parallelize._whole_moe_plan): attention's 4 a as above; the layer's input is
                   all-gathered (forward) and its whole output cut to the rank's sequence chunk
                   (no exchange), whose gradient is all-gathered in backward while the input's
                   gradient, whole on every rank, is cut alike: 2 a; without sequence parallel
                   the layer's input and output are whole already: nothing. Its weights'
                   gradients, computed from all the tokens on every rank, need no reduction
        recompute  3 a (two all-gathers and the reduce-scatter after wo) or 2 a (the all-reduce
                   after wo) per block checkpointing re-runs: the recomputation stops before the
                   block's last collective, whose output backward does not need
        ends       4 a: the embedding's reduce-scatter (all-reduce) of its partial lookups and,
                   for the output projection, the all-gather of the final norm's output (in
                   backward the reduction of its gradient), each with its mirror in backward
        logits     loss parallel: three all-reduces of one float32 per token (the maximum, the
                   sum of exponentials and the target's logit); without it the all-gather of
                   the [tokens, vocab] logits in the compute dtype (its backward is a local slice)

    The gradients of the norms, which TP replicates, are also summed over the TP group: 2L + 1
    vectors of dim per micro-batch, left out (a few hundred KB).
    """
    activation = tokens * args.dim * activation_bytes
    per_recomputed_block = 3 if sequence_parallel else 2  # an MoE block's the same (its forward all-gather)
    per_moe_block = 6 if sequence_parallel else 4
    blocks = 8 * (args.n_layers - moe_blocks) + per_moe_block * moe_blocks
    whole_activations = blocks + per_recomputed_block * recomputed_blocks + 4
    if loss_parallel:
        logits = 3 * 2 * tokens * 4  # three all-reduces (2 x the bytes) of one float32 per token
    else:
        logits = tokens * args.vocab_size * activation_bytes
    return ring_bytes(whole_activations * activation + logits, tp)


def group_spans_nodes(
    dp_replicate: int, dp_shard: int, tp: int, gpus_per_node: int, dim: str, pp: int = 1, ep: int = 1
) -> bool:
    """Whether any group of mesh dimension ``dim`` ("pp", "replicate", "shard", "tp", "ep" or
    "expert_shard") has ranks on two nodes. Ranks fill the (pp, replicate, shard, tp) mesh row
    by row, rank = ((h x r + i) x s + j) x t + k, and nodes hold consecutive ranks: a TP group
    is t consecutive ranks, a shard group has stride t, a replicate group stride s x t, a
    pipeline stride r x s x t. Expert parallelism splits the shard dimension, its ep ranks the
    inner part (j = j' x ep + e): an EP group has stride t, and the expert_shard group FSDP
    shards the experts over (the s / ep ranks holding the same experts) stride ep x t.
    A group spans nodes when its first and last rank sit on different nodes (the ranks between
    them lie between). One straddling group is enough: a collective waits for its slowest group.
    """
    size = {
        "pp": pp,
        "replicate": dp_replicate,
        "shard": dp_shard,
        "tp": tp,
        "ep": ep,
        "expert_shard": dp_shard // ep,
    }[dim]
    stride = {
        "pp": dp_replicate * dp_shard * tp,
        "replicate": dp_shard * tp,
        "shard": tp,
        "tp": 1,
        "ep": tp,
        "expert_shard": ep * tp,
    }[dim]
    span = (size - 1) * stride
    firsts = (rank for rank in range(pp * dp_replicate * dp_shard * tp) if rank // stride % size == 0)
    return any(first // gpus_per_node != (first + span) // gpus_per_node for first in firsts)


def expert_all_to_all_bytes(
    tokens: float,
    top_k: int,
    dim: int,
    activation_bytes: int,
    n_experts: int,
    ep: int,
    moe_layers: int,
    recomputed_moe_layers: int,
) -> float:
    """Per-device bytes of expert parallelism's all-to-alls in one micro-batch over the EP group
    (titanlite.parallel.expert_parallel), for ``tokens`` tokens entering each MoE layer on the
    device:

        rows       tokens x top_k x dim x activation_bytes: one row per routed (token, expert)
                   pair, in the compute dtype
        per pass   2 rows: the dispatch to the experts' owners and the combine back
        passes     forward and backward (the gradients travel the reverse ways) of every MoE
                   layer, plus a forward again for each layer activation checkpointing recomputes
        counts     n_experts int64 token counts, exchanged before every forward's dispatch (the
                   backward reuses the split sizes)

        total = ((2 L + R) x 2 x rows + (L + R) x n_experts x 8) x (ep - 1) / ep

    L MoE layers, R of them recomputed. A pair's expert lives on one of the ep ranks, so with an
    even load 1/ep of the rows stays on the device and (ep - 1)/ep leaves it; an uneven load
    moves more from the ranks that send to busy experts, which this average leaves out.
    """
    passes = 2 * moe_layers + recomputed_moe_layers
    rows = tokens * top_k * dim * activation_bytes
    counts = (moe_layers + recomputed_moe_layers) * n_experts * 8
    return ring_bytes(passes * 2 * rows + counts, ep)


def link(hardware: Hardware, group_size: int, spans_nodes: bool) -> tuple[str, float]:
    """(name, bytes/s) of the link a group's collective runs over: none for a group of one,
    inter-node when the group spans nodes, intra-node otherwise."""
    if group_size == 1:
        return "none", math.inf
    if spans_nodes:
        return "inter-node", hardware.inter_node_bw
    return "intra-node", hardware.intra_node_bw
