"""The [model] section: the model family, its size and tokenizer, and an MoE model's load
balancing."""

from dataclasses import dataclass

from titanlite.config.ranges import AT_LEAST_ZERO_OR_UNSET, ranged

# The [model] keys that set an MoE model's load balancing, each under its model args' name.
MOE_BALANCING_KEYS = ("moe_aux_loss_coef", "moe_bias_update_rate")


@dataclass
class Model:
    name: str = "llama3"
    """Model family in the registry: llama2, llama3 or qwen3."""

    flavor: str = "debugmodel"
    """Size preset of the model family, e.g. debugmodel, 7B, 8B, 70B."""

    hf_assets_path: str | None = None
    """Folder (or file) holding a Hugging Face tokenizer.json; unset means the built-in byte tokenizer."""

    moe_aux_loss_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of the auxiliary load-balancing loss (transformers' router_aux_loss_coef) added to the
    training loss; 0 turns it off. Unset: the flavor's value (0 for qwen3's MoE flavors)."""

    moe_bias_update_rate: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: step of the auxiliary-loss-free expert bias (DeepSeek-V3's), updated after every optimizer step
    from the token counts of all data-parallel ranks (DeepSeek-V3 uses 1e-3); 0 turns it off. Unset: the flavor's value
    (0 for qwen3's MoE flavors: a Qwen3-MoE trained with the bias does not export to transformers, which has none)."""
