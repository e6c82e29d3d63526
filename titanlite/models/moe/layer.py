"""The mixture-of-experts layer: route, sort by expert, run the experts, put back, weigh."""

import torch
from torch import nn

from titanlite.models.init import fill_trunc_normal_
from titanlite.models.moe.args import BALANCE_LOSSES, MoEArgs
from titanlite.models.moe.balancing import RankSum, RouterStats, router_stats
from titanlite.models.moe.experts import GroupedExperts, to_compute_dtype
from titanlite.models.moe.router import RouterGate, Routing, count_tokens, route_logits


def _recomputing() -> bool:
    """Whether autograd is running a backward pass now, the only time a module's forward runs
    inside one being activation checkpointing's recomputation. Inside a compiled graph the
    recomputation is part of the compiled backward, which does not run the forward's code."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The routed mixture-of-experts feed-forward: a drop-in for a dense feed-forward block."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = RouterGate(args.dim, args.n_experts)
        self.experts = GroupedExperts(args)
        # Trained by update_expert_bias, not by the optimizer; saved, so a resumed run routes
        # as the interrupted one did (0 throughout when bias_update_rate is 0).
        self.register_buffer("expert_bias", torch.empty(args.n_experts, dtype=torch.float32))
        # (token, expert) pairs per expert, summed over the training forwards since the last
        # reset_load(): what the bias update and the load metrics read. Not saved: a step's
        # counts start from 0. Integers, so exact at any count, and left as they are when the
        # model is cast to another floating-point dtype.
        self.register_buffer("tokens_per_expert", torch.empty(args.n_experts, dtype=torch.int64), persistent=False)
        # The balancing losses (BALANCE_LOSSES, in that order) of the forwards since the last
        # reset_load(), each weighted by its share of aux_loss_step_tokens, kept by the first
        # MoE layer of each model (or stage) forward (see add_load_balancing_loss): what the
        # metrics read. Not saved.
        self.register_buffer(
            "balance_loss_sums", torch.empty(len(BALANCE_LOSSES), dtype=torch.float32), persistent=False
        )
        self.last_router_stats: RouterStats | None = None
        # The tokens of one optimizer step over all ranks, set by the trainer: each forward's
        # auxiliary loss weighs its tokens' share of them, so that the summed gradients are the
        # mean over the step's forwards. None: every forward weighs 1.
        self.aux_loss_step_tokens: int | None = None
        # Set by tensor parallelism, whose ranks each route their own equal slice of a forward's
        # tokens: how many ranks share them, and a sum over those ranks whose gradient passes
        # through unchanged. The balancing losses' terms are summed so (add_load_balancing_loss),
        # and every rank gets the losses of the whole forward, as one process does.
        self.token_ranks = 1
        self.sum_over_token_ranks: RankSum | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = self.expert_bias if self.args.bias_update_rate > 0 or self.args.route_by_bias else None
        # The router is called as a module, not read as a weight, so that parallel code can
        # change how it multiplies (tensor parallelism: by its weight's local tensor).
        logits = self.gate(tokens)
        routing = route_logits(logits, tokens.dtype, self.args, bias)
        counts = count_tokens(routing.experts, self.args.n_experts)
        self._record(routing, counts, shape[0] if len(shape) == 3 else 1)
        # Every (token, expert) pair becomes one row; a stable sort by expert keeps each
        # expert's rows in token order.
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        # In autocast's dtype from here (as FSDP's bf16 gives them): expert parallelism then
        # sends bf16 rows, and the experts take the grouped path.
        rows = to_compute_dtype(tokens[order // self.args.top_k])
        expert_out = self.experts(rows, counts)
        per_pair = expert_out[torch.argsort(order)].view(tokens.shape[0], self.args.top_k, -1)
        out = (per_pair * routing.weights.unsqueeze(-1)).sum(dim=1)
        return out.view(shape)

    # Eager also inside a compiled block (which breaks its graph here): the compiler refuses
    # state kept across calls inside activation checkpointing's traced region, and eager code
    # can tell the recomputation from the forward.
    @torch.compiler.disable
    def _record(self, routing: Routing, counts: torch.Tensor, batch: int) -> None:
        """Keep what the load balancing and the metrics read later; ``batch``: the sequences
        routed (the tokens of a 2-D input are one). A forward that activation checkpointing
        runs again during the backward pass routes the same tokens again and is not counted
        twice, nor does it replace the kept stats."""
        if _recomputing():
            return
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts
        if self.args.has_balance_loss and self.training:
            self.last_router_stats = router_stats(routing, counts, batch, self.args)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """One step of the auxiliary-loss-free balancing: experts that got fewer tokens than
        the mean are raised, those that got more are lowered (by bias_update_rate under the
        "sign" rule, by the rate times their distance from the mean load, relative to it, under
        "proportional"), and the step is centred so that the biases keep a mean of 0.
        ``tokens_per_expert`` is this layer's count, all-reduced first over the ranks that saw
        different tokens. ``skip``: a flag on the device (non-zero: the optimizer step was not
        applied, and neither is this one). Runs on the device (no value is read on the host)."""
        load = tokens_per_expert.float()
        mean = load.mean()
        if self.args.bias_update_rule == "sign":
            step = self.args.bias_update_rate * torch.sign(mean - load)
        else:
            step = self.args.bias_update_rate * (mean - load) / mean.clamp(min=1.0)
        step = step - step.mean()
        if skip is not None:
            step = step * (skip == 0)
        self.expert_bias += step

    def load_imbalance(self) -> torch.Tensor:
        """max / mean of the accumulated tokens per expert (1 is a perfectly even load), as a
        0-dim tensor on the device."""
        load = self.tokens_per_expert.float()
        return load.max() / load.mean().clamp(min=1.0)

    @torch.no_grad()
    def reset_load(self) -> None:
        self.tokens_per_expert.zero_()
        self.balance_loss_sums.zero_()

    def init_buffers(self) -> None:
        """The counts: never saved, so a model whose weights were loaded needs them zeroed too."""
        self.reset_load()

    @torch.no_grad()
    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        """Gate, then w1, w2, w3, each drawn whole from ``generator``; the bias starts at 0."""
        fill_trunc_normal_(self.gate.weight, std=0.02, generator=generator)
        self.experts.init_weights(out_std, generator)
        self.expert_bias.zero_()
        self.init_buffers()


def moe_layers(module: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers in ``module``, found by type (no model's module names)."""
    return [layer for layer in module.modules() if isinstance(layer, MoE)]
