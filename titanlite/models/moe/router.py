"""Token-choice top-k routing: which experts each token goes to, and with what weight.

logits (float32) -> scores (softmax over the experts, or a sigmoid each) -> + expert bias,
for choosing only -> with groups: keep each token's topk_groups best groups -> top-k ->
the chosen experts' unbiased scores, rescaled to sum to 1 (norm_topk_prob), times
route_scale -> the weights, in the tokens' dtype.

All of it is float32 whatever the tokens' dtype, autocast included: a bf16 router would
round its scores to 8 bits, enough to change which expert wins a close choice.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.moe.args import MoEArgs


@dataclass
class Routing:
    """What the router decided for T tokens."""

    experts: torch.Tensor  # [T, k] int64: the chosen experts of each token
    weights: torch.Tensor  # [T, k] in the tokens' dtype: what each chosen expert's output is scaled by
    probs: torch.Tensor  # [T, n_experts] float32: each token's scores normalised to sum to 1 (no bias)
    logits: torch.Tensor  # [T, n_experts] float32: the router's logits


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, dim] times the router's weight [n_experts, dim] transposed, in float32. Autocast
    lists linear among the ops it runs in the lower precision (on the CPU and on CUDA), so
    it is switched off here and both operands are upcast: bf16 inputs give their exact
    products, summed in float32."""
    device_type = x.device.type
    autocasting = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    with torch.autocast(device_type, enabled=False) if autocasting else contextlib.nullcontext():
        return F.linear(x.float(), gate_weight.float())


class RouterGate(nn.Linear):
    """The router's linear map dim -> n_experts (no bias), computed in float32 (router_logits)."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__(dim, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return router_logits(x, self.weight)


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, args: MoEArgs, expert_bias: torch.Tensor | None = None
) -> Routing:
    """Route the tokens x [T, dim] with the router's weight [n_experts, dim]; see route_logits."""
    return route_logits(router_logits(x, gate_weight), x.dtype, args, expert_bias)


def route_logits(
    logits: torch.Tensor, dtype: torch.dtype, args: MoEArgs, expert_bias: torch.Tensor | None = None
) -> Routing:
    """Route by the router's logits [T, n_experts] as ``args`` says (score_func,
    norm_topk_prob, route_scale, n_groups, topk_groups, top_k). ``expert_bias`` [n_experts]
    is added to the scores for choosing the experts (and their groups) only: the weights are
    the unbiased scores. The weights come out in ``dtype``, the tokens' dtype."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if args.score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if args.n_groups > 1:
        choice = keep_top_groups(choice, args.n_groups, args.topk_groups)
    experts = torch.topk(choice, args.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if args.norm_topk_prob:
        # Sigmoid scores can all underflow to 0; a softmax's k largest sum to at least k / n_experts.
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    if args.route_scale != 1.0:
        weights = weights * args.route_scale
    probs = scores if args.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    return Routing(experts=experts, weights=weights.to(dtype), probs=probs, logits=logits)


def keep_top_groups(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice`` [T, n_experts] with every expert outside each token's ``topk_groups`` best
    groups set to -inf, so that top-k cannot pick it. The experts form n_groups groups of
    consecutive experts; a group's score is the sum of its two highest choice scores
    (DeepSeek-V3's; its one score where a group holds one expert)."""
    tokens, n_experts = choice.shape
    grouped = choice.view(tokens, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, n_groups]
    best = group_scores.topk(topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, n_experts)


def count_tokens(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many (token, expert) pairs each expert received: [n_experts] int64, made on the
    device without reading any value on the host (bincount would size its output from the
    largest index)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
