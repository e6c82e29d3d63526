"""The sweep (scripts/estimate.py --sweep): every layout of one model at some GPU counts, the
global batch held, each with its analytic step time and memory floor (fast: arithmetic), and
memory simulated (slow: a fake-tensor step, titanlite.estimate.memory) only where it can
change which layout wins.

Which layout can still win. At each GPU count the winner is the layout with the most tokens/s
per GPU among those that fit, ties going to the first in the sweep's order. Whether a layout
fits does not depend on any other layout, and its step time does not depend on its memory, so
the layouts are ranked by (tokens/s per GPU, highest first; then the sweep's order), and

* a layout whose memory floor (estimate.floor: what a rank surely holds) does not fit cannot
  win: its simulated peak would be at least the floor; it is not simulated;
* the others are simulated in rank order until one fits: that one is the winner, exactly as if
  every layout had been simulated, since each layout ranked above it either is over its floor
  or was simulated and does not fit, and none ranked below it can beat it. They are not
  simulated ("faster_fits"), except where a simulation already made for the same per-rank
  memory answers them for free.

The one premise: a floor never exceeds the simulated peak of its layout (estimate.floor counts
only what a rank surely holds; tests/test_estimate_cli.py compares the two on every layout of a
small sweep: FSDP, HSDP, TP, DDP + TP and PP).

Layouts that share per-rank memory share one simulation: a rank holds the same tensors for the
same shard, TP, pipeline (degree and schedule) and EP degrees and batch, whatever the number of
replicas or GPUs, so HSDP 8 x 4 x 2 at 64 GPUs and HSDP 64 x 4 x 2 at 512 are simulated once
(whether there are replicas at all is part of the key: DDP and HSDP add the replicas' buffers).

``simulate="all"`` simulates every layout under its floor (the verdicts' comparisons then name
layouts known to fit); ``"none"`` none (--skip_memory: the floor stands in for the fit).
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

from titanlite.config import ConfigError, JobConfig
from titanlite.estimate.hardware import Hardware
from titanlite.estimate.memory import estimate_memory
from titanlite.estimate.results import floor_only_memory, layout_result, memory_result
from titanlite.parallel.parallel_dims import ep_problem
from titanlite.plan import meta_model, run_model_args, tokenizer_for_estimate
from titanlite.registry import get_model_spec

SIMULATE = ("needed", "all", "none")

# progress(what, done, total, detail): "estimating step time" or "simulating memory", how many
# of how many (for the simulations, at most that many), and the layout at hand.
Progress = Callable[[str, int, int, str], None]


@dataclass(frozen=True)
class SweepSettings:
    """What the sweep tries and how. ``pipelines``: (pp degree, schedule) pairs, (1, None)
    first; ``ep_degrees``: the EP degrees to try (those that divide a layout's shard degree
    and the experts are); ``simulate``: one of SIMULATE (see the module docstring);
    ``cp_degrees``: the context-parallel degrees to try, each splitting a layout's shard ranks
    into dp_shard x cp (those that divide them)."""

    sizes: tuple[int, ...]
    pipelines: tuple[tuple[int, str | None], ...]
    ep_degrees: tuple[int, ...]
    efficiency: float
    reserve_bytes: int
    simulate: str = "needed"
    cp_degrees: tuple[int, ...] = (1,)  # context-parallel degrees, each carved out of the shard ranks


@dataclass
class SweepCandidate:
    """One layout of the sweep: its GPUs, its name in the "skipped" lines and the progress, its
    config (the layout applied), and its result once estimated."""

    world_size: int
    name: str
    job_config: JobConfig | None
    result: dict | None = None


# measure(candidate) -> the "memory" of its result (results.memory_result of a simulation).
Measure = Callable[[SweepCandidate], dict]


def sweep(
    job_config: JobConfig, hardware: Hardware, settings: SweepSettings, progress: Progress | None = None
) -> tuple[list[dict], list[str]]:
    """Every layout of the sweep that holds the global batch, estimated (its result dict, see
    titanlite.estimate.results; "not_simulated" says why one has no "memory"); and a line for
    each layout left out: its data-parallel ranks do not split the global batch, or its
    pipeline cannot run (too few blocks for the stages, micro-batches that do not fill the
    rounds)."""
    if settings.simulate not in SIMULATE:
        raise ValueError(f"simulate must be one of {', '.join(SIMULATE)}, got {settings.simulate!r}")
    progress = progress or (lambda *_: None)
    candidates, skipped = _candidates(job_config, hardware, settings)
    model = meta_model(job_config, run_model_args(job_config, tokenizer_for_estimate(job_config)[0]))
    estimated = []
    for done, candidate in enumerate(candidates, 1):
        progress("estimating step time", done, len(candidates), f"{candidate.world_size} GPUs {candidate.name}")
        try:
            candidate.result = layout_result(
                candidate.job_config,
                candidate.world_size,
                hardware,
                settings.efficiency,
                settings.reserve_bytes,
                model,
            )
        except (ConfigError, ValueError) as error:
            skipped.append(f"skipped {candidate.world_size} GPUs {candidate.name}: {error}")
            continue
        if not candidate.result["memory_floor"]["fits"]:
            candidate.result["memory"] = floor_only_memory(candidate.result, hardware, settings.reserve_bytes)
        estimated.append(candidate)

    def measure(candidate: SweepCandidate) -> dict:
        memory = estimate_memory(candidate.job_config, candidate.world_size)
        return memory_result(memory, hardware, settings.reserve_bytes)

    simulate_where_needed(estimated, settings.simulate, measure, progress)
    return [candidate.result for candidate in estimated], skipped


def simulate_where_needed(
    candidates: list[SweepCandidate], simulate: str, measure: Measure, progress: Progress | None = None
) -> None:
    """Give the result of each candidate under its memory floor its "memory" (``measure``'s, one
    call per per-rank memory) or a "not_simulated" reason: "faster_fits" or "skip_memory";
    ``simulate`` is one of SIMULATE, as the module docstring says. The candidates over their
    floor have their "memory" already (results.floor_only_memory)."""
    progress = progress or (lambda *_: None)
    under_floor = [candidate for candidate in candidates if candidate.result["memory_floor"]["fits"]]
    if simulate == "none":
        for candidate in under_floor:
            candidate.result["not_simulated"] = "skip_memory"
        return
    memories: dict[tuple, dict] = {}
    at_most = len({_memory_key(candidate.result) for candidate in under_floor})
    for world_size in dict.fromkeys(candidate.world_size for candidate in candidates):
        ranked = sorted(
            (candidate for candidate in under_floor if candidate.world_size == world_size),
            key=lambda candidate: -candidate.result["step_time"]["tokens_per_second_per_device"],
        )  # sorted is stable: equal throughputs keep the sweep's order, as the verdicts' max does
        winner_found = False
        for candidate in ranked:
            key = _memory_key(candidate.result)
            if key not in memories:
                if winner_found and simulate == "needed":
                    candidate.result["not_simulated"] = "faster_fits"
                    continue
                progress("simulating memory", len(memories) + 1, at_most, f"{world_size} GPUs {candidate.name}")
                memories[key] = measure(candidate)
            candidate.result["memory"] = memories[key]
            winner_found = winner_found or memories[key]["fits"]


def _memory_key(result: dict) -> tuple:
    """What a rank's memory depends on within one sweep (the module docstring says why)."""
    layout = result["layout"]
    return (
        layout["dp_shard"],
        layout["tp"],
        layout["dp_replicate"] > 1,
        layout["local_batch_size"],
        layout.get("pp", 1),
        layout.get("schedule"),
        layout.get("ep", 1),
        layout.get("cp", 1),
    )


def _candidates(
    job_config: JobConfig, hardware: Hardware, settings: SweepSettings
) -> tuple[list[SweepCandidate], list[str]]:
    """Every layout the sweep tries, in its order (GPU count, pipeline, TP degree, FSDP before
    HSDP, CP degree, EP degree), and the "skipped" line of each whose data-parallel ranks do not split the
    global batch."""
    candidates, skipped = [], []
    training = job_config.training
    for world_size in settings.sizes:
        global_batch = training.global_batch_size
        if global_batch == -1:
            global_batch = training.local_batch_size * world_size
        for pp, schedule, replicate, ranks, tp in _layouts(job_config, world_size, hardware, settings.pipelines):
            for cp in (cp for cp in settings.cp_degrees if ranks % cp == 0):
                shard, data_parallel = ranks // cp, replicate * ranks // cp  # the cp ranks share a batch
                name = (
                    f"{replicate} x {shard} x {tp}" if pp == 1 else f"{pp} x {replicate} x {shard} x {tp} ({schedule})"
                )
                name += f" cp {cp}" if cp > 1 else ""
                if global_batch % data_parallel:
                    skipped.append(
                        f"skipped {world_size} GPUs {name}: the global batch of {global_batch} "
                        f"sequences does not split over {data_parallel} data-parallel ranks"
                    )
                    continue
                for ep in expert_parallel_degrees(job_config, settings.ep_degrees, shard * cp, tp):
                    local_batch = global_batch // data_parallel
                    layout = with_layout(job_config, replicate, shard, tp, local_batch, pp, schedule, ep, cp)
                    candidates.append(SweepCandidate(world_size, name + (f" ep {ep}" if ep > 1 else ""), layout))
    return candidates, skipped


def _layouts(job_config: JobConfig, world_size: int, hardware: Hardware, pipelines):
    """(pp, schedule, replicate, shard, tp) of each layout of ``world_size`` GPUs: for each
    pipeline that divides them, the data-parallel layouts of a stage's ranks."""
    tp_degrees = tensor_parallel_degrees(job_config, world_size, hardware.gpus_per_node)
    for pp, schedule in pipelines:
        if world_size % pp:
            continue
        stage_ranks = world_size // pp
        stage_tp = [tp for tp in tp_degrees if stage_ranks % tp == 0]
        for replicate, shard, tp in data_parallel_layouts(stage_ranks, hardware.gpus_per_node, stage_tp):
            yield pp, schedule, replicate, shard, tp


def with_layout(
    job_config: JobConfig,
    replicate: int,
    shard: int,
    tp: int,
    local_batch_size: int,
    pp: int = 1,
    schedule: str | None = None,
    ep: int = 1,
    cp: int = 1,
) -> JobConfig:
    """A copy of the config with this layout (and pipeline schedule) and local batch, and no
    accumulation."""
    changed = copy.deepcopy(job_config)
    changed.parallelism.expert_parallel_degree = ep
    changed.parallelism.context_parallel_degree = cp
    changed.parallelism.data_parallel_replicate_degree = replicate
    changed.parallelism.data_parallel_shard_degree = shard
    changed.parallelism.tensor_parallel_degree = tp
    changed.parallelism.pipeline_parallel_degree = pp
    if schedule is not None:
        changed.parallelism.pipeline_parallel_schedule = schedule
    changed.training.local_batch_size = local_batch_size
    changed.training.global_batch_size = -1
    return changed


def tensor_parallel_degrees(job_config: JobConfig, world_size: int, gpus_per_node: int) -> list[int]:
    """The TP degrees the sweep tries: the divisors of the GPUs per node (a TP group stays in
    one node, where its per-block collectives get the fast link) that divide the world size
    and that the model's TP plan accepts (whole heads and key/value heads, equal FFN slices)."""
    args = run_model_args(job_config, tokenizer_for_estimate(job_config)[0])
    spec = get_model_spec(job_config.model.name)
    return [
        tp
        for tp in range(1, gpus_per_node + 1)
        if gpus_per_node % tp == 0 and world_size % tp == 0 and spec.tensor_parallel_problem(args, tp) is None
    ]


def data_parallel_layouts(world_size: int, gpus_per_node: int, tp_degrees: list[int]) -> list[tuple[int, int, int]]:
    """(replicate, shard, tp) for each TP degree: FSDP over all the data-parallel ranks, and,
    beyond one node, HSDP with one shard x TP group per node (the replicas across nodes)."""
    layouts = []
    for tp in tp_degrees:
        layouts.append((1, world_size // tp, tp))
        if world_size > gpus_per_node and world_size % gpus_per_node == 0:
            layouts.append((world_size // gpus_per_node, gpus_per_node // tp, tp))
    return layouts


def expert_parallel_degrees(job_config: JobConfig, degrees: tuple[int, ...], shard: int, tp: int = 1) -> list[int]:
    """The EP degrees the sweep tries for a layout of ``shard`` FSDP ranks and ``tp`` TP ranks:
    those of ``degrees`` that fit the ranks EP borrows (all the TP ranks, then shard ranks:
    parallel_dims.ep_problem) and divide the model's experts; 1 alone for a dense model."""
    n_experts = getattr(run_model_args(job_config, tokenizer_for_estimate(job_config)[0]), "n_experts", 0)
    if not n_experts:
        return [1]
    return sorted({1} | {ep for ep in degrees if ep_problem(ep, shard, tp) is None and n_experts % ep == 0})
