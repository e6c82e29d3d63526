"""Translation between titanlite's DeepSeek-V3 state dict and Hugging Face's
DeepseekV3ForCausalLM.

Qwen3-MoE's adapter (its routed experts stacked on titanlite's side, one tensor per expert
on Hugging Face's; Llama's names for the embedding, norms, wo and the dense feed-forward)
with latent attention's weights and the shared experts added, and two differences:
  - no weight is permuted: transformers' DeepSeek-V3 turns interleaved pairs of the rope part
    (rope_interleave, its default and what the published checkpoints need), the pairs
    titanlite turns. The two write the turned features in another order, but queries and keys
    alike, so the scores are the same;
  - the expert bias is a Hugging Face tensor (e_score_correction_bias), exported and
    imported as it is, in float32 whatever the export's dtype (as transformers keeps it).
"""

from titanlite.models.deepseek_v3.hf_config import args_to_hf_config
from titanlite.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

_LATENT_ATTENTION = {
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wq_a.weight": "model.layers.{}.self_attn.q_a_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_a_layernorm.weight",
    "layers.{}.attention.wq_b.weight": "model.layers.{}.self_attn.q_b_proj.weight",
    "layers.{}.attention.wkv_a.weight": "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight",
    "layers.{}.attention.kv_norm.weight": "model.layers.{}.self_attn.kv_a_layernorm.weight",
    "layers.{}.attention.wkv_b.weight": "model.layers.{}.self_attn.kv_b_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
}
_SHARED_EXPERTS = {
    "layers.{}.feed_forward.shared_experts.w1.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    "layers.{}.feed_forward.shared_experts.w2.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
    "layers.{}.feed_forward.shared_experts.w3.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
}
_BIAS = {"layers.{}.feed_forward.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias"}
# Qwen3-MoE's names that DeepSeek-V3 shares: embedding, norms, dense feed-forward, router, output.
_SHARED_NAMES = (
    "tok_embeddings.weight",
    "layers.{}.attention_norm.weight",
    "layers.{}.ffn_norm.weight",
    "layers.{}.feed_forward.w1.weight",
    "layers.{}.feed_forward.w2.weight",
    "layers.{}.feed_forward.w3.weight",
    "layers.{}.feed_forward.gate.weight",
    "norm.weight",
    "output.weight",
)


class DeepSeekV3StateDictAdapter(Qwen3StateDictAdapter):
    hf_names = {
        **{ours: Qwen3StateDictAdapter.hf_names[ours] for ours in _SHARED_NAMES},
        **_LATENT_ATTENTION,
        **_SHARED_EXPERTS,
        **_BIAS,
    }
    # Hugging Face tensors written in float32 whatever the export's dtype (transformers'
    # _keep_in_fp32_modules_strict for DeepSeek-V3): the router's weight and the bias.
    float32_hf_names = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def _heads_of(self, name: str) -> int | None:
        return None  # nothing is permuted (see the module's docstring)

    def hf_parts(self, name: str) -> dict[str, int | None]:
        if name.endswith("feed_forward.expert_bias"):
            return {self.to_hf_name(name): None}
        return super().hf_parts(name)

    def from_hf(self, hf_state_dict: dict) -> dict:
        """Qwen3-MoE's (which starts every bias at 0), with the biases the file holds."""
        state = super().from_hf(hf_state_dict)
        biases = {name: tensor for name, tensor in hf_state_dict.items() if name.endswith("e_score_correction_bias")}
        state.update({self.from_hf_name(name): tensor.float() for name, tensor in biases.items()})
        return state

    def hf_config(self) -> dict:
        """The DeepseekV3Config fields that describe this model."""
        return args_to_hf_config(self.args)
