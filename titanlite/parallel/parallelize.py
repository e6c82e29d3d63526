"""Where parallelism is applied: expert parallelism, tensor parallelism, activation
checkpointing, torch.compile, then FSDP2.

The order matters and is fixed:
  1. expert parallelism splits each mixture-of-experts layer's stacked experts over the
     ``ep`` ranks (DTensors, Shard(0)), with the all-to-alls that carry tokens to them. It
     comes first because it reads the experts' plain (meta) weights, before tensor
     parallelism would make them Replicate DTensors on ``tp``; its ep groups take all the
     tp ranks (and some shard ranks);
  2. tensor parallelism turns each block's matrices into DTensors split over the mesh's
     ``tp`` dimension, with the collectives between them; everything after sees the
     already-split block. Each MoE layer's router and experts it holds whole on every TP
     rank, which routes its own slice of the sequence (moe_tensor_parallel.py), and it
     leaves experts EP has split on their own mesh;
  3. activation checkpointing wraps each transformer block, so that
  4. torch.compile sees the checkpointed block and compiles recomputation (and TP's
     collectives) with it; where torch 2.13 cannot compile a checkpoint (MoE blocks, and TP
     blocks whose checkpoint recomputes attention: apply_compile says why) it compiles the
     block inside its wrapper instead, the wrapper still applied first; and
  5. fully_shard runs last, around the (compiled, checkpointed) blocks and then the
     root, over the mesh's data-parallel dimensions, so FSDP's all-gather/reduce-scatter
     hooks sit outside compiled code and shard the TP shards further. Experts split by EP
     get their own unit inside their block's, over the data-parallel ranks EP leaves.
The model must still be on the meta device; the caller materialises it afterwards.
"""

import contextlib
import os
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.models.moe import MoE, moe_layers
from titanlite.parallel.context_parallel import apply_context_parallel, sequence_split
from titanlite.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel

# Ops whose outputs per-op selective checkpointing keeps: the matmuls (plain, grouped for
# MoE experts, and float8's scaled ones) and the attention kernels, which are most of the
# FLOPs; and float8's per-tensor amax (max.default, one number), which would otherwise read
# a whole activation again. Everything else (norms, RoPE, SwiGLU's gate) is cheap
# elementwise work and is recomputed in backward. FlexAttention (block_causal on CUDA) is a
# higher-order op that reaches the policy as itself where a compiled block traces it; in an
# eager block it runs as torch's compiled flex_attention, which the policy does not see (it is
# recomputed there).
_aten = torch.ops.aten
_SAVED_OPS = (
    {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.max.default}
    | {torch.ops.higher_order.flex_attention}
    | {
        getattr(_aten, name).default
        for name in (
            "_grouped_mm",
            "_scaled_mm",
            "_scaled_grouped_mm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
        if hasattr(_aten, name)
    }
)


# --- Expert parallelism ----------------------------------------------------------------


def _shard_experts_by_row(param: nn.Parameter) -> Shard:
    """FSDP's placement for an expert-parallel weight [local experts, out, in]: its rows
    (dimension 1). Dimension 0 is already split by EP; FSDP's default Shard(0) on top would
    make a strided shard (each rank a slice of every EP block), where Shard(1) keeps both
    splits plain (EP by expert, FSDP by row within each expert)."""
    return Shard(1)


# --- Activation checkpointing, compile, FSDP ------------------------------------------


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def saves_per_op(mode: str, selective_option: str) -> bool:
    """Whether AC keeps chosen ops' outputs (the attention's among them) in every block,
    rather than recomputing whole blocks."""
    return mode == "selective" and selective_option == "op"


def apply_activation_checkpointing(layers: nn.ModuleDict, mode: str, selective_option: str) -> None:
    """Wrap blocks in place: every block (full), every N-th block (selective N), or every
    block keeping only matmul/attention outputs (selective op)."""
    if mode == "none":
        return
    per_op = saves_per_op(mode, selective_option)
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


def keep_compiled_graphs_per_rank() -> None:
    """Turn off torch's AOTAutograd cache, which hands one rank the graph another rank traced.
    Its key for a DTensor holds the mesh and placements but not this rank's place in the mesh
    (torch 2.13), while TP code bakes that place in: loss parallel, for one, compares the labels
    with its rank's slice of the vocabulary. With a warm cache every rank ran the first rank's
    graph, and the loss and gradients came out silently wrong. Inductor's FX graph cache, keyed
    on the traced graph itself (constants included), stays on."""
    import torch._functorch.config as functorch_config  # not loaded by `import torch`

    functorch_config.enable_autograd_cache = False


def keep_compiled_code_per_cpu_isa() -> None:
    """Give inductor a cache folder per CPU vector ISA (under the user's TORCHINDUCTOR_CACHE_DIR
    or torch's default). torch 2.13's FX graph cache key leaves the ISA out, so a graph whose
    C++ was generated for AVX-512 (16 floats a vector) is served to a process that picked AVX2
    (ATEN_CPU_CAPABILITY=avx2, or another host sharing the folder) and compiled with 8-float
    vectors: every vector loop then skips half its elements, and an indexing kernel failed
    with "index out of bounds" (reproduction in docs/performance.md)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = f"isa-{type(pick_vec_isa()).__name__}"  # VecAVX2, VecAVX512, VecAMX, InvalidVecISA ...
    if os.path.basename(cache_dir()) != folder:  # cache_dir() reads and sets TORCHINDUCTOR_CACHE_DIR
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), folder)


def apply_compile(layers: nn.ModuleDict, tp: bool, recomputes_blocks: bool) -> None:
    """Compile each block separately: blocks are identical, so one compiled graph is reused
    and FSDP's per-block hooks stay between graphs. A block with an MoE layer is compiled in
    pieces around what stays eager (the layer's counting, the float32 loop over experts,
    expert-parallel experts' call). ``tp``: the blocks hold DTensors; ``recomputes_blocks``:
    a checkpointed block is recomputed whole (full or every-N-th AC, not per-op).

    A checkpointed block is compiled wrapper and all, its recomputation in the compiled
    backward, but torch 2.13 fails at that in two cases, where the block is compiled inside
    its wrapper and torch.utils.checkpoint runs eagerly around it:
    - an MoE block: checkpoint runs eagerly as a whole when its region breaks the graph;
    - a TP block recomputed whole. Attention kernels are marked as drawing random numbers
      (dropout), so the compiler saves the RNG state for the recomputation; on the CPU as
      one more saved output, which torch places after the DeviceMesh the DTensor gradients
      need, where only tensors are expected ("expected all tensors_saved_with_vc_check to be
      Tensors"). CUDA passes the state otherwise; one layout on every device is what CI tests."""
    for block in layers.values():
        has_moe = any(isinstance(module, MoE) for module in block.modules())
        if isinstance(block, CheckpointWrapper) and (has_moe or (tp and recomputes_blocks)):
            block._checkpoint_wrapped_module.compile(fullgraph=not has_moe)
        else:
            block.compile(fullgraph=not has_moe)


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleDict,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """One FSDP unit per block plus the root (embeddings, final norm, output). With expert
    parallelism each block's experts are a unit of their own first, over ``expert_mesh``
    (the data-parallel ranks holding the same experts), since their EP split already uses
    the ep part of the block's mesh."""
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
        for experts in (m for m in block.modules() if isinstance(m, ExpertParallelExperts)):
            expert_options = {**options, "mesh": expert_mesh, "shard_placement_fn": _shard_experts_by_row}
            fully_shard(experts, reshard_after_forward=reshard, **expert_options)
        fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **options)
    # Gradients are summed, not averaged, across ranks: the trainer already divides the
    # loss by the number of tokens in the whole global batch. A factor of 1 with forced
    # SUM reductions is a plain SUM collective (gloo has neither AVG nor PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_gradient_all_reduce(runs_backward, parallel_dims: ParallelDims, enabled: bool) -> None:
    """Whether this micro-step's backward all-reduces across replicas (DDP/HSDP): only a step's last
    needs to; earlier ones only reduce-scatter within the shard group. ``runs_backward``: the
    FSDP-wrapped model, or the Pipeline running its parts (FSDP's method name, on its stages)."""
    if parallel_dims.dp_replicate > 1:
        runs_backward.set_requires_all_reduce(enabled)


def parallelize_decoder(
    model: nn.Module, parallel_dims: ParallelDims, mesh: DeviceMesh | None, job_config: JobConfig
) -> nn.Module:
    """Apply CP, EP, TP, AC, compile and FSDP, in that order, to a Llama-style decoder."""
    parallelism = job_config.parallelism
    # 0. Context parallelism: global RoPE positions, and each attention's kernel all-gathering
    # keys and values over cp (before TP, whose plan then runs the new kernel on local heads).
    split = sequence_split(parallel_dims, mesh, parallelism.context_parallel_load_balancer)
    if split is not None:
        apply_context_parallel(model, parallel_dims.cp_mesh(mesh), split)
    # 1. Expert parallelism over the ep ranks (all of tp's and a split of dp_shard's), every MoE layer.
    ep_mesh = parallel_dims.ep_mesh(mesh)
    if ep_mesh is not None:
        for moe in moe_layers(model):
            apply_expert_parallel(moe, ep_mesh)
    # 2. Tensor parallelism over the mesh's tp dimension (experts split by EP stay as they are).
    tp_mesh = parallel_dims.tp_mesh(mesh)
    if tp_mesh is not None:
        apply_tensor_parallel(
            model,
            tp_mesh,
            sequence_parallel=parallelism.enable_sequence_parallel,
            shard_logits=not parallelism.disable_loss_parallel,
        )
        if parallelism.enable_async_tensor_parallel:
            enable_async_tensor_parallel()
    # 3. Activation checkpointing, per block.
    ac = job_config.activation_checkpoint
    apply_activation_checkpointing(model.layers, ac.mode, ac.selective_ac_option)
    # 4. Compile, per block. Process-wide, so for the compiled loss too.
    if job_config.compile.enable or job_config.model.attn_mask_type == "block_causal":  # FlexAttention compiles
        keep_compiled_code_per_cpu_isa()
    if job_config.compile.enable and tp_mesh is not None:
        keep_compiled_graphs_per_rank()
    if job_config.compile.enable and "model" in job_config.compile.components:
        recomputes_blocks = not saves_per_op(ac.mode, ac.selective_ac_option)
        apply_compile(model.layers, tp=tp_mesh is not None, recomputes_blocks=recomputes_blocks)
    # 5. FSDP over the data-parallel dimensions (the experts over what EP leaves of them).
    dp_mesh = parallel_dims.dp_mesh(mesh)
    if dp_mesh is not None:
        training = job_config.training
        reshard = parallelism.fsdp_reshard_after_forward
        if reshard == "default" and parallel_dims.pp > 1:
            # Every micro-batch of a pipeline step goes through the stage: freeing its
            # parameters after each forward would all-gather them again for every one.
            reshard = "never"
        apply_fsdp(
            model,
            model.layers,
            dp_mesh,
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=reshard,
            cpu_offload=training.enable_cpu_offload,
            expert_mesh=parallel_dims.expert_fsdp_mesh(mesh),
        )
    return model


def compute_context(parallel_dims: ParallelDims, param_dtype: str, device_type: str):
    """Mixed precision for forward/backward. Under FSDP the policy casts parameters; without
    FSDP (one process, or tensor parallelism alone) autocast provides the same bf16 compute."""
    if parallel_dims.fsdp_applied or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[param_dtype])
