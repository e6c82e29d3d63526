"""A mixture-of-experts feed-forward layer, top to bottom.

x [batch, seq, dim] -> router (linear, softmax, top-k) -> every token's k (expert, weight)
pairs -> the pairs sorted by expert -> each expert's SwiGLU on its rows (one grouped GEMM,
or a loop over experts) -> the rows put back in token order -> weighted sum over each
token's k experts -> [batch, seq, dim]

Token choice without a capacity limit: every token reaches all of its k experts, however
unevenly they are chosen (no token is dropped). Two ways to keep the load even, chosen by
the args: the auxiliary load-balancing loss of transformers' Qwen3-MoE, whose per-forward
terms the layer keeps for the caller to add to the loss (``last_router_stats``,
``load_balancing_loss``), and the auxiliary-loss-free per-expert bias of DeepSeek-V3, which
only shifts which experts are chosen and which the caller updates once per optimizer step
from the token counts the layer accumulates (``tokens_per_expert``, ``update_expert_bias``).

Nothing here knows about parallelism: expert parallelism and the trainer's use of the
counts and of the loss are built on top of this module.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import fill_trunc_normal_


@dataclass(frozen=True)
class MoEArgs:
    dim: int
    """Width of the tokens going in and out."""
    n_experts: int
    """Routed experts in the layer."""
    top_k: int
    """Experts each token is sent to."""
    hidden_dim: int
    """Hidden width of each expert's SwiGLU (transformers' moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Rescale each token's k router probabilities to sum to 1 (else they are used as they are)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the auxiliary load-balancing loss in the training loss (0: no such loss). The
    layer keeps the loss's terms; the caller adds coefficient x loss."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free expert bias at each update (0: the bias stays 0)."""

    def __post_init__(self):
        for name in ("dim", "n_experts", "top_k", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEArgs.top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        for name in ("router_aux_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEArgs.{name} must be 0 or more, got {getattr(self, name)}")


# --- Routing ------------------------------------------------------------------------


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


# --- Experts ------------------------------------------------------------------------


@lru_cache
def _cuda_has_grouped_mm(device_index: int) -> bool:
    # torch documents grouped GEMM for CUDA devices of compute capability 8.0 and above.
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply x [rows, in] by weight [E, out, in]: both
    bfloat16 (the only dtype of its compile-time rules, even though the CPU kernel also takes
    float32), on the CPU or a capable CUDA device, with rows of a multiple of 16 bytes."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if x.shape[-1] % 8 or weight.shape[-2] % 8:
        return False
    if x.device.type == "cuda":
        return _cuda_has_grouped_mm(x.device.index or 0)
    return x.device.type == "cpu"


def expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """x [rows, in], sorted by expert with counts[e] rows for expert e, times each expert's
    weight[e] [out, in] transposed: [rows, out]. ``grouped`` runs one grouped GEMM; otherwise a
    loop over experts runs one matmul each (exact, any dtype, but it reads the counts on the host)."""
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return _linear_per_expert(x, weight, counts)


# Eager also inside a compiled block (which breaks its graph here): the split sizes are read
# on the host, and the compiler cannot size the pieces from values it does not know.
@torch.compiler.disable
def _linear_per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    rows = x.split(counts.tolist())
    # unbind, not weight[e]: each index's backward fills a zero tensor the size of the whole
    # stacked weight (cost growing with the square of the expert count); unbind's stacks once.
    return torch.cat([F.linear(expert_rows, w) for w, expert_rows in zip(weight.unbind(0), rows, strict=True)])


def swiglu_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    use_grouped_mm: bool | None,
) -> torch.Tensor:
    """Each expert's SwiGLU on its rows of x [rows, dim] (sorted by expert, counts[e] rows for
    expert e, of the len(counts) experts whose weights are stacked in w1, w2, w3): [rows, dim].
    ``use_grouped_mm`` None: grouped GEMM wherever it fits; False: always the loop."""
    # w1 fitting means dim and hidden_dim both do, and so w2 and w3 fit too.
    grouped = use_grouped_mm is not False and grouped_mm_fits(x, w1)
    hidden = F.silu(expert_linear(x, w1, counts, grouped)) * expert_linear(x, w3, counts, grouped)
    return expert_linear(hidden, w2, counts, grouped)


class GroupedExperts(nn.Module):
    """n_experts SwiGLU feed-forwards, w2(silu(w1 x) * w3 x), their weights stacked: w1 and
    w3 [n_experts, hidden_dim, dim], w2 [n_experts, dim, hidden_dim] ([out, in] per expert,
    as nn.Linear and transformers' per-expert checkpoints keep them)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, args.hidden_dim))
        self.w3 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.use_grouped_mm: bool | None = None  # None: wherever grouped_mm_fits; False: always the loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [rows, dim] sorted by expert, counts [n_experts] rows per expert -> [rows, dim]."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.use_grouped_mm)

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        fill_trunc_normal_(self.w1, std=0.02, generator=generator)
        fill_trunc_normal_(self.w2, std=out_std, generator=generator)
        fill_trunc_normal_(self.w3, std=out_std, generator=generator)


def _recomputing() -> bool:
    """Whether autograd is running a backward pass now, the only time a module's forward runs
    inside one being activation checkpointing's recomputation. Inside a compiled graph the
    recomputation is part of the compiled backward, which does not run the forward's code."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


# --- The layer ----------------------------------------------------------------------


@dataclass
class RouterStats:
    """One forward's terms of the auxiliary load-balancing loss. The counts are those of the
    experts really chosen, so with the expert bias on they follow the biased choice."""

    token_counts: torch.Tensor  # [n_experts] float32: (token, expert) pairs per expert
    prob_sums: torch.Tensor  # [n_experts] float32: router probability summed over the tokens (has grad)
    n_tokens: int


class MoE(nn.Module):
    """The routed mixture-of-experts feed-forward: a drop-in for a dense feed-forward block."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args)
        # Trained by update_expert_bias, not by the optimizer; saved, so a resumed run routes
        # as the interrupted one did (0 throughout when bias_update_rate is 0).
        self.register_buffer("expert_bias", torch.empty(args.n_experts, dtype=torch.float32))
        # (token, expert) pairs per expert, summed over the training forwards since the last
        # reset_load(): what the bias update and the load metrics read. Not saved: a step's
        # counts start from 0. Integers, so exact at any count, and left as they are when the
        # model is cast to another floating-point dtype.
        self.register_buffer("tokens_per_expert", torch.empty(args.n_experts, dtype=torch.int64), persistent=False)
        # The auxiliary losses of the forwards since the last reset_load(), each weighted by its
        # share of aux_loss_step_tokens, kept by the first MoE layer of each model (or stage)
        # forward (see add_load_balancing_loss): what the metrics read. Not saved.
        self.register_buffer("aux_loss_sum", torch.empty((), dtype=torch.float32), persistent=False)
        self.last_router_stats: RouterStats | None = None
        # The tokens of one optimizer step over all ranks, set by the trainer: each forward's
        # auxiliary loss weighs its tokens' share of them, so that the summed gradients are the
        # mean over the step's forwards. None: every forward weighs 1.
        self.aux_loss_step_tokens: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = self.expert_bias if self.args.bias_update_rate > 0 else None
        # The router is called as a module, not read as a weight, so that hooks on it act
        # (tensor parallelism hands it a weight held whole on every rank, as a DTensor).
        logits = self.gate(tokens)
        routing = route_logits(logits, tokens.dtype, self.args.top_k, self.args.norm_topk_prob, bias)
        counts = count_tokens(routing.experts, self.args.n_experts)
        self._record(routing, counts, tokens.shape[0])
        # Every (token, expert) pair becomes one row; a stable sort by expert keeps each
        # expert's rows in token order.
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        rows = tokens[order // self.args.top_k]
        expert_out = self.experts(rows, counts)
        per_pair = expert_out[torch.argsort(order)].view(tokens.shape[0], self.args.top_k, -1)
        out = (per_pair * routing.weights.unsqueeze(-1)).sum(dim=1)
        return out.view(shape)

    # Eager also inside a compiled block (which breaks its graph here): the compiler refuses
    # state kept across calls inside activation checkpointing's traced region, and eager code
    # can tell the recomputation from the forward.
    @torch.compiler.disable
    def _record(self, routing: Routing, counts: torch.Tensor, n_tokens: int) -> None:
        """Keep what the load balancing and the metrics read later. A forward that activation
        checkpointing runs again during the backward pass routes the same tokens again and is
        not counted twice, nor does it replace the kept stats."""
        if _recomputing():
            return
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts
        if self.args.router_aux_loss_coef > 0:
            self.last_router_stats = RouterStats(counts.float(), routing.probs.sum(dim=0), n_tokens)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """One step of the auxiliary-loss-free balancing: experts that got fewer tokens than
        the mean are raised by bias_update_rate, those that got more are lowered, and the step
        is centred so that the biases keep a mean of 0. ``tokens_per_expert`` is this layer's
        count, all-reduced first over the ranks that saw different tokens. ``skip``: a flag on
        the device (non-zero: the optimizer step was not applied, and neither is this one).
        Runs on the device (no value is read on the host)."""
        load = tokens_per_expert.float()
        step = self.args.bias_update_rate * torch.sign(load.mean() - load)
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
        self.aux_loss_sum.zero_()

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


# --- Hugging Face's per-expert weights ----------------------------------------------

# transformers checkpoints save each expert's projections apart:
# {prefix}.{e}.gate_proj.weight [hidden, dim] (w1), up_proj (w3), down_proj [dim, hidden] (w2).
HF_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def stack_hf_experts(hf_state: dict[str, torch.Tensor], prefix: str, n_experts: int) -> dict[str, torch.Tensor]:
    """{"w1", "w2", "w3"}: the stacked weights of the experts saved under ``prefix`` (for
    example "model.layers.3.mlp.experts"); a KeyError names the first key that is missing."""
    stacked = {}
    for ours, theirs in HF_EXPERT_NAMES.items():
        keys = [f"{prefix}.{e}.{theirs}.weight" for e in range(n_experts)]
        missing = next((key for key in keys if key not in hf_state), None)
        if missing is not None:
            raise KeyError(f"expert weight '{missing}' is missing ({n_experts} experts expected under '{prefix}')")
        stacked[ours] = torch.stack([hf_state[key] for key in keys])
    return stacked


def unstack_hf_experts(stacked: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The per-expert keys and tensors of ``stacked`` {"w1", "w2", "w3"}; the tensors are views
    into the stacked ones (clone them before saving with safetensors, which refuses shared memory)."""
    return {
        f"{prefix}.{e}.{theirs}.weight": expert
        for ours, theirs in HF_EXPERT_NAMES.items()
        for e, expert in enumerate(stacked[ours].unbind(0))
    }
