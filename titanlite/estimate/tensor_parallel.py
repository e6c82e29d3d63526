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
