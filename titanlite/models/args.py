"""What every model family's hyper-parameters dataclass gives the shared code (the registry,
the trainer's planning, the FLOP count), beside the fields docs/model.md lists; and the fields
the families declare once here: what every long-context RoPE scaling holds (RopeStretch), a
decoder's sizes (DecoderArgs) and an MoE router's options and load balancing (MoERoutingArgs)."""

from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class RopeStretch:
    """What every family's long-context RoPE scaling holds, as transformers' rope_parameters
    name it: how far the context is stretched, and from what length. Each family's scaling
    (Llama 3.1's RopeScaling, DeepSeek-V3's YarnScaling) adds how its frequencies follow."""

    factor: float
    """How many times longer the context is than the one pre-training used."""
    original_max_position_embeddings: int
    """The pre-training context length."""


class ModelArgs:
    """Base of each family's frozen dataclass of hyper-parameters (LlamaArgs, Qwen3Args)."""

    def with_seq_len(self, seq_len: int):
        """The same model with RoPE tables for ``seq_len`` positions (max_seq_len)."""
        return replace(self, max_seq_len=seq_len)

    def with_rope_scaling(self, factor: float, original_seq_len: int | None):
        """The same model with its family's RoPE scaling for a context ``factor`` times longer
        than ``original_seq_len`` (None: the flavor's, or max_seq_len / factor): the flavor's
        own scaling stretched so, or the family's (new_rope_scaling) for a flavor without one;
        ValueError for a family without one."""
        original = self.original_seq_len(factor, original_seq_len)
        scaling = getattr(self, "rope_scaling", None)
        if scaling is None:
            scaling = self.new_rope_scaling(factor, original)
        else:
            scaling = replace(scaling, factor=factor, original_max_position_embeddings=original)
        return replace(self, rope_scaling=scaling)

    def new_rope_scaling(self, factor: float, original_seq_len: int) -> RopeStretch:
        """The family's long-context RoPE scaling by ``factor`` over ``original_seq_len``, with
        the family's own settings; ValueError for a family without one."""
        raise ValueError(f"{type(self).__name__.removesuffix('Args').lower()} has no RoPE scaling in titanlite")

    def original_seq_len(self, factor: float, given: int | None) -> int:
        """The context length RoPE scaling stretches: ``given``, else the flavor's scaling's,
        else max_seq_len (the run's seq_len) / factor."""
        if given is not None:
            return given
        scaling = getattr(self, "rope_scaling", None)
        return scaling.original_max_position_embeddings if scaling else int(self.max_seq_len / factor)

    @classmethod
    def model_cls(cls) -> type:
        """The decoder these hyper-parameters describe: what the registry builds and what the
        FLOP count measures (on the meta device). Each family imports it inside the method, as
        its model.py imports its args.py."""
        raise NotImplementedError(f"{cls.__name__} names no model class")


@dataclass(frozen=True, kw_only=True)
class DecoderArgs(ModelArgs):
    """The fields Qwen3's and DeepSeek-V3's args share (Llama's predate it). The sizes have no
    default: each flavor (and each config.json import) gives them."""

    dim: int
    """Width of the residual stream (hidden_size)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per block (kv_heads says how many key/value heads)."""
    vocab_size: int
    """Rows of the token embedding and of the output projection."""
    ffn_hidden_dim: int
    """Hidden size of a dense block's SwiGLU feed-forward (intermediate_size), given as it is."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (rms_norm_eps)."""
    max_seq_len: int = 4096
    """Length of the precomputed RoPE tables."""


@dataclass(frozen=True)
class MoERoutingArgs:
    """The router and load-balancing fields of a family whose feed-forward may be a mixture of
    experts (moe_args_of turns them into MoEArgs); [model] keys of the same names override
    them (moe_norm_topk_prob for norm_topk_prob). The defaults are Qwen3-MoE's: a family with
    other ones declares those again."""

    moe_score_func: str = "softmax"
    """How the router turns its logits into scores: "softmax" over the experts (Qwen3-MoE's,
    the only one its Hugging Face model has) or "sigmoid", one per expert (DeepSeek-V3's, the
    only one its Hugging Face model has)."""
    norm_topk_prob: bool = True
    """Rescale each token's top_k router scores to sum to 1."""
    moe_route_scale: float = 1.0
    """Factor on the chosen experts' weights after the rescaling (DeepSeek-V3's
    routed_scaling_factor; 1, none, in Qwen3-MoE, the only value its export takes)."""
    moe_n_groups: int = 1
    """Group-limited routing: the experts form this many groups of consecutive experts and a
    token chooses among those of its moe_topk_groups best groups (DeepSeek-V3's n_group); 1:
    no groups (Qwen3-MoE, the only value its export takes)."""
    moe_topk_groups: int = 1
    """Groups a token chooses its experts from under group-limited routing (DeepSeek-V3's
    topk_group), ranked by the sum of each group's two highest scores."""
    moe_aux_loss_coef: float = 0.0
    """Weight of transformers' auxiliary load-balancing loss, pooled over the layers, in the
    training loss (router_aux_loss_coef, exported as such for Qwen3-MoE); 0: no such loss, as
    transformers trains by default (output_router_logits off)."""
    moe_load_balance_coef: float = 0.0
    """Weight of the per-layer load-balancing loss (Megatron's: each layer's n_experts x
    sum_i f_i x P_i, summed over the layers); 0: off."""
    moe_seq_balance_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, summed over the layers; 0: off."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean over tokens of logsumexp(logits)^2, summed over the
    layers; 1e-3 in ST-MoE); 0: off."""
    moe_bias_update_rate: float = 0.0
    """Step of DeepSeek-V3's auxiliary-loss-free expert bias after each optimizer step; 0: the
    bias stays as it is (0, or as loaded). DeepSeek-V3's export carries the bias
    (e_score_correction_bias); Qwen3-MoE has none, so a Qwen3 model trained with it routes in
    a way transformers' Qwen3MoeForCausalLM cannot reproduce from the exported weights."""
    moe_bias_update_rule: str = "sign"
    """How the bias steps: "sign" (DeepSeek-V3's: by the rate, up for an expert below the
    mean load, down above it) or "proportional" (by the rate times (mean - load) / mean)."""
