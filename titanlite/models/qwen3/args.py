"""Qwen3 (dense) hyper-parameters and the published sizes ("flavors")."""

from dataclasses import asdict, dataclass, replace

from titanlite.models.args import DecoderArgs, MoERoutingArgs
from titanlite.models.moe import MODEL_BALANCING_FIELDS, MoEArgs, moe_args_of


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs, MoERoutingArgs):
    n_kv_heads: int = 8
    """Key/value heads per block; each is shared by n_heads / n_kv_heads query heads."""
    head_dim: int = 128
    """Width of one head. Unlike Llama's it is not dim / n_heads: Qwen3 0.6B has 16 heads of
    128 in a 1024-wide stream, so attention is wider than the stream."""
    rope_theta: float = 1_000_000.0
    """RoPE base: pair i of a head turns by position * rope_theta^(-2i/head_dim)."""
    tie_word_embeddings: bool = False
    """Whether the output projection is the token embedding (one matrix, one parameter)."""
    n_experts: int = 0
    """Routed experts in every block's feed-forward (Qwen3-MoE's num_experts); 0: the dense
    SwiGLU of ffn_hidden_dim. Every block is MoE when it is set (Qwen3-MoE's published
    decoder_sparse_step 1, no mlp_only_layers)."""
    top_k: int = 0
    """Experts each token is sent to (num_experts_per_tok); used when n_experts is set."""
    moe_hidden_dim: int = 0
    """Hidden size of each expert's SwiGLU (moe_intermediate_size); used when n_experts is set."""

    def __post_init__(self):
        if not self.n_experts:
            return
        if self.top_k < 1 or self.moe_hidden_dim < 1:
            raise ValueError(f"Qwen3Args: an MoE model ({self.n_experts} experts) needs top_k and moe_hidden_dim >= 1")
        self.moe_args()  # the router's options and the balancing, checked once here

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def moe_args(self) -> MoEArgs:
        """The feed-forward's MoE layer: its router, and the run's load balancing."""
        return moe_args_of(
            self, dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, hidden_dim=self.moe_hidden_dim
        )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def rope_scaling(self) -> None:
        """Qwen3 rotates at its base frequencies at every length: no long-context scaling."""
        return None

    def architecture(self) -> dict:
        """The hyper-parameters that decide what the model computes, for telling whether two
        args describe the same model. max_seq_len is left out: it only sizes the RoPE tables,
        so weights carry over to any length; so is the load balancing, which only steers
        training (a run may resume with other settings)."""
        return {name: value for name, value in asdict(self).items() if name not in _NOT_ARCHITECTURE}

    @classmethod
    def model_cls(cls) -> type:
        from titanlite.models.qwen3.model import Qwen3Transformer

        return Qwen3Transformer


_NOT_ARCHITECTURE = ("max_seq_len", *MODEL_BALANCING_FIELDS)

# What the published sizes share (their config.json files): the 151,936-id vocabulary,
# 128-wide heads, 8 key/value heads, RoPE base 1,000,000 and RMSNorm epsilon 1e-6. The three
# small ones tie their output projection to the embedding.
_PUBLISHED = dict(vocab_size=151936, head_dim=128, n_kv_heads=8, rope_theta=1_000_000.0, norm_eps=1e-6)

_TINY = Qwen3Args(
    dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=258, rope_theta=10000.0
)

QWEN3_FLAVORS = {
    # Small enough to train on one CPU core, with what makes Qwen3 differ from Llama: heads
    # wider than dim / n_heads (8 x 64 in a 256-wide stream), per-head query/key norms and
    # tied embeddings. Its vocabulary is the built-in byte tokenizer's (256 bytes + BOS + EOS).
    "debugmodel": Qwen3Args(
        dim=256, n_layers=6, n_heads=8, vocab_size=258, ffn_hidden_dim=768,
        n_kv_heads=4, head_dim=64, tie_word_embeddings=True,
    ),
    # The test suite's models: 3 blocks, grouped-query attention, heads wider than
    # dim / n_heads; untied (which pipeline parallelism can split) and tied like the published
    # small sizes (what FSDP and TP must keep one parameter).
    "tiny": _TINY,
    "tiny_tied": replace(_TINY, tie_word_embeddings=True),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, ffn_hidden_dim=3072, tie_word_embeddings=True, **_PUBLISHED),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, ffn_hidden_dim=6144, tie_word_embeddings=True, **_PUBLISHED),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, ffn_hidden_dim=9728, tie_word_embeddings=True, **_PUBLISHED),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, ffn_hidden_dim=12288, **_PUBLISHED),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=17408, **_PUBLISHED),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, ffn_hidden_dim=25600, **_PUBLISHED),
}  # fmt: skip

# What the published Qwen3-MoE sizes share besides _PUBLISHED (their config.json files): 4
# key/value heads, 128 experts of which each token meets 8, renormalised top-8 weights,
# untied embeddings. Their ffn_hidden_dim (intermediate_size) is unused: every block is MoE.
# Trained with the per-layer load-balancing loss at 0.1: the balancing that measured best among
# those that keep Qwen3-MoE's architecture, and so its export (docs/performance.md, "MoE load
# balancing"); transformers' pooled loss at Qwen3's published 0.001 left the routers collapsed.
# A Qwen3-MoE read from a Hugging Face config.json trains with it too.
MOE_BALANCING = {"moe_load_balance_coef": 0.1}
_PUBLISHED_MOE = {**_PUBLISHED, "n_kv_heads": 4, "n_experts": 128, "top_k": 8, **MOE_BALANCING}
_TINY_MOE = replace(_TINY, n_experts=4, top_k=2, moe_hidden_dim=32)

QWEN3_FLAVORS.update(
    {
        # debugmodel's attention with 8 experts of 256, 2 per token (512 hidden units a token
        # meets, against the dense 768), untied like the published MoE sizes.
        "debugmodel_moe": replace(
            QWEN3_FLAVORS["debugmodel"],
            n_experts=8,
            top_k=2,
            moe_hidden_dim=256,
            tie_word_embeddings=False,
            **MOE_BALANCING,
        ),
        # The test suite's MoE: tiny's attention, 4 experts of 32, 2 per token, untied.
        "tiny_moe": _TINY_MOE,
        "30B-A3B": Qwen3Args(
            dim=2048, n_layers=48, n_heads=32, ffn_hidden_dim=6144, moe_hidden_dim=768, **_PUBLISHED_MOE
        ),
        "235B-A22B": Qwen3Args(
            dim=4096, n_layers=94, n_heads=64, ffn_hidden_dim=12288, moe_hidden_dim=1536, **_PUBLISHED_MOE
        ),
    }
)
