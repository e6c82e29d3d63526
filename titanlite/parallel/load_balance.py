"""MoE load balancing over the training loop's steps.

After every optimizer step that was applied, each MoE layer's token counts (accumulated by
the layer over the step's forwards) are summed over the ranks that routed different tokens:
the data-parallel ranks, and the ranks of a tensor-parallel group, each of which routes its
own slice of the sequence (moe_tensor_parallel.py). Under pipeline parallelism each stage
sums its own layers over its own data-parallel and tensor-parallel groups. The sums update
the auxiliary-loss-free expert bias, and the counts start again from 0. Everything runs on
the device: no value is read on the host. The step's load per layer (max / mean tokens per
expert) and balancing losses stay on the device for the metrics, which read them at log
steps only.
"""

import re

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.moe import BALANCE_LOSSES, MoE, MoEArgs
from titanlite.parallel.parallel_dims import ParallelDims

# A block's index in a module name: "layers.3.feed_forward", also under the wrappers that
# activation checkpointing or compile add below the block's name.
_BLOCK_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoadBalancer:
    """The MoE layers of ``model`` (this rank's pipeline stages under PP), balanced over the
    data-parallel ranks of ``mesh``. ``after_step`` is an optimizer step post-hook.
    ``moe_args``: the model's MoE layers' args (those of every stage, also of a stage
    holding none)."""

    def __init__(self, model: nn.Module, n_layers: int, dims: ParallelDims, mesh, step_tokens: int, moe_args: MoEArgs):
        named = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
        self.layers = [module for _, module in named]
        self.block_indices = [int(_BLOCK_INDEX.search(name).group(1)) for name, _ in named]
        self.n_layers = n_layers
        dp_mesh = dims.dp_mesh(mesh)
        # The groups the counts are summed over, one after the other. HSDP's and DDP's
        # data-parallel mesh is 2-D: a sum over each dimension in turn is the sum over all its
        # ranks. Then tp: each TP rank routes its own slice of the sequence.
        self.count_groups = [] if dp_mesh is None else [dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim)]
        tp_mesh = dims.tp_mesh(mesh)
        self.count_groups += [] if tp_mesh is None else [tp_mesh.get_group()]
        # For the metrics' one sum over all ranks: every rank of a stage holds the same load
        # values, and the ranks of a tensor- and context-parallel group the same balancing losses
        # (each rank's the whole forward's: their terms are summed over tp and cp,
        # add_load_balancing_loss).
        self.ranks_per_stage, self.token_ranks = dims.world_size // dims.pp, dims.tp * dims.cp
        self.losses_on = [coef > 0 for coef in moe_args.balance_loss_coefs]
        for layer in self.layers:
            layer.aux_loss_step_tokens = step_tokens
        self.step_load: torch.Tensor | None = None  # [layers here] float32: max / mean of the last step
        self.step_losses: torch.Tensor | None = None  # [BALANCE_LOSSES]: this rank's share of the last step's
        pipeline = getattr(model, "pipeline", None)  # a LocalModel's, under pipeline parallelism
        if pipeline is not None:
            forget_metadata_inference(pipeline.stages, self.layers)

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer, *_) -> None:
        """Sum the counts over the data-parallel and TP ranks, update the expert biases, keep
        the step's load and balancing losses, and start the counts again. A fused optimizer runs
        every step and skips a non-finite one on the device (its found_inf flag): so do the
        biases. Other kernels are not called on such a step (titanlite.nonfinite), and its
        counts join the next step's."""
        if not self.layers:
            return
        counts = torch.stack([layer.tokens_per_expert for layer in self.layers])  # [layers, experts]
        for group in self.count_groups:
            dist.all_reduce(counts, group=group)
        skip = getattr(optimizer, "found_inf", None)
        for layer, layer_counts in zip(self.layers, counts.unbind(0), strict=True):
            if layer.args.bias_update_rate > 0:
                layer.update_expert_bias(layer_counts, skip)
        load = counts.float()
        self.step_load = load.amax(dim=1) / load.mean(dim=1).clamp(min=1.0)
        self.step_losses = torch.stack([layer.balance_loss_sums for layer in self.layers]).sum(dim=0)
        for layer in self.layers:
            layer.reset_load()

    def routed_counts(self) -> list[torch.Tensor]:
        """This rank's routed-token counts of the step so far, one per layer (summed in place
        over other replica groups by fault tolerance before after_step sums them here)."""
        return [layer.tokens_per_expert for layer in self.layers]

    def discard_step(self) -> None:
        """Forget a step that was not applied (its counts must not join the next step's)."""
        for layer in self.layers:
            layer.reset_load()

    def step_metrics(self) -> tuple[dict[int, float], dict[str, float]]:
        """({block index: load} of every MoE layer over all stages, {name: loss summed over
        the stages} of the BALANCE_LOSSES that are on), of the last step. Every rank must call
        it: one all-reduce gathers the stages' layers, then one read on the host."""
        device = self.layers[0].tokens_per_expert.device if self.layers else torch.device("cpu")
        n_losses = len(BALANCE_LOSSES)
        # [load per block (0 where none)..., 1 per block holding an MoE layer..., the losses]
        values = torch.zeros(2 * self.n_layers + n_losses, device=device)
        if self.step_load is not None:
            where = torch.tensor(self.block_indices, device=device)
            values[where] = self.step_load / self.ranks_per_stage
            values[where + self.n_layers] = 1.0 / self.ranks_per_stage
            values[-n_losses:] = self.step_losses / self.token_ranks
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)
        values = values.tolist()
        held = values[self.n_layers : 2 * self.n_layers]
        loads = {block: values[block] for block in range(self.n_layers) if held[block] > 0.5}
        on = zip(BALANCE_LOSSES, values[-n_losses:], self.losses_on, strict=True)
        losses = {name: value for name, value, is_on in on if is_on}
        return loads, losses


def forget_metadata_inference(stages: list, layers: list[MoE]) -> None:
    """torch 2.13's pipeline stages learn their tensors' shapes at the first step by running
    each stage's forward (and backward) once more, the later stages on uninitialised inputs:
    those forwards would count as routed tokens (and add a NaN to the auxiliary loss's
    tally). The inference ends, before any real micro-batch, with each stage's
    _post_metadata_inference_cleanup: the layers' counts start again from 0 after it."""
    for stage in stages:
        cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
        if cleanup is None:  # a torch that infers otherwise: nothing known to run extra forwards
            continue

        def cleanup_and_reset(cleanup=cleanup):
            cleanup()
            for layer in layers:
                layer.reset_load()

        stage._post_metadata_inference_cleanup = cleanup_and_reset
