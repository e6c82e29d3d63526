"""Token-choice top-k routing: which experts each token goes to, and with what weight."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    """What the router decided for T tokens."""

    experts: torch.Tensor  # [T, k] int64: the chosen experts of each token
    weights: torch.Tensor  # [T, k] in the tokens' dtype: what each chosen expert's output is scaled by
    probs: torch.Tensor  # [T, n_experts] float32: the softmax over all experts


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
) -> Routing:
    """Token-choice top-k routing of x [T, dim], in transformers' Qwen3-MoE order: logits in
    the tokens' dtype, softmax in float32, top-k, renormalisation in float32, then the weights
    cast back to the tokens' dtype. ``expert_bias`` [n_experts] is added to the probabilities
    for choosing the experts only; the weights are the unbiased probabilities."""
    return route_logits(F.linear(x, gate_weight), x.dtype, top_k, norm_topk_prob, expert_bias)


def route_logits(
    logits: torch.Tensor,
    dtype: torch.dtype,
    top_k: int,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
) -> Routing:
    """route() from the router's logits [T, n_experts]; the weights come out in ``dtype``,
    the tokens' dtype (under autocast the logits' may differ)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    scores = probs if expert_bias is None else probs + expert_bias.float()
    experts = torch.topk(scores, top_k, dim=-1).indices
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts=experts, weights=weights.to(dtype), probs=probs)


def count_tokens(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many (token, expert) pairs each expert received: [n_experts] int64, made on the
    device without reading any value on the host (bincount would size its output from the
    largest index)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
