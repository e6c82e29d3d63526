"""Context parallelism: every sequence split over the ``cp`` ranks of a group.

The cp ranks of a group read the same sequences; each keeps some chunks of every sequence
(its columns, ``sequence_positions``) and runs the whole model on them. Everything but
attention works token by token, so only attention must see the rest of the sequence: in
every layer each rank all-gathers the keys and values of the whole sequence over the cp
group (its key/value heads only, never copied to the query heads) and attends its own queries
over the keys each one sees by global position, computing nothing the causal mask drops
(ContextParallelKernel). The all-gather is autograd's (torch.distributed._functional_collectives),
whose backward reduce-scatters the keys' and values' gradients back to the ranks that computed them.

Causal attention makes late queries costlier than early ones; the headtail load balancer
cuts a sequence into 2 x cp chunks and gives rank r chunks r and 2 cp - 1 - r, so every rank
holds the same amount of attention work, half its [seq / cp, seq] rectangle. Without it
(none) rank r holds chunk r of cp.

The model learns of this through its seams only (no model imports this file): its
``token_positions`` (the global positions RoPE turns tokens by) and each attention's kernel
module (models/attention.py), which ContextParallelKernel replaces.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from titanlite.models.attention import (
    Documents,
    attend_by_position,
    document_mask,
)
from titanlite.models.merged_attention import Call, merged_attention
from titanlite.models.moe import moe_layers
from titanlite.parallel.moe_tensor_parallel import split_tokens_over


def sequence_positions(seq_len: int, cp: int, cp_rank: int, headtail: bool) -> torch.Tensor:
    """The positions (int64, ascending) of a ``seq_len``-token sequence that cp rank ``cp_rank``
    keeps: chunks r and 2 cp - 1 - r of 2 cp under headtail, else chunk r of cp."""
    chunks = 2 * cp if headtail else cp
    if seq_len % chunks != 0:
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into {chunks} equal chunks")
    size = seq_len // chunks
    return torch.cat([torch.arange(chunk * size, (chunk + 1) * size) for chunk in kept_chunks(cp, cp_rank, headtail)])


def kept_chunks(cp: int, cp_rank: int, headtail: bool) -> tuple[int, ...]:
    """The chunks (of 2 cp under headtail, else of cp) cp rank ``cp_rank`` keeps, in order."""
    return (cp_rank, 2 * cp - 1 - cp_rank) if headtail else (cp_rank,)


class SequenceSplit:
    """How this rank's part of every sequence is chosen: its cp degree, rank and load balancer.
    ``columns`` picks a batch's columns; ``local_positions`` and ``gathered_positions`` give the
    global positions of this rank's tokens and of the all-gathered keys, from the local length."""

    def __init__(self, cp: int, cp_rank: int, headtail: bool):
        self.cp, self.cp_rank, self.headtail = cp, cp_rank, headtail
        # The last micro-batch's attention calls and what they were made for: every layer's
        # kernel asks for the same ones (its documents' masks included).
        self._calls: tuple[tuple[int, int], torch.Tensor | None, list[Call]] | None = None

    def columns(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``batch`` [rows, seq_len]: its chunks of every row, in position order."""
        positions = sequence_positions(batch.shape[1], self.cp, self.cp_rank, self.headtail)
        return batch[:, positions.to(batch.device)].contiguous()

    def local_positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        return sequence_positions(local_len * self.cp, self.cp, self.cp_rank, self.headtail).to(device)

    def gathered_positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of the all-gathered keys: every cp rank's in rank order."""
        seq_len = local_len * self.cp
        ranks = [sequence_positions(seq_len, self.cp, rank, self.headtail) for rank in range(self.cp)]
        return torch.cat(ranks).to(device)

    def attention_calls(self, batch: int, local_len: int, ids: torch.Tensor | None) -> list[Call]:
        """The kernel calls of this rank's causal attention (models/merged_attention.py): each of
        its query chunks against its own chunk causally, then against every earlier chunk whole
        (source 0: this rank's keys [batch, heads, local_len, features], a call per chunk;
        source 1: the gathered ones, [cp x batch, ...] rank-major, one call over the earlier
        chunks other ranks hold), the later chunks skipped. With documents (``ids`` [batch,
        seq_len]) each call is masked to query and key sharing a document, and a chunk that no
        document crosses is left out. The calls on this rank's own keys come first, so that the
        all-gather has their time to arrive. Made once per micro-batch, for all the layers (the
        key holds ``ids`` itself, so its id cannot be another batch's)."""
        held = self._calls
        if held is None or held[0] != (batch, local_len) or held[1] is not ids:
            held = self._calls = ((batch, local_len), ids, self._make_calls(batch, local_len, ids))
        return held[2]

    def _make_calls(self, batch: int, local_len: int, ids: torch.Tensor | None) -> list[Call]:
        kept = kept_chunks(self.cp, self.cp_rank, self.headtail)
        size = local_len // len(kept)
        owners = {
            chunk: (rank, piece)
            for rank in range(self.cp)
            for piece, chunk in enumerate(kept_chunks(self.cp, rank, self.headtail))
        }
        calls = []
        for q_piece, q_chunk in enumerate(kept):
            rows = (q_piece * size, (q_piece + 1) * size)
            remote, masks = [], []  # the other ranks' visible chunks: one call over all of them
            for kv_chunk in range(q_chunk, -1, -1):  # the diagonal first: it gives every query a key
                rank, piece = owners[kv_chunk]
                keys = slice(piece * size, (piece + 1) * size)
                diagonal = kv_chunk == q_chunk
                mask = None if ids is None else _document_block(ids, q_chunk, kv_chunk, size, diagonal)
                if mask is not None and not is_fake(mask) and not mask.any():  # fake: no ids to read
                    continue
                if rank == self.cp_rank:
                    index = (slice(None), slice(None), keys)
                    calls.append(Call(*rows, 0, index, diagonal and mask is None, mask))
                else:
                    remote.append((slice(rank * batch, (rank + 1) * batch), slice(None), keys))
                    masks.append(mask)
            if remote:
                mask = None if ids is None else torch.cat(masks, dim=-1)
                calls.append(Call(*rows, 1, remote[0], False, mask, tuple(remote[1:])))
        return sorted(calls, key=lambda call: call.source)  # stable: each range's diagonal stays first

    def whole_sequence(self, tokens: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
        """The whole sequences of which ``tokens`` [batch, local_len] are this rank's chunks,
        gathered over ``cp_mesh`` (plain ids, no gradient), in position order."""
        local = tokens.t().contiguous()  # all_gather_into_tensor stacks along dimension 0
        gathered = local.new_empty(local.shape[0] * self.cp, local.shape[1])
        dist.all_gather_into_tensor(gathered, local, group=cp_mesh.get_group())
        whole = torch.empty_like(gathered)
        whole[self.gathered_positions(tokens.shape[1], tokens.device)] = gathered
        return whole.t()


class ContextParallelKernel(nn.Module):
    """The attention kernel under context parallelism: this rank's queries over the keys and
    values of the whole sequence, all-gathered over the cp group, causal by global position (a
    key is seen by the queries at or after it), within each document too when ``documents``
    holds the batch's (their ids cover whole sequences).

    On the CPU it computes only what the mask keeps (``SequenceSplit.attention_calls``): each of
    its query chunks against its own chunk causally and the earlier chunks unmasked, in flash
    kernel calls merged exactly (models/merged_attention.py), skipping the blocks no document
    crosses. The all-gather is left in flight while the calls on this rank's own keys run. On
    CUDA it runs FlexAttention over the gathered keys with a block mask that skips the tiles
    no query sees (position_block_mask; document_block_mask under documents); elsewhere, or
    with attention.FLEX_ON_CUDA off, SDPA over the whole [local, seq] rectangle under a mask."""

    def __init__(self, scale: float | None, cp_mesh: DeviceMesh, split: SequenceSplit, documents: Documents | None):
        super().__init__()
        self.scale = scale
        self.cp_mesh = cp_mesh
        self.split = split
        self.documents = documents

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ids = self.documents.ids if self.documents is not None else None
        group = self.cp_mesh.get_group()
        if q.device.type != "cpu":
            return self._masked_rectangle(q, k, v, ids, group)
        # [batch, kv heads, local, features] gathered along dimension 0 (rank-major [cp x batch,
        # ...]): the functional collective then returns before it completes, and is waited on
        # by the first call that reads another rank's keys.
        k_all = all_gather_single_autograd(k.contiguous(), gather_dim=0, group=group)
        v_all = all_gather_single_autograd(v.contiguous(), gather_dim=0, group=group)
        calls = self.split.attention_calls(q.shape[0], q.shape[2], ids)
        return merged_attention(q, [(k, v), (k_all, v_all)], calls, self.scale)

    def _masked_rectangle(self, q, k, v, ids, group) -> torch.Tensor:
        k = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=group)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=group)
        local_len = q.shape[2]
        q_positions = self.split.local_positions(local_len, q.device)
        kv_positions = self.split.gathered_positions(local_len, q.device)
        documents = () if ids is None else (ids[:, q_positions], ids[:, kv_positions])
        return attend_by_position(q, k, v, self.scale, q_positions, kv_positions, *documents)


def _document_block(ids: torch.Tensor, q_chunk: int, kv_chunk: int, size: int, diagonal: bool) -> torch.Tensor:
    """[batch, 1, size, size] booleans: document_mask of query chunk ``q_chunk`` against key
    chunk ``kv_chunk`` (chunks of ``size`` consecutive positions of ``ids``' rows), causal on the
    diagonal, whole below it."""
    allowed = torch.ones(size, size, dtype=torch.bool, device=ids.device)
    q_ids, kv_ids = (ids[:, chunk * size : (chunk + 1) * size] for chunk in (q_chunk, kv_chunk))
    return document_mask(allowed.tril() if diagonal else allowed, q_ids, kv_ids).unsqueeze(1)


def sequence_split(parallel_dims, mesh: DeviceMesh | None, load_balancer: str) -> SequenceSplit | None:
    """This rank's SequenceSplit in ``mesh`` (parallelism.context_parallel_load_balancer:
    ``load_balancer``), or None without context parallelism."""
    cp_mesh = parallel_dims.cp_mesh(mesh)
    if cp_mesh is None:
        return None
    return SequenceSplit(cp_mesh.size(), cp_mesh.get_local_rank(), load_balancer == "headtail")


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, split: SequenceSplit) -> None:
    """Make ``model`` (a whole decoder or one pipeline stage of it) run on this rank's chunks
    of each sequence, as ``split`` chooses them (the data loader applies the same split to every
    batch): RoPE at global positions, and every attention's kernel replaced by
    ContextParallelKernel over ``cp_mesh``. Each MoE layer routes this rank's tokens only: its
    balancing losses' terms (per-sequence ones too) are summed over cp, as over tp."""
    model.token_positions = split.local_positions
    model.whole_sequence = partial(split.whole_sequence, cp_mesh=cp_mesh)
    for block in model.layers.values():
        attention = block.attention
        kernel = getattr(attention, attention.kernel_name)
        replacement = ContextParallelKernel(kernel.scale, cp_mesh, split, kernel.documents)
        setattr(attention, attention.kernel_name, replacement)
    for moe in moe_layers(model):
        split_tokens_over(moe, cp_mesh)


def kv_gather_line(model_args, attention_cls, local_batch_size: int, seq_len: int, tp: int, cp: int, dtype_bytes: int):
    """The start-up line on the keys and values each attention layer all-gathers under
    context parallelism: the whole sequence's (held while the layer runs) and what arrives
    from the other cp ranks, per micro-batch, from the kernel's width (its TP rank's heads)."""
    whole = local_batch_size * seq_len * attention_cls.kernel_kv_features(model_args) // tp * dtype_bytes
    received = whole * (cp - 1) // cp
    return (
        f"context parallel over {cp} ranks: each attention layer all-gathers keys and values of "
        f"{whole / 2**20:,.1f} MiB per micro-batch ({received / 2**20:,.1f} MiB from the other ranks, "
        "the same again reduce-scattered in backward)"
    )
