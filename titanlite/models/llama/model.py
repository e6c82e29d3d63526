"""The Llama 2 / Llama 3 decoder, top to bottom.

tokens -> embedding -> n_layers x [RMSNorm -> attention (RoPE, GQA) -> residual,
RMSNorm -> SwiGLU feed-forward -> residual] -> RMSNorm -> output projection -> logits

The model is built on the meta device (no memory), parallelised, moved to its device
with ``to_empty`` and only then filled by ``init_weights``. Parameter names are the
checkpoint format (see docs/model.md); do not rename them.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.attention import AttentionKernel, Documents, document_ids
from titanlite.models.init import fill_normal_, fill_trunc_normal_
from titanlite.models.llama.args import LlamaArgs


class RMSNorm(nn.Module):
    """Scales each vector to unit root-mean-square, then by a learned gain (no mean, no bias)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even when activations are bf16: the mean of squares
        # loses too much precision otherwise.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


# --- Rotary position embedding --------------------------------------------------------
# Each head vector is read as head_dim/2 consecutive pairs (x[2i], x[2i+1]); pair i at
# position p is rotated by the angle p * theta^(-2i/head_dim).


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Rotation speed of each pair, with Llama 3.1's long-context scaling when enabled."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
    scaling = args.rope_scaling
    if scaling is None:
        return freqs
    # Llama 3.1: wavelengths longer than the original context are slowed down by
    # `factor`, short ones are kept, and those in between are blended linearly.
    wavelen = 2 * math.pi / freqs
    blend = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blend = blend.clamp(0.0, 1.0)
    return (1 - blend) * freqs / scaling.factor + blend * freqs


def rope_tables(args: LlamaArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle: two [max_seq_len, head_dim/2] float32 tables."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rope_frequencies(args).to(device))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by the tables cut to its sequence length."""
    seq_len = x.shape[1]
    cos = cos[:seq_len].view(1, seq_len, 1, -1)
    sin = sin[:seq_len].view(1, seq_len, 1, -1)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


# --- Attention ----------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads: n_heads queries share kv_heads keys/values."""

    # The module that computes attention from the heads (titanlite/models/attention.py), by
    # name: context parallelism puts a kernel of its own there.
    kernel_name = "attend"

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.attend = AttentionKernel()

    @staticmethod
    def kernel_kv_features(args: LlamaArgs) -> int:
        """Numbers per token of the keys and values the kernel takes (its key/value heads)."""
        return 2 * args.kv_heads * args.head_dim

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x, each [batch, seq, heads, head_dim], before RoPE."""
        batch, seq_len, _ = x.shape
        # Heads are counted from the projections' outputs (-1), not from the args: under
        # tensor parallelism each rank holds only its share of the query and key/value heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.project_heads(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Attention wants [batch, heads, seq, head_dim].
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        for linear in (self.wq, self.wk, self.wv):
            fill_trunc_normal_(linear.weight, std=0.02, generator=generator)
        fill_trunc_normal_(self.wo.weight, std=out_std, generator=generator)


# --- Feed-forward -------------------------------------------------------------------


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        fill_trunc_normal_(self.w1.weight, std=0.02, generator=generator)
        fill_trunc_normal_(self.w2.weight, std=out_std, generator=generator)
        fill_trunc_normal_(self.w3.weight, std=out_std, generator=generator)


# --- Transformer block and the whole model -----------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(.))."""

    attention_cls = Attention  # a family whose attention differs names its own here
    # How tensor parallelism splits the attention, as data (titanlite/parallel reads it; no
    # model imports parallel code): its module -> "colwise" (split by output features, i.e.
    # by heads), "rowwise" (split by input features, the partial outputs summed) or
    # "replicate" (held whole by every TP rank, computing on the whole input) or "per_head" (a
    # norm over each head's features, on this rank's heads) or "local_heads" (a module without
    # parameters run on this rank's heads as plain tensors). A module the
    # attention lacks is skipped. attention_tp_dtensors: whether the attention's tensors stay
    # DTensors between its modules (needed where a replicated module's output meets split
    # heads, whose gradients then sum over the ranks), else plain local tensors.
    attention_tp_plan = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}
    attention_tp_dtensors = False

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = self.attention_cls(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = self.make_feed_forward(layer_id, args)
        # Deeper blocks start with smaller output projections so that the residual
        # stream's variance does not grow with depth.
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def make_feed_forward(self, layer_id: int, args: LlamaArgs) -> nn.Module:
        """The block's feed-forward; a family whose feed-forward differs (in some blocks or
        all) returns its own."""
        return FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, generator: torch.Generator) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std, generator)
        self.feed_forward.init_weights(self.out_std, generator)


class Transformer(nn.Module):
    # Pipeline parallelism splits the model into stages in this order: the modules before the
    # blocks, the blocks one by one, the modules after them. A stage's model is this class with
    # the other stages' blocks removed and their outer modules None (forward skips them).
    pipeline_first = ("tok_embeddings",)
    pipeline_last = ("norm", "output")
    block_cls = TransformerBlock  # a family whose blocks differ names its own here

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed "0", "1", ... rather than a list keeps parameter names stable
        # when blocks are wrapped or removed.
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from the args, never trained: non-persistent, so checkpoints do not
        # carry them and init_weights recomputes them on the real device.
        cos, sin = self.rope_tables(torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The global positions of the tokens this model sees, (local seq_len, device) -> int64
        # [seq_len], or None for 0 .. seq_len - 1. Context parallelism sets it: each rank then
        # holds chunks of longer sequences, and RoPE must turn each token by where it stands.
        self.token_positions = None
        # Document masking (block_causal): the end-of-document token id, set by whoever builds
        # the model for training, or None for plain causal attention. The forward finds each
        # token's document and shares them with every attention kernel through `documents`.
        # whole_sequence (context parallelism sets it): this rank's tokens -> the whole
        # sequences', whose documents the chunks' tokens alone do not tell.
        self.document_end_id: int | None = None
        self.whole_sequence = None
        self.documents = Documents()
        for block in self.layers.values():
            getattr(block.attention, block.attention.kernel_name).documents = self.documents

    def forward(self, tokens: torch.Tensor, document_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]. A pipeline stage without the
        embedding takes the previous stage's hidden state instead of tokens (and, under
        block_causal, the tokens as ``document_tokens``: their end-of-document tokens mark
        the documents), and one without the output returns its hidden state."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.document_end_id is not None:  # block_causal
            self.documents.ids = document_ids(self._document_marks(tokens, document_tokens), self.document_end_id)
        cos, sin = self.rope_cos, self.rope_sin
        if self.token_positions is not None:
            positions = self.token_positions(tokens.shape[1], cos.device)
            cos, sin = cos[positions], sin[positions]
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _document_marks(self, tokens: torch.Tensor, document_tokens: torch.Tensor | None) -> torch.Tensor:
        """The whole sequences' tokens that block_causal finds the documents in (under context
        parallelism this rank's chunks are gathered)."""
        if document_tokens is None and self.tok_embeddings is None:
            raise ValueError("block_causal: a pipeline stage after the first needs the tokens as document_tokens")
        marks = tokens if document_tokens is None else document_tokens
        return marks if self.whole_sequence is None else self.whole_sequence(marks)

    def init_buffers(self, device: torch.device) -> None:
        """The RoPE tables: derived from the args and never saved, so a model whose weights
        were loaded needs them made too. Kept in float32 whatever the weights' dtype."""
        self.rope_cos, self.rope_sin = self.rope_tables(device)

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables the blocks' attention turns by; a family whose RoPE differs
        (its width, its scaling) makes its own."""
        return rope_tables(self.args, device=device)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and buffer. The values depend only on `seed` and the
        device type, not on how the parameters are sharded or which pipeline stage holds
        them: each tensor is drawn whole, and every rank keeps its own part of it; the
        embedding, each block and the output draw from generators of their own, so a stage
        holding some of them draws exactly what the whole model would."""
        device = buffer_device or next(self.parameters()).device
        self.init_buffers(device)
        if self.tok_embeddings is not None:
            fill_normal_(self.tok_embeddings.weight, std=1.0, generator=part_generator(seed, 0, device))
        for name, block in self.layers.items():
            block.init_weights(part_generator(seed, 1 + int(name), device))
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None:
            generator = part_generator(seed, 1 + self.args.n_layers, device)
            fill_trunc_normal_(self.output.weight, std=self.args.dim**-0.5, generator=generator, cutoff=3.0)


def part_generator(seed: int, part: int, device: torch.device) -> torch.Generator:
    """The generator of the model's ``part``-th piece (0 the embedding, then the blocks, then
    the output): seeded from the run's seed and the piece's place alone."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + part)
