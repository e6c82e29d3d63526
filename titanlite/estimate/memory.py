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

* Compile: the step runs eagerly (compiling would cost minutes), with what the compiled
  loss allocates in place of the eager loss and what compiled blocks keep less taken off,
  where that was measured (titanlite.estimate.compiled).
* The mesh and the fake tensors are CPU ones whatever ``device_type`` says: this process
  needs no accelerator, and byte counts do not depend on the device. On "cuda" the
  caching allocator's reserve is added for ``reserved_bytes`` (ALLOCATOR_SLACK), which
  ``fits`` compares with the device; not counted: the CUDA context and library workspaces
  (which are not tensors) and NCCL buffers, for which ``fits`` keeps a reserve aside.
* With gradient accumulation the last micro-batch is measured, with the earlier ones'
  gradients resident (as unpadded shards: a few rows per parameter less than FSDP's).
* With CPU offload the sharded parameters, gradients and optimizer state are taken out
  of the total as host memory; the device copies FSDP makes of each unit's shards before
  the all-gather are not modelled, so offloaded estimates are rougher.
* Context parallelism is simulated, not added by arithmetic: rank 0 runs seq_len / cp
  tokens of every sequence, and the fake process group's all-gather hands its attention
  the whole sequence's keys and values (cp times its own), so the gathered keys and values,
  the [seq_len / cp, seq_len] masks and the logits of its own tokens are all counted.
* The tracker ignores the global-shape fake tensors DTensor makes to infer output shapes
  (see titanlite.estimate.tracker): they are never allocated.
"""

import time
from dataclasses import dataclass, field

import torch.distributed as dist

from titanlite.config import ConfigError, JobConfig
from titanlite.estimate.floor import ModelStateBytes
from titanlite.estimate.pipeline import in_flight_microbatches
from titanlite.estimate.simulation import (
    FLOAT8_MEMORY_NOTE,
    Simulated,
    fake_process_group,
    simulate,
    stage_ends,
    without_converters,
)
from titanlite.estimate.tracker import CATEGORIES
from titanlite.plan import plan_run, tokenizer_for_estimate

# The CUDA caching allocator reserves more than the tensors hold. Memory a block held stays
# cached when the block is freed, and a later request the cached blocks cannot serve whole
# is carved out of a larger one or gets a new segment; the pieces left over (inactive split
# blocks) are reserved but not allocated. Only what a step allocates and frees (activations
# and temporaries) is carved so; the state allocated once (weights, optimizer state, EMA) is
# not. Measured on an H200 (docs/performance.md, "GPU memory against the estimator"), the
# reserved peak exceeded the allocated one by 0.08 to 0.19 of the step's activations and
# temporaries at the peak, the eager and compiled 1 B steps at seq 4096 and 8192; the
# estimate takes the most, rounded up.
ALLOCATOR_SLACK = 0.2


def reserved_bytes(peak: dict[str, int], device_type: str) -> int:
    """What the CUDA caching allocator reserves at a step's peak ``peak`` (CATEGORIES and
    "total", the tensors' bytes): the tensors plus ALLOCATOR_SLACK of the step's own; on a
    device without that allocator the tensors alone."""
    if device_type != "cuda":
        return peak["total"]
    return peak["total"] + int(ALLOCATOR_SLACK * (peak["activations"] + peak["temporary"]))


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
    microbatch_activations: int  # the most one micro-batch waiting for its backward holds in one of its stages
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
        """The most the step's tensors hold at once (the allocator's allocated peak)."""
        return self.peak["total"]

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator reserves at that peak (see ALLOCATOR_SLACK): what the
        device must have free."""
        return reserved_bytes(self.peak, self.device_type)

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
            f"peak {self.peak_bytes / gib:.2f} GiB{where}, {self.reserved_bytes / gib:.2f} GiB reserved",
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
    """Whether the step fits in ``memory_bytes`` per rank: the caching allocator's reserved
    figure (the tensors and what the allocator keeps cached beside them), with
    ``reserve_bytes`` aside for what is no tensor (the CUDA context, library workspaces,
    NCCL's buffers). Returns (fits, headroom); a negative headroom is how much is missing."""
    headroom = memory_bytes - reserve_bytes - estimate.reserved_bytes
    return headroom >= 0, headroom


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
        notes.append(
            "compile: the step is simulated eagerly, with the compiled loss's and blocks' memory "
            "in place of theirs where measured (titanlite.estimate.compiled)"
        )
    if job_config.model.converters:
        notes.append(FLOAT8_MEMORY_NOTE)
        job_config = without_converters(job_config)
    tokenizer, note = tokenizer_for_estimate(job_config)
    notes += [note] if note else []
    plan = plan_run(job_config, world_size, tokenizer)
    parallel_dims, accumulation, training = plan.parallel_dims, plan.grad_accum_steps, job_config.training
    if parallel_dims.ep > 1:
        notes.append(
            f"expert parallelism {parallel_dims.ep}: simulated with the experts FSDP-sharded over all "
            f"{parallel_dims.dp_shard} shard ranks{' (each TP rank holding the same)' if parallel_dims.tp > 1 else ''} "
            "(fake tensors cannot run the all-to-all, whose split sizes are read on the host); the experts' state, "
            "the experts gathered per block and the all-to-all buffers corrected by arithmetic"
        )
    if parallel_dims.cp > 1:
        notes.append(
            f"context parallelism {parallel_dims.cp}: simulated (seq_len / {parallel_dims.cp} tokens of each sequence, "
            "the keys and values all-gathered over the cp group, FSDP sharding over dp_shard x cp)"
        )
    if accumulation > 1:
        notes.append(
            f"{accumulation} micro-batches per step: measured the last, with the earlier ones' gradients resident"
        )

    if plan.pipeline is not None:
        return _estimate_pipeline(job_config, plan, world_size, device_type, rank, notes, start)
    with fake_process_group(world_size, rank):
        # The mesh is a CPU one: the fake backend serves any device, and CPU fake tensors
        # need no accelerator in this process. Byte counts do not depend on the device.
        run = simulate(job_config, plan, parallel_dims.build_mesh("cpu"))
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


def _estimate_pipeline(
    job_config: JobConfig, plan, world_size: int, device_type: str, rank: int, notes: list[str], start: float
) -> MemoryEstimate:
    """Every pp rank's memory (at ``rank``'s place among its stage's ranks); the estimate's
    figures are the fullest rank's. Each distinct stage (its block count, and whether it holds
    the embedding or the output) is simulated once, on a rank of the fake process group that
    runs it."""
    pipeline, training, parallel_dims = plan.pipeline, job_config.training, plan.parallel_dims
    stride = world_size // pipeline.pp  # ranks per stage: pp is the outermost mesh dimension
    simulated: dict[tuple, Simulated] = {}
    ranks: list[tuple[StageMemory, list[Simulated], list[str]]] = []
    for pp_rank in range(pipeline.pp):
        stages = pipeline.rank_stages(pp_rank)
        kinds = [_stage_kind(job_config, pipeline.stage_modules[stage]) for stage in stages]
        if any(kind not in simulated for kind in kinds):
            with fake_process_group(world_size, pp_rank * stride + rank % stride):
                mesh = parallel_dims.build_mesh("cpu")
                for stage, kind in zip(stages, kinds, strict=True):
                    if kind not in simulated:
                        simulated[kind] = simulate(job_config, plan, mesh, pipeline.stage_modules[stage])
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
        activations=worst.peak["activations"],
        measured=_summed(run.measured for run in runs),
        exact=_summed(run.exact for run in runs),
        num_params=sum(stage.num_params for stage, _, _ in ranks),
        pipeline=[stage for stage, _, _ in ranks],
    )


def _rank_memory(pipeline, pp_rank: int, runs: list[Simulated], cpu_offload: bool, notes: list[str]) -> StageMemory:
    """One pp rank's peak from its stages' simulated steps (each of one micro-batch in flight):
    their breakdowns at their peaks added up, as if every stage peaked at once (exact for one
    stage per rank, an upper bound for several), plus the activations of the further
    micro-batches the schedule keeps in flight, each what a micro-batch holds between its
    forward and its backward in the rank's largest stage. That is less than the simulated
    micro-batch's own peak, which under activation checkpointing also holds a block's
    recomputed activations: one micro-batch at a time runs its backward."""
    in_flight = in_flight_microbatches(pipeline, pp_rank)
    per_microbatch = max(run.held_activations for run in runs)
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
    return (sum(name.startswith("layers.") for name in stage_modules), *stage_ends(job_config, stage_modules))


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
