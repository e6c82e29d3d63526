"""Estimates made before a run: how long a step takes (step_time) on which hardware,
how much memory each rank needs (memory, simulated), and the floor below which a run
surely cannot fit (floor, by arithmetic); one layout's estimate as JSON (results), and the
sweep over layouts (sweep, with its table and verdicts in sweep_report)."""

from titanlite.estimate.data_parallel import threshold_tokens_per_device
from titanlite.estimate.floor import (
    ModelStateBytes,
    check_memory_floor,
    device_memory_bytes,
    exact_model_state_bytes,
    step_floor_bytes,
)
from titanlite.estimate.hardware import HARDWARE, Hardware, get_hardware, parse_hardware_overrides
from titanlite.estimate.memory import EstimateError, MemoryEstimate, estimate_memory, fits
from titanlite.estimate.simulation import measure_real_memory
from titanlite.estimate.step_time import (
    DEFAULT_EFFICIENCY,
    StepTimeEstimate,
    estimate_for_job_config,
    estimate_step_time,
)

__all__ = [
    "EstimateError",
    "check_memory_floor",
    "MemoryEstimate",
    "ModelStateBytes",
    "device_memory_bytes",
    "estimate_memory",
    "exact_model_state_bytes",
    "fits",
    "measure_real_memory",
    "step_floor_bytes",
    "DEFAULT_EFFICIENCY",
    "HARDWARE",
    "Hardware",
    "StepTimeEstimate",
    "estimate_for_job_config",
    "estimate_step_time",
    "get_hardware",
    "parse_hardware_overrides",
    "threshold_tokens_per_device",
]
