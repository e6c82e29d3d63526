"""Translation between titanlite's Qwen3 state dict and Hugging Face's Qwen3ForCausalLM
and Qwen3MoeForCausalLM.

Llama's adapter with the two per-head norms added. Their gain vectors are permuted like
one head of wq/wk: titanlite's RoPE turns consecutive pairs of a head, Hugging Face's its
two halves, so a head's elements sit in another order on each side, and a gain that scales
element i must move with it. A tied model's state dict has no output.weight, so nothing is
written under lm_head.weight (as Hugging Face saves a tied model).

Qwen3-MoE: the router is renamed like any weight; each block's stacked experts (w1, w2, w3
[n_experts, ...]) are one titanlite tensor each but n_experts Hugging Face tensors each
(model.layers.N.mlp.experts.E.{gate,down,up}_proj.weight): hf_parts lists them (one slice
of the stacked tensor each), which export writes and the folder reader stacks (from_hf_name
names the stacked tensor an expert's goes into), and from_hf stacks a whole state dict. The expert bias is not a
Hugging Face weight: it is dropped on the way out and starts at 0 on the way in.
"""

import re

import torch

from titanlite.models.llama.state_dict_adapter import LlamaStateDictAdapter
from titanlite.models.moe import HF_EXPERT_NAMES, stack_hf_experts
from titanlite.models.qwen3.hf_config import args_to_hf_config

_PER_HEAD_NORMS = {
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
_ROUTER = {"layers.{}.feed_forward.gate.weight": "model.layers.{}.mlp.gate.weight"}
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(\w+)\.weight")
_EXPERT_BIAS = re.compile(r"layers\.(\d+)\.feed_forward\.expert_bias")


class Qwen3StateDictAdapter(LlamaStateDictAdapter):
    hf_names = {**LlamaStateDictAdapter.hf_names, **_PER_HEAD_NORMS, **_ROUTER}

    def _heads_of(self, name: str) -> int | None:
        # A norm's gain is [head_dim]: permuted as one head (both sides end in these names).
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return 1
        return super()._heads_of(name)

    def hf_parts(self, name: str) -> dict[str, int | None]:
        if _EXPERT_BIAS.fullmatch(name):
            return {}
        stacked = _OUR_EXPERTS.fullmatch(name)
        if stacked is None:
            return super().hf_parts(name)
        layer, ours = stacked.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        return {f"{prefix}.{e}.{HF_EXPERT_NAMES[ours]}.weight": e for e in range(self.args.n_experts)}

    def from_hf_name(self, name: str) -> str:
        """An expert's tensor reads into its block's stacked tensor (at the expert's index)."""
        expert = _HF_EXPERT.fullmatch(name)
        if expert is None:
            return super().from_hf_name(name)
        layer, theirs = expert.groups()
        ours = next(w for w, hf in HF_EXPERT_NAMES.items() if hf == theirs)
        return f"layers.{layer}.feed_forward.experts.{ours}"

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layers = set()
        state = {}
        for hf_name, tensor in hf_state_dict.items():
            expert = _HF_EXPERT.fullmatch(hf_name)
            if expert:
                layers.add(expert.group(1))
            else:
                state[self.from_hf_name(hf_name)] = self.from_hf_tensor(hf_name, tensor)
        for layer in sorted(layers, key=int):
            stacked = stack_hf_experts(hf_state_dict, f"model.layers.{layer}.mlp.experts", self.args.n_experts)
            state.update({f"layers.{layer}.feed_forward.experts.{w}": weight for w, weight in stacked.items()})
            state[f"layers.{layer}.feed_forward.expert_bias"] = torch.zeros(self.args.n_experts)
        return state

    def hf_config(self) -> dict:
        """The Qwen3Config (or Qwen3MoeConfig) fields that describe this model."""
        return args_to_hf_config(self.args)
