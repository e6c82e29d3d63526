"""The [metrics] and [profiling] sections: what the run records about itself."""

from dataclasses import dataclass

from titanlite.config.ranges import at_least, ranged


@dataclass
class Metrics:
    log_freq: int = ranged(at_least(1), default=10)
    """Log metrics every this many steps (and at the first step trained, a resumed run's too, and the last step)."""

    disable_color_printing: bool = False
    """Print the console metrics line without ANSI colors."""

    enable_tensorboard: bool = False
    """Write TensorBoard event files under dump_folder/save_tb_folder/<run time>."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    save_for_all_ranks: bool = False
    """Write TensorBoard and JSONL metrics for every rank (rank_N sub-folders), not only rank 0."""

    enable_jsonl: bool = True
    """Write one JSON object per logged step to dump_folder/metrics/<run time>/metrics.jsonl."""

    enable_wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; settings from WANDB_* variables)."""

    peak_tflops: float = ranged(at_least(0), default=0.0)
    """Peak dense TFLOPs of one device for MFU; 0 looks the GPU up by name (on CPU, no MFU unless set)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces, one per rank, every profile_freq steps."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder; traces go to iteration_<step>/rank<N>_trace.json."""

    profile_freq: int = ranged(at_least(1), default=10)
    """Trace the last step of every window of this many steps."""

    enable_memory_snapshot: bool = False
    """Record CUDA allocator history and dump a memory snapshot every profile_freq steps (GPU only)."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""
