"""Where parallelism is applied: activation checkpointing, torch.compile, then FSDP2.

The order matters and is fixed:
  1. activation checkpointing wraps each transformer block, so that
  2. torch.compile sees the checkpointed block and compiles recomputation with it, and
  3. fully_shard runs last, around the (compiled, checkpointed) blocks and then the
     root, so FSDP's all-gather/reduce-scatter hooks sit outside compiled code.
The model must still be on the meta device; the caller materialises it afterwards.
"""

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.parallel.parallel_dims import ParallelDims

# Ops whose outputs per-op selective checkpointing keeps: the matmuls and the attention
# kernels, which are most of the FLOPs. Everything else (norms, RoPE, SwiGLU's gate) is
# cheap elementwise work and is recomputed in backward.
_aten = torch.ops.aten
_SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default} | {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
}


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(layers: nn.ModuleDict, mode: str, selective_option: str) -> None:
    """Wrap blocks in place: every block (full), every N-th block (selective N), or every
    block keeping only matmul/attention outputs (selective op)."""
    if mode == "none":
        return
    per_op = mode == "selective" and selective_option == "op"
    every_nth = int(selective_option) if mode == "selective" and not per_op else 1
    for index, (name, block) in enumerate(layers.named_children()):
        if index % every_nth != 0:
            continue
        if per_op:
            context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)
            block = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        else:
            # Llama has no dropout, so the RNG state need not be saved and restored.
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        layers.register_module(name, block)


def apply_compile(layers: nn.ModuleDict) -> None:
    """Compile each block separately: blocks are identical, so one compiled graph is reused
    and FSDP's per-block hooks stay between graphs."""
    for block in layers.values():
        block.compile(fullgraph=True)


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleDict,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool,
) -> None:
    """One FSDP unit per block plus the root (embeddings, final norm, output)."""
    # No cast of forward arguments: a block's arguments are the hidden state and the RoPE
    # cos/sin tables, and the tables must stay float32 as in a single process (bf16 keeps
    # 8 significant bits of each value). The hidden state needs no cast: the embedding
    # weight is gathered in param_dtype, so the first block already gets it in that
    # dtype, and every block returns it in that dtype. The root's only input is token ids.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    options = {"mesh": mesh, "mp_policy": policy}
    if cpu_offload:
        # Pinned host memory makes the copies to the GPU asynchronous; it needs CUDA.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = list(layers.values())
    for index, block in enumerate(blocks):
        if reshard_after_forward == "never":  # SHARD_GRAD_OP / ZeRO-2
            reshard = False
        elif reshard_after_forward == "always":  # FULL_SHARD / ZeRO-3
            reshard = True
        else:
            # Backward starts with the last block, so freeing it after forward would
            # only force an immediate second all-gather.
            reshard = index < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **options)
    # Gradients are summed, not averaged, across ranks: the trainer already divides the
    # loss by the number of tokens in the whole global batch. A factor of 1 with forced
    # SUM reductions is a plain SUM collective (gloo has neither AVG nor PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize_decoder(
    model: nn.Module, parallel_dims: ParallelDims, mesh: DeviceMesh | None, job_config: JobConfig
) -> nn.Module:
    """Apply AC, compile and FSDP, in that order, to a decoder with a ``layers`` ModuleDict."""
    ac = job_config.activation_checkpoint
    apply_activation_checkpointing(model.layers, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model.layers)
    if mesh is not None:
        training = job_config.training
        apply_fsdp(
            model,
            model.layers,
            mesh,
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            cpu_offload=training.enable_cpu_offload,
        )
    return model


def compute_context(parallel_dims: ParallelDims, param_dtype: str, device_type: str):
    """Mixed precision for forward/backward. Under FSDP the policy casts parameters; a
    single process has no FSDP, so autocast provides the same bf16 compute instead."""
    if parallel_dims.world_size > 1 or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[param_dtype])
