"""The auxiliary balancing losses: the per-forward terms a layer keeps, the losses over a
forward's layers, and how their gradients join the training loss's.

Four losses, each weighted by its own MoEArgs coefficient (BALANCE_LOSSES, in this order):
  aux           transformers' load-balancing loss, pooled over a forward's layers
                (load_balancing_loss);
  load_balance  the per-layer load-balancing loss, Megatron's form, summed over the layers
                (layer_balance_loss);
  seq_balance   DeepSeek-V3's sequence-wise balance loss, summed over the layers
                (sequence_balance_loss);
  z             the router z-loss, summed over the layers (router_z_loss).
The three per-layer ones add up over the layers, so under pipeline parallelism the stages'
losses add up to the whole model's; the pooled one is pooled over each stage's layers.
"Probabilities" below are each token's router scores normalised to sum to 1 (Routing.probs:
the softmax itself, or the sigmoids over their sum), and the counts are those of the experts
really chosen, so with the expert bias on they follow the biased choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from titanlite.models.moe.args import MoEArgs

# A differentiable sum over the ranks that share a forward's tokens (MoE.sum_over_token_ranks).
RankSum = Callable[[torch.Tensor], torch.Tensor]

if TYPE_CHECKING:
    from titanlite.models.moe.layer import MoE
    from titanlite.models.moe.router import Routing


@dataclass
class RouterStats:
    """One forward's terms of one layer's balancing losses. The layer makes them inside its
    forward by sums alone, which save nothing for the backward pass: under activation
    checkpointing the forward that runs again during backward does not make them, and
    anything saved only in the first run would fail checkpointing's check that both runs
    save the same tensors. The losses are computed from them after the model's (or stage's)
    forward (balance_losses)."""

    token_counts: torch.Tensor  # [n_experts] float32: (token, expert) pairs per expert
    prob_sums: torch.Tensor  # [n_experts] float32: router probability summed over the tokens (has grad)
    n_tokens: int
    seq_counts: torch.Tensor | None = None  # [B, n_experts] float32: pairs per expert in each sequence
    seq_prob_sums: torch.Tensor | None = None  # [B, n_experts]: probability summed over each sequence (has grad)
    logits: torch.Tensor | None = None  # [T, n_experts] float32: the router's logits (has grad), for the z-loss


def router_stats(routing: Routing, counts: torch.Tensor, batch: int, args: MoEArgs) -> RouterStats:
    """The terms of the losses ``args`` turns on, from one forward's routing of ``batch``
    sequences (the same number of tokens each) and its pairs per expert ``counts``."""
    n_tokens, n_experts = routing.probs.shape
    stats = RouterStats(counts.float(), routing.probs.sum(dim=0), n_tokens)
    if args.seq_balance_coef > 0:
        per_sequence = routing.experts.view(batch, -1)
        ones = torch.ones_like(per_sequence, dtype=torch.float32)
        stats.seq_counts = ones.new_zeros(batch, n_experts).scatter_add_(1, per_sequence, ones)
        stats.seq_prob_sums = routing.probs.view(batch, -1, n_experts).sum(dim=1)
    if args.z_loss_coef > 0:
        stats.logits = routing.logits
    return stats


def layer_balance_loss(token_counts: torch.Tensor, prob_sums: torch.Tensor, n_tokens: int, top_k: int) -> torch.Tensor:
    """Megatron's load-balancing loss of one layer over T tokens:

        n_experts x sum_i f_i x P_i,  f_i = count_i / (top_k x T),  P_i = prob_sum_i / T

    f_i is expert i's share of the layer's (token, expert) pairs and P_i its mean router
    probability: 1 at an even load with even probabilities, n_experts / top_k at the worst."""
    fraction = token_counts / (top_k * n_tokens)
    mean_prob = prob_sums / n_tokens
    return fraction.numel() * torch.sum(fraction * mean_prob)


def sequence_balance_loss(
    seq_counts: torch.Tensor, seq_prob_sums: torch.Tensor, seq_len: int, top_k: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one layer (its paper, section 2.1.2), the
    mean over the B sequences of

        L_seq = sum_i f_i x P_i,
        f_i = N / (K x T) x sum_t 1(token t chose expert i),
        P_i = 1 / T x sum_t s'_{i,t},  s'_{i,t} = s_{i,t} / sum_j s_{j,t},

    with N routed experts, K = top_k, T = ``seq_len`` the tokens of the sequence and s_{i,t}
    the router's score of expert i for token t (s' its normalised probability): 1 for an even
    sequence, N / K at the worst. The paper's indicator is the top-K of the unbiased scores;
    here it is the experts really chosen, as for the other losses. ``seq_counts`` [B, N]:
    the indicator summed over each sequence; ``seq_prob_sums`` [B, N]: s' summed likewise."""
    n_experts = seq_counts.shape[-1]
    fraction = seq_counts * (n_experts / (top_k * seq_len))
    mean_prob = seq_prob_sums / seq_len
    return torch.sum(fraction * mean_prob, dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of one layer: the mean over the tokens of logsumexp(logits)^2,
    which keeps the router's logits small (logits [T, n_experts], float32)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def load_balancing_loss(stats: Sequence[RouterStats]) -> torch.Tensor:
    """transformers' auxiliary load-balancing loss (Switch Transformer's) over the MoE layers
    of one forward: n_experts x sum over experts of (pairs routed to it per token) x (its mean
    router probability), both pooled over the layers before they are multiplied, as
    transformers pools them. For one layer it is that layer's loss."""
    n_tokens = sum(stat.n_tokens for stat in stats)
    tokens_per_expert = torch.stack([stat.token_counts for stat in stats]).sum(0) / n_tokens
    mean_prob = torch.stack([stat.prob_sums for stat in stats]).sum(0) / n_tokens
    return tokens_per_expert.numel() * torch.sum(tokens_per_expert * mean_prob)


def balance_losses(
    stats: Sequence[RouterStats], args: MoEArgs, total: RankSum | None = None, ranks: int = 1
) -> torch.Tensor:
    """The BALANCE_LOSSES of one forward's layers, [4]: the pooled loss, then the per-layer
    ones summed over the layers; each 0 where ``args`` turns it off. ``total``: a sum over the
    ``ranks`` ranks that each routed an equal share of the forward's tokens (tensor
    parallelism's, MoE.sum_over_token_ranks), whose gradient passes through; then ``stats``
    are this rank's share, and the losses are the whole forward's on every rank. None: the
    stats are the whole forward's."""
    z_losses = [router_z_loss(stat.logits) if args.z_loss_coef > 0 else None for stat in stats]
    if total is not None:
        stats, z_losses = _over_ranks(stats, z_losses, total, ranks)
    pooled = load_balancing_loss(stats) if args.router_aux_loss_coef > 0 else stats[0].prob_sums.new_zeros(())
    per_layer = torch.stack([_layer_losses(stat, z, args) for stat, z in zip(stats, z_losses, strict=True)])
    return torch.cat([pooled.unsqueeze(0), per_layer.sum(dim=0)])


def _summed_terms(stat: RouterStats) -> dict[str, torch.Tensor]:
    """The fields of ``stat`` that add up over the tokens, and so over ranks routing
    different ones (those its losses use)."""
    fields = {"token_counts": stat.token_counts, "prob_sums": stat.prob_sums}
    fields |= {"seq_counts": stat.seq_counts, "seq_prob_sums": stat.seq_prob_sums}
    return {name: value for name, value in fields.items() if value is not None}


def _over_ranks(
    stats: Sequence[RouterStats], z_losses: list[torch.Tensor | None], total: RankSum, ranks: int
) -> tuple[list[RouterStats], list[torch.Tensor | None]]:
    """Each layer's stats summed over the ranks (its sequences' too: every rank holds a slice
    of each sequence) and its z-loss averaged over them (each rank's is a mean over as many
    tokens), in one call of ``total`` for all the layers."""
    terms = [_summed_terms(stat) for stat in stats]
    pieces = [value for layer in terms for value in layer.values()] + [z for z in z_losses if z is not None]
    sums = iter(total(torch.cat([piece.reshape(-1) for piece in pieces])).split([piece.numel() for piece in pieces]))
    whole = []
    for stat, layer in zip(stats, terms, strict=True):
        summed = {name: next(sums).view_as(value) for name, value in layer.items()}
        # The logits cannot be summed over ranks: their z-loss is averaged instead.
        whole.append(replace(stat, n_tokens=stat.n_tokens * ranks, logits=None, **summed))
    return whole, [None if z is None else next(sums).view(()) / ranks for z in z_losses]


def _layer_losses(stat: RouterStats, z_loss: torch.Tensor | None, args: MoEArgs) -> torch.Tensor:
    """[load_balance, seq_balance, z] of one layer (``z_loss``: its z-loss, None when off),
    each 0 where ``args`` turns it off."""
    zero = stat.prob_sums.new_zeros(())
    balance, sequence = zero, zero
    if args.load_balance_coef > 0:
        balance = layer_balance_loss(stat.token_counts, stat.prob_sums, stat.n_tokens, args.top_k)
    if args.seq_balance_coef > 0:
        seq_len = stat.n_tokens // stat.seq_counts.shape[0]
        sequence = sequence_balance_loss(stat.seq_counts, stat.seq_prob_sums, seq_len, args.top_k)
    return torch.stack([balance, sequence, zero if z_loss is None else z_loss])


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
    ``layers``, made to carry their balancing losses' gradients when one is on and the
    forward trains: sum over BALANCE_LOSSES of coefficient x loss of the layers' stats x this
    forward's share of the step's tokens (aux_loss_step_tokens). The gradients reach the
    routers through the backward of ``output``; the losses themselves (without their
    coefficients) are added to the first layer's balance_loss_sums for the metrics. Every
    layer's stats are used once and dropped. Under tensor parallelism each rank's layers
    routed their own slice of the forward's tokens: the losses are those of the whole forward
    (balance_losses, one sum over the TP ranks), the same on every rank."""
    stats = [layer.last_router_stats for layer in layers if layer.last_router_stats is not None]
    for layer in layers:
        layer.last_router_stats = None
    if not stats or not layers[0].training or not torch.is_grad_enabled():
        return output
    first = layers[0]
    tokens = stats[0].n_tokens * first.token_ranks  # the forward's, over the ranks that share it
    share = tokens / first.aux_loss_step_tokens if first.aux_loss_step_tokens else 1.0
    losses = balance_losses(stats, first.args, first.sum_over_token_ranks, first.token_ranks) * share
    with torch.no_grad():
        first.balance_loss_sums += losses.detach()
    weighted = sum(coef * loss for coef, loss in zip(first.args.balance_loss_coefs, losses.unbind(), strict=True))
    return _AddLossGradient.apply(output, weighted)
