"""Expert parallelism in a step's estimate: the bytes each device sends in the all-to-alls that
carry token rows to their experts' ranks and back (pure arithmetic, see step_time)."""

from titanlite.estimate.communication import ring_bytes
from titanlite.estimate.compute import RankWork


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


def moe_all_to_all_bytes(
    model_args,
    work: RankWork,
    micro_tokens: float,
    activation_bytes: int,
    ep: int,
    recomputed_blocks: int,
    tp: int = 1,
) -> float:
    """Per-device all-to-all bytes of one micro-batch through the busiest rank's MoE layers
    (expert_all_to_all_bytes): the tokens entering a MoE layer on a device are its 1/tp slice of
    the data-parallel rank's micro-batch of ``micro_tokens`` (each TP rank routes its own part of
    the sequence, sequence parallel or not, and exchanges it over an ep group that takes the TP
    ranks: parallel/moe_tensor_parallel.py); the layers activation checkpointing re-runs are the
    ``recomputed_blocks``' share of the MoE layers (tensor_parallel.recomputed_collective_blocks:
    the blocks whose forward collectives run twice). 0 for a dense model or ep 1."""
    if ep == 1 or not work.moe_layers:
        return 0.0
    recomputed_moe = recomputed_blocks * work.moe_layers // work.blocks
    return expert_all_to_all_bytes(
        micro_tokens / tp,
        model_args.top_k,
        model_args.dim,
        activation_bytes,
        model_args.n_experts,
        ep,
        work.moe_layers,
        recomputed_moe,
    )
