"""The auxiliary load-balancing loss: the per-forward terms a layer keeps, the loss over a
forward's layers, and how its gradient joins the training loss's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titanlite.models.moe.layer import MoE


@dataclass
class RouterStats:
    """One forward's terms of the auxiliary load-balancing loss. The counts are those of the
    experts really chosen, so with the expert bias on they follow the biased choice."""

    token_counts: torch.Tensor  # [n_experts] float32: (token, expert) pairs per expert
    prob_sums: torch.Tensor  # [n_experts] float32: router probability summed over the tokens (has grad)
    n_tokens: int


def load_balancing_loss(stats: Sequence[RouterStats]) -> torch.Tensor:
    """transformers' auxiliary load-balancing loss (Switch Transformer's) over the MoE layers
    of one forward: n_experts x sum over experts of (pairs routed to it per token) x (its mean
    router probability), both pooled over the layers before they are multiplied, as
    transformers pools them. For one layer it is that layer's loss."""
    n_tokens = sum(stat.n_tokens for stat in stats)
    tokens_per_expert = torch.stack([stat.token_counts for stat in stats]).sum(0) / n_tokens
    mean_prob = torch.stack([stat.prob_sums for stat in stats]).sum(0) / n_tokens
    return tokens_per_expert.numel() * torch.sum(tokens_per_expert * mean_prob)


class _AddLossGradient(torch.autograd.Function):
    """The identity on ``output``, whose backward also gives ``loss`` (a 0-dim tensor) the
    gradient 1: the loss's gradients join the training loss's without its value joining the
    loss function's (which under pipeline parallelism only the last stage computes)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        # The same memory, but not a view of ``output`` (``_base`` unset): FSDP warns of a
        # wrapped module that returns a view, since an in-place op on one would drop the
        # pre-backward hook it registers. An input returned as it is would become a view too.
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_output, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def add_load_balancing_loss(output: torch.Tensor, layers: Sequence[MoE]) -> torch.Tensor:
    """``output`` of the forward (of a model, or of one pipeline stage) that ran the MoE
    ``layers``, made to carry their auxiliary loss's gradient when it is on and the forward
    trains: router_aux_loss_coef x load_balancing_loss of the layers' stats (pooled over these
    layers, as transformers pools over a model's) x this forward's share of the step's tokens
    (aux_loss_step_tokens). The gradient reaches the routers through the backward of
    ``output``; the loss itself is added to the first layer's aux_loss_sum for the metrics.
    Every layer's stats are used once and dropped."""
    stats = [layer.last_router_stats for layer in layers if layer.last_router_stats is not None]
    for layer in layers:
        layer.last_router_stats = None
    if not stats or not layers[0].training or not torch.is_grad_enabled():
        return output
    first = layers[0]
    share = stats[0].n_tokens / first.aux_loss_step_tokens if first.aux_loss_step_tokens else 1.0
    loss = load_balancing_loss(stats) * share
    with torch.no_grad():
        first.aux_loss_sum += loss.detach()
    return _AddLossGradient.apply(output, first.args.router_aux_loss_coef * loss)
