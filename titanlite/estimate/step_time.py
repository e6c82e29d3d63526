"""An analytic model of one training step under FSDP / HSDP / DDP, with or without tensor
parallelism: compute time, communication time, which of the two bounds the step, and the
throughput and MFU that follow. Pure arithmetic: nothing is built, nothing runs on a device.

The roofline rule it reproduces (data parallelism and FSDP alike, since an all-reduce
is an all-gather plus a reduce-scatter): a step is compute-bound when the tokens each
device processes per collective round exceed

    C / W = peak FLOP/s of one device / bytes per second one device sends,

because compute grows with the tokens per device while the weight traffic does not.
On an H100 that is 989e12 / 450e9 ~ 2,198 tokens when the FSDP group sits inside one
NVLink node, but 989e12 / 50e9 ~ 19,780 tokens once the group spans nodes over
400 Gb/s InfiniBand; HSDP keeps the heavy, per-layer FSDP traffic on NVLink and sends
only one all-reduce of the gradient shard per step across nodes.

Assumptions (each is also stated where it is used):
  * Ring collectives: an all-gather or reduce-scatter of S bytes over n ranks makes
    every rank send S x (n-1)/n bytes; an all-reduce twice that.
  * A collective runs at the per-direction bandwidth of its slowest link: the
    intra-node one when every group of that mesh dimension fits in one node, the
    inter-node one otherwise.
  * FSDP overlaps communication with compute (prefetching the next unit's all-gather,
    reduce-scattering while the previous unit's backward runs), so a step takes
    max(compute, communication) plus the part that nothing can hide.
  * Tensor parallelism splits every matmul (and attention, by heads) over the t ranks of a
    TP group, which see the same batch: each device does 1/t of its data-parallel rank's
    FLOPs and holds 1/t of the weights FSDP gathers. An MoE feed-forward is split by tokens
    instead: every TP rank holds its router and experts whole (unless expert parallelism,
    whose ep groups take the TP ranks, splits the experts) and routes its own 1/t of the
    sequence (parallel/moe_tensor_parallel.py), so its FLOPs and all-to-all bytes are divided
    by t too, and the gradients of the weights it holds whole are summed over the TP group.
    TP's collectives sit between the matmuls that need their results, so they add to the
    compute time (async TP, which overlaps them with the matmuls in compiled code, is taken as
    hiding them entirely; the MoE gradients' sum is not). TP groups are consecutive ranks,
    inside a node whenever t divides the GPUs per node.
  * Compute runs at `efficiency` x peak on every FLOP, recomputed ones included.
  * Pipeline parallelism over p ranks (the outermost mesh dimension, so across nodes once a
    stage's ranks fill a node): each rank computes its stages only, and the step is the
    busiest rank's compute stretched by the pipeline bubble b (PipelinePlan.bubble_at), the
    idle share of the step that running the schedule's own actions on a clock gives:

        pipelined = compute / (1 - b),   b = (p - 1) / (m + p - 1) for GPipe and 1F1B

    (less for the interleaved schedules, least for the zero-bubble ones, which fill the idle
    time with weight gradients; the backward's share there counts what AC recomputes). The
    activations sent between stages overlap compute except while the pipeline fills and drains
    (one activation per stage boundary each way, per accumulation step). FSDP under PP gathers
    each stage's parameters once per accumulation step and reduce-scatters once (titanlite's
    default keeps them gathered across micro-batches).
"""

import functools
import math
from dataclasses import replace

from titanlite.dtypes import DTYPES
from titanlite.estimate.communication import Traffic, traffic
from titanlite.estimate.compute import (
    compute_time,
    device_flops_per_token,
    rank_work,
    recompute_fraction,
)
from titanlite.estimate.context_parallel import kv_gather_bytes, kv_gather_hidden_seconds, kv_sent_bytes
from titanlite.estimate.data_parallel import (
    break_even_tokens,
    data_parallel_traffic,
    overlapped_step_seconds,
    threshold_tokens_per_device,
)
from titanlite.estimate.expert_parallel import moe_all_to_all_bytes
from titanlite.estimate.float8 import Float8Work, float8_seconds, float8_work
from titanlite.estimate.hardware import Hardware, get_hardware
from titanlite.estimate.inputs import check_choices, check_experts, positive_int, resolve_layout
from titanlite.estimate.pipeline import backward_per_forward, pipeline_send_bytes, pipelined_seconds
from titanlite.estimate.step_time_result import StepTimeEstimate
from titanlite.estimate.tensor_parallel import (
    moe_gradient_all_reduce_bytes,
    recomputed_collective_blocks,
    tensor_parallel_bytes,
)
from titanlite.metrics.flops import flops_per_token, mfu
from titanlite.models.llama.args import LlamaArgs
from titanlite.parallel import tensor_parallel_problem
from titanlite.parallel.pipeline import PipelinePlan

# Fraction of the peak a well-tuned bf16 transformer step reaches on its matmuls
# (attention and elementwise kernels included). Llama pretraining on H100/A100 with
# FSDP reports roughly 40-55% MFU; 0.5 sits in that range. Override per run.
DEFAULT_EFFICIENCY = 0.5


# The layout's degrees by ParallelDims' names, which estimate_step_time takes as keywords (pp
# comes with its pipeline) and StepTimeEstimate records, with the strategy's name and pp.
_DEGREES = ("dp_replicate", "dp_shard", "world_size", "tp", "ep", "cp")
_LAYOUT_FIELDS = ("strategy", *_DEGREES, "pp")
# What StepTimeEstimate records of the data-parallel traffic, by DataParallelTraffic's names.
_DATA_PARALLEL_FIELDS = (
    "all_gather_bytes",
    "reduce_scatter_bytes",
    "all_reduce_bytes",
    "all_gather_s",
    "reduce_scatter_s",
    "all_reduce_s",
    "shard_link",
    "replicate_link",
    "expert_shard_link",
)


def _attributes(record, names: tuple[str, ...]) -> dict:
    """``record``'s attributes ``names``, by name: for a result or a call that takes them as they are."""
    return {name: getattr(record, name) for name in names}


def _traffic_fields(prefix: str, traffic: Traffic) -> dict:
    """One parallelism's traffic as StepTimeEstimate records it: <prefix>_bytes, _link and _s."""
    return {f"{prefix}_bytes": traffic.sent_bytes, f"{prefix}_link": traffic.link, f"{prefix}_s": traffic.seconds}


def estimate_step_time(
    model_args: LlamaArgs,
    *,
    seq_len: int,
    local_batch_size: int,
    hardware: Hardware | str,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    world_size: int | None = None,
    tp: int = 1,
    grad_accum_steps: int = 1,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    ac_mode: str = "selective",
    selective_ac_option: str = "2",
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    async_tp: bool = False,
    efficiency: float = DEFAULT_EFFICIENCY,
    gpus_per_node: int | None = None,
    pipeline: PipelinePlan | None = None,
    ep: int = 1,
    float8: Float8Work | None = None,
    cp: int = 1,
    kv_features: int | None = None,
) -> StepTimeEstimate:
    """Estimate one optimizer step. Defaults follow the job config's (bf16 parameters,
    fp32 reductions, reshard "default", selective AC every 2nd block, no TP; with TP,
    sequence parallel and loss parallel on, async TP off; no pipeline).

    local_batch_size is the sequences of one data-parallel rank's micro-batch, which all tp ranks of its group
    (and, with ``pipeline``, all pp ranks of its pipeline) see; the pipeline splits it into
    pipeline.microbatches micro-batches. ``ep``: expert parallelism's degree, all the tp ranks and a split of
    the dp_shard ranks (an MoE model's experts, n_experts / ep per rank, FSDP-sharded over the
    dp_shard / (ep / tp) ranks left). ``float8``: the layers a float8 run converts (estimate.float8). hardware:
    a Hardware or a table name ("h100"). ``cp``: context parallelism's degree, each sequence split over
    cp ranks, whose attention all-gathers ``kv_features`` numbers per token (the attention class's
    kernel_kv_features; needed when cp > 1). gpus_per_node overrides the hardware's. world_size may be left out
    when neither degree is -1. Raises ValueError with a one-line message for any inconsistent input."""
    for name, value in (
        ("seq_len", seq_len),
        ("local_batch_size", local_batch_size),
        ("grad_accum_steps", grad_accum_steps),
    ):
        positive_int(name, value)
    check_choices(ac_mode, selective_ac_option, reshard_after_forward, param_dtype, reduce_dtype, efficiency)
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if gpus_per_node is not None:
        positive_int("gpus_per_node", gpus_per_node)
        hw = replace(hw, gpus_per_node=gpus_per_node)
    pp = 1 if pipeline is None else pipeline.pp
    dims = resolve_layout(dp_replicate, dp_shard, world_size, tp, pp, ep, cp)
    t = dims.tp
    if cp > 1 and kv_features is None:
        raise ValueError("context parallelism needs kv_features (the attention's kernel_kv_features)")
    # TP splits an MoE feed-forward by tokens: only attention's sizes must split.
    problem = tensor_parallel_problem(model_args, t, split_ffn=not getattr(model_args, "n_experts", 0))
    if problem is not None:
        raise ValueError(problem)
    check_experts(model_args, ep)

    # compute: a TP group shares its data-parallel rank's tokens, each device 1/t of the FLOPs
    # of its pipeline rank's stages (the whole model without PP), the MoE layers' split by token;
    # the busiest rank sets the pace
    model_flops = flops_per_token(model_args, seq_len)
    fraction = recompute_fraction(model_args.n_layers, ac_mode, selective_ac_option)
    work = rank_work(model_args, seq_len, fraction, pipeline, t)
    local_seq = seq_len // cp  # a cp rank's tokens of each sequence
    micro_tokens = local_batch_size * local_seq  # per data-parallel (and cp) rank
    rank_tokens = micro_tokens * grad_accum_steps  # through each device's stages, its TP group's alike
    float8_s = float8_seconds(float8, work, model_args.n_layers, pipeline, fraction, t, rank_tokens, hw, efficiency)
    compute_s = compute_time(work, t, rank_tokens, hw.peak_flops, efficiency) - float8_s

    # communication: each parallelism's collectives over the step, on its own link
    p_bytes, g_bytes = DTYPES[param_dtype].itemsize, DTYPES[reduce_dtype].itemsize
    data_parallel = data_parallel_traffic(
        model_args,
        work,
        pipeline,
        dims,
        hw,
        grad_accum_steps=grad_accum_steps,
        param_bytes=p_bytes,
        reduce_bytes=g_bytes,
        reshard_after_forward=reshard_after_forward,
    )
    over = functools.partial(traffic, hw, dims)  # (mesh dimension, bytes sent) -> Traffic
    recomputed_blocks = recomputed_collective_blocks(work.blocks, ac_mode, selective_ac_option)
    rank_model = replace(model_args, n_layers=work.blocks)  # the busiest pp rank's blocks
    tp_options = (sequence_parallel, loss_parallel, recomputed_blocks, work.moe_layers, work.held.attention_outputs)
    tp_b = tensor_parallel_bytes(rank_model, micro_tokens, p_bytes, t, *tp_options)
    moe_gradient_b = _moe_gradient_bytes(work, dims, grad_accum_steps, p_bytes)
    tensor = over("tp", grad_accum_steps * tp_b + moe_gradient_b)
    all_to_all = moe_all_to_all_bytes(model_args, work, micro_tokens, p_bytes, ep, recomputed_blocks, t)
    experts = over("ep", grad_accum_steps * all_to_all)
    kv_gathered = kv_gather_bytes(kv_features or 0, local_batch_size, seq_len, t, cp, p_bytes)
    context = over("cp", grad_accum_steps * kv_sent_bytes(kv_gathered, cp, work.blocks, recomputed_blocks))
    # Each forward all-gather (the recomputed ones too) partly behind the attention on own keys.
    hidden = kv_gather_hidden_seconds(
        model_args, seq_len, cp, t, micro_tokens, kv_gathered, context.bandwidth, hw.peak_flops * efficiency
    )
    cp_hidden_s = grad_accum_steps * (work.blocks + recomputed_blocks) * hidden
    pp_b, pp_exposed_b = pipeline_send_bytes(
        pipeline,
        local_batch_size=local_batch_size,
        seq_len=local_seq,
        dim=model_args.dim,
        tp=t,
        sequence_parallel=sequence_parallel,
        activation_bytes=p_bytes,
        grad_accum_steps=grad_accum_steps,
    )
    sends = over("pp", pp_b)
    pp_exposed_s = pp_exposed_b / sends.bandwidth
    bubble = 0.0 if pipeline is None else pipeline.bubble_at(backward_per_forward(work.flops, work.recompute_flops))
    data_parallel_s, tp_s, ep_s = data_parallel.seconds, tensor.seconds, experts.seconds
    cp_s = context.seconds - cp_hidden_s  # what attention waits for
    comm_s = data_parallel_s + tp_s + sends.seconds + ep_s + context.seconds

    # TP's collectives wait between matmuls (unless async TP hides them), and the experts wait
    # for their rows (the all-to-alls are on the critical path), and attention for its gathered
    # keys and values; the pipeline's bubble stretches them with the compute; FSDP's
    # communication overlaps all of it.
    critical_s = (max(compute_s, tp_s) if async_tp else compute_s + tp_s) + ep_s + cp_s
    pipelined_s = pipelined_seconds(critical_s, bubble, sends.seconds, pp_exposed_s)
    step_s, exposed_s = overlapped_step_seconds(pipelined_s, data_parallel_s, work.blocks + 1)
    device_tokens = rank_tokens / t / pp  # the tokens a device's share of the model processes
    tokens_per_s = device_tokens / step_s
    return StepTimeEstimate(
        **_attributes(dims, _LAYOUT_FIELDS),
        **_attributes(data_parallel, _DATA_PARALLEL_FIELDS),
        **_traffic_fields("tp", tensor),
        **_traffic_fields("pp", sends),
        **_traffic_fields("ep", experts),
        **_traffic_fields("cp", context),
        hardware=hw,
        efficiency=efficiency,
        flops_per_token=model_flops,
        recompute_flops_per_token=work.recompute_flops,
        tokens_per_device_per_micro_batch=micro_tokens / t,
        tokens_per_device_per_step=device_tokens,
        compute_s=compute_s,
        tp_moe_gradient_bytes=moe_gradient_b,
        comm_s=comm_s,
        exposed_comm_s=exposed_s + (0.0 if async_tp else tp_s) + pp_exposed_s + ep_s + cp_s,
        overlapped=True,
        step_s=step_s,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        async_tp=async_tp,
        schedule=None if pipeline is None else pipeline.schedule,
        microbatches=1 if pipeline is None else pipeline.microbatches,
        bubble=bubble,
        pp_exposed_s=pp_exposed_s,
        moe_flops_per_token=(work.moe_flops + work.moe_recompute_flops) / t,
        moe_tokens_per_device_per_micro_batch=micro_tokens / t if work.moe_layers else 0.0,
        # Compute-bound when the compute time exceeds the communication time.
        verdict="compute-bound" if compute_s > comm_s else "communication-bound",
        # The threshold C / W uses the link that carries the heavy data-parallel traffic.
        threshold_tokens_per_device=(
            None
            if math.isinf(data_parallel.heavy_bw)
            else threshold_tokens_per_device(hw.peak_flops, data_parallel.heavy_bw)
        ),
        break_even_tokens_per_device=break_even_tokens(
            data_parallel_s, grad_accum_steps, t * device_flops_per_token(work, t), hw.peak_flops, efficiency
        ),
        tokens_per_second_per_device=tokens_per_s,
        mfu_percent=mfu(tokens_per_s, model_flops, hw.peak_flops),
        float8_saved_s=float8_s,
        cp_hidden_s=cp_hidden_s,
        kv_gathered_bytes=kv_gathered,
    )


def _moe_gradient_bytes(work, dims, grad_accum_steps: int, param_bytes: int) -> float:
    """The bytes one device sends over a step summing over tp the gradients of the MoE weights
    its TP group holds whole (tensor_parallel.moe_gradient_all_reduce_bytes): the routers and
    shared experts of its stages' MoE layers, and their routed experts without expert parallelism. Under FSDP every
    accumulation step sums them, in the parameter dtype; without it the step sums them once,
    in float32 (the parameters' dtype, autocast computing in bf16)."""
    if dims.tp == 1 or not work.moe_layers:
        return 0.0
    held_whole = work.held.moe + (work.experts if dims.ep == 1 else 0)
    sums, gradient_bytes = (grad_accum_steps, param_bytes) if dims.fsdp_applied else (1, 4)
    return sums * moe_gradient_all_reduce_bytes(held_whole, gradient_bytes, dims.tp)


def estimate_for_job_config(
    job_config,
    world_size: int,
    hardware: Hardware | str,
    efficiency: float = DEFAULT_EFFICIENCY,
    gpus_per_node: int | None = None,
) -> StepTimeEstimate:
    """estimate_step_time with every input read from a JobConfig: model flavor, seq_len,
    local and global batch (hence the accumulation steps), degrees (TP's with its sequence,
    loss and async options, the pipeline's stages and schedule), mixed precision, float8, reshard
    policy and activation checkpointing. world_size is the number of GPUs the run would have; a
    layout that does not multiply to it is a ValueError."""
    # The registry behind these pulls in every model.
    from titanlite.parallel.pipeline import plan_pipeline
    from titanlite.plan import run_model_args, tokenizer_for_estimate
    from titanlite.registry import get_model_spec

    training, parallelism, ac = job_config.training, job_config.parallelism, job_config.activation_checkpoint
    dims = resolve_layout(
        parallelism.data_parallel_replicate_degree,
        parallelism.data_parallel_shard_degree,
        world_size,
        parallelism.tensor_parallel_degree,
        parallelism.pipeline_parallel_degree,
        parallelism.expert_parallel_degree,
        parallelism.context_parallel_degree,
    )
    positive_int("training.local_batch_size", training.local_batch_size)
    _, accumulation = dims.batch_plan(training.local_batch_size, training.global_batch_size)
    model_args = run_model_args(job_config, tokenizer_for_estimate(job_config)[0])
    pipeline, model_cls = None, get_model_spec(job_config.model.name).model_cls
    if dims.pp > 1:
        pipeline = plan_pipeline(parallelism, model_cls, model_args, training.local_batch_size)
    return estimate_step_time(
        model_args,
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        hardware=hardware,
        **_attributes(dims, _DEGREES),
        grad_accum_steps=accumulation,
        param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        reshard_after_forward=parallelism.fsdp_reshard_after_forward,
        ac_mode=ac.mode,
        selective_ac_option=ac.selective_ac_option,
        sequence_parallel=parallelism.enable_sequence_parallel,
        loss_parallel=not parallelism.disable_loss_parallel,
        async_tp=parallelism.enable_async_tensor_parallel,
        efficiency=efficiency,
        gpus_per_node=gpus_per_node,
        pipeline=pipeline,
        float8=float8_work(job_config, model_args),
        kv_features=model_cls.block_cls.attention_cls.kernel_kv_features(model_args),
    )
