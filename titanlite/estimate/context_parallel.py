"""What context parallelism adds to a step's estimate (pure arithmetic, see step_time): the
keys and values each attention layer all-gathers over the cp group, and the attention work a
cp rank's kernel does.

Under cp ranks each rank runs seq_len / cp tokens of every sequence through the whole model
(parallel/context_parallel.py). Everything but attention works token by token, so the
weights' FLOPs per rank are divided by cp like the tokens. Attention all-gathers the whole
sequence's keys and values (the kernel's key/value heads, its TP rank's share) and attends the
rank's queries over them with a [seq_len / cp, seq_len] mask from global positions. Head-tail
balance (chunks r and 2 cp - 1 - r of 2 cp) gives every rank the same causal work, 1/cp of the
sequence's; without it the last rank would do (2 cp - 1) / cp of the average. But SDPA given
a mask computes the whole rectangle, masked scores included (it cannot skip blocks the mask
empties), so a cp rank's kernel does the whole [seq_len / cp, seq_len] matrix: twice the
causal work it needs, on every rank whatever the balancer. The estimate charges that; MFU
still counts the causal work the model needs.
"""

from titanlite.estimate.communication import ring_bytes
from titanlite.metrics.flops import attention_flops_per_token


def kv_gather_bytes(kv_features: int, local_batch_size: int, seq_len: int, tp: int, cp: int, dtype_bytes: int) -> float:
    """The keys and values one attention layer holds gathered per micro-batch on one device:

        local_batch_size x seq_len x kv_features / tp x dtype bytes

    ``kv_features``: numbers per token of the keys and values the kernel takes (its
    attention class's kernel_kv_features), which TP splits by heads. Zero without CP."""
    if cp == 1:
        return 0.0
    return local_batch_size * seq_len * kv_features / tp * dtype_bytes


def kv_sent_bytes(gathered_bytes: float, cp: int, blocks: int, recomputed_blocks: int) -> float:
    """Bytes one device sends per micro-batch for the keys and values of ``blocks`` layers: a
    ring all-gather of ``gathered_bytes`` in each forward (again in each recomputed one) and the
    reduce-scatter of their gradients, the same size, in backward:

        (2 x blocks + recomputed_blocks) x gathered x (cp - 1) / cp"""
    return (2 * blocks + recomputed_blocks) * ring_bytes(gathered_bytes, cp)


def masked_attention_flops_per_token(args, seq_len: int, cp: int, blocks: int, recompute_fraction: float) -> float:
    """FLOPs per token a cp rank's attention kernel does beyond the causal count the model's
    FLOPs hold: the masked half of the [seq_len / cp, seq_len] rectangle it computes anyway,
    in forward and backward, and in the forward activation checkpointing repeats, in the
    ``blocks`` blocks of the rank's stages:

        (1 + fraction / 3) x attention_flops_per_token(causal) x blocks / n_layers   (0 without CP)"""
    if cp == 1:
        return 0.0
    return (1 + recompute_fraction / 3) * attention_flops_per_token(args, seq_len) * blocks / args.n_layers
