"""A mixture-of-experts feed-forward layer, top to bottom.

x [batch, seq, dim] -> router (float32 linear, softmax or sigmoid, top-k, optionally within
the best groups of experts) -> every token's k (expert, weight)
pairs -> the pairs sorted by expert -> each expert's SwiGLU on its rows (one grouped GEMM,
or a loop over experts) -> the rows put back in token order -> weighted sum over each
token's k experts -> [batch, seq, dim]

Token choice without a capacity limit: every token reaches all of its k experts, however
unevenly they are chosen (no token is dropped). Two ways to keep the load even, chosen by
the args: auxiliary balancing losses (transformers' pooled load-balancing loss, Megatron's
per-layer one, DeepSeek-V3's sequence-wise one and the router z-loss), whose per-forward
terms the layer keeps for the caller to add to the loss (``last_router_stats``,
``add_load_balancing_loss``), and the auxiliary-loss-free per-expert bias of DeepSeek-V3,
which only shifts which experts are chosen and which the caller updates once per optimizer
step from the token counts the layer accumulates (``tokens_per_expert``,
``update_expert_bias``).

Nothing here knows about parallelism: expert parallelism and the trainer's use of the
counts and of the loss are built on top of this module.

The layer's parts, in the order a token meets them: args.py, router.py, experts.py,
layer.py (the layer itself) and balancing.py (the auxiliary losses).
"""

from titanlite.models.moe.args import BALANCE_LOSSES, MODEL_BALANCING_FIELDS, SCORE_FUNCS, MoEArgs, moe_args_of
from titanlite.models.moe.balancing import (
    RouterStats,
    add_load_balancing_loss,
    layer_balance_loss,
    load_balancing_loss,
    router_z_loss,
    sequence_balance_loss,
)
from titanlite.models.moe.experts import (
    HF_EXPERT_NAMES,
    GroupedExperts,
    expert_linear,
    grouped_mm_fits,
    stack_hf_experts,
    swiglu_experts,
    unstack_hf_experts,
)
from titanlite.models.moe.layer import MoE, moe_layers
from titanlite.models.moe.router import (
    RouterGate,
    Routing,
    count_tokens,
    keep_top_groups,
    route,
    route_logits,
    router_logits,
)

__all__ = [
    "BALANCE_LOSSES",
    "HF_EXPERT_NAMES",
    "MODEL_BALANCING_FIELDS",
    "SCORE_FUNCS",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "RouterGate",
    "RouterStats",
    "Routing",
    "add_load_balancing_loss",
    "count_tokens",
    "expert_linear",
    "grouped_mm_fits",
    "keep_top_groups",
    "layer_balance_loss",
    "load_balancing_loss",
    "moe_args_of",
    "moe_layers",
    "route",
    "route_logits",
    "router_logits",
    "router_z_loss",
    "sequence_balance_loss",
    "stack_hf_experts",
    "swiglu_experts",
    "unstack_hf_experts",
]
