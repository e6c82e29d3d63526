"""The [model] section: the model family, its size and tokenizer, the converters applied
before parallelisation (float8), and an MoE model's router and load balancing."""

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import AT_LEAST_ZERO_OR_UNSET, POSITIVE_OR_UNSET, ranged

# The [model] keys that set an MoE model's router and load balancing, each with the model
# args' field it overrides.
MOE_KEYS = {
    "moe_score_func": "moe_score_func",
    "moe_norm_topk_prob": "norm_topk_prob",
    "moe_route_scale": "moe_route_scale",
    "moe_n_groups": "moe_n_groups",
    "moe_topk_groups": "moe_topk_groups",
    "moe_aux_loss_coef": "moe_aux_loss_coef",
    "moe_load_balance_coef": "moe_load_balance_coef",
    "moe_seq_balance_coef": "moe_seq_balance_coef",
    "moe_z_loss_coef": "moe_z_loss_coef",
    "moe_bias_update_rate": "moe_bias_update_rate",
    "moe_bias_update_rule": "moe_bias_update_rule",
}
# The keys among them that even out the experts' load, which a collapsed router's warning
# points to (the z-loss only keeps the logits small).
MOE_BALANCING_KEYS = ("moe_load_balance_coef", "moe_aux_loss_coef", "moe_seq_balance_coef", "moe_bias_update_rate")


@dataclass
class Model:
    name: str = "llama3"
    """Model family in the registry: llama2, llama3, qwen3 or deepseek_v3."""

    flavor: str = "debugmodel"
    """Size preset of the model family, e.g. debugmodel, 7B, 8B, 70B."""

    hf_assets_path: str | None = None
    """Folder (or file) holding a Hugging Face tokenizer.json; unset means the built-in byte tokenizer."""

    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention's mask in training and validation: causal (every earlier token of the window) or block_causal (only
    the earlier tokens of the same document, documents ending at the tokenizer's end-of-document token, which the data
    pipeline puts after each). On CPU through SDPA with a boolean mask, on CUDA through FlexAttention. Composes with
    every layout. Export is unchanged: transformers does not mask documents."""

    rope_scaling_factor: float | None = ranged(POSITIVE_OR_UNSET, default=None)
    """Context extension: stretch RoPE for a context this many times longer than rope_original_seq_len, with the
    family's scaling (Llama 3.1's for llama2/llama3, YaRN for deepseek_v3; qwen3 has none). A checkpoint of the same
    model at another scaling (a short-context phase's) resumes with this one. Unset: the flavor's scaling, if any."""

    rope_original_seq_len: int | None = ranged(POSITIVE_OR_UNSET, default=None)
    """With rope_scaling_factor: the context length the model was trained at before the extension. Unset: the
    flavor's scaling's, else training.seq_len / rope_scaling_factor."""

    converters: list[str] = field(default_factory=list)
    """Changes made to the model before it is parallelised: float8 (torchtitan 0.2 also spells it
    quantize.linear.float8) trains its linear layers in float8 through torchao, as [quantize.linear.float8] says;
    needs pip install titanlite[float8]."""

    moe_score_func: Literal["softmax", "sigmoid"] | None = None
    """MoE models only: how the router turns logits into scores, softmax over the experts (Qwen3-MoE) or one sigmoid per
    expert (DeepSeek-V3; torchtitan's score_func). Only softmax exports to a Qwen3-MoE, only sigmoid to a DeepSeek-V3.
    Unset: the flavor's (softmax for qwen3's MoE flavors, sigmoid for deepseek_v3's but 16B)."""

    moe_norm_topk_prob: bool | None = None
    """MoE models only: rescale each token's chosen scores to sum to 1 (transformers' norm_topk_prob, torchtitan's
    route_norm). Unset: the flavor's (true for qwen3's MoE flavors)."""

    moe_route_scale: float | None = ranged(POSITIVE_OR_UNSET, default=None)
    """MoE models only: factor on the chosen experts' weights (torchtitan's route_scale, DeepSeek-V3's
    routed_scaling_factor). Only 1 exports to a Qwen3-MoE. Unset: the flavor's (1 for qwen3's MoE flavors)."""

    moe_n_groups: int | None = ranged(POSITIVE_OR_UNSET, default=None)
    """MoE models only: group-limited routing over this many groups of consecutive experts (torchtitan's
    num_expert_groups, DeepSeek-V3's n_group); 1: none, the only value that exports to a Qwen3-MoE. Unset: the
    flavor's (1 for qwen3's MoE flavors)."""

    moe_topk_groups: int | None = ranged(POSITIVE_OR_UNSET, default=None)
    """MoE models only: the groups, ranked by the sum of their two highest scores, that each token chooses its experts
    from (torchtitan's num_limited_groups, DeepSeek-V3's topk_group). Unset: the flavor's (1 for qwen3's MoE
    flavors)."""

    moe_aux_loss_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of transformers' auxiliary load-balancing loss (its router_aux_loss_coef, pooled over
    the layers) added to the training loss, logged as moe_metrics/aux_loss; 0 turns it off. Unset: the flavor's value
    (0 for qwen3's MoE flavors)."""

    moe_load_balance_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of the per-layer load-balancing loss (Megatron's: each layer's n_experts x sum of
    f_i x P_i, summed over the layers), logged as moe_metrics/load_balance_loss; 0 turns it off. Unset: the flavor's
    value (0.1 for qwen3's MoE flavors but the tests' tiny_moe, 0 for deepseek_v3's)."""

    moe_seq_balance_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of DeepSeek-V3's sequence-wise balance loss (each sequence's own f_i x P_i, averaged
    over the sequences, summed over the layers; DeepSeek-V3 uses 1e-4), logged as moe_metrics/seq_balance_loss; 0
    turns it off. Unset: the flavor's value (0 for qwen3's MoE flavors, 1e-3 for deepseek_v3's)."""

    moe_z_loss_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of the router z-loss (mean over tokens of logsumexp(logits)^2, summed over the layers;
    ST-MoE uses 1e-3), logged as moe_metrics/router_z_loss; 0 turns it off. Unset: the flavor's value (0 for qwen3's
    MoE flavors)."""

    moe_bias_update_rate: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: step of the auxiliary-loss-free expert bias (DeepSeek-V3's; torchtitan's load_balance_coeff),
    updated after every optimizer step from the token counts of all data-parallel ranks (DeepSeek-V3 uses 1e-3); 0
    turns it off. Unset: the flavor's value (0 for qwen3's MoE flavors: a Qwen3-MoE trained with the bias does not
    export to transformers, which has none; 0.05 for deepseek_v3's, whose bias exports)."""

    moe_bias_update_rule: Literal["sign", "proportional"] | None = None
    """MoE models only: how the expert bias steps after each optimizer step: "sign" (DeepSeek-V3's: every expert by
    moe_bias_update_rate, up when below the mean load, down when above) or "proportional" (by the rate times (mean -
    load) / mean: fast far from even, still near it). Unset: the flavor's ("sign" for qwen3's MoE flavors,
    "proportional" for deepseek_v3's, measured in docs/performance.md, "MoE load balancing")."""
