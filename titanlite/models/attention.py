"""The attention kernel every family's attention calls: softmax(q k^T x scale) v, causal, and
with document masking (block_causal) stopping at document boundaries too.

It is a module of its own (no parameters) at the name its attention class gives in
``kernel_name``, so that code outside the models can run it differently without the models
knowing: tensor parallelism runs it on each rank's heads, and context parallelism puts in its
place a kernel that gathers the other ranks' keys and values first and masks by global
positions (titanlite/parallel/context_parallel.py), calling ``attend`` with that mask.

Document masking: a token attends only to the earlier tokens of its own document, documents
ending at the data pipeline's end-of-document token (which belongs to the document it ends).
The model finds each token's document from the tokens (``document_ids``) and hands them to its
kernels through one shared ``Documents``. Which kernel runs it: on CPU, SDPA with a boolean
[batch, 1, q, kv] mask (FlexAttention's backward refuses CPU in torch 2.13), which costs a
mask of q x kv booleans per sequence and SDPA's math path (the [q, kv] scores of every head);
on CUDA, FlexAttention with a block mask, which skips the blocks no token of a pair of
documents reads (a mask of (q / 128) x (kv / 128) blocks).
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


def document_ids(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """Each token's document in ``tokens`` [batch, seq]: the number of end-of-document tokens
    (``end_id``) before it, so an end token belongs to the document it ends."""
    ends = (tokens == end_id).long()
    return ends.cumsum(dim=1) - ends


class Documents:
    """The documents of the batch a model runs on, shared by all its attention kernels: set
    by the model's forward before its blocks run (None: plain causal attention). ``ids``
    [batch, seq] covers the whole sequence, under context parallelism too."""

    def __init__(self):
        self.ids: torch.Tensor | None = None


def attend_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    q_documents: torch.Tensor,
    kv_documents: torch.Tensor,
) -> torch.Tensor:
    """Attention where query i sees key j when ``allowed`` [q, kv] (causality by position) and
    both are in the same document (``q_documents`` [batch, q], ``kv_documents`` [batch, kv])."""
    if q.device.type == "cuda":  # cuda-only: FlexAttention trains on GPUs only
        return _flex_attend(q, k, v, scale, q_positions, kv_positions, q_documents, kv_documents)
    same_document = q_documents.unsqueeze(2) == kv_documents.unsqueeze(1)  # [batch, q, kv]
    return attend(q, k, v, mask=(allowed & same_document).unsqueeze(1), scale=scale)


def _flex_attend(q, k, v, scale, q_positions, kv_positions, q_documents, kv_documents):  # cuda-only
    """FlexAttention with a block mask of the same rule as attend_documents' boolean one."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # cuda-only

    def mask_mod(batch, head, q_index, kv_index):  # cuda-only
        causal = kv_positions[kv_index] <= q_positions[q_index]  # cuda-only
        return causal & (q_documents[batch, q_index] == kv_documents[batch, kv_index])  # cuda-only

    block_mask = create_block_mask(  # cuda-only
        mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device
    )
    grouped = k.shape[1] != q.shape[1]  # cuda-only
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=grouped)  # cuda-only


class AttentionKernel(nn.Module):
    """``attend`` as a module: causal attention of q over k and v, at ``scale`` (None: 1 / sqrt(qk)),
    within each document when ``documents`` holds the batch's (block_causal)."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale
        self.documents: Documents | None = None  # the model's, set when it is built

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ids = self.documents.ids if self.documents is not None else None
        if ids is None:
            return attend(q, k, v, scale=self.scale)
        positions = torch.arange(q.shape[2], device=q.device)
        allowed = positions.unsqueeze(0) <= positions.unsqueeze(1)
        return attend_documents(q, k, v, allowed, self.scale, positions, positions, ids, ids)
