"""Llama hyper-parameters and the published sizes ("flavors")."""

from dataclasses import asdict, dataclass, replace

from titanlite.models.args import ModelArgs, RopeStretch


@dataclass(frozen=True, kw_only=True)
class RopeScaling(RopeStretch):
    """Llama 3.1's long-context RoPE frequency scaling (transformers' rope_type "llama3"); the
    wavelengths between the two bounds below blend the slowed and the kept speed."""

    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position_embeddings / this are slowed down by factor."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position_embeddings / this keep their speed."""


# Llama 3.1's own (its config.json): 8 x the 8,192 tokens it was pre-trained on.
LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0, original_max_position_embeddings=8192)


@dataclass(frozen=True)
class LlamaArgs(ModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many key/value heads as query heads (no GQA)
    vocab_size: int = 32000
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096  # length of the precomputed RoPE tables

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # SwiGLU has three matrices instead of two, so the 4*dim hidden size is scaled
        # by 2/3 to keep the parameter count of a classic MLP, then rounded up.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def new_rope_scaling(self, factor: float, original_seq_len: int) -> RopeScaling:
        """Llama 3.1's scaling, with its low and high frequency factors."""
        return RopeScaling(factor=factor, original_max_position_embeddings=original_seq_len)

    def architecture(self) -> dict:
        """The hyper-parameters that decide what the model computes, for telling whether two
        args describe the same model. max_seq_len is left out (it only sizes the RoPE tables,
        so weights carry over to any length), and so is how the FFN size and the key/value
        head count are spelled (multiple_of, ffn_dim_multiplier, None heads): their values
        are kept instead, as a Hugging Face import spells them differently."""
        spelled = ("max_seq_len", "multiple_of", "ffn_dim_multiplier", "n_kv_heads")
        kept = {name: value for name, value in asdict(self).items() if name not in spelled}
        return {**kept, "ffn_hidden_dim": self.ffn_hidden_dim, "kv_heads": self.kv_heads}

    @classmethod
    def model_cls(cls) -> type:
        from titanlite.models.llama.model import Transformer

        return Transformer


# A model small enough to train on one CPU core in about a second per step.
# Its vocabulary is the built-in byte tokenizer's (256 bytes + BOS + EOS).
_DEBUG = LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=258, multiple_of=64)

LLAMA2_FLAVORS = {
    "debugmodel": _DEBUG,
    "7B": LlamaArgs(dim=4096, n_layers=32, n_heads=32),
    "13B": LlamaArgs(dim=5120, n_layers=40, n_heads=40),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
}

# What the published Llama 3 sizes share: the 128K vocabulary, RoPE base 500000 and 8 key/value
# heads; the two large ones round the FFN size to a multiple of 4096.
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, n_kv_heads=8, multiple_of=1024)
_LLAMA3_LARGE = {**_LLAMA3, "multiple_of": 4096}

LLAMA3_FLAVORS = {
    # torchtitan's llama3 debugmodel embeds 2048 ids so that its test tokenizer (2,000 ids)
    # fits; the same here, so its debug config and assets carry over. The byte tokenizer
    # uses the first 258 rows.
    "debugmodel": replace(_DEBUG, n_kv_heads=4, rope_theta=500000.0, vocab_size=2048),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, **_LLAMA3),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, **_LLAMA3_LARGE),
    "405B": LlamaArgs(
        dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, rope_scaling=LLAMA31_ROPE_SCALING, **_LLAMA3_LARGE
    ),
    # The test suite's model, small enough for dozens of runs on a shared CPU: 3 blocks (so
    # "every 2nd block" activation checkpointing and the last-block reshard rule both show),
    # grouped-query attention, and the byte tokenizer's 258 ids, which do not split evenly
    # over 4 ranks. A real flavor so that every process, spawned ranks and
    # `python -m titanlite.train` included, knows it without registering it first.
    "tiny": LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32, rope_theta=10000.0),
}
