"""One training step simulated on fake tensors for the memory estimate (titanlite.estimate.memory
says what it measures): rank ``rank`` of a fake process group, the run's model (or one pipeline
stage of it) built and parallelised as the trainer builds it and materialised as fake tensors,
one steady-state step tracked category by category, and the arithmetic for what the simulation
cannot run (expert parallelism's all-to-all) or see (the EMA's copy). measure_real_memory runs
the same step on real tensors, to check the estimate against."""

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.estimate.compiled import CompiledParts, compiled_loss, held_savings
from titanlite.estimate.floor import TP_DIM, ModelStateBytes, exact_model_state_bytes, unsharded_stage_bytes
from titanlite.estimate.tracker import (
    CATEGORIES,
    Compiled,
    StepRecipe,
    fold_step,
    prime_optimizer,
    tracked_stage_step,
    tracked_step,
)
from titanlite.loss import cross_entropy_sum
from titanlite.metrics.flops import param_counts
from titanlite.models.moe import experts
from titanlite.optim import build_optimizer
from titanlite.optim.ema import EMA
from titanlite.parallel import ParallelDims, compute_context, loss_context
from titanlite.plan import build_model, plan_run
from titanlite.registry import get_model_spec


def without_compile(job_config: JobConfig) -> JobConfig:
    """A copy of the config with compile off (see the module docstring)."""
    return dataclasses.replace(job_config, compile=dataclasses.replace(job_config.compile, enable=False))


# Why the memory estimate simulates a float8 run without its converter.
FLOAT8_MEMORY_NOTE = (
    "float8 is simulated in bf16: torchao 0.18's Float8Linear keeps the same high-precision input and weight for "
    "backward, and its float8 copies live for one matmul"
)


def without_converters(job_config: JobConfig) -> JobConfig:
    """A copy of the config with model.converters empty (see FLOAT8_MEMORY_NOTE)."""
    return dataclasses.replace(job_config, model=dataclasses.replace(job_config.model, converters=[]))


def _without_expert_parallelism(job_config: JobConfig) -> JobConfig:
    """A copy of the config with expert parallelism off: what the fake-tensor simulation runs
    (see expert_parallel_bytes)."""
    parallelism = dataclasses.replace(job_config.parallelism, expert_parallel_degree=1)
    return dataclasses.replace(job_config, parallelism=parallelism)


def expert_parallel_bytes(
    plan, job_config: JobConfig, model: nn.Module, stage_modules: tuple[str, ...] | None
) -> dict[str, int]:
    """What expert parallelism (``plan``'s ep ranks) changes in a rank's step, by arithmetic:
    the simulation cannot run the EP layer, whose all-to-all split sizes are read on the host
    (``tolist``), which fake tensors have no values for, so it runs ``model`` (the run's, or a
    stage's) with EP off, the experts FSDP-sharded over all the shard ranks, and these are
    added to its peak:

        temporary  - what FSDP holds gathered less: a block's n_experts / ep experts, not all
                     n_experts, (1 - 1/ep) x one MoE block's experts x parameter bytes (one
                     block gathered at the peak); under pipeline parallelism with several
                     micro-batches, where the stage stays gathered and its gradients unreduced
                     for the whole step, (1 - 1/ep) of all the stage's experts so held
                     (floor.unsharded_stage_bytes); never more than the simulated temporaries
                   + 2 x tokens / tp x top_k x dim x parameter bytes: the rows a rank receives
                     for its experts and the results it sends back, beside the rows the layer
                     makes without EP (an even load: a rank's experts get its share of pairs),
                     each TP rank routing its 1/tp of the data-parallel rank's tokens

    The sharded experts, their gradients and Adam state are 1 / shards of them without EP
    (every TP rank holding the same) and 1 / (shards x tp) with it (n_experts / ep experts over
    shards / (ep / tp) ranks; exact_model_state_bytes with ``ep``): the caller takes the
    difference from that arithmetic."""
    args, training, ep = plan.model_args, job_config.training, plan.parallel_dims.ep
    p_bytes = DTYPES[training.mixed_precision_param].itemsize
    gathered = int(max(param_counts(args).experts, default=0) * (1 - 1 / ep)) * p_bytes
    seq = training.seq_len // plan.parallel_dims.cp  # a cp rank's tokens of each sequence
    tokens = training.local_batch_size * seq
    if stage_modules is not None:
        tokens = job_config.parallelism.pipeline_parallel_microbatch_size * seq
        if not any(name.startswith("layers.") for name in stage_modules):
            return {"gathered": 0, "buffers": 0}
        without_ep = dataclasses.replace(plan, parallel_dims=dataclasses.replace(plan.parallel_dims, ep=1))
        held = [unsharded_stage_bytes(job_config, layout, model) for layout in (without_ep, plan)]
        gathered = max(gathered, held[0] - held[1])
    # Each TP rank routes its own slice of the sequence (parallel/moe_tensor_parallel.py).
    tokens //= plan.parallel_dims.tp
    return {"gathered": gathered, "buffers": 2 * tokens * args.top_k * args.dim * p_bytes}


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """Rank ``rank`` of a fake process group of ``world_size`` ranks, destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if world_size == 1:
        yield
        return
    # DTensor caches its sharding decisions by mesh layout, not by process group: a cached
    # output would carry the mesh (and group names) of an earlier, destroyed group into this
    # one, or of this fake group into the caller's next real one. Forget them both ways.
    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


@dataclass
class Simulated:
    """What one simulated step (a whole model's, or one pipeline stage's) gave, bytes."""

    peak: dict[str, int]
    activations: int
    held_activations: int | None  # a pipeline stage's, per waiting micro-batch (StepMemory's)
    measured: ModelStateBytes
    exact: ModelStateBytes
    num_params: int
    ema_bytes: int


@contextlib.contextmanager
def _even_expert_split():
    """A float32 MoE layer runs its experts as a loop that splits the rows by the routed
    counts, read on the host; fake tensors have no values to read. In the simulated step the
    loop splits the rows evenly over the experts instead: balanced routing, which the
    arithmetic for expert parallelism's all-to-all assumes too."""
    loop = experts._linear_per_expert

    def evenly(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows, n_experts = x.shape[0], weight.shape[0]
        sizes = [rows // n_experts + (expert < rows % n_experts) for expert in range(n_experts)]
        return experts.linear_by_sizes(x, weight, sizes)

    experts._linear_per_expert = evenly
    try:
        yield
    finally:
        experts._linear_per_expert = loop


def simulate(job_config: JobConfig, plan, mesh, stage_modules: tuple[str, ...] | None = None) -> Simulated:
    """Build the run's model (or, with ``stage_modules``, that pipeline stage's part) on
    ``mesh`` as fake tensors and run one tracked steady-state step: the whole local batch, or
    for a stage two of its micro-batches (one without the pipeline's per-micro-batch
    settings' effects would miss the gathered parameters and unreduced gradients they keep)."""
    training, parallel_dims = job_config.training, plan.parallel_dims
    compiled_parts = CompiledParts.of(job_config)  # the step runs eagerly, with stand-ins for them
    job_config = without_compile(job_config)
    ep, ep_plan = parallel_dims.ep, plan
    if ep > 1:  # simulated without EP, then corrected by arithmetic (expert_parallel_bytes)
        job_config, plan = (
            _without_expert_parallelism(job_config),
            dataclasses.replace(plan, parallel_dims=dataclasses.replace(parallel_dims, ep=1)),
        )
    global_tokens = plan.global_batch_size * training.seq_len
    # Under context parallelism each rank takes seq_len / cp tokens of every sequence, and its
    # attention all-gathers the keys and values of the whole sequence over the cp group: the
    # fake process group's all-gather returns cp times its input, so the simulated step holds
    # what a cp rank holds (the gathered keys and values, the [S / cp, S] masks).
    local_seq = training.seq_len // parallel_dims.cp
    model = build_model(job_config, plan, mesh, stage_modules=stage_modules)  # materialised as fake tensors below
    # allow_non_fake_inputs: to_empty reads the meta parameters, which are not fake.
    with FakeTensorMode(allow_non_fake_inputs=True), _even_expert_split():
        model.to_empty(device="cpu")  # no init_weights: fake tensors have no values
        optimizer = build_optimizer(_parameter_groups(model, job_config), job_config.optimizer)
        prime_optimizer(model, optimizer, keep_gradients=plan.grad_accum_steps > 1)
        ema_bytes = _ema_bytes(model, job_config)
        context = compute_context(parallel_dims, training.mixed_precision_param, "cpu")
        losses = partial(loss_context, parallel_dims, job_config)
        microbatch = job_config.parallelism.pipeline_parallel_microbatch_size
        sequences = training.local_batch_size if stage_modules is None else microbatch
        compiled = _stand_ins(model, job_config, compiled_parts, parallel_dims, sequences * local_seq)
        recipe = StepRecipe(global_tokens, training.max_norm, context, losses, compiled)
        if stage_modules is None:
            batch = _fake_batch(plan, training.local_batch_size, local_seq, has_first=True, has_last=True)
            step = tracked_step(model, optimizer, batch, recipe)
        else:
            microbatches = [
                _stage_batch(job_config, plan, stage_modules) for _ in range(min(2, plan.pipeline.microbatches))
            ]
            step = tracked_stage_step(model, optimizer, microbatches, recipe)
    # The gradients as the step leaves them, in their parameters' layout. The tracker's own
    # figure is their peak, which under TP alone holds the vocabulary-split embedding's
    # gradient whole (DTensor's embedding backward has no vocabulary-split rule) until
    # clipping slices it; that transient is in the peak, not in the resident state.
    gradient_bytes = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
    # The arithmetic reads which parameters TP split from the model's own placements.
    shard_rank, tp_rank = _mesh_coordinates(mesh)
    optimizer_name = job_config.optimizer.name
    shards = parallel_dims.dp_shard * parallel_dims.cp  # FSDP shards over dp_shard x cp
    state = partial(exact_model_state_bytes, model, shards, optimizer_name, shard_rank, tp_rank)
    exact = state(ep=ep, tp=parallel_dims.tp)
    num_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its global one
    peak, measured, activations = fold_step(step)
    measured = dataclasses.replace(measured, gradients=gradient_bytes)
    if ep > 1:
        changes = expert_parallel_bytes(ep_plan, job_config, model, stage_modules)
        _add_expert_parallelism(peak, exact, state(), changes)
    return Simulated(peak, activations, step.held_activations, measured, exact, num_params, ema_bytes)


# Tensors per parameter group of the simulated fused optimizer (see _parameter_groups).
FUSED_GROUP_TENSORS = 16


def _parameter_groups(model: nn.Module, job_config: JobConfig) -> list[dict]:
    """The model's parameters as the simulated optimizer's groups. Fused Adam updates its
    tensors in place, one kernel call per group, so groups of a few tensors hold the same bytes
    as the run's single group; DTensor's sharding propagation for one call over n tensors
    costs n x n (each tensor's strategy scans every argument's placements): over a 70B
    model's 723 tensors, 2 to 2.5 s of its simulation's 24 to 27 s of CPU. The other kernels
    make temporaries over all of a group's tensors at once: one group, as the run has."""
    parameters = list(model.parameters())
    if job_config.optimizer.implementation != "fused":
        return [{"params": parameters}]
    size = FUSED_GROUP_TENSORS
    return [{"params": parameters[start : start + size]} for start in range(0, len(parameters), size)]


def _stand_ins(model: nn.Module, job_config: JobConfig, parts: CompiledParts, parallel_dims, tokens: int) -> Compiled:
    """What the eagerly simulated step runs or counts in place of the run's compiled parts
    (titanlite.estimate.compiled): the compiled loss's allocations, the compiled blocks'
    savings."""
    savings = held_savings(model, parts, job_config.training.mixed_precision_param, parallel_dims, tokens)
    return Compiled(loss_fn=compiled_loss if parts.loss else cross_entropy_sum, savings=savings)


def _add_expert_parallelism(
    peak: dict[str, int], exact: ModelStateBytes, without_ep: ModelStateBytes, changes: dict[str, int]
) -> None:
    """Correct, in place, the peak of a step simulated without expert parallelism: the sharded
    state by its arithmetic with EP (FSDP's padding), the temporaries by what EP gathers less
    and buffers more (expert_parallel_bytes)."""
    for name in ModelStateBytes.__annotations__:
        peak[name] += getattr(exact, name) - getattr(without_ep, name)
    peak["temporary"] += changes["buffers"] - min(changes["gathered"], peak["temporary"])
    peak["total"] = sum(peak[name] for name in CATEGORIES)


def _fake_batch(plan, batch_size: int, seq_len: int, has_first: bool, has_last: bool, hidden=None) -> tuple:
    """(inputs, labels) of fake tensors: token ids for the first stage (or a whole model), else
    ``hidden`` = (shape, dtype) of the previous stage's output, requiring its gradient; labels
    for the last stage only."""
    vocab = plan.model_args.vocab_size
    if has_first:
        inputs = torch.randint(0, vocab, (batch_size, seq_len))
    else:
        shape, dtype = hidden
        inputs = torch.empty(shape, dtype=dtype, requires_grad=True)
    return inputs, torch.randint(0, vocab, (batch_size, seq_len)) if has_last else None


def _stage_batch(job_config: JobConfig, plan, stage_modules: tuple[str, ...]) -> tuple:
    """One pipeline micro-batch for the stage holding ``stage_modules``. Between stages the
    residual stream travels as each rank's local piece: [micro-batch, seq / tp, dim] with
    sequence parallel, whole without, in the parameter dtype; seq is seq_len / cp under context
    parallelism."""
    training, parallelism = job_config.training, job_config.parallelism
    has_first, has_last = stage_ends(job_config, stage_modules)
    tp, microbatch = plan.parallel_dims.tp, parallelism.pipeline_parallel_microbatch_size
    local_seq = training.seq_len // plan.parallel_dims.cp
    seq = local_seq // tp if tp > 1 and parallelism.enable_sequence_parallel else local_seq
    hidden = ((microbatch, seq, plan.model_args.dim), DTYPES[training.mixed_precision_param])
    return _fake_batch(plan, microbatch, local_seq, has_first, has_last, hidden)


def stage_ends(job_config: JobConfig, stage_modules: tuple[str, ...]) -> tuple[bool, bool]:
    """(whether the stage takes the tokens, whether it makes the logits): the model class
    names the modules before and after its blocks."""
    model_cls = get_model_spec(job_config.model.name).model_cls
    return model_cls.pipeline_first[0] in stage_modules, model_cls.pipeline_last[-1] in stage_modules


def _mesh_coordinates(mesh) -> tuple[int, int]:
    """(index in the FSDP shard group, index in the TP group) of this rank; 0 without them.
    Under context parallelism the shard group is dp_shard x cp flattened, cp inner."""
    coordinate = ParallelDims.coordinate(mesh)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    cp = mesh.size(names.index("cp")) if "cp" in names else 1
    return coordinate.get("dp_shard", 0) * cp + coordinate.get("cp", 0), coordinate.get(TP_DIM, 0)


def _ema_bytes(model: nn.Module, job_config: JobConfig) -> int:
    """Bytes of the EMA's averages (clones of the floating-point state), 0 when disabled.
    They are made before the tracker starts, which therefore never sees them."""
    if not job_config.ema.enable:
        return 0
    ema = EMA(model, job_config.ema.decay)
    return sum(_local(t).numel() * t.element_size() for t in ema.averages.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- the same step on real tensors (for checking the estimate) ----------------------------------


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        # Keyed by the storage object itself (its C++ address), which fake tensors, whose
        # data pointers are all alike, have too: FSDP's gradients are views of shared buffers.
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def measure_real_memory(job_config: JobConfig) -> dict[str, int]:
    """On this rank of an initialised (e.g. gloo) process group, with real CPU tensors: build
    the model as the trainer does, run the same steady-state step under the tracker and
    return this rank's bytes: "parameters", "gradients" and "optimizer_state" counted from
    the real tensors' storages, and "activations" and "peak" as the tracker measured them."""
    job_config = without_compile(job_config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    plan = plan_run(job_config, world_size)
    training = job_config.training
    model = build_model(job_config, plan, plan.parallel_dims.build_mesh("cpu"), device="cpu")
    global_tokens = plan.global_batch_size * training.seq_len
    optimizer = build_optimizer(model.parameters(), job_config.optimizer)
    # Weight decay in the priming step nudges the weights; nothing here reads them.
    prime_optimizer(model, optimizer, keep_gradients=plan.grad_accum_steps > 1)
    generator = torch.Generator().manual_seed(job_config.debug.seed)
    local_seq = training.seq_len // plan.parallel_dims.cp  # a cp rank's columns
    batch = tuple(
        torch.randint(0, plan.model_args.vocab_size, (training.local_batch_size, local_seq), generator=generator)
        for _ in range(2)
    )
    context = compute_context(plan.parallel_dims, training.mixed_precision_param, "cpu")
    losses = partial(loss_context, plan.parallel_dims, job_config)
    step = tracked_step(model, optimizer, batch, StepRecipe(global_tokens, training.max_norm, context, losses))
    peak, _, activations = fold_step(step)
    params = list(model.parameters())
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _storage_bytes(
            t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ),
        "activations": activations,
        "peak": peak["total"],
    }
