"""FlexAttention, block_causal's kernel on CUDA, checked on the CPU: torch 2.13 refuses its
backward here ("FlexAttention does not support backward on CPU", eager and compiled), so the
forward runs, compiled, with the very mask function and block mask the CUDA path builds,
against the SDPA mask the CPU trains with; and per-op activation checkpointing keeps its
output. benchmarks/gpu_check.py trains with it on a GPU."""

from functools import partial

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tests.helpers import TINY
from titanlite.models.attention import (
    attend_by_position,
    document_block_mask,
    document_mask_mod,
    flex_attend,
)
from titanlite.parallel.parallelize import _save_matmuls_and_attention

# Two rows of 320 tokens: three 128-token tiles, the last one short. Row 0 holds five
# documents, one ending at the last token of the first tile (so the tile below the diagonal
# is skipped); row 1 two, the first spanning the first two tiles (a full tile).
SEQ = 320
ENDS = ([5, 6, 127, 200], [300])


def documents() -> torch.Tensor:
    ids = torch.zeros(len(ENDS), SEQ, dtype=torch.long)
    for row, ends in enumerate(ENDS):
        for end in ends:
            ids[row, end + 1 :] += 1
    return ids


def tiny_heads(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the tiny model's attention hands them over: 4 query heads sharing 2 key/value
    heads (GQA), head dim 16, float32."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(len(ENDS), TINY.n_heads, SEQ, TINY.head_dim, generator=generator)
    k, v = (torch.randn(len(ENDS), TINY.kv_heads, SEQ, TINY.head_dim, generator=generator) for _ in range(2))
    return q, k, v


def test_the_block_mask_is_create_block_masks_with_every_kind_of_tile():
    positions, ids = torch.arange(SEQ), documents()
    ours = document_block_mask(positions, positions, ids, ids)
    mask_mod = document_mask_mod(positions, positions, ids, ids)
    torchs = create_block_mask(mask_mod, len(ENDS), None, SEQ, SEQ, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices"):
        assert torch.equal(getattr(ours, name), getattr(torchs, name)), name
    assert ours.seq_lengths == (SEQ, SEQ)
    # Row 0's tile below the diagonal is skipped, row 1's full: the test covers each kind.
    dense = ours.to_dense()[:, 0]
    assert dense[0, 1, 0] == 0 and ours.full_kv_num_blocks[1, 0, 1] == 1, dense


def test_compiled_flex_attention_forward_equals_the_sdpa_mask():
    # The shapes and scale of benchmarks/gpu_check.py's dry-run row: one compiled kernel for both.
    q, k, v = tiny_heads()
    positions, ids = torch.arange(SEQ), documents()
    block_mask = document_block_mask(positions, positions, ids, ids)
    flex = flex_attend(q, k, v, block_mask, scale=None)
    sdpa = attend_by_position(q, k, v, None, positions, positions, ids, ids)  # the CPU's SDPA mask
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    # The test can fail: with the documents ignored the outputs differ.
    whole = torch.zeros_like(ids)
    plain = flex_attend(q, k, v, document_block_mask(positions, positions, whole, whole), None)
    assert (plain - sdpa).abs().max() > 1e-2


def test_per_op_checkpointing_keeps_flex_attentions_output_in_a_compiled_block():
    """The policy meets FlexAttention as the compiler traces a checkpointed block (here with
    the aot_eager backend: the CPU's inductor template cannot fuse what follows it), block
    mask built inside as attention.py builds it, and saves its output."""
    q, k, v = tiny_heads()
    positions, ids = torch.arange(SEQ), documents()
    decisions = []

    def recorded(ctx, op, *args, **kwargs):
        decisions.append((op, _save_matmuls_and_attention(ctx, op, *args, **kwargs)))
        return decisions[-1][1]

    def block(weight, ids):
        block_mask = document_block_mask(positions, positions, ids, ids)
        return flex_attend(q, k, v, block_mask, None) * weight

    def checkpointed(weight, ids):
        context = partial(create_selective_checkpoint_contexts, recorded)
        return checkpoint(block, weight, ids, use_reentrant=False, context_fn=context)

    weight = torch.ones(1, requires_grad=True)  # so that the compiler traces the backward too
    torch.compile(checkpointed, fullgraph=True, backend="aot_eager")(weight, ids)
    flex = [decision for op, decision in decisions if op is torch.ops.higher_order.flex_attention]
    assert flex and set(flex) == {CheckpointPolicy.MUST_SAVE}, decisions
