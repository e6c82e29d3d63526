"""Training metrics: where they go (console, TensorBoard, JSONL, W&B), the tag names they
go under, model FLOPs and MFU, and peak memory per logging window.

The trainer builds one logger with build_loggers(...) and calls log({tag: value}, step)
on it; the tag constants of the tags module (tags.LOSS, tags.TPS, tags.MFU, ...) name
every series. Nothing here imports the trainer, the parallel package or the checkpoint
package.
"""

from titanlite.metrics import tags
from titanlite.metrics.flops import (
    count_params,
    flops_per_token,
    mfu,
    peak_flops_per_device,
    resolve_peak_flops,
    tflops,
)
from titanlite.metrics.loggers import (
    ConsoleLogger,
    FanOutLogger,
    JsonlLogger,
    MetricLogger,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    default_run_name,
    metric_folders,
)
from titanlite.metrics.memory import MemoryMonitor, phase_peak_gib

__all__ = [
    "ConsoleLogger",
    "FanOutLogger",
    "JsonlLogger",
    "MemoryMonitor",
    "MetricLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "count_params",
    "default_run_name",
    "flops_per_token",
    "metric_folders",
    "mfu",
    "peak_flops_per_device",
    "phase_peak_gib",
    "resolve_peak_flops",
    "tags",
    "tflops",
]
