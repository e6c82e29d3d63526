"""The attention kernel every family's attention calls: softmax(q k^T x scale) v, causal, and
with document masking (block_causal) stopping at document boundaries too.

It is a module of its own (no parameters) at the name its attention class gives in
``kernel_name``, so that code outside the models can run it differently without the models
knowing: tensor parallelism runs it on each rank's heads, and context parallelism puts in its
place a kernel that gathers the other ranks' keys and values first and attends by global
positions (titanlite/parallel/context_parallel.py): on the CPU in chunk-by-chunk flash calls
(models/merged_attention.py), on CUDA with FlexAttention and ``position_block_mask``.

Document masking: a token attends only to the earlier tokens of its own document, documents
ending at the data pipeline's end-of-document token (which belongs to the document it ends).
The model finds each token's document from the tokens (``document_ids``) and hands them to its
kernels through one shared ``Documents``. Which kernel runs it: on CPU, SDPA with a boolean
[batch, 1, q, kv] mask (FlexAttention's backward refuses CPU in torch 2.13), which costs a
mask of q x kv booleans per sequence and SDPA's math path (the [q, kv] scores of every head);
on CUDA, FlexAttention with a block mask, which skips the blocks no token of a pair of
documents reads (a mask of (q / 128) x (kv / 128) blocks, built from each block's positions
and documents: no q x kv mask is made). Its mask function and block mask
(``document_mask_mod``, ``document_block_mask``) are plain functions: tests/test_flex_attention.py
runs the CUDA path's forward, compiled, on the CPU against the SDPA mask, and
benchmarks/gpu_check.py trains with it on a GPU against the SDPA mask.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Whether document masking runs FlexAttention on CUDA (True) or the CPU's SDPA mask (False: the
# reference benchmarks/gpu_check.py's block_causal rows train against). Set it before a model
# first runs: a compiled block keeps the kernel it traced.
FLEX_ON_CUDA = True
FLEX_BLOCK = 128  # the block mask's tiles are FLEX_BLOCK x FLEX_BLOCK (torch's default)


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


def attend_by_position(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    q_documents: torch.Tensor | None = None,
    kv_documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention by position, queries and keys in any order (context parallelism's
    gathered keys): query i sees key j when key j (at ``kv_positions`` [kv]) is at or before
    query i (at ``q_positions`` [q]), and, given documents (``q_documents`` [batch, q],
    ``kv_documents`` [batch, kv]), both are in the same one. On CUDA FlexAttention skips the tiles
    no query sees, and no [q, kv] mask is made (position_block_mask, document_block_mask)."""
    if q.device.type == "cuda" and FLEX_ON_CUDA:
        if q_documents is None:  # cuda-only
            return flex_attend(q, k, v, position_block_mask(q_positions, kv_positions), scale)  # cuda-only
        block_mask = document_block_mask(q_positions, kv_positions, q_documents, kv_documents)  # cuda-only
        return flex_attend(q, k, v, block_mask, scale)  # cuda-only
    seen = causal_by_position(q_positions, kv_positions)
    if q_documents is not None:
        seen = document_mask(seen, q_documents, kv_documents).unsqueeze(1)
    return attend(q, k, v, mask=seen, scale=scale)


def causal_by_position(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
    """[q, kv] booleans: the key at or before the query, by their positions."""
    return kv_positions.unsqueeze(0) <= q_positions.unsqueeze(1)


def document_mask(allowed: torch.Tensor, q_documents: torch.Tensor, kv_documents: torch.Tensor) -> torch.Tensor:
    """[batch, q, kv] booleans: ``allowed`` [q, kv] where query and key share a document."""
    return allowed & (q_documents.unsqueeze(2) == kv_documents.unsqueeze(1))


def document_mask_mod(q_positions, kv_positions, q_documents, kv_documents):
    """FlexAttention's mask function of document_mask's rule, for one (batch row, head, query
    index, key index): the key at or before the query, in the same document."""

    def same_document_at_or_before(batch, head, q_index, kv_index):
        causal = kv_positions[kv_index] <= q_positions[q_index]
        return causal & (q_documents[batch, q_index] == kv_documents[batch, kv_index])

    return same_document_at_or_before


def document_block_mask(q_positions, kv_positions, q_documents, kv_documents) -> BlockMask:
    """FlexAttention's block mask of document masking (document_mask's rule), built from each
    FLEX_BLOCK x FLEX_BLOCK tile's least and greatest position and document rather than a
    [batch, q, kv] mask (at 131,072 tokens a rank's would be gigabytes): a tile is skipped when
    causality skips it (position_block_mask) or its query and key tiles' document ranges do not
    meet; full when causality fills it and all its queries and keys are in one document;
    partial otherwise (document_mask_mod decides). Where a tile's positions are consecutive (no
    context-parallel chunk boundary inside it) its documents are consecutive too, and the
    classification is exact: the tests hold it equal to create_block_mask's. Otherwise a tile
    whose ranges meet but whose documents do not is kept partial: the mask function masks it
    whole. Built with plain tensor ops rather than create_block_mask, whose vmap of the mask
    function runs under a torch-function mode that torch 2.13's compiler refuses inside an
    activation-checkpointed block ("Mutating a variable from outside the scope of this HOP")."""
    seen, full = _causal_tiles(q_positions, kv_positions)
    q_first, q_last, _ = _tile_spans(q_documents)  # [batch, q tiles]
    kv_first, kv_last, _ = _tile_spans(kv_documents)  # [batch, kv tiles]
    ranges_meet = (kv_first.unsqueeze(1) <= q_last.unsqueeze(2)) & (q_first.unsqueeze(2) <= kv_last.unsqueeze(1))
    one_document = (q_first == q_last).unsqueeze(2) & (kv_first == kv_last).unsqueeze(1)
    one_document &= q_first.unsqueeze(2) == kv_first.unsqueeze(1)
    seen, full = seen & ranges_meet, full & one_document
    return BlockMask.from_kv_blocks(
        *_tile_lists(seen & ~full),
        *_tile_lists(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=document_mask_mod(q_positions, kv_positions, q_documents, kv_documents),
        seq_lengths=(len(q_positions), len(kv_positions)),
    )


def position_block_mask(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of causality by position (the key at ``kv_positions`` at or
    before the query at ``q_positions``, both [len], in any order), built tile by tile
    (_causal_tiles) rather than from a [q, kv] mask."""
    seen, full = _causal_tiles(q_positions, kv_positions)
    return BlockMask.from_kv_blocks(
        *_tile_lists((seen & ~full).unsqueeze(0)),
        *_tile_lists(full.unsqueeze(0)),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=lambda batch, head, q_index, kv_index: kv_positions[kv_index] <= q_positions[q_index],
        seq_lengths=(len(q_positions), len(kv_positions)),
    )


def _causal_tiles(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[q tiles, kv tiles] booleans from each tile's least and greatest position: whether causality
    keeps any pair of the tile (its first key at or before its last query), and whether it keeps
    every pair (its last key at or before its first query, neither side padding)."""
    q_first, q_last, q_whole = _tile_spans(q_positions)
    kv_first, kv_last, kv_whole = _tile_spans(kv_positions)
    seen = kv_first.unsqueeze(0) <= q_last.unsqueeze(1)
    full = (kv_last.unsqueeze(0) <= q_first.unsqueeze(1)) & q_whole.unsqueeze(1) & kv_whole.unsqueeze(0)
    return seen, full


def _tile_spans(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each FLEX_BLOCK tile's least and greatest value along the last dimension of ``values``
    (integers: positions or document ids), and whether the tile holds no padding [tiles]."""
    padding = -values.shape[-1] % FLEX_BLOCK
    # The last tile is padded with copies of its last value, which leave its least and greatest
    # alone (F.pad's float fill value cannot hold int64's extremes: they would wrap).
    last_value = values[..., -1:].expand(*values.shape[:-1], padding)
    tiles = torch.cat([values, last_value], dim=-1).unflatten(-1, (-1, FLEX_BLOCK))
    whole = torch.ones(tiles.shape[-2], dtype=torch.bool, device=values.device)
    whole[-1] = padding == 0
    return tiles.amin(-1), tiles.amax(-1), whole


def _tile_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, q tiles, kv tiles] booleans as FlexAttention lists them, one head for all: how
    many kv tiles each q tile row holds [batch, 1, q tiles], and their indices first, in order
    [batch, 1, q tiles, kv tiles]."""
    tiles = tiles.unsqueeze(1).to(torch.int32)
    # Sorted as torch 2.13 sorts its own block masks' lists (flex_attention._dense_to_ordered):
    # by aten's kernel, which the compiler is told to call rather than generate a Triton sort
    # (whose compile takes minutes at some sizes, pytorch#182060).
    with torch.fx.traceback.annotate({"fallback_to_eager": True}):
        order = tiles.argsort(dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32)


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float | None
) -> torch.Tensor:
    """FlexAttention of q over k and v (as ``attend`` takes them) under ``block_mask``, compiled:
    inside a compiled model the model's compile takes the call in; outside one it runs torch's
    compiled flex_attention, since uncompiled it is a dense reference that holds the [q, kv]
    scores of every head."""
    kernel = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)  # made on first use: torch.compile itself takes 2 s


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
        return attend_by_position(q, k, v, self.scale, positions, positions, ids, ids)
