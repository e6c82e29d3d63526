"""Translation between titanlite's Llama state dict and Hugging Face's LlamaForCausalLM.

The one place that knows both naming schemes. Besides renaming, the query and key
projections are permuted: titanlite rotates consecutive pairs (x[2i], x[2i+1]) of each
head, Hugging Face rotates the two halves (x[i], x[i + head_dim/2]). The permutation
moves the output rows of wq/wk so that both conventions compute the same attention.
"""

import re

import torch

from titanlite.models.llama.args import LlamaArgs
from titanlite.models.llama.hf_config import args_to_hf_config

# titanlite name pattern -> Hugging Face name pattern; {} is the layer index.
_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The names later torchtitan versions store some weights under, where torchtitan 0.2 stores
# them under titanlite's: main of 2026-08 keeps the projections in a qkv_linear module and
# calls the output projection lm_head. These names only, nothing guessed beyond them.
_LATER_TORCHTITAN = {
    "layers.{}.attention.wq.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "layers.{}.attention.wk.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "layers.{}.attention.wv.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _rename(name: str, table: dict[str, str]) -> str:
    match = _LAYER_INDEX.search(name)
    pattern = _LAYER_INDEX.sub(".{}.", name, count=1) if match else name
    if pattern not in table:
        raise KeyError(f"no counterpart for state-dict key '{name}'")
    return table[pattern].format(match.group(1)) if match else table[pattern]


def _pairs_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows_per_head = weight.shape[0] // n_heads
    return weight.view(n_heads, rows_per_head // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def _halves_to_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows_per_head = weight.shape[0] // n_heads
    return weight.view(n_heads, 2, rows_per_head // 2, -1).transpose(1, 2).reshape(weight.shape)


class LlamaStateDictAdapter:
    # titanlite's tensors whose rows are the token ids: a padded vocabulary pads these.
    vocab_rows = ("tok_embeddings.weight", "output.weight")
    # The names both ways; a family that adds weights extends this table.
    hf_names = _TO_HF
    # Hugging Face names (their endings) written in float32 whatever the export's dtype, as
    # the Hugging Face model keeps them; none for Llama.
    float32_hf_names: tuple[str, ...] = ()

    def __init__(self, args: LlamaArgs):
        self.args = args
        self._from_hf = {hf: ours for ours, hf in self.hf_names.items()}

    def _heads_of(self, name: str) -> int | None:
        """How many RoPE heads a projection holds, or None if it is not rotated."""
        if name.endswith(("attention.wq.weight", "self_attn.q_proj.weight")):
            return self.args.n_heads
        if name.endswith(("attention.wk.weight", "self_attn.k_proj.weight")):
            return self.args.kv_heads
        return None

    def to_hf_name(self, name: str) -> str:
        return _rename(name, self.hf_names)

    def from_hf_name(self, name: str) -> str:
        return _rename(name, self._from_hf)

    def torchtitan_names(self, name: str) -> tuple[str, ...]:
        """The other names torchtitan checkpoints may hold titanlite's weight `name` under."""
        try:
            return (_rename(name, _LATER_TORCHTITAN),)
        except KeyError:  # a weight every torchtitan version names as titanlite does
            return ()

    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads_of(name)
        return tensor if heads is None else _pairs_to_halves(tensor, heads)

    def from_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads_of(hf_name)
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

    def rows_from_hf(self, name: str, start: int, stop: int, read_hf_rows) -> torch.Tensor:
        """Rows [start, stop) of titanlite's tensor `name`, where read_hf_rows(a, b) gives
        rows [a, b) of its Hugging Face counterpart. Lets a rank read only its own shard:
        the RoPE permutation moves rows only within a head, so a rotated projection is
        read in whole heads and cut to the rows asked for."""
        heads = self._heads_of(name)
        if heads is None or start >= stop:
            return read_hf_rows(start, stop)
        per_head = self.args.head_dim
        first, last = start // per_head, -(-stop // per_head)
        block = _halves_to_pairs(read_hf_rows(first * per_head, last * per_head), last - first)
        return block[start - first * per_head : stop - first * per_head]

    def hf_parts(self, name: str) -> dict[str, int | None]:
        """The Hugging Face tensors titanlite's weight `name` is written as, each with its
        index along the first dimension (None: the whole tensor). A Llama weight has one
        counterpart; a family that stacks several Hugging Face tensors into one (experts)
        lists each, and one whose tensor Hugging Face does not keep lists none."""
        return {self.to_hf_name(name): None}

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf_state = {}
        for name, tensor in state_dict.items():
            converted = self.to_hf_tensor(name, tensor)
            for hf_name, index in self.hf_parts(name).items():
                hf_state[hf_name] = converted if index is None else converted[index]
        return hf_state

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.from_hf_name(k): self.from_hf_tensor(k, v) for k, v in hf_state_dict.items()}

    def hf_config(self) -> dict:
        """The LlamaConfig fields that describe this model."""
        return args_to_hf_config(self.args)
