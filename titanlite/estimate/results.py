"""One layout's estimate as a JSON-ready dict, the form scripts/estimate.py prints (--json)
and its sweep ranks: the layout, its analytic step time, its memory floor (by arithmetic, in
no time) and, once simulated, its memory (titanlite.estimate.memory)."""

import dataclasses

from torch import nn

from titanlite.config import JobConfig
from titanlite.estimate.floor import fullest_floor
from titanlite.estimate.hardware import Hardware
from titanlite.estimate.memory import MemoryEstimate, fits
from titanlite.estimate.step_time import estimate_for_job_config
from titanlite.plan import plan_run, tokenizer_for_estimate


def layout_result(
    job_config: JobConfig,
    world_size: int,
    hardware: Hardware,
    efficiency: float,
    reserve_bytes: int,
    model: nn.Module | None = None,
) -> dict:
    """The layout, its step time and its memory floor (not its simulated memory: see
    memory_result). ``model``: the whole model on meta, for a caller that asks about many
    layouts of one model (floor.fullest_floor)."""
    timing = estimate_for_job_config(job_config, world_size, hardware, efficiency=efficiency)
    pipelined = {"pp": timing.pp, "schedule": timing.schedule, "microbatches": timing.microbatches}
    floor_bytes = floor_bytes_of(job_config, world_size, model)
    return {
        "layout": {
            "strategy": timing.strategy,
            "world_size": world_size,
            "dp_replicate": timing.dp_replicate,
            "dp_shard": timing.dp_shard,
            "tp": timing.tp,
            "local_batch_size": job_config.training.local_batch_size,
            "hardware": hardware.name,
            **(pipelined if timing.pp > 1 else {}),
            **({"ep": timing.ep} if timing.ep > 1 else {}),
            **({"cp": timing.cp} if timing.cp > 1 else {}),
        },
        "step_time": {k: v for k, v in dataclasses.asdict(timing).items() if k != "hardware"},
        "memory_floor": {"bytes": floor_bytes, "fits": floor_bytes + reserve_bytes <= hardware.memory_bytes},
    }


def floor_bytes_of(job_config: JobConfig, world_size: int, model: nn.Module | None = None) -> int:
    """The trainer's own floor (estimate.floor) for this layout's fullest rank: what it surely
    holds, by arithmetic, in no time."""
    plan = plan_run(job_config, world_size, tokenizer_for_estimate(job_config)[0])
    return sum(fullest_floor(job_config, plan, model)[1].values())


def floor_only_memory(result: dict, hardware: Hardware, reserve_bytes: int) -> dict:
    """The "memory" of a layout whose floor does not fit, not simulated: it surely does not
    fit, its peak is at least the floor."""
    floor_bytes = result["memory_floor"]["bytes"]
    return {
        "peak_bytes": floor_bytes,
        "reserved_bytes": floor_bytes,
        "floor_only": True,
        "device_bytes": hardware.memory_bytes,
        "reserve_bytes": reserve_bytes,
        "fits": False,
        "headroom_bytes": hardware.memory_bytes - reserve_bytes - floor_bytes,
    }


def memory_result(memory: MemoryEstimate, hardware: Hardware, reserve_bytes: int) -> dict:
    """The "memory" of a simulated layout: the peak and its breakdown, what the caching
    allocator reserves at it, the sharded state, and whether the reserved figure fits beside
    ``reserve_bytes`` (per pp rank too under pipeline parallelism)."""
    fit, headroom = fits(memory, hardware.memory_bytes, reserve_bytes)
    result = {
        "peak_bytes": memory.peak_bytes,
        "reserved_bytes": memory.reserved_bytes,
        "by_category_at_peak": memory.peak,
        "largest_activations": memory.activations,
        "parameters": memory.exact.parameters,
        "gradients": memory.exact.gradients,
        "optimizer_state": memory.exact.optimizer_state,
        "device_bytes": hardware.memory_bytes,
        "reserve_bytes": reserve_bytes,
        "fits": fit,
        "headroom_bytes": headroom,
        "notes": memory.notes,
    }
    if memory.pipeline:
        result["per_pp_rank"] = [
            {
                "pp_rank": rank.pp_rank,
                "stages": list(rank.stages),
                "peak_bytes": rank.peak_bytes,
                "in_flight_microbatches": rank.in_flight,
                "microbatch_activations": rank.microbatch_activations,
            }
            for rank in memory.pipeline
        ]
    return result
