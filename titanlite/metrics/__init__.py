"""Training metrics: where they go (console, TensorBoard, JSONL, W&B), the tag names they
go under, model FLOPs and MFU, and peak memory per logging window.

The trainer builds one logger with build_loggers(...) and calls log({tag: value}, step)
on it; the tag constants (LOSS, TPS, MFU, ...) name every series. Nothing here imports
the trainer, the parallel room or the checkpoint room.
"""

from titanlite.metrics.flops import (
    count_params,
    flops_per_token,
    mfu,
    peak_flops_per_device,
    resolve_peak_flops,
    tflops,
)
from titanlite.metrics.loggers import (
    ALL_TAGS,
    DATA_PCT,
    DATA_TIME,
    GRAD_NORM,
    LOSS,
    LR,
    MAX_ACTIVE_GIB,
    MAX_ACTIVE_PCT,
    MAX_LOSS,
    MAX_RESERVED_GIB,
    MAX_RESERVED_PCT,
    MFU,
    NUM_ALLOC_RETRIES,
    NUM_OOMS,
    PEAK_RSS_GIB,
    RSS_GIB,
    STEP_TIME,
    TFLOPS,
    TOKENS_SEEN,
    TPS,
    VAL_LOSS,
    VAL_PERPLEXITY,
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
    "ALL_TAGS", "DATA_PCT", "DATA_TIME", "GRAD_NORM", "LOSS", "LR", "MAX_ACTIVE_GIB", "MAX_ACTIVE_PCT",
    "MAX_LOSS", "MAX_RESERVED_GIB", "MAX_RESERVED_PCT", "MFU", "NUM_ALLOC_RETRIES", "NUM_OOMS",
    "PEAK_RSS_GIB", "RSS_GIB", "STEP_TIME", "TFLOPS", "TOKENS_SEEN", "TPS", "VAL_LOSS", "VAL_PERPLEXITY",
    "ConsoleLogger", "FanOutLogger", "JsonlLogger", "MemoryMonitor", "MetricLogger", "TensorBoardLogger",
    "WandbLogger", "build_loggers", "count_params", "default_run_name", "flops_per_token", "metric_folders",
    "mfu", "peak_flops_per_device", "phase_peak_gib", "resolve_peak_flops", "tflops",
]
