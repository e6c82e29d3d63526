"""Context parallelism's attention on one process: every cp rank simulated in turn, its kernel
calls (SequenceSplit.attention_calls) run by models/merged_attention.py on its queries against
its own keys and all ranks' keys stacked as the all-gather returns them, against one causal
(or document-masked) SDPA over the whole sequence: the outputs and the gradients of queries,
keys and values, grouped-query attention and unequal query and value widths included. And the
work they do, counted at the dispatcher (benchmarks/context_parallel.py's AttentionWork): at
most 0.55 of the [seq / cp, seq] rectangle, the same on every rank under headtail."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from titanlite.models.attention import (
    attend_by_position,
    document_block_mask,
    document_mask_mod,
    flex_attend,
    position_block_mask,
)
from titanlite.models.merged_attention import merged_attention
from titanlite.parallel.context_parallel import SequenceSplit

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "context_parallel.py"


def _benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARK.parent))  # its rank_process helper
    spec = importlib.util.spec_from_file_location("context_parallel_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(seq_len, heads=4, kv_heads=2, qk=8, v_width=8, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, qk, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq_len, qk, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq_len, v_width, generator=generator, dtype=torch.float64)
    return [t.float().requires_grad_() for t in (q, k, v)]


def _reference(q, k, v, ids):
    seq_len = q.shape[2]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if ids is not None:
        mask = mask & (ids.unsqueeze(2) == ids.unsqueeze(1))
        mask = mask.unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)


def _cp_ranks(q, k, v, cp, headtail, ids):
    """Each rank's output rows placed at their positions, the gradients flowing back to the
    whole q, k, v as through the loader's split and the all-gather."""
    out = torch.empty(q.shape[:3] + (v.shape[-1],))
    seq_len = q.shape[2]
    splits = [SequenceSplit(cp, rank, headtail) for rank in range(cp)]
    local_len = seq_len // cp
    positions = [split.local_positions(local_len) for split in splits]
    gathered = [torch.cat([t[:, :, p] for p in positions]) for t in (k, v)]  # [cp x batch, ...]
    pieces = []
    for split, rank_positions in zip(splits, positions, strict=True):
        local = [t[:, :, rank_positions] for t in (q, k, v)]
        calls = split.attention_calls(q.shape[0], local_len, ids)
        pieces.append(merged_attention(local[0], [tuple(local[1:]), tuple(gathered)], calls, 0.3))
    return torch.cat(pieces, dim=2), torch.cat(positions), out


def _documents(seq_len, batch):
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    ids[0, 5:] += 1
    ids[0, 13:] += 1
    ids[1, 20:] += 1  # row 1: two documents, one of 20 tokens
    return ids


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("headtail", [True, False])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "block_causal"])
@pytest.mark.parametrize("widths", [(8, 8), (8, 6)], ids=["gqa", "wider_qk"])
def test_chunked_attention_equals_whole_sequence_attention(cp, headtail, documents, widths):
    seq_len = 32
    q, k, v = _inputs(seq_len, qk=widths[0], v_width=widths[1])
    ids = _documents(seq_len, q.shape[0]) if documents else None
    reference = _reference(q, k, v, ids)
    out, positions, _ = _cp_ranks(q, k, v, cp, headtail, ids)
    torch.testing.assert_close(out, reference[:, :, positions], rtol=0, atol=2e-6)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(reference[:, :, positions], (q, k, v), grad)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=4e-6)


def test_blocks_no_document_crosses_are_skipped():
    """At cp 4, one document a chunk (8 tokens): every rank runs its two diagonal calls only."""
    seq_len, cp = 64, 4
    ids = torch.arange(seq_len).div(seq_len // (2 * cp), rounding_mode="floor").unsqueeze(0)
    for rank in range(cp):
        calls = SequenceSplit(cp, rank, True).attention_calls(1, seq_len // cp, ids)
        assert [(call.q_start, call.source) for call in calls] == [(0, 0), (8, 0)]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_computes_half_the_rectangle_counted_at_the_dispatcher(cp, monkeypatch):
    work = _benchmark(monkeypatch).AttentionWork
    seq_len, heads = 64, 4
    q, k, v = _inputs(seq_len, heads=heads, batch=1)
    gathered = [t.detach() for t in (k, v)]  # one rank's keys stand for every rank's: the shapes count
    stacked = [torch.cat([t[:, :, : seq_len // cp]] * cp) for t in gathered]
    rectangle = heads * (seq_len // cp) * seq_len
    shares = {}
    for headtail in (True, False):
        for rank in range(cp):
            split = SequenceSplit(cp, rank, headtail)
            local = [t.detach()[:, :, : seq_len // cp] for t in (q, k, v)]
            calls = split.attention_calls(1, seq_len // cp, None)
            with work() as counted:
                merged_attention(local[0], [tuple(local[1:]), tuple(stacked)], calls, None)
            shares[headtail, rank] = counted.pairs / rectangle
    assert {shares[True, rank] for rank in range(cp)} == {0.5}  # every rank alike, half the rectangle
    assert shares[False, cp - 1] == (cp - 0.5) / cp  # without the balancer the last rank does the most
    with work() as counted:  # the old kernel: SDPA over the whole rectangle under a mask
        keys = torch.randn(1, heads, seq_len, 8)
        mask = torch.ones(seq_len // cp, seq_len, dtype=torch.bool)
        F.scaled_dot_product_attention(local[0], keys, keys, attn_mask=mask)
    assert counted.pairs == rectangle


BLOCK_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _tiles(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, q tiles, kv tiles] booleans: the tiles a block mask keeps, and those it keeps full."""

    def dense(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        tiles = torch.zeros(indices.shape, dtype=torch.bool)
        for index in itertools.product(*map(range, counts.shape)):
            tiles[index][indices[index][: counts[index]].long()] = True
        return tiles[:, 0]

    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return dense(block_mask.kv_num_blocks, block_mask.kv_indices) | full, full


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("chunk", [80, 128])
def test_the_cuda_block_masks_built_tile_by_tile_are_create_block_masks(cp, chunk):
    """CUDA's FlexAttention under CP: the block masks built tile by tile from positions (causal)
    and from positions and documents (block_causal) against torch's create_block_mask of the
    same mask functions, with head-tail chunks filling the 128-token tiles (128: equal) or
    straddling them (80: a tile's positions then jump at a chunk boundary, and a tile whose
    document ranges meet but whose documents do not may be kept partial, never the reverse:
    no kept pair is dropped, no tile is called full that is not)."""
    seq_len = 2 * cp * chunk
    # Row 0: documents of 50 tokens; row 1: one document, then one from two thirds on.
    positions = torch.arange(seq_len)
    ids = torch.stack([positions // 50, (positions >= 2 * seq_len // 3).long()])
    for rank in range(cp):
        split = SequenceSplit(cp, rank, True)
        q_positions, kv_positions = split.local_positions(seq_len // cp), split.gathered_positions(seq_len // cp)
        causal_mod = position_block_mask(q_positions, kv_positions).mask_mod
        pairs = (
            (
                position_block_mask(q_positions, kv_positions),
                create_block_mask(causal_mod, None, None, seq_len // cp, seq_len, device="cpu"),
            ),
            (
                document_block_mask(q_positions, kv_positions, ids[:, q_positions], ids[:, kv_positions]),
                create_block_mask(
                    document_mask_mod(q_positions, kv_positions, ids[:, q_positions], ids[:, kv_positions]),
                    2,
                    None,
                    seq_len // cp,
                    seq_len,
                    device="cpu",
                ),
            ),
        )
        for ours, torchs in pairs:
            assert ours.seq_lengths == (seq_len // cp, seq_len)
            if chunk == 128:
                for name in BLOCK_LISTS:
                    assert torch.equal(getattr(ours, name), getattr(torchs, name)), name
            else:
                (kept, full), (true_kept, true_full) = _tiles(ours), _tiles(torchs)
                assert torch.equal(kept & true_kept, true_kept.expand_as(kept)) and torch.equal(full, full & true_full)
                assert torch.equal(full, true_full.expand_as(full))
        if chunk == 128:  # 2 query tiles x 2 cp key tiles: 2 cp + 1 seen (the half), 2 cp - 1 of them full
            causal_mask = pairs[0][0]
            assert (causal_mask.kv_num_blocks.sum() + causal_mask.full_kv_num_blocks.sum()).item() == 2 * cp + 1
            assert causal_mask.full_kv_num_blocks.sum().item() == 2 * cp - 1


def test_under_fake_tensors_no_block_is_skipped_and_nothing_is_read():
    """The estimator simulates a block_causal CP rank on fake tensors, whose document ids hold no
    values: every visible block is kept (its memory counted), none read to decide."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq_len, cp = 64, 4
    ids = torch.arange(seq_len).div(seq_len // (2 * cp), rounding_mode="floor").unsqueeze(0)
    with FakeTensorMode() as mode:
        fake_ids = mode.from_tensor(ids)
        calls = SequenceSplit(cp, 0, True).attention_calls(1, seq_len // cp, fake_ids)
    causal = SequenceSplit(cp, 0, True).attention_calls(1, seq_len // cp, None)
    # chunk 0's diagonal; chunk 7's diagonal, chunk 0 (its own), chunks 1 to 6 in one call
    assert [(call.source, len(call.more)) for call in calls] == [(0, 0)] * 3 + [(1, 5)]
    assert [(call.source, len(call.more)) for call in causal] == [(0, 0)] * 3 + [(1, 5)]


def test_compiled_flex_attention_forward_under_the_position_block_mask_equals_the_sdpa_mask():
    """CUDA's CP kernel on the CPU (forward only: FlexAttention's backward refuses the CPU): CP 2
    rank 0's queries over the gathered keys in rank order, 160-token chunks (tiles skipped, full
    and partial), two sequences sharing the one-row block mask, against SDPA's dense mask."""
    cp, seq_len = 2, 640
    split = SequenceSplit(cp, 0, True)
    q_positions, kv_positions = split.local_positions(seq_len // cp), split.gathered_positions(seq_len // cp)
    q, k, v = _inputs(seq_len)
    q, k, v = q.detach()[:, :, q_positions], k.detach()[:, :, kv_positions], v.detach()[:, :, kv_positions]
    flex = flex_attend(q, k, v, position_block_mask(q_positions, kv_positions), scale=0.3)
    mask = kv_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    # The kernel's own entry (its CPU branch here; FlexAttention under this block mask on CUDA).
    torch.testing.assert_close(attend_by_position(q, k, v, 0.3, q_positions, kv_positions), sdpa, rtol=0, atol=1e-6)


def test_compiled_flex_attention_forward_under_the_document_block_mask_equals_the_sdpa_mask():
    """block_causal's CUDA CP kernel on the CPU (forward only): CP 2 rank 1's queries over the
    gathered keys, 160-token chunks, documents of 70 tokens in row 0 and one boundary in row 1,
    the block mask built tile by tile from positions and documents (no [local, seq] mask),
    against the SDPA document mask the CPU path builds."""
    cp, seq_len = 2, 640
    split = SequenceSplit(cp, 1, True)
    q_positions, kv_positions = split.local_positions(seq_len // cp), split.gathered_positions(seq_len // cp)
    positions = torch.arange(seq_len)
    ids = torch.stack([positions // 70, (positions >= 300).long()])
    q_documents, kv_documents = ids[:, q_positions], ids[:, kv_positions]
    q, k, v = _inputs(seq_len)
    q, k, v = q.detach()[:, :, q_positions], k.detach()[:, :, kv_positions], v.detach()[:, :, kv_positions]
    block_mask = document_block_mask(q_positions, kv_positions, q_documents, kv_documents)
    flex = flex_attend(q, k, v, block_mask, scale=0.3)
    sdpa = attend_by_position(q, k, v, 0.3, q_positions, kv_positions, q_documents, kv_documents)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    # Some tiles are skipped for their documents alone (causality would keep them).
    causal_kept, _ = _tiles(position_block_mask(q_positions, kv_positions))
    document_kept, _ = _tiles(block_mask)
    assert (causal_kept & ~document_kept).any()
