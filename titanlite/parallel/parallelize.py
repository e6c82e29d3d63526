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
from functools import partial

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.models.moe import MoE, moe_layers
from titanlite.parallel.context_parallel import apply_context_parallel, sequence_split
from titanlite.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from titanlite.parallel.float8_styles import float8_styles
from titanlite.parallel.moe_tensor_parallel import moe_tensor_parallel_plan
from titanlite.parallel.parallel_dims import ParallelDims

# Ops whose outputs per-op selective checkpointing keeps: the matmuls (plain, grouped for
# MoE experts, and float8's scaled ones) and the attention kernels, which are most of the
# FLOPs; and float8's per-tensor amax (max.default, one number), which would otherwise read
# a whole activation again. Everything else (norms, RoPE, SwiGLU's gate) is cheap
# elementwise work and is recomputed in backward.
_aten = torch.ops.aten
_SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.max.default} | {
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


# --- Tensor parallelism: the Llama plan ------------------------------------------------
# Megatron-style: in each block the first matrix of a pair is split by output features
# (column-wise: wq/wk/wv by heads, w1/w3 by FFN features) and the second by input features
# (row-wise: wo, w2), so the pair needs one collective, after the second matrix. With
# sequence parallelism the activations between pairs (norms, residuals) are split along
# the sequence instead of repeated: the collective before a pair is an all-gather of the
# sequence, the one after a reduce-scatter back to it.


def tensor_parallel_problem(args, tp: int, split_ffn: bool = True) -> str | None:
    """Why the Llama TP plan cannot split ``args`` over ``tp`` ranks (one line naming the
    key), or None. Each rank must get whole query heads, whole key/value heads (so a query
    head and the key/value head it reads land on the same rank) and, where the feed-forward
    is split (``split_ffn``: a dense one), equal FFN slices."""
    key = "parallelism.tensor_parallel_degree"
    counts = [("attention heads", args.n_heads), ("key/value heads", args.kv_heads)]
    if split_ffn:
        counts.append(("FFN hidden size", args.ffn_hidden_dim))
    for what, count in counts:
        if count % tp != 0:
            return f"{key} ({tp}) must divide the model's {what} ({count})"
    return None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, shard_logits: bool) -> None:
    """Split a Llama decoder over ``tp_mesh`` in place. ``shard_logits``: the output layer
    leaves the logits split by vocabulary (a DTensor) for loss parallel to work on as they are."""
    # Between blocks the residual stream is split by sequence (sequence parallel) or whole.
    stream = Shard(1) if sequence_parallel else Replicate()
    outer_plan = {
        # Rows of the embedding are split by vocabulary; each rank looks up the ids it holds
        # and the partial results are summed (and scattered by sequence).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if shard_logits else Replicate(),
            use_local_output=not shard_logits,
        ),
    }
    if sequence_parallel:
        outer_plan["norm"] = SequenceParallel()
    elif model.norm is not None:
        replicate_over(model.norm, tp_mesh)
    # A pipeline stage holds some of the outer modules only (the others are None).
    outer_plan = {name: style for name, style in outer_plan.items() if getattr(model, name) is not None}
    tied = model.output is not None and model.tok_embeddings is not None
    tied = tied and model.output.weight is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, float8_styles(model, outer_plan, tp_mesh))
    if tied:
        # Tied embeddings (Qwen3's small flavors): each module got a DTensor of its own. Both
        # split the [vocab, dim] matrix by rows (Shard(0)), so the output takes the
        # embedding's and the two stay one parameter.
        model.output.weight = model.tok_embeddings.weight
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_collective)
    for block in model.layers.values():
        block_plan = attention_plan(block, stream)
        if isinstance(block.feed_forward, MoE):
            block_plan |= moe_tensor_parallel_plan(block.feed_forward, tp_mesh, stream)
        else:
            block_plan |= {
                "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            }
        if sequence_parallel:
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        else:
            replicate_over(block.attention_norm, tp_mesh)
            replicate_over(block.ffn_norm, tp_mesh)
        parallelize_module(block, tp_mesh, float8_styles(block, block_plan, tp_mesh))


def attention_plan(block: nn.Module, stream) -> dict:
    """The block plan's entries for its attention, from the block's attention_tp_plan (data
    in the model's folder: see TransformerBlock). Attention's extra arguments are the RoPE
    tables, plain tensors every rank holds whole (Replicate DTensors where the attention
    computes on DTensors)."""
    dtensors = block.attention_tp_dtensors
    tables = (Replicate(), Replicate()) if dtensors else (None, None)
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(stream, *tables), desired_input_layouts=(Replicate(), *tables), use_local_output=False
        )
    }
    for name, how in block.attention_tp_plan.items():
        if not hasattr(block.attention, name):
            continue
        if how == "colwise":
            plan[f"attention.{name}"] = ColwiseParallel(use_local_output=not dtensors)
        elif how == "rowwise":
            plan[f"attention.{name}"] = RowwiseParallel(output_layouts=stream)
        elif how == "per_head":
            # A norm over each head's features sees this rank's heads only: its input is split
            # by heads (dimension 2), its gain held whole and its gradient summed.
            plan[f"attention.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif how == "local_heads":
            # Attention itself, whose kernels DTensor has no rule for on every device: it runs
            # on this rank's heads (dimension 1) as plain tensors.
            heads = (Shard(1),) * 3
            plan[f"attention.{name}"] = PrepareModuleInputOutput(
                input_layouts=heads,
                desired_input_layouts=heads,
                use_local_input=True,
                output_layouts=(Shard(1),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            )
        elif how == "replicate":
            plan[f"attention.{name}"] = _HeldWhole()
        else:
            raise ValueError(f"{type(block).__name__}.attention_tp_plan['{name}']: unknown style '{how}'")
    return plan


class _HeldWhole(ParallelStyle):
    """A module every TP rank holds whole (its parameters Replicate DTensors), computing on
    the whole input, a Replicate DTensor, into a Replicate DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class _WaitedCollective(torch.autograd.Function):
    """The result of an asynchronous collective, waited for, as a plain tensor that autograd
    links to the collective (the gradient passes through unchanged)."""

    @staticmethod
    def forward(ctx, pending: AsyncCollectiveTensor) -> torch.Tensor:
        return pending.trigger_wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_for_collective(module: nn.Module, inputs, output):
    """Forward hook after the embedding's TP hook, whose sum over the TP ranks is still in
    flight (an AsyncCollectiveTensor). A compiled block that takes such a tensor waits for it
    itself but drops its autograd history (torch 2.13): the embedding then gets no gradient,
    silently under FSDP, or the backward fails on a plain tensor where a DTensor belongs."""
    return _WaitedCollective.apply(output) if isinstance(output, AsyncCollectiveTensor) else output


def replicate_over(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters DTensors held whole by every TP rank, taking and giving
    plain tensors. Without sequence parallelism the norms are not split at all, but their
    parameters must still live on the same mesh as all the others: FSDP then shards every
    parameter over the same 2-D mesh, and the optimizer's and clipping's foreach kernels,
    which take one mesh per call, see one."""

    def inputs_to_dtensors(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def output_to_local(module, output, mesh):
        return output.to_local()

    distribute_module(module, tp_mesh, input_fn=inputs_to_dtensors, output_fn=output_to_local)


def enable_async_tensor_parallel() -> None:
    """Let the compiler split TP's all-gather/reduce-scatter and the matmuls next to them
    into pieces that overlap (micro-pipelining, over symmetric memory, which torch 2.13
    sets up for a group by itself). It acts inside compiled blocks, on CUDA only."""
    import torch._inductor.config as inductor_config  # loaded by torch.compile only when it first runs

    inductor_config._micro_pipeline_tp = True


def loss_context(parallel_dims: ParallelDims, job_config: JobConfig):
    """What the loss's forward and backward run under: loss parallel when the logits are
    split by vocabulary, so cross entropy works on each rank's slice (exchanging only the
    per-token maxima and sums), never gathering the [batch, seq, vocab] logits."""
    if parallel_dims.tp > 1 and not job_config.parallelism.disable_loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


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
