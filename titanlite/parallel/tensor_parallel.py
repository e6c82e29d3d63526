"""Tensor parallelism: the decoder's Megatron-style plan, each family's attention plan read as
data (TransformerBlock.attention_tp_plan), the weights held whole on every TP rank, and loss
parallel. parallelize.py applies it in its place in the fixed order (step 2 there)."""

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
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

from titanlite.config import JobConfig
from titanlite.models.moe import MoE
from titanlite.parallel.float8_styles import float8_styles
from titanlite.parallel.moe_tensor_parallel import moe_tensor_parallel_plan
from titanlite.parallel.parallel_dims import ParallelDims

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
