"""The weights tensor parallelism holds whole on every TP rank instead of splitting them, counted
on the model itself (e.g. built on meta), so that the estimate follows any family's plan:

  attention  the modules its block's attention_tp_plan (data in the model's folder, read by
             parallel/parallelize.py) marks "replicate": DeepSeek-V3's low-rank
             down-projections and their norms (wq_a, q_norm, wkv_a, kv_norm). Every TP rank runs
             them on the whole micro-batch (their FLOPs are not split), and in backward the
             gradient of each one's output, consumed by heads split over the ranks, is a partial
             sum that one all-reduce of its features completes; the weights' own gradients then
             come out whole on every rank (no further sum).
  MoE        an MoE layer's weights beside its routed experts: the router and the shared experts
             (parallel/moe_tensor_parallel.py). They run on the rank's own tokens (their FLOPs
             split by token), and their gradients are partial sums over tp.

Both are what FSDP gathers whole on a TP rank rather than 1/t of."""

from dataclasses import dataclass, fields

from torch import nn

from titanlite.models.moe import moe_layers


@dataclass(frozen=True)
class HeldWhole:
    """Of some blocks, the weights tensor parallelism holds whole on every TP rank."""

    attention: int = 0  # attention's weights in "replicate" modules: run whole on every TP rank
    attention_outputs: int = 0  # per token, the features those modules' linear maps output (summed in backward)
    moe: int = 0  # MoE layers' weights beside the routed experts: routers and shared experts

    @property
    def params(self) -> int:
        return self.attention + self.moe

    def __add__(self, other: "HeldWhole") -> "HeldWhole":
        return HeldWhole(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _numel(module: nn.Module) -> int:
    return sum(param.numel() for param in module.parameters())


def _attention_held_whole(block: nn.Module) -> HeldWhole:
    modules = [
        getattr(block.attention, name)
        for name, how in block.attention_tp_plan.items()
        if how == "replicate" and hasattr(block.attention, name)
    ]
    outputs = sum(
        linear.out_features for module in modules for linear in module.modules() if isinstance(linear, nn.Linear)
    )
    return HeldWhole(attention=sum(_numel(module) for module in modules), attention_outputs=outputs)


def held_whole(module: nn.Module) -> HeldWhole:
    """What tensor parallelism holds whole in ``module`` (a model, a block, or a pipeline stage's
    part): summed over the blocks in it (the modules that carry an attention_tp_plan) and its
    MoE layers."""
    total = HeldWhole()
    for block in module.modules():
        if hasattr(block, "attention_tp_plan") and hasattr(block, "attention"):
            total = total + _attention_held_whole(block)
    beside_experts = sum(_numel(layer) - _numel(layer.experts) for layer in moe_layers(module))
    return total + HeldWhole(moe=beside_experts)
