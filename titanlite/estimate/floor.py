"""What one rank surely needs, by arithmetic on parameter shapes: the exact sharded model
state, and the floor below which a run cannot fit (checked before the trainer starts)."""

import copy
import math
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config import ConfigError, JobConfig
from titanlite.dtypes import DTYPES
from titanlite.errors import unknown_name
from titanlite.estimate.compiled import CompiledParts
from titanlite.estimate.hardware import HARDWARE, get_hardware
from titanlite.models.moe import MoE
from titanlite.parallel.parallel_dims import MESH_DIMS, ep_shard_ranks
from titanlite.parallel.pipeline import prune_to_stage
from titanlite.plan import RunPlan

# The mesh dimension tensor parallelism splits layers over (the last: its ranks are consecutive).
TP_DIM = MESH_DIMS[-1]


@dataclass(frozen=True)
class ModelStateBytes:
    """The three figures that do not depend on the batch: bytes per rank."""

    parameters: int
    gradients: int
    optimizer_state: int


def _shard_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """(padded, actual) rows of ``rank``'s piece when ``rows`` are split over ``shards``: FSDP on
    dim 0 and DTensor alike split like torch.chunk (the first ranks get the larger pieces);
    FSDP pads every shard's storage to the first (largest) one, DTensor pads nothing."""
    padded = math.ceil(rows / shards)
    return padded, max(0, min(padded, rows - rank * padded))


def tensor_parallel_shape(param: torch.Tensor, tp_rank: int = 0) -> tuple[int, ...]:
    """The shape of ``tp_rank``'s piece of ``param`` once tensor parallelism has split it, before
    FSDP shards it further, read from the parameter's own placements: a DTensor placed Shard(d)
    on the mesh's tensor-parallel dimension keeps its piece of dimension d; a DTensor replicated
    over that dimension (the norms), one without it, or a plain (e.g. meta) tensor keeps its
    whole shape. FSDP's placements on the data-parallel dimensions are left to the caller."""
    shape = list(param.shape)
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        if TP_DIM in names:
            mesh_dim = names.index(TP_DIM)
            placement = param.placements[mesh_dim]
            if placement.is_shard():
                _, shape[placement.dim] = _shard_rows(shape[placement.dim], param.device_mesh.size(mesh_dim), tp_rank)
    return tuple(shape)


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the routed experts' weights in ``model`` (its MoE layers' experts modules, EP-split
    or not): what expert parallelism splits before FSDP does."""
    return {id(param) for layer in model.modules() if isinstance(layer, MoE) for param in layer.experts.parameters()}


PARAMETER_KINDS = ("all", "dense", "experts")


def exact_model_state_bytes(
    model: nn.Module,
    shards: int,
    optimizer_name: str = "AdamW",
    rank: int = 0,
    tp_rank: int = 0,
    ep: int = 1,
    kind: str = "all",
    tp: int = 1,
) -> ModelStateBytes:
    """Parameters, gradients and Adam state of one rank, by arithmetic on parameter shapes:
    those of an unsharded (e.g. meta) model, or of a parallelised one, whose tensor-parallel
    placements say which parameters TP split (see tensor_parallel_shape). ``rank`` is the
    rank's index in the FSDP shard group, ``tp_rank`` in the TP group. ``kind``: all the
    parameters, the dense ones, or the routed experts' only.

    FSDP shards dim 0 of each (TP-split) parameter over ``shards`` ranks and keeps the shard,
    and the gradient reduce-scattered into it, in a storage padded to the largest shard; Adam's
    moments are ``zeros_like`` the parameter's local shard, so they are not padded; its step
    counter is one float32 per parameter. Gradients are counted in their parameter's layout.

    With expert parallelism over ``ep`` ranks, the ``tp`` ranks (the TP degree) of ep / tp
    shard ranks (the inner part of the shard index: shard rank = efsdp rank x ep / tp + its
    place among them; ParallelDims.ep_shard), a stacked expert weight [n_experts, ...] (its
    global shape, whether EP has split it yet or not) keeps n_experts / ep experts on each
    rank, and FSDP splits dim 0 of that piece over the shards / (ep / tp) ranks holding the
    same experts.
    """
    if optimizer_name not in ("AdamW", "Adam"):
        raise ValueError(f"no arithmetic for optimizer {optimizer_name}")
    if kind not in PARAMETER_KINDS:
        raise ValueError(f"kind must be one of {', '.join(PARAMETER_KINDS)}, got {kind!r}")
    experts = expert_parameters(model)
    padded_bytes = local_bytes = count = 0
    for param in model.parameters():
        is_expert = id(param) in experts
        if kind != "all" and is_expert != (kind == "experts"):
            continue
        shape = tensor_parallel_shape(param, tp_rank)
        row_elems = math.prod(shape[1:])  # 1 for a scalar, which FSDP does not split
        if is_expert and ep > 1:
            ep_shard = ep_shard_ranks(ep, tp)
            _, local_experts = _shard_rows(shape[0], ep, rank % ep_shard * tp + tp_rank)
            padded, actual = _shard_rows(local_experts, shards // ep_shard, rank // ep_shard)
        else:
            padded, actual = _shard_rows(shape[0], shards, rank) if shape else (1, 1)
        padded_bytes += padded * row_elems * param.element_size()
        local_bytes += actual * row_elems * param.element_size()
        count += 1
    step_bytes = count * torch.empty((), dtype=torch.float32).element_size()
    return ModelStateBytes(padded_bytes, padded_bytes, 2 * local_bytes + step_bytes)


def device_memory_bytes(device_type: str, ranks_per_node: int) -> tuple[int, str]:
    """(bytes one rank can use, what they are): the local GPU's capacity, or on CPU the
    host's physical memory split between the node's ranks."""
    if device_type == "cuda":
        properties = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))  # cuda-only
        return properties.total_memory, f"the GPU ({properties.name})"  # cuda-only
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(ranks_per_node, 1), f"the host's memory / {ranks_per_node} rank(s) on this node"


def memory_to_check(job_config: JobConfig, ranks_per_node: int) -> tuple[int, str]:
    """(bytes one rank can use, what they are) for the floor check: the device this process
    finds (device_memory_bytes), except for job.validate_only on a host without a GPU, which
    checks the GPU the config is for (job.validate_hardware; cpu: the host's memory)."""
    key = job_config.job.validate_hardware
    try:
        hardware = None if key == "cpu" else get_hardware(key)
    except ValueError:
        raise ConfigError(unknown_name("job.validate_hardware", key, [*HARDWARE, "cpu"])) from None
    gpu_here = torch.cuda.is_available()
    if hardware is None or gpu_here or not job_config.job.validate_only:
        return device_memory_bytes("cuda" if gpu_here else "cpu", ranks_per_node)
    return hardware.memory_bytes, f"the {hardware.name} of job.validate_hardware"


def step_floor_bytes(
    model: nn.Module,
    vocab_size: int,
    shards: int,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    cpu_offload: bool,
    tp: int = 1,
    loss_parallel: bool = True,
    ep: int = 1,
    compiled_loss: bool = False,
) -> dict[str, int]:
    """What one rank surely holds at once during a step, by arithmetic on Python ints (no
    tensor is made, so any batch size is safe to ask about): the sharded weights and Adam
    state (unless offloaded), and the logits in the compute dtype beside the float32
    log-probabilities the loss keeps for backward, or with ``compiled_loss`` beside the one
    buffer of the logits' size and dtype the compiled loss keeps instead
    (titanlite.estimate.compiled). The real peak is higher (activations, gradients,
    all-gathered units); scripts/estimate.py simulates it.

    With tensor parallelism over ``tp`` ranks the model (unsharded: nothing in it says which
    parameters TP splits) is taken as split ``tp`` ways on top of the FSDP shards. For a matrix
    that is what rank 0 holds when the dimensions divide evenly and less otherwise; the norms
    and MoE routers, which TP replicates, are counted low; so the figure stays a floor. The routed experts of
    an MoE model are not split by TP's features: without expert parallelism every TP rank holds
    them, FSDP-sharded over the shards (1 / shards of them); with it n_experts / ``ep`` of them
    on a rank, FSDP-sharded over the shards / (ep / tp) ranks left (exact_model_state_bytes),
    about 1 / (shards x tp) of them in all. Under loss parallel each rank holds its vocabulary
    slice of the logits, else all of them.
    """
    loss_bytes = compute_bytes if compiled_loss else 4  # per logit, beside the logits
    dense = exact_model_state_bytes(model, shards, kind="dense")
    experts = exact_model_state_bytes(model, shards, ep=ep, kind="experts", tp=tp)
    vocab_per_rank = math.ceil(vocab_size / tp) if loss_parallel else vocab_size
    weights = (dense.parameters + dense.optimizer_state) // tp + experts.parameters + experts.optimizer_state
    return {
        "weights and Adam state": 0 if cpu_offload else weights,
        "logits": local_batch_size * seq_len * vocab_per_rank * (compute_bytes + loss_bytes),
    }


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB" if size < 2**50 else f"{size / 2**30:.2e} GiB"


def _stage_part(model: nn.Module, keep: tuple[str, ...]) -> nn.Module:
    """The modules of one pipeline stage as prune_to_stage leaves them, without building the
    model again and leaving ``model`` whole: a shallow copy of the model and of its block
    container, each with its own table of children, pruned; the modules kept are shared."""
    part, layers = copy.copy(model), copy.copy(model.layers)
    part._modules, layers._modules = dict(model._modules), dict(model.layers._modules)
    part.layers = layers
    prune_to_stage(part, keep)
    return part


def _floors(
    job_config: JobConfig, plan: RunPlan, compute_bytes: int, model: nn.Module | None = None
) -> list[tuple[str, dict[str, int]]]:
    """(whose, floor) for each rank kind: one for the whole model, or with pipeline
    parallelism one per pp rank, holding its stages' modules (pruned from the model itself)
    and, on the rank with the last stage, one micro-batch's logits. ``model``: the whole
    model on meta, when the caller has one (else it is built here)."""
    training, parallel_dims, model_args = job_config.training, plan.parallel_dims, plan.model_args
    model = plan.meta_model() if model is None else model

    def floor(model: nn.Module, batch_size: int) -> dict[str, int]:
        # Under context parallelism FSDP shards over dp_shard x cp, and each rank holds the
        # logits of its seq_len / cp tokens of every sequence.
        return step_floor_bytes(
            model,
            model_args.vocab_size,
            parallel_dims.dp_shard * parallel_dims.cp,
            batch_size,
            training.seq_len // parallel_dims.cp,
            compute_bytes,
            training.enable_cpu_offload,
            parallel_dims.tp,
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            ep=parallel_dims.ep,
            compiled_loss=CompiledParts.of(job_config).loss,
        )

    pipeline = plan.pipeline
    if pipeline is None:
        return [("", floor(model, training.local_batch_size))]
    floors = []
    for pp_rank in range(pipeline.pp):
        stages = pipeline.rank_stages(pp_rank)
        part = _stage_part(model, tuple(name for stage in stages for name in pipeline.stage_modules[stage]))
        holds_logits = pipeline.num_stages - 1 in stages
        logits_batch = job_config.parallelism.pipeline_parallel_microbatch_size if holds_logits else 0
        whose = f"pp rank {pp_rank} (stage(s) {', '.join(map(str, stages))}) of "
        rank_floor = floor(part, logits_batch)
        rank_floor["unsharded stage weights and gradients"] = unsharded_stage_bytes(job_config, plan, part)
        floors.append((whose, rank_floor))
    return floors


def unsharded_stage_bytes(job_config: JobConfig, plan: RunPlan, stage: nn.Module) -> int:
    """What FSDP surely holds unsharded on a pp rank with several micro-batches per step: as
    torch.distributed.pipelining runs FSDP, every micro-batch's backward but the step's last
    keeps the stage's gradients unsharded and unreduced (accumulated in the reduce dtype), and
    titanlite's default reshard policy under PP keeps the gathered weights (in the parameter
    dtype) for the whole step; each is the stage's dense parameters over the TP degree and its
    routed experts over the EP degree (n_experts / ep of each MoE layer's experts)."""
    parallel_dims, training = plan.parallel_dims, job_config.training
    if not parallel_dims.fsdp_applied or plan.pipeline.microbatches < 2:
        return 0
    experts = expert_parameters(stage)
    params = sum(
        param.numel() // (parallel_dims.ep if id(param) in experts else parallel_dims.tp)
        for param in stage.parameters()
    )
    gathered = job_config.parallelism.fsdp_reshard_after_forward != "always"
    weight_bytes = DTYPES[training.mixed_precision_param].itemsize if gathered else 0
    return params * (weight_bytes + DTYPES[training.mixed_precision_reduce].itemsize)


def fullest_floor(job_config: JobConfig, plan: RunPlan, model: nn.Module | None = None) -> tuple[str, dict[str, int]]:
    """(whose, floor) of the rank with the highest floor: with pipeline parallelism the
    fullest pp rank ("pp rank 1 (stage(s) 1) of "), else any rank (""). ``model``: the whole
    model of ``plan.model_args`` on meta, for a caller that asks about many layouts of one
    model (it is read, not changed); else it is built here."""
    compute_bytes = torch.empty((), dtype=DTYPES[job_config.training.mixed_precision_param]).element_size()
    return max(_floors(job_config, plan, compute_bytes, model), key=lambda entry: sum(entry[1].values()))


def check_memory_floor(job_config: JobConfig, plan: RunPlan) -> str:
    """Refuse a run whose rank surely cannot fit in this machine's device (the host's memory
    on CPU; under validate_only on a host without a GPU, the config's: memory_to_check): told
    in one line before start-up, instead of by the out-of-memory killer. With pipeline
    parallelism every pp rank is checked (its stages only); the fullest must fit. Returns
    what was checked against what, for the config-ok line."""
    training, parallel_dims = job_config.training, plan.parallel_dims
    whose, floor = fullest_floor(job_config, plan)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
    available, what = memory_to_check(job_config, ranks_per_node)
    needed = sum(floor.values())
    if needed <= available:
        return f"memory floor {_gib(needed)} a rank, within {_gib(available)}: {what}"
    parts = ", ".join(f"{name} {_gib(size)}" for name, size in floor.items())
    pipelined = parallel_dims.pp > 1
    if floor["logits"] >= floor["weights and Adam state"]:
        batch = "parallelism.pipeline_parallel_microbatch_size" if pipelined else "training.local_batch_size"
        size = job_config.parallelism.pipeline_parallel_microbatch_size if pipelined else training.local_batch_size
        key = f"{batch} {size} (x seq_len {training.seq_len})"
        fix = f"lower {batch} (training.global_batch_size keeps the batch through accumulation)"
        if size == 1:  # below one sequence a rank, only context parallelism splits it further
            fix = "raise parallelism.context_parallel_degree (each rank then holds seq_len / cp tokens of a sequence)"
    else:
        tp = f" x {parallel_dims.tp} tensor-parallel rank(s)" if parallel_dims.tp > 1 else ""
        shards = parallel_dims.dp_shard * parallel_dims.cp  # FSDP shards over dp_shard x cp
        key = f"{whose}model {job_config.model.name} {job_config.model.flavor} on {shards} shard(s){tp}"
        fix = (
            "shard over more ranks (parallelism.data_parallel_shard_degree, parallelism.tensor_parallel_degree, "
            "parallelism.pipeline_parallel_degree) or offload (training.enable_cpu_offload)"
        )
    raise ConfigError(
        f"{key}: one rank needs at least {_gib(needed)} ({parts}), more than {what} holds "
        f"({_gib(available)}); {fix}. scripts/estimate.py estimates the whole step"
    )
