"""The arguments of a mixture-of-experts layer: how its router chooses and weighs experts,
and how training keeps the experts' load even."""

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
BIAS_UPDATE_RULES = ("sign", "proportional")

# The auxiliary balancing losses, in the order a layer tallies them, each with the MoEArgs
# field that weighs it in the training loss (balancing.py defines them).
BALANCE_LOSSES = ("aux", "load_balance", "seq_balance", "z")
BALANCE_LOSS_COEFS = ("router_aux_loss_coef", "load_balance_coef", "seq_balance_coef", "z_loss_coef")


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
    score_func: str = "softmax"
    """How the router's logits become scores: "softmax" over the experts (Qwen3-MoE) or an
    independent "sigmoid" per expert (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Rescale each token's k chosen scores to sum to 1 (else they are used as they are)."""
    route_scale: float = 1.0
    """Factor on every chosen expert's weight, after the rescaling (DeepSeek-V3's
    routed_scaling_factor; 1 in Qwen3-MoE)."""
    n_groups: int = 1
    """Group-limited selection: the experts form n_groups groups of consecutive experts, and
    a token chooses its experts among those of its topk_groups best groups only (DeepSeek-V3's
    n_group); 1: no groups."""
    topk_groups: int = 1
    """Groups each token chooses its experts from (DeepSeek-V3's topk_group), ranked by the
    sum of each group's two highest scores (bias included)."""
    router_aux_loss_coef: float = 0.0
    """Weight of transformers' auxiliary load-balancing loss, pooled over the layers of a
    forward, in the training loss (0: no such loss)."""
    load_balance_coef: float = 0.0
    """Weight of the per-layer load-balancing loss (Megatron's form), summed over the layers."""
    seq_balance_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, summed over the layers."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE's), summed over the layers."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free expert bias at each update (0: the bias stays 0): the
    step itself under the "sign" rule, the step at an expert's load of twice the mean under
    "proportional"."""
    bias_update_rule: str = "sign"
    """How the bias moves each expert from the step's load: "sign" (DeepSeek-V3's: by the
    rate, up when below the mean load, down when above) or "proportional" (by the rate times
    (mean - load) / mean: far from even it moves fast, near even it barely moves)."""
    route_by_bias: bool = False
    """Choose experts by score plus expert bias even when bias_update_rate is 0: for a model
    whose checkpoints carry a trained bias (DeepSeek-V3's e_score_correction_bias). False:
    the bias takes part only while training updates it."""

    def __post_init__(self):
        for name in ("dim", "n_experts", "top_k", "hidden_dim", "n_groups", "topk_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEArgs.top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEArgs.score_func must be one of {', '.join(SCORE_FUNCS)}, got '{self.score_func}'")
        if self.bias_update_rule not in BIAS_UPDATE_RULES:
            rules = ", ".join(BIAS_UPDATE_RULES)
            raise ValueError(f"MoEArgs.bias_update_rule must be one of {rules}, got '{self.bias_update_rule}'")
        if self.route_scale <= 0:
            raise ValueError(f"MoEArgs.route_scale must be above 0, got {self.route_scale}")
        for name in (*BALANCE_LOSS_COEFS, "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEArgs.{name} must be 0 or more, got {getattr(self, name)}")
        self._check_groups()

    def _check_groups(self) -> None:
        if self.n_experts % self.n_groups:
            raise ValueError(f"MoEArgs.n_groups ({self.n_groups}) must divide n_experts ({self.n_experts})")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"MoEArgs.topk_groups ({self.topk_groups}) must not exceed n_groups ({self.n_groups})")
        reachable = self.topk_groups * self.experts_per_group
        if self.top_k > reachable:
            raise ValueError(
                f"MoEArgs.top_k ({self.top_k}) must not exceed the experts of topk_groups groups "
                f"({self.topk_groups} x {self.experts_per_group})"
            )

    @property
    def experts_per_group(self) -> int:
        return self.n_experts // self.n_groups

    @property
    def balance_loss_coefs(self) -> tuple[float, ...]:
        """The weight of each of BALANCE_LOSSES, in that order."""
        return tuple(getattr(self, name) for name in BALANCE_LOSS_COEFS)

    @property
    def has_balance_loss(self) -> bool:
        return any(coef > 0 for coef in self.balance_loss_coefs)

    @property
    def worst_load(self) -> float:
        """The largest max / mean tokens per expert a layer can reach: every token's k
        choices on the same k experts, each of which gets n_experts / top_k times the mean."""
        return self.n_experts / self.top_k


# The model args' fields (every MoE family spells them alike, as the [model] keys that
# override them) that give each MoEArgs field.
_MODEL_ARGS_FIELDS = {
    "score_func": "moe_score_func",
    "norm_topk_prob": "norm_topk_prob",
    "route_scale": "moe_route_scale",
    "n_groups": "moe_n_groups",
    "topk_groups": "moe_topk_groups",
    "router_aux_loss_coef": "moe_aux_loss_coef",
    "load_balance_coef": "moe_load_balance_coef",
    "seq_balance_coef": "moe_seq_balance_coef",
    "z_loss_coef": "moe_z_loss_coef",
    "bias_update_rate": "moe_bias_update_rate",
    "bias_update_rule": "moe_bias_update_rule",
}


# The model args' fields that only steer training (the balancing): left out of what
# decides whether two args describe the same model, so a run may resume with others.
MODEL_BALANCING_FIELDS = tuple(
    _MODEL_ARGS_FIELDS[name] for name in (*BALANCE_LOSS_COEFS, "bias_update_rate", "bias_update_rule")
)


def moe_args_of(model_args, **shape) -> MoEArgs:
    """The MoEArgs of a family's model args: the router and balancing fields they spell as
    _MODEL_ARGS_FIELDS says, and ``shape`` (dim, n_experts, top_k, hidden_dim, ...) given as is."""
    return MoEArgs(**shape, **{ours: getattr(model_args, theirs) for ours, theirs in _MODEL_ARGS_FIELDS.items()})
