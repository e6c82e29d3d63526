"""Tensor parallelism in a step's estimate: the bytes each device sends in TP's activation
collectives, forward, backward and recomputed (pure arithmetic, see step_time)."""

import math

from titanlite.estimate.communication import ring_bytes
from titanlite.models.llama.args import LlamaArgs


def recomputed_collective_blocks(n_layers: int, ac_mode: str, selective_ac_option: str) -> int:
    """Blocks whose forward TP collectives activation checkpointing issues a second time:

    none          -> 0
    full          -> every block
    selective N   -> ceil(n_layers / N) (blocks 0, N, 2N, ... as parallelize.py wraps them)
    selective op  -> every block: only matmul and attention outputs are saved, so recomputing
                     the norms' inputs and outputs re-runs the collectives between them

    Unlike recomputed FLOPs (compute.recompute_fraction), per-op checkpointing saves none of
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
    held_whole_outputs: int = 0,
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
        MoE blocks 4 a (sequence parallel) or 6 a instead, for the ``moe_blocks`` of the blocks
                   whose feed-forward is an MoE layer, whose tokens TP splits
                   (parallel/moe_tensor_parallel.py): attention's 4 a as above; with sequence
                   parallel the layer takes and gives the rank's part of the sequence as the
                   residual stream holds it: nothing; without it the layer cuts its whole input
                   (no exchange) and all-gathers its output in forward, and all-gathers its
                   input's gradient in backward: 2 a. Its weights' gradients are partial sums
                   over the ranks' tokens: moe_gradient_all_reduce_bytes
        recompute  3 a (two all-gathers and the reduce-scatter after wo) or 2 a (the all-reduce
                   after wo) per block checkpointing re-runs, 2 a either way for an MoE block
                   (attention's all-gather and reduce-scatter, or its all-reduce): the
                   recomputation stops before the block's last collective, whose output
                   backward does not need
        ends       4 a: the embedding's reduce-scatter (all-reduce) of its partial lookups and,
                   for the output projection, the all-gather of the final norm's output (in
                   backward the reduction of its gradient), each with its mirror in backward
        held whole 2 x tokens x ``held_whole_outputs`` x activation_bytes: in backward the
                   all-reduce of the output gradients of the attention modules TP holds whole
                   (estimate.held_whole: DeepSeek-V3's low-rank down-projections, whose outputs
                   feed heads split over the ranks; the features summed over the blocks)
        logits     loss parallel: three all-reduces of one float32 per token (the maximum, the
                   sum of exponentials and the target's logit); without it the all-gather of
                   the [tokens, vocab] logits in the compute dtype (its backward is a local slice)

    The gradients of the norms, which TP replicates, are also summed over the TP group: 2L + 1
    vectors of dim per micro-batch, left out (a few hundred KB), as is the sum of the MoE
    balancing losses' terms (one all-reduce per forward of a few numbers per expert, layer and
    sequence, when a loss is on).
    """
    activation = tokens * args.dim * activation_bytes
    per_moe_block = 4 if sequence_parallel else 6
    blocks = 8 * (args.n_layers - moe_blocks) + per_moe_block * moe_blocks
    # The recomputed blocks, as parallelize.py wraps them (every N-th from block 0, or all), are
    # taken to be MoE blocks in the share the MoE blocks have of all blocks.
    recomputed_moe = recomputed_blocks * moe_blocks // args.n_layers
    recomputed = (3 if sequence_parallel else 2) * (recomputed_blocks - recomputed_moe) + 2 * recomputed_moe
    whole_activations = blocks + recomputed + 4
    if loss_parallel:
        logits = 3 * 2 * tokens * 4  # three all-reduces (2 x the bytes) of one float32 per token
    else:
        logits = tokens * args.vocab_size * activation_bytes
    held_whole = 2 * tokens * held_whole_outputs * activation_bytes
    return ring_bytes(whole_activations * activation + held_whole + logits, tp)


def moe_gradient_all_reduce_bytes(held_whole: float, gradient_bytes: int, tp: int) -> float:
    """Per-device bytes of summing over the TP group the gradients of the MoE weights every TP
    rank holds whole (``held_whole`` of them: the routers and shared experts, and the routed
    experts unless expert parallelism splits them), once per gradient reduction (under FSDP every accumulation step,
    before its reduce-scatter; without it once per step, before clipping):

        2 x held_whole x gradient_bytes x (t - 1) / t      (an all-reduce)

    Each TP rank routes its own tokens, so each rank's gradient of such a weight is a partial
    sum. FSDP sums it over tp on the compute stream, before its reduce-scatter: like TP's
    activation collectives it is not hidden. Expert parallelism, whose ep groups take the TP
    ranks, leaves only the routers' (n_experts x dim per layer) to sum.
    """
    return 2 * ring_bytes(held_whole * gradient_bytes, tp)
