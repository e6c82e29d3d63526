"""The arguments of a mixture-of-experts layer."""

from dataclasses import dataclass


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
