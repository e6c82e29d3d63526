"""The attention kernel every family's attention calls: softmax(q k^T x scale) v, causal.

It is a module of its own (no parameters) at the name its attention class gives in
``kernel_name``, so that code outside the models can run it differently without the models
knowing: tensor parallelism runs it on each rank's heads, and context parallelism puts in its
place a kernel that gathers the other ranks' keys and values first and masks by global
positions (titanlite/parallel/context_parallel.py), calling ``attend`` with that mask.
"""

import torch
import torch.nn.functional as F
from torch import nn


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """Attention of q [batch, n_heads, q_len, qk] over k [batch, kv_heads, kv_len, qk] and v
    [batch, kv_heads, kv_len, v] (kv_heads divides n_heads: query head h reads key/value head
    h // (n_heads / kv_heads)). ``mask``: a boolean [q_len, kv_len] or [batch, 1, q_len, kv_len]
    (True: may attend), or None for plain causal attention over equal q and kv positions.
    ``scale``: None for 1 / sqrt(qk)."""
    grouped = k.shape[1] != q.shape[1]
    if grouped and (mask is not None or q.dtype not in (torch.float16, torch.bfloat16)):
        # On GPUs only the flash kernel shares key/value heads between query heads
        # without copying them, and it runs in 16 bits only, without a mask. Otherwise the
        # fused kernel left (memory-efficient) needs one key/value head per query head; given
        # fewer, SDPA falls back to the math kernel, which stores the [seq, seq] scores
        # of every head. Copying k and v to every query head costs 2 * head_dim numbers
        # per position and head instead of seq.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        grouped = False
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class AttentionKernel(nn.Module):
    """``attend`` as a module: causal attention of q over k and v, at ``scale`` (None: 1 / sqrt(qk))."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, scale=self.scale)
