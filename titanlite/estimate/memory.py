"""Per-rank memory of one training step, estimated in a single process without allocating it.

``estimate_memory(job_config, world_size)`` pretends to be rank 0 of ``world_size`` ranks:
a fake process group (collectives do nothing), the model built on meta and parallelised by
the registry's own parallelize function (the config's tensor parallelism, activation
checkpointing, FSDP layout and mixed-precision policy, on the run's 1-, 2- or 3-D mesh),
then materialised as fake tensors (shapes, dtypes and storage sizes, no data). One training
step (forward, summed cross-entropy, backward, gradient clipping, optimizer step) runs on a
fake ``[local_batch_size, seq_len]`` batch under PyTorch's ``FSDPMemTracker``, which files
every storage under a category and records the peak; under tensor parallelism the loss runs
under loss parallel as in the trainer. Rank 0 holds the largest shard when a dimension does
not split evenly, so its figures are the most any rank needs.

With tensor parallelism a parameter is split by TP and then by FSDP, so each rank holds about
1 / (dp_shard x tp) of it; the norms, which TP replicates, only 1 / dp_shard. Activations are
the rank's own: with sequence parallelism the residual stream is split along the sequence,
the attention and FFN inputs are all-gathered (counted as they are held).

What each figure means (bytes on one rank):

* ``parameters``: the sharded parameters (FSDP's padded shard storage, in the parameter
  dtype, float32 for the master weights).
* ``gradients``: the sharded gradients once backward is done, in the layout they really get
  (a gradient can be held larger than its parameter; see the notes).
* ``optimizer_state``: the tensors in ``optimizer.state`` (Adam: two moments plus a
  one-element step counter per parameter).
* ``activations``: the largest amount the tracker files as "Activation" during the step:
  tensors produced in forward (and recomputed by activation checkpointing) that are held
  for backward, including the logits and the loss's float32 copies.
* ``temporary``: at the peak moment, everything transient: unsharded parameters and their
  all-gather buffers, unsharded gradients and reduce-scatter buffers, gradients of
  activations during backward ("Temp"), and the optimizer step's scratch tensors.
* ``other``: buffers (the RoPE tables), the input batch and, when enabled, the EMA copy.

Under pipeline parallelism every pp rank is estimated: each of its stages is built as the
trainer builds it and simulated for two micro-batches, and the activations of the further
micro-batches its schedule keeps in flight are added (estimate.pipeline, docs/estimate.md);
the figures above are then the fullest pp rank's, and ``MemoryEstimate.pipeline`` lists all.

The measured step is a steady-state one: the optimizer state is created before tracking
starts (a step on zero gradients), because from the second step on it stays resident
during forward and backward; a first step alone would miss it.

Choices to know about:

* Compile is forced off: compiling would cost minutes, and compiled blocks change only how
  much scratch memory fused kernels need (usually less), not the resident state; the
  estimate is for eager execution and so errs on the high side.
* The mesh and the fake tensors are CPU ones whatever ``device_type`` says (it is only
  recorded): this process needs no accelerator, and byte counts do not depend on the
  device. Not counted: the CUDA caching allocator's rounding of each block to 512 bytes
  and its fragmentation, the CUDA context and library workspaces (which are not tensors),
  and NCCL buffers. ``fits`` takes a reserve for these.
* With gradient accumulation the last micro-batch is measured, with the earlier ones'
  gradients resident (as unpadded shards: a few rows per parameter less than FSDP's).
* With CPU offload the sharded parameters, gradients and optimizer state are taken out
  of the total as host memory; the device copies FSDP makes of each unit's shards before
  the all-gather are not modelled, so offloaded estimates are rougher.
* The tracker ignores the global-shape fake tensors DTensor makes to infer output shapes
  (see titanlite.estimate.tracker): they are never allocated.
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from titanlite.config import ConfigError, JobConfig
from titanlite.dtypes import DTYPES
from titanlite.estimate.floor import TP_DIM, ModelStateBytes, exact_model_state_bytes, unsharded_stage_bytes
from titanlite.estimate.pipeline import in_flight_microbatches
from titanlite.estimate.tracker import CATEGORIES, fold_step, prime_optimizer, tracked_stage_step, tracked_step
from titanlite.metrics.flops import param_counts
from titanlite.optim import build_optimizer
from titanlite.optim.ema import EMA
from titanlite.parallel import ParallelDims, compute_context, loss_context
from titanlite.plan import build_model, plan_run, tokenizer_for_estimate
from titanlite.registry import get_model_spec


class EstimateError(RuntimeError):
    """The estimate cannot run in this process (e.g. a real process group is already up)."""


@dataclass
class StageMemory:
    """One pp rank's memory under pipeline parallelism, bytes: its stages' model state and
    the activations of the micro-batches it holds at once (estimate.pipeline)."""

    pp_rank: int
    stages: tuple[int, ...]
    modules: tuple[str, str]  # the first and the last module its stages hold
    num_params: int
    in_flight: int  # chunks (micro-batch x stage) whose activations it holds at its peak
    microbatch_activations: int  # the largest activation footprint of one micro-batch through one of its stages
    peak: dict[str, int]  # CATEGORIES and "total"

    @property
    def peak_bytes(self) -> int:
        return self.peak["total"]

    def line(self) -> str:
        gib = 2**30
        stages = ", ".join(str(stage) for stage in self.stages)
        return (
            f"  pp rank {self.pp_rank} (stage {stages}: {self.modules[0]} .. {self.modules[1]}, "
            f"{self.num_params / 1e9:.2f} B params): peak {self.peak_bytes / gib:.2f} GiB, {self.in_flight} "
            f"micro-batch(es) in flight x {self.microbatch_activations / gib:.2f} GiB of activations"
        )


@dataclass
class MemoryEstimate:
    """One rank's memory for one steady-state training step; every figure is in bytes.

    ``peak`` is the breakdown at the moment the total is highest (keys: CATEGORIES and
    "total"); ``measured`` holds the resident parameters, gradients and optimizer state
    the tracker saw; ``exact`` the same three by arithmetic; ``activations`` the largest
    activation footprint during the step (not necessarily at the peak moment).
    """

    world_size: int
    strategy: str
    dp_shard: int  # FSDP shards of each parameter
    tp: int  # tensor-parallel ranks each matrix is split over first
    device_type: str
    local_batch_size: int
    seq_len: int
    peak: dict[str, int]
    activations: int
    measured: ModelStateBytes
    exact: ModelStateBytes
    num_params: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    # With pipeline parallelism: every pp rank's figures; the fields above are the worst rank's.
    pipeline: list[StageMemory] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.peak["total"]

    @property
    def worst_stage(self) -> StageMemory | None:
        """The pp rank with the highest peak (None without pipeline parallelism)."""
        return max(self.pipeline, key=lambda rank: rank.peak_bytes) if self.pipeline else None

    def lines(self) -> list[str]:
        """A short human-readable report, one line per figure."""
        gib = 2**30
        worst = self.worst_stage
        where = "" if worst is None else f" on pp rank {worst.pp_rank}, the fullest of {len(self.pipeline)}"
        out = [
            f"memory per rank ({self.strategy}, {self.world_size} rank(s), {self.dp_shard} shard(s) x tp {self.tp}, "
            f"batch {self.local_batch_size} x {self.seq_len}, {self.num_params / 1e9:.2f} B params): "
            f"peak {self.peak_bytes / gib:.2f} GiB{where}",
        ]
        for name in CATEGORIES:
            out.append(f"  {name:<16} {self.peak[name] / gib:8.2f} GiB at the peak")
        out.append(f"  largest activation footprint {self.activations / gib:.2f} GiB")
        for name in ("parameters", "gradients", "optimizer_state"):
            out.append(
                f"  {name:<16} tracked {getattr(self.measured, name) / gib:.3f} GiB, "
                f"arithmetic {getattr(self.exact, name) / gib:.3f} GiB"
            )
        out.extend(rank.line() for rank in self.pipeline)
        out.extend(f"  note: {note}" for note in self.notes)
        return out


def fits(estimate: MemoryEstimate, memory_bytes: int, reserve_bytes: int = 0) -> tuple[bool, int]:
    """Whether the step fits in ``memory_bytes`` per rank, keeping ``reserve_bytes`` aside for
    what is not tensors (CUDA context, allocator fragmentation). Returns (fits, headroom);
    a negative headroom is how much is missing."""
    headroom = memory_bytes - reserve_bytes - estimate.peak_bytes
    return headroom >= 0, headroom


# --- building the run -------------------------------------------------------------------------


def _without_compile(job_config: JobConfig) -> JobConfig:
    """A copy of the config with compile off (see the module docstring)."""
    return dataclasses.replace(job_config, compile=dataclasses.replace(job_config.compile, enable=False))


def _without_expert_parallelism(job_config: JobConfig) -> JobConfig:
    """A copy of the config with expert parallelism off: what the fake-tensor simulation runs
    (see _expert_parallel_bytes)."""
    parallelism = dataclasses.replace(job_config.parallelism, expert_parallel_degree=1)
    return dataclasses.replace(job_config, parallelism=parallelism)


def _expert_parallel_bytes(
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
                   + 2 x tokens x top_k x dim x parameter bytes: the rows a rank receives for
                     its experts and the results it sends back, beside the rows the layer
                     makes without EP (an even load: a rank's experts get its share of pairs),
                     all of the data-parallel rank's tokens on every TP rank

    The sharded experts, their gradients and Adam state are 1 / shards of them either way
    (n_experts / ep experts over shards / ep ranks; exact_model_state_bytes with ``ep``),
    different only by FSDP's padding, which the caller takes from that arithmetic."""
    args, training, ep = plan.model_args, job_config.training, plan.parallel_dims.ep
    p_bytes = DTYPES[training.mixed_precision_param].itemsize
    gathered = int(max(param_counts(args).experts, default=0) * (1 - 1 / ep)) * p_bytes
    tokens = training.local_batch_size * training.seq_len
    if stage_modules is not None:
        tokens = job_config.parallelism.pipeline_parallel_microbatch_size * training.seq_len
        if not any(name.startswith("layers.") for name in stage_modules):
            return {"gathered": 0, "buffers": 0}
        without_ep = dataclasses.replace(plan, parallel_dims=dataclasses.replace(plan.parallel_dims, ep=1))
        held = [unsharded_stage_bytes(job_config, layout, model) for layout in (without_ep, plan)]
        gathered = max(gathered, held[0] - held[1])
    # TP holds the MoE layer whole: each TP rank routes all of the tokens (sequence parallel
    # all-gathers them first), so its buffers are not divided by the TP degree.
    return {"gathered": gathered, "buffers": 2 * tokens * args.top_k * args.dim * p_bytes}


@contextlib.contextmanager
def _fake_process_group(world_size: int, rank: int):
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


def estimate_memory(job_config: JobConfig, world_size: int, device_type: str = "cuda", rank: int = 0) -> MemoryEstimate:
    """Estimate one rank's memory for one training step of ``job_config`` on ``world_size`` ranks:
    rank 0's by default, which holds the largest shards, i.e. the most any rank needs.

    Runs in the calling process with a fake process group and fake tensors: nothing of the
    model's size is allocated. Raises EstimateError when a real process group is already
    initialised (the fake one would replace it) and ConfigError for an invalid layout.
    """
    if dist.is_initialized():
        raise EstimateError(
            "estimate_memory needs a process without a process group (it starts a fake one); "
            "call it before init_process_group, or from a separate process"
        )
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not one of the {world_size} rank(s)")
    start = time.perf_counter()
    notes = []
    if job_config.compile.enable:
        notes.append("compile is forced off in the estimate; compiled blocks may need a little less scratch memory")
        job_config = _without_compile(job_config)
    tokenizer, note = tokenizer_for_estimate(job_config)
    notes += [note] if note else []
    plan = plan_run(job_config, world_size, tokenizer)
    parallel_dims, accumulation, training = plan.parallel_dims, plan.grad_accum_steps, job_config.training
    if parallel_dims.ep > 1:
        notes.append(
            f"expert parallelism {parallel_dims.ep}: simulated with the experts FSDP-sharded over all "
            f"{parallel_dims.dp_shard} shard ranks (fake tensors cannot run the all-to-all, whose split sizes "
            "are read on the host); the experts gathered per block and the all-to-all buffers added by arithmetic"
        )
    if accumulation > 1:
        notes.append(
            f"{accumulation} micro-batches per step: measured the last, with the earlier ones' gradients resident"
        )

    if plan.pipeline is not None:
        return _estimate_pipeline(job_config, plan, world_size, device_type, rank, notes, start)
    with _fake_process_group(world_size, rank):
        # The mesh is a CPU one: the fake backend serves any device, and CPU fake tensors
        # need no accelerator in this process. Byte counts do not depend on the device.
        run = _simulate(job_config, plan, parallel_dims.build_mesh("cpu"))
    _add_untracked(run.peak, run.ema_bytes, training.enable_cpu_offload, notes)
    figures = {"peak": run.peak, "activations": run.activations, "measured": run.measured, "exact": run.exact}
    return _estimate(job_config, plan, device_type, start, notes, num_params=run.num_params, **figures)


def _estimate(job_config: JobConfig, plan, device_type: str, start: float, notes: list[str], **figures):
    """A MemoryEstimate of ``figures`` (peak, activations, ...) with the layout's own fields."""
    training, parallel_dims = job_config.training, plan.parallel_dims
    return MemoryEstimate(
        world_size=parallel_dims.world_size,
        strategy=parallel_dims.strategy,
        dp_shard=parallel_dims.dp_shard,
        tp=parallel_dims.tp,
        device_type=device_type,
        local_batch_size=training.local_batch_size,
        seq_len=training.seq_len,
        seconds=time.perf_counter() - start,
        notes=notes,
        **figures,
    )


@dataclass
class _Simulated:
    """What one simulated step (a whole model's, or one pipeline stage's) gave, bytes."""

    peak: dict[str, int]
    activations: int
    measured: ModelStateBytes
    exact: ModelStateBytes
    num_params: int
    ema_bytes: int


def _simulate(job_config: JobConfig, plan, mesh, stage_modules: tuple[str, ...] | None = None) -> _Simulated:
    """Build the run's model (or, with ``stage_modules``, that pipeline stage's part) on
    ``mesh`` as fake tensors and run one tracked steady-state step: the whole local batch, or
    for a stage two of its micro-batches (one without the pipeline's per-micro-batch
    settings' effects would miss the gathered parameters and unreduced gradients they keep)."""
    training, parallel_dims = job_config.training, plan.parallel_dims
    ep, ep_plan = parallel_dims.ep, plan
    if ep > 1:  # simulated without EP, then corrected by arithmetic (_expert_parallel_bytes)
        job_config, plan = (
            _without_expert_parallelism(job_config),
            dataclasses.replace(plan, parallel_dims=dataclasses.replace(parallel_dims, ep=1)),
        )
    global_tokens = plan.global_batch_size * training.seq_len
    model = build_model(job_config, plan, mesh, stage_modules=stage_modules)  # materialised as fake tensors below
    # allow_non_fake_inputs: to_empty reads the meta parameters, which are not fake.
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # no init_weights: fake tensors have no values
        optimizer = build_optimizer(model.parameters(), job_config.optimizer)
        prime_optimizer(model, optimizer, keep_gradients=plan.grad_accum_steps > 1)
        ema_bytes = _ema_bytes(model, job_config)
        context = compute_context(parallel_dims, training.mixed_precision_param, "cpu")
        losses = partial(loss_context, parallel_dims, job_config)
        if stage_modules is None:
            batch = _fake_batch(plan, training.local_batch_size, training.seq_len, has_first=True, has_last=True)
            step = tracked_step(model, optimizer, batch, global_tokens, training.max_norm, context, losses)
        else:
            microbatches = [
                _stage_batch(job_config, plan, stage_modules) for _ in range(min(2, plan.pipeline.microbatches))
            ]
            step = tracked_stage_step(model, optimizer, microbatches, global_tokens, training.max_norm, context, losses)
    # The gradients as the step leaves them, in their parameters' layout. The tracker's own
    # figure is their peak, which under TP alone holds the vocabulary-split embedding's
    # gradient whole (DTensor's embedding backward has no vocabulary-split rule) until
    # clipping slices it; that transient is in the peak, not in the resident state.
    gradient_bytes = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
    # The arithmetic reads which parameters TP split from the model's own placements.
    shard_rank, tp_rank = _mesh_coordinates(mesh)
    optimizer_name = job_config.optimizer.name
    state = partial(exact_model_state_bytes, model, parallel_dims.dp_shard, optimizer_name, shard_rank, tp_rank)
    exact = state(ep=ep)
    num_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its global one
    peak, measured, activations = fold_step(step)
    measured = dataclasses.replace(measured, gradients=gradient_bytes)
    if ep > 1:
        changes = _expert_parallel_bytes(ep_plan, job_config, model, stage_modules)
        _add_expert_parallelism(peak, exact, state(), changes)
    return _Simulated(peak, activations, measured, exact, num_params, ema_bytes)


def _add_expert_parallelism(
    peak: dict[str, int], exact: ModelStateBytes, without_ep: ModelStateBytes, changes: dict[str, int]
) -> None:
    """Correct, in place, the peak of a step simulated without expert parallelism: the sharded
    state by its arithmetic with EP (FSDP's padding), the temporaries by what EP gathers less
    and buffers more (_expert_parallel_bytes)."""
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
    sequence parallel, whole without, in the parameter dtype."""
    training, parallelism = job_config.training, job_config.parallelism
    has_first, has_last = _stage_ends(job_config, stage_modules)
    tp, microbatch = plan.parallel_dims.tp, parallelism.pipeline_parallel_microbatch_size
    seq = training.seq_len // tp if tp > 1 and parallelism.enable_sequence_parallel else training.seq_len
    hidden = ((microbatch, seq, plan.model_args.dim), DTYPES[training.mixed_precision_param])
    return _fake_batch(plan, microbatch, training.seq_len, has_first, has_last, hidden)


def _stage_ends(job_config: JobConfig, stage_modules: tuple[str, ...]) -> tuple[bool, bool]:
    """(whether the stage takes the tokens, whether it makes the logits): the model class
    names the modules before and after its blocks."""
    model_cls = get_model_spec(job_config.model.name).model_cls
    return model_cls.pipeline_first[0] in stage_modules, model_cls.pipeline_last[-1] in stage_modules


def _estimate_pipeline(
    job_config: JobConfig, plan, world_size: int, device_type: str, rank: int, notes: list[str], start: float
) -> MemoryEstimate:
    """Every pp rank's memory (at ``rank``'s place among its stage's ranks); the estimate's
    figures are the fullest rank's. Each distinct stage (its block count, and whether it holds
    the embedding or the output) is simulated once, on a rank of the fake process group that
    runs it."""
    pipeline, training, parallel_dims = plan.pipeline, job_config.training, plan.parallel_dims
    stride = world_size // pipeline.pp  # ranks per stage: pp is the outermost mesh dimension
    simulated: dict[tuple, _Simulated] = {}
    ranks: list[tuple[StageMemory, list[_Simulated], list[str]]] = []
    for pp_rank in range(pipeline.pp):
        stages = pipeline.rank_stages(pp_rank)
        kinds = [_stage_kind(job_config, pipeline.stage_modules[stage]) for stage in stages]
        if any(kind not in simulated for kind in kinds):
            with _fake_process_group(world_size, pp_rank * stride + rank % stride):
                mesh = parallel_dims.build_mesh("cpu")
                for stage, kind in zip(stages, kinds, strict=True):
                    if kind not in simulated:
                        simulated[kind] = _simulate(job_config, plan, mesh, pipeline.stage_modules[stage])
        runs, rank_notes = [simulated[kind] for kind in kinds], []
        ranks.append((_rank_memory(pipeline, pp_rank, runs, training.enable_cpu_offload, rank_notes), runs, rank_notes))
    worst, runs, worst_notes = max(ranks, key=lambda entry: entry[0].peak_bytes)
    notes.extend(worst_notes)
    notes.append(
        f"pipeline {pipeline.schedule}, {pipeline.microbatches} micro-batch(es) of "
        f"{job_config.parallelism.pipeline_parallel_microbatch_size} sequence(s) per accumulation step: "
        "each pp rank holds its stages' state and its in-flight micro-batches' activations"
    )
    return _estimate(
        job_config,
        plan,
        device_type,
        start,
        notes,
        peak=worst.peak,
        activations=worst.in_flight * worst.microbatch_activations,
        measured=_summed(run.measured for run in runs),
        exact=_summed(run.exact for run in runs),
        num_params=sum(stage.num_params for stage, _, _ in ranks),
        pipeline=[stage for stage, _, _ in ranks],
    )


def _rank_memory(pipeline, pp_rank: int, runs: list[_Simulated], cpu_offload: bool, notes: list[str]) -> StageMemory:
    """One pp rank's peak from its stages' simulated steps (each of one micro-batch in flight):
    their breakdowns at their peaks added up, as if every stage peaked at once (exact for one
    stage per rank, an upper bound for several), plus the activations of the further
    micro-batches the schedule keeps in flight, each as large as the rank's largest stage's."""
    in_flight = in_flight_microbatches(pipeline, pp_rank)
    per_microbatch = max(run.activations for run in runs)
    peak = {name: sum(run.peak[name] for run in runs) for name in CATEGORIES}
    peak["activations"] += max(0, in_flight - len(runs)) * per_microbatch
    peak["total"] = sum(peak[name] for name in CATEGORIES)
    _add_untracked(peak, sum(run.ema_bytes for run in runs), cpu_offload, notes)
    stages = pipeline.rank_stages(pp_rank)
    return StageMemory(
        pp_rank=pp_rank,
        stages=tuple(stages),
        modules=(pipeline.stage_modules[stages[0]][0], pipeline.stage_modules[stages[-1]][-1]),
        num_params=sum(run.num_params for run in runs),
        in_flight=in_flight,
        microbatch_activations=per_microbatch,
        peak=peak,
    )


def _summed(states) -> ModelStateBytes:
    states = list(states)
    return ModelStateBytes(*(sum(getattr(state, name) for state in states) for name in ModelStateBytes.__annotations__))


def _stage_kind(job_config: JobConfig, stage_modules: tuple[str, ...]) -> tuple:
    """What a stage's memory depends on: its block count and whether it holds either end."""
    return (sum(name.startswith("layers.") for name in stage_modules), *_stage_ends(job_config, stage_modules))


def _mesh_coordinates(mesh) -> tuple[int, int]:
    """(index in the FSDP shard group, index in the TP group) of this rank; 0 without them."""
    coordinate = ParallelDims.coordinate(mesh)
    return coordinate.get("dp_shard", 0), coordinate.get(TP_DIM, 0)


def _add_untracked(peak: dict[str, int], ema_bytes: int, cpu_offload: bool, notes: list[str]) -> None:
    """Correct the peak breakdown, in place, for what the tracker cannot see or place."""
    if ema_bytes:
        notes.append("the EMA copy of the weights is counted under 'other' (from its tensors, outside the tracker)")
        peak["other"] += ema_bytes
        peak["total"] += ema_bytes
    if cpu_offload:
        offloaded = peak["parameters"] + peak["gradients"] + peak["optimizer_state"]
        notes.append(f"CPU offload: {offloaded / 2**30:.2f} GiB of sharded state is in host memory, not in the total")
        for name in ("parameters", "gradients", "optimizer_state"):
            peak[name] = 0
        peak["total"] -= offloaded


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
    job_config = _without_compile(job_config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    plan = plan_run(job_config, world_size)
    training = job_config.training
    model = build_model(job_config, plan, plan.parallel_dims.build_mesh("cpu"), device="cpu")
    global_tokens = plan.global_batch_size * training.seq_len
    optimizer = build_optimizer(model.parameters(), job_config.optimizer)
    # Weight decay in the priming step nudges the weights; nothing here reads them.
    prime_optimizer(model, optimizer, keep_gradients=plan.grad_accum_steps > 1)
    generator = torch.Generator().manual_seed(job_config.debug.seed)
    batch = tuple(
        torch.randint(0, plan.model_args.vocab_size, (training.local_batch_size, training.seq_len), generator=generator)
        for _ in range(2)
    )
    context = compute_context(plan.parallel_dims, training.mixed_precision_param, "cpu")
    losses = partial(loss_context, plan.parallel_dims, job_config)
    step = tracked_step(model, optimizer, batch, global_tokens, training.max_norm, context, losses)
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
