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

The layer's parts, in the order a token meets them: args.py, router.py, experts.py,
layer.py (the layer itself) and balancing.py (the auxiliary loss).
"""

from titanlite.models.moe.args import MoEArgs
from titanlite.models.moe.balancing import RouterStats, add_load_balancing_loss, load_balancing_loss
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
from titanlite.models.moe.router import Routing, count_tokens, route, route_logits

__all__ = [
    "HF_EXPERT_NAMES",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "RouterStats",
    "Routing",
    "add_load_balancing_loss",
    "count_tokens",
    "expert_linear",
    "grouped_mm_fits",
    "load_balancing_loss",
    "moe_layers",
    "route",
    "route_logits",
    "stack_hf_experts",
    "swiglu_experts",
    "unstack_hf_experts",
]
