"""What one rank surely needs, by arithmetic on parameter shapes: the exact sharded model
state, and the floor below which a run cannot fit (checked before the trainer starts)."""

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from titanlite.config import ConfigError, JobConfig
from titanlite.dtypes import DTYPES
from titanlite.plan import RunPlan, meta_model


@dataclass(frozen=True)
class ModelStateBytes:
    """The three figures that do not depend on the batch: bytes per rank."""

    parameters: int
    gradients: int
    optimizer_state: int


def _shard_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """(padded, actual) dim-0 rows of ``rank``'s shard: FSDP splits dim 0 like torch.chunk
    and pads every shard's storage to the first (largest) one."""
    padded = math.ceil(rows / shards)
    return padded, max(0, min(padded, rows - rank * padded))


def exact_model_state_bytes(
    model: nn.Module, shards: int, optimizer_name: str = "AdamW", rank: int = 0
) -> ModelStateBytes:
    """Parameters, gradients and Adam state of one rank, computed from the parameter shapes
    of an unsharded (e.g. meta) model.

    FSDP keeps each sharded parameter, and the gradient reduce-scattered into it, in a
    storage padded to the largest shard; Adam's moments are ``zeros_like`` the parameter's
    local shard, so they are not padded; its step counter is one float32 per parameter.
    """
    if optimizer_name not in ("AdamW", "Adam"):
        raise ValueError(f"no arithmetic for optimizer {optimizer_name}")
    padded_bytes = local_bytes = count = 0
    for param in model.parameters():
        row_elems = param.numel() // param.shape[0] if param.dim() else 1
        padded, actual = _shard_rows(param.shape[0], shards, rank) if param.dim() else (1, 1)
        padded_bytes += padded * row_elems * param.element_size()
        local_bytes += actual * row_elems * param.element_size()
        count += 1
    step_bytes = count * torch.empty((), dtype=torch.float32).element_size()
    return ModelStateBytes(padded_bytes, padded_bytes, 2 * local_bytes + step_bytes)


def device_memory_bytes(device_type: str, ranks_per_node: int) -> tuple[int, str]:
    """(bytes one rank can use, what they are): the local GPU's capacity, or on CPU the
    host's physical memory split between the node's ranks."""
    if device_type == "cuda":
        properties = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return properties.total_memory, f"the GPU ({properties.name})"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(ranks_per_node, 1), f"the host's memory / {ranks_per_node} rank(s) on this node"


def step_floor_bytes(
    model: nn.Module,
    vocab_size: int,
    shards: int,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    cpu_offload: bool,
) -> dict[str, int]:
    """What one rank surely holds at once during a step, by arithmetic on Python ints (no
    tensor is made, so any batch size is safe to ask about): the sharded weights and Adam
    state (unless offloaded), and the logits in the compute dtype beside the float32
    log-probabilities the loss keeps for backward. The real peak is higher (activations,
    gradients, all-gathered units); scripts/estimate.py simulates it."""
    state = exact_model_state_bytes(model, shards)
    return {
        "weights and Adam state": 0 if cpu_offload else state.parameters + state.optimizer_state,
        "logits": local_batch_size * seq_len * vocab_size * (compute_bytes + 4),
    }


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB" if size < 2**50 else f"{size / 2**30:.2e} GiB"


def check_memory_floor(job_config: JobConfig, plan: RunPlan) -> None:
    """Refuse a run whose rank surely cannot fit in this machine's device (the host's memory
    on CPU): told in one line before start-up, instead of by the out-of-memory killer."""
    training, parallel_dims, model_args = job_config.training, plan.parallel_dims, plan.model_args
    compute_bytes = torch.empty((), dtype=DTYPES[training.mixed_precision_param]).element_size()
    floor = step_floor_bytes(
        meta_model(job_config, model_args),
        model_args.vocab_size,
        parallel_dims.dp_shard,
        training.local_batch_size,
        training.seq_len,
        compute_bytes,
        training.enable_cpu_offload,
    )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
    available, what = device_memory_bytes(device_type, ranks_per_node)
    needed = sum(floor.values())
    if needed <= available:
        return
    parts = ", ".join(f"{name} {_gib(size)}" for name, size in floor.items())
    if floor["logits"] >= floor["weights and Adam state"]:
        key = f"training.local_batch_size {training.local_batch_size} (x seq_len {training.seq_len})"
        fix = "lower training.local_batch_size (training.global_batch_size keeps the batch through accumulation)"
    else:
        key = f"model {job_config.model.name} {job_config.model.flavor} on {parallel_dims.dp_shard} shard(s)"
        fix = "shard over more ranks (parallelism.data_parallel_shard_degree) or offload (training.enable_cpu_offload)"
    raise ConfigError(
        f"{key}: one rank needs at least {_gib(needed)} ({parts}), more than {what} holds "
        f"({_gib(available)}); {fix}. scripts/estimate.py estimates the whole step"
    )
