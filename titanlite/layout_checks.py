"""Config checks of how a layout splits the model and its sequences: the TP degree against
the model's shapes (and async TP against what it needs), the sequence lengths that sequence
parallelism, MoE routing under TP and context parallelism cut into equal pieces, and what
document masking needs. plan.py runs them before any process group or tensor exists."""

import torch
from torch import nn

from titanlite.config import ConfigError, JobConfig, Model
from titanlite.parallel import ParallelDims
from titanlite.registry import ModelSpec


def check_tensor_parallel(job_config: JobConfig, spec: ModelSpec, model_args, tp: int) -> None:
    """The TP degree against the model's shapes (by its registry ``spec``'s rule), and async TP
    against what it needs."""
    problem = spec.tensor_parallel_problem(model_args, tp)
    if problem is not None:
        raise ConfigError(f"{problem} ({job_config.model.name} {job_config.model.flavor})")
    sequence_parallel = job_config.parallelism.enable_sequence_parallel
    moe = getattr(model_args, "is_moe", False)
    if tp > 1 and (sequence_parallel or moe):
        # Sequence parallel splits every sequence into tp equal slices, and so does an MoE
        # layer under TP, each rank routing its own slice (parallel/moe_tensor_parallel.py).
        lengths = _checked_seq_lens(job_config)
        why = "sequence parallel; change it or set parallelism.enable_sequence_parallel = false"
        if moe:
            why = "an MoE model: each TP rank routes an equal slice of every sequence"
        for key, seq_len in lengths.items():
            if seq_len % tp != 0:
                raise ConfigError(
                    f"{key} ({seq_len}) must be a multiple of parallelism.tensor_parallel_degree ({tp}) with {why}"
                )
    if not job_config.parallelism.enable_async_tensor_parallel:
        return
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    missing = [
        what
        for what, present in (
            ("parallelism.tensor_parallel_degree > 1", tp > 1),
            ("compile.enable with 'model' in compile.components", compiled),
            ("CUDA GPUs", torch.cuda.is_available()),
        )
        if not present
    ]
    if missing:
        raise ConfigError(f"parallelism.enable_async_tensor_parallel needs {', '.join(missing)}; set it to false")


def _checked_seq_lens(job_config: JobConfig) -> dict[str, int]:
    """The sequence lengths a run's batches have, by key: training's, and validation's when set."""
    lengths = {"training.seq_len": job_config.training.seq_len}
    if job_config.validation.enable and job_config.validation.seq_len != -1:
        lengths["validation.seq_len"] = job_config.validation.seq_len
    return lengths


def check_context_parallel(job_config: JobConfig, model_cls: type[nn.Module], model_args, dims: ParallelDims) -> None:
    """Every sequence must cut into the cp ranks' equal chunks (2 x cp of them for headtail), each
    then split evenly over the TP ranks where sequence parallelism or an MoE layer splits it; and
    the model's attention must have the kernel module context parallelism replaces."""
    if dims.cp == 1:
        return
    parallelism = job_config.parallelism
    if getattr(model_cls.block_cls.attention_cls, "kernel_name", None) is None:
        raise ConfigError(
            f"parallelism.context_parallel_degree ({dims.cp}): {job_config.model.name}'s attention has no kernel "
            "module context parallelism can take over; use 1"
        )
    headtail = parallelism.context_parallel_load_balancer == "headtail"
    chunks = 2 * dims.cp if headtail else dims.cp
    splits_over_tp = dims.tp > 1 and (parallelism.enable_sequence_parallel or getattr(model_args, "is_moe", False))
    multiple = chunks * (dims.tp if splits_over_tp else 1)
    why = f"{'2 x ' if headtail else ''}parallelism.context_parallel_degree ({dims.cp})"
    if splits_over_tp:
        why += f" x parallelism.tensor_parallel_degree ({dims.tp}), each cp chunk split over the TP ranks"
    if headtail:
        why += " for the headtail load balancer"
    for key, seq_len in _checked_seq_lens(job_config).items():
        if seq_len % multiple != 0:
            raise ConfigError(f"{key} ({seq_len}) must be a multiple of {why}")


def check_document_mask(model: Model, tokenizer) -> None:
    """block_causal needs the tokenizer's end-of-document token."""
    if model.attn_mask_type != "block_causal":
        return
    if tokenizer.eos_id is None:
        raise ConfigError(
            'model.attn_mask_type = "block_causal" needs an end-of-document token, and the tokenizer of '
            f"model.hf_assets_path ({model.hf_assets_path}) names no eos_token"
        )
