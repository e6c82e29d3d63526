"""Attention computed as several kernel calls over pieces of the keys and values, merged exactly.

A query block that sees only some of a long key sequence (context parallelism's chunks: the
strictly earlier chunks whole, its own chunk causally, the later ones not at all) need not be
given the whole [q, kv] rectangle under a mask, whose masked scores SDPA computes anyway. Each
``Call`` runs the CPU flash kernel on one query range against one block of keys and values,
unmasked, causal or under a small boolean mask, and returns the block's output and the
log-sum-exp of its scores; the blocks of one query range are merged by

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) out_i

which is softmax over the union of the blocks. The backward runs the flash backward of each call
with the merged output and log-sum-exp (the softmax's rows and its correction term
rowsum(d_out * out) are the whole row's), which gives each block's exact share of the gradients.

The keys and values of a call come from one of several ``sources`` by a basic index, so a call can
read a block of a tensor that is still arriving (an async collective's result): the calls run in
order, and a source is touched only by the first call that reads it. Grouped-query attention runs
as it is (the kernel shares a key/value head among its query heads without copying it); the CPU
flash kernel wants one width for queries, keys and values, so a narrower one is zero-padded.

CPU only (torch's CPU flash operators).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class Call:
    """One kernel call: queries ``q_start:q_end`` (along the sequence) against the keys and values
    ``keys[index]``, ``values[index]`` of source pair ``source`` (a basic index: ints and slices,
    [batch, kv_heads, kv_len, features] after it), followed along the sequence by those at each
    of ``more`` (one call over several blocks: a copy of them, fewer calls and merges).
    ``causal``: query i sees key j <= i (the diagonal block, q and kv of one length); ``mask``: a
    boolean [batch, 1, q, kv] (True: may attend) instead. The first call of each query range
    must give every query a key."""

    q_start: int
    q_end: int
    source: int
    index: tuple
    causal: bool = False
    mask: torch.Tensor | None = None
    more: tuple = ()


def merged_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], calls: list[Call], scale):
    """softmax(q k^T x scale) v of q [batch, heads, q_len, qk] over the keys each query range's
    ``calls`` read from ``sources`` (pairs of keys and values), as one attention over their union.
    ``scale``: None for 1 / sqrt(qk). Every query position must be in some call's range."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    flat = [tensor for pair in sources for tensor in pair]
    return _MergedAttention.apply(tuple(calls), scale, q, *flat)


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, calls, scale, q, *flat):
        width = max(q.shape[-1], flat[1].shape[-1])
        merged: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for call in calls:
            k, v = _keys_values(flat, call)
            out, lse = _FORWARD(
                *_widened(_rows(q, call), k, v, width=width), 0.0, call.causal, **_options(call, scale, q.dtype)
            )
            if call.mask is not None:  # a row that sees none of this block: SDPA gives it lse 0
                lse = lse.masked_fill(~call.mask.any(-1), float("-inf"))
            span = (call.q_start, call.q_end)
            merged[span] = (out.float(), lse) if span not in merged else _merge(*merged[span], out, lse)
        spans = sorted(merged)
        out = torch.cat([merged[span][0] for span in spans], dim=2).to(q.dtype)
        lse = torch.cat([merged[span][1] for span in spans], dim=2)
        ctx.calls, ctx.scale, ctx.width, ctx.v_width = calls, scale, width, flat[1].shape[-1]
        ctx.save_for_backward(q, out, lse, *(_arrived(tensor) for tensor in flat))
        return out if ctx.v_width == width else out[..., : ctx.v_width].clone()

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *flat = ctx.saved_tensors
        width = ctx.width
        grad_out = _widen(grad_out, width)
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, *flat)]
        for call in ctx.calls:
            k, v = _keys_values(flat, call)
            rows = slice(call.q_start, call.q_end)
            dq, dk, dv = _BACKWARD(
                grad_out[:, :, rows],
                *_widened(_rows(q, call), k, v, width=width),
                out[:, :, rows],
                lse[:, :, rows],
                0.0,
                call.causal,
                **_options(call, ctx.scale, q.dtype),
            )
            grads[0][:, :, rows] += dq[..., : q.shape[-1]]
            start = 0
            for index in (call.index, *call.more):
                length = flat[2 * call.source][index].shape[2]
                grads[1 + 2 * call.source][index] += dk[:, :, start : start + length, : k.shape[-1]]
                grads[2 + 2 * call.source][index] += dv[:, :, start : start + length, : v.shape[-1]]
                start += length
        return None, None, *(grad.to(t.dtype) for grad, t in zip(grads, (q, *flat), strict=True))


def _keys_values(flat: list[torch.Tensor], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a call reads: its source's blocks at ``index`` and ``more``, in order."""
    keys, values = flat[2 * call.source], flat[2 * call.source + 1]
    if not call.more:
        return keys[call.index], values[call.index]
    indices = (call.index, *call.more)
    return torch.cat([keys[index] for index in indices], dim=2), torch.cat([values[index] for index in indices], dim=2)


def _arrived(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, an async collective's result waited on (not the wrapper that waits)."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def _rows(q: torch.Tensor, call: Call) -> torch.Tensor:
    return q[:, :, call.q_start : call.q_end]


def _widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` zero-padded to ``width`` features: a zero feature adds nothing to a score, and a
    zero value column is an output column to drop."""
    return tensor if tensor.shape[-1] == width else F.pad(tensor, (0, width - tensor.shape[-1]))


def _widened(*tensors: torch.Tensor, width: int) -> list[torch.Tensor]:
    return [_widen(tensor, width) for tensor in tensors]


def _options(call: Call, scale: float, dtype: torch.dtype) -> dict:
    """The kernel's keywords: the scale, and the call's mask as the additive one it takes."""
    if call.mask is None:
        return {"scale": scale}
    additive = torch.zeros(call.mask.shape, dtype=dtype, device=call.mask.device)
    return {"scale": scale, "attn_mask": additive.masked_fill(~call.mask, float("-inf"))}


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Softmax over two blocks' union from each one's output and log-sum-exp (``out`` float32,
    ``lse`` finite: the query range's first call gave every query a key)."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * (lse - merged).exp().unsqueeze(-1) + block_out.float() * (block_lse - merged).exp().unsqueeze(-1)
    return out, merged
