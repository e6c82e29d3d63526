"""What context parallelism adds to a step's estimate (pure arithmetic, see step_time): the
keys and values each attention layer all-gathers over the cp group, and the attention work a
cp rank's kernel does.

Under cp ranks each rank runs seq_len / cp tokens of every sequence through the whole model
(parallel/context_parallel.py). Everything but attention works token by token, so the
weights' FLOPs per rank are divided by cp like the tokens. Attention all-gathers the whole
sequence's keys and values (the kernel's key/value heads, its TP rank's share, not repeated to
the query heads) and attends the rank's queries over the keys they see only: each query chunk
against the earlier chunks whole and its own causally (FlexAttention skipping the tiles no
query sees on CUDA). Head-tail balance (chunks r and 2 cp - 1 - r of 2 cp) gives every rank
the same causal work, 1/cp of the sequence's, half its [seq_len / cp, seq_len] rectangle; so
attention costs a cp rank the causal FLOPs the model's count already holds, divided by cp like
the rest (the diagonal tiles' upper halves, which FlexAttention computes whole, are
128 / seq_len of it and left out). The forward all-gather runs while the kernel attends the
rank's own keys (kv_gather_hidden_seconds).
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


def kv_gather_hidden_seconds(
    args, seq_len: int, cp: int, tp: int, micro_tokens: int, gathered_bytes: float, bandwidth: float, flop_rate: float
) -> float:
    """Seconds of one layer's forward all-gather (per micro-batch) that the kernel hides behind its
    attention over the rank's own keys, which it runs while the gather is in flight: its two
    chunks' diagonals and the late chunk against the early one, 1/cp of the rank's causal
    attention under head-tail (2 of its 2 cp chunk-sized blocks). The forward's share of that
    work is a third of attention's training FLOPs (backward twice the forward):

        min(gather, attention_flops_per_token(causal) / n_layers / 3 x micro_tokens / (cp x tp) / flop_rate)

    ``flop_rate``: the device's FLOP/s at the estimate's efficiency; ``micro_tokens``: a cp rank's
    tokens per micro-batch. The backward's reduce-scatter is waited on at once (hides nothing)."""
    if cp == 1:
        return 0.0
    gather_s = ring_bytes(gathered_bytes, cp) / bandwidth
    local_s = attention_flops_per_token(args, seq_len) / args.n_layers / 3 * micro_tokens / (cp * tp) / flop_rate
    return min(gather_s, local_s)
