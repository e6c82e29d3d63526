"""Translation between titanlite's Qwen3 state dict and Hugging Face's Qwen3ForCausalLM.

Llama's adapter with the two per-head norms added. Their gain vectors are permuted like
one head of wq/wk: titanlite's RoPE turns consecutive pairs of a head, Hugging Face's its
two halves, so a head's elements sit in another order on each side, and a gain that scales
element i must move with it. A tied model's state dict has no output.weight, so nothing is
written under lm_head.weight (as Hugging Face saves a tied model).
"""

from titanlite.models.llama.state_dict_adapter import LlamaStateDictAdapter
from titanlite.models.qwen3.hf_config import args_to_hf_config

_PER_HEAD_NORMS = {
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}


class Qwen3StateDictAdapter(LlamaStateDictAdapter):
    hf_names = {**LlamaStateDictAdapter.hf_names, **_PER_HEAD_NORMS}

    def _heads_of(self, name: str) -> int | None:
        # A norm's gain is [head_dim]: permuted as one head (both sides end in these names).
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return 1
        return super()._heads_of(name)

    def hf_config(self) -> dict:
        """The Qwen3Config fields that describe this model."""
        return args_to_hf_config(self.args)
