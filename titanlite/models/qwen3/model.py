"""The Qwen3 dense decoder, top to bottom.

tokens -> embedding -> n_layers x [RMSNorm -> attention -> residual, RMSNorm -> SwiGLU
feed-forward -> residual] -> RMSNorm -> output projection -> logits

It is Llama's decoder (titanlite/models/llama/model.py, whose pieces it imports) with three
differences:
  - a head's width (head_dim) is a hyper-parameter of its own, not dim / n_heads;
  - attention normalises each query and key head with an RMSNorm over head_dim (q_norm,
    k_norm, one gain vector shared by all heads) before RoPE turns them;
  - the output projection may be the token embedding itself (tie_word_embeddings): one
    parameter, saved once, under tok_embeddings.weight.
A Qwen3-MoE model (args.n_experts > 0) has the routed experts of titanlite/models/moe/
as every block's feed_forward, under that name; with an auxiliary balancing loss on, the
model's output carries that loss's gradient (add_load_balancing_loss).
Grouped-query attention, RoPE (with Qwen3's base), SwiGLU and the initialisation are
Llama's. Parameter names are Llama's wherever the meaning is the same, so Llama's tensor
parallel plan, FSDP, activation checkpointing and compile apply as they are.
"""

import torch
from torch import nn

from titanlite.models.llama.model import Attention, RMSNorm, Transformer, TransformerBlock
from titanlite.models.moe import MoE, add_load_balancing_loss, moe_layers
from titanlite.models.qwen3.args import Qwen3Args

TIED_OUTPUT = "output.weight"
TIED_EMBEDDING = "tok_embeddings.weight"


class Qwen3Attention(Attention):
    """Llama's grouped-query attention with every query and key head RMS-normalised first."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_heads(x)
        return self.q_norm(q), self.k_norm(k), v

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        super().init_weights(out_std, generator)
        self.q_norm.init_weights()
        self.k_norm.init_weights()


class Qwen3Block(TransformerBlock):
    attention_cls = Qwen3Attention
    attention_tp_plan = {**TransformerBlock.attention_tp_plan, "q_norm": "per_head", "k_norm": "per_head"}

    def make_feed_forward(self, layer_id: int, args: Qwen3Args) -> nn.Module:
        # Qwen3-MoE: the routed experts take the dense feed-forward's place (and name).
        return MoE(args.moe_args()) if args.is_moe else super().make_feed_forward(layer_id, args)


class Qwen3Transformer(Transformer):
    block_cls = Qwen3Block

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        if args.tie_word_embeddings:
            # One parameter under two modules. init_weights fills it last as the output
            # projection (the scale the logits need; each block's first norm rescales what
            # the embedding hands it anyway). The state dict holds it once, under the
            # embedding's name, as Hugging Face saves a tied model (no lm_head.weight).
            self.tie_output()
            self._register_state_dict_hook(_drop_tied_output)
            self.register_load_state_dict_pre_hook(_fill_tied_output)

    def forward(self, tokens: torch.Tensor, document_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's forward; with an MoE model's balancing losses on, its output carries their
        gradients for the MoE layers it ran (this pipeline stage's under PP)."""
        output = super().forward(tokens, document_tokens)
        if not self.args.is_moe or not self.args.moe_args().has_balance_loss:
            return output
        return add_load_balancing_loss(output, moe_layers(self))

    def init_buffers(self, device: torch.device) -> None:
        """The RoPE tables, and each MoE layer's token counts (never saved either)."""
        super().init_buffers(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()

    def tie_output(self) -> None:
        self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty, to(dtype) and the like give a plain (non-DTensor) parameter a new tensor
        # per module that holds it, which would untie the two: tie them again.
        super()._apply(fn, recurse)
        if self.args.tie_word_embeddings and self.output is not None:
            self.tie_output()
        return self


def _drop_tied_output(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + TIED_OUTPUT, None)


def _fill_tied_output(module, state_dict, prefix, *args):
    """Loading a tied model: the output projection reads the embedding's entry, so a strict
    load finds every parameter and the shared one is filled from the one saved tensor."""
    if prefix + TIED_EMBEDDING in state_dict:
        state_dict[prefix + TIED_OUTPUT] = state_dict[prefix + TIED_EMBEDDING]
