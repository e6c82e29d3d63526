"""DeepSeek-V3 hyper-parameters and the sizes ("flavors"): DeepSeek-V3 671B, a 16B of
DeepSeek-V2-Lite's shape, and a debug model."""

from dataclasses import asdict, dataclass, replace

from titanlite.models.args import DecoderArgs, MoERoutingArgs, RopeStretch
from titanlite.models.moe import MODEL_BALANCING_FIELDS, MoEArgs, moe_args_of


@dataclass(frozen=True, kw_only=True)
class YarnScaling(RopeStretch):
    """YaRN's long-context RoPE scaling (transformers' rope_type "yarn"), as DeepSeek-V3 uses it."""

    beta_fast: float = 32.0
    """Pairs that turn more than this many times over the original context keep their speed."""
    beta_slow: float = 1.0
    """Pairs that turn fewer times than this are slowed down by factor; those between blend."""
    mscale: float = 1.0
    """Weight of log(factor) in the RoPE tables' magnitude (with mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """Weight of log(factor) in the softmax-scale correction (squared); 0: none."""
    attention_factor: float | None = None
    """The RoPE tables' magnitude given outright; None: from mscale and mscale_all_dim."""


@dataclass(frozen=True)
class DeepSeekV3Args(DecoderArgs, MoERoutingArgs):
    # n_heads: queries, keys and values alike (latent attention has no GQA); ffn_hidden_dim:
    # the SwiGLU of the first first_k_dense_replace blocks, the dense ones.
    q_lora_rank: int = 1536
    """Width of the queries' low-rank bottleneck (dim -> q_lora_rank -> heads); 0: one plain
    projection dim -> heads (the 16B shape; transformers' q_lora_rank None)."""
    kv_lora_rank: int = 512
    """Width of the compressed key-value latent every head expands its keys and values from."""
    qk_nope_head_dim: int = 128
    """Per-head query/key features without position (from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query features that RoPE turns; the key's are one vector shared by all heads."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_theta: float = 10000.0
    """RoPE base of the rope part: pair i turns by position * rope_theta^(-2i/qk_rope_head_dim)."""
    rope_scaling: YarnScaling | None = None
    """YaRN scaling of the RoPE frequencies and the softmax scale; None: plain RoPE."""
    first_k_dense_replace: int = 3
    """Blocks, from the first, whose feed-forward is dense; all later ones are MoE."""
    n_experts: int = 256
    """Routed experts of each MoE block (n_routed_experts)."""
    n_shared_experts: int = 1
    """Experts every token meets in each MoE block, beside its routed ones: one SwiGLU of
    n_shared_experts x moe_hidden_dim."""
    top_k: int = 8
    """Routed experts each token is sent to (num_experts_per_tok)."""
    moe_hidden_dim: int = 2048
    """Hidden size of each routed expert's SwiGLU (moe_intermediate_size)."""
    # The router's and the balancing's defaults that differ from MoERoutingArgs' (docstrings
    # there): DeepSeek-V3's sigmoid scores scaled by 2.5 in 4 of 8 groups, and what docs/model.md
    # "Training an MoE" measured best for a sigmoid router: the auxiliary-loss-free bias,
    # stepped in proportion to each expert's distance from the mean load at 0.05 (which held
    # off the early collapse that DeepSeek-V3's fixed sign step let through, over 3 seeds),
    # with a sequence-wise loss of 1e-3 (the bias exports as e_score_correction_bias).
    moe_score_func: str = "sigmoid"
    moe_route_scale: float = 2.5
    moe_n_groups: int = 8
    moe_topk_groups: int = 4
    moe_seq_balance_coef: float = 1e-3
    moe_bias_update_rate: float = 0.05
    moe_bias_update_rule: str = "proportional"

    def new_rope_scaling(self, factor: float, original_seq_len: int) -> YarnScaling:
        """YaRN with DeepSeek-V3's magnitudes (mscale and mscale_all_dim 1) and the default betas."""
        return YarnScaling(
            factor=factor, original_max_position_embeddings=original_seq_len, mscale=1.0, mscale_all_dim=1.0
        )

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSeekV3Args.{name} must be at least 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE pairs)")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ValueError(
                f"DeepSeekV3Args.first_k_dense_replace ({self.first_k_dense_replace}) must be 0 to n_layers "
                f"({self.n_layers})"
            )
        if self.is_moe:
            self.moe_args()  # the router's options and the balancing, checked once here

    @property
    def is_moe(self) -> bool:
        return self.first_k_dense_replace < self.n_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def moe_args(self) -> MoEArgs:
        """A MoE block's routed experts: its router, and the run's load balancing. The bias
        always takes part in choosing (the checkpoints carry it)."""
        return moe_args_of(
            self,
            dim=self.dim,
            n_experts=self.n_experts,
            top_k=self.top_k,
            hidden_dim=self.moe_hidden_dim,
            route_by_bias=True,
        )

    @property
    def qk_head_dim(self) -> int:
        """Width of one query or key head: its position-free part and its rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The mean width of the two attention matmuls' heads (qk_head_dim for scores,
        v_head_dim for the weighted values): what the shared attention-FLOP count
        (12 x layers x heads x head_dim x seq) multiplies by."""
        return (self.qk_head_dim + self.v_head_dim) // 2

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def shared_hidden_dim(self) -> int:
        return self.n_shared_experts * self.moe_hidden_dim

    def architecture(self) -> dict:
        """The hyper-parameters that decide what the model computes (max_seq_len and the load
        balancing left out: weights carry over to any length and any balancing)."""
        return {name: value for name, value in asdict(self).items() if name not in _NOT_ARCHITECTURE}

    @classmethod
    def model_cls(cls) -> type:
        from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer

        return DeepSeekV3Transformer


_NOT_ARCHITECTURE = ("max_seq_len", *MODEL_BALANCING_FIELDS)

# DeepSeek-V3's config.json: a 40 x YaRN over the 4,096 tokens it was pre-trained on.
_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
# DeepSeek-V2-Lite's: the same stretch, its magnitudes weighted 0.707.
_V2_LITE_YARN = replace(_V3_YARN, mscale=0.707, mscale_all_dim=0.707)

# Each flavor a line per concern: the sizes, the latent attention, its RoPE, the feed-forwards
# and their router (left as written: one field a line hides the shape).
DEEPSEEK_V3_FLAVORS = {
    # Small enough to train on one CPU core, with what makes DeepSeek-V3 itself: a query
    # bottleneck, 1 dense block before the MoE ones, 8 experts in 4 groups (2 chosen of
    # them), a shared expert, sigmoid scores scaled by 2.5, YaRN. Its vocabulary is the byte
    # tokenizer's (256 bytes + BOS + EOS).
    "debugmodel": DeepSeekV3Args(
        dim=256, n_layers=4, n_heads=8, vocab_size=258, ffn_hidden_dim=512,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_scaling=replace(_V3_YARN, factor=4.0, original_max_position_embeddings=256),
        first_k_dense_replace=1, n_experts=8, top_k=2, moe_hidden_dim=128, moe_n_groups=4, moe_topk_groups=2,
    ),
    # torchtitan's 16B (DeepSeek-V2-Lite's shape): no query bottleneck, 64 experts of which
    # each token meets 6 plus 2 shared, softmax scores, no groups, no renormalisation.
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_dim=10944, max_seq_len=4096,
        q_lora_rank=0, rope_scaling=_V2_LITE_YARN,
        first_k_dense_replace=1, n_experts=64, n_shared_experts=2, top_k=6, moe_hidden_dim=1408,
        moe_score_func="softmax", norm_topk_prob=False, moe_route_scale=1.0, moe_n_groups=1, moe_topk_groups=1,
    ),
    # DeepSeek-V3 (its config.json; the class defaults are the rest of its shape).
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432, rope_scaling=_V3_YARN
    ),
}  # fmt: skip

# The test suite's model: tiny's widths, 3 blocks (1 dense), 4 experts in 2 groups.
DEEPSEEK_V3_FLAVORS["tiny"] = replace(
    DEEPSEEK_V3_FLAVORS["debugmodel"],
    dim=64, n_layers=3, n_heads=4, ffn_hidden_dim=96,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
    n_experts=4, moe_hidden_dim=32, moe_n_groups=2, moe_topk_groups=1,
)  # fmt: skip
