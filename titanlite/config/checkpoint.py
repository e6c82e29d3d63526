"""The [checkpoint] section: saving, resuming and the first load."""

from dataclasses import dataclass
from typing import Literal

from titanlite.config.ranges import MINUS_ONE_OR_AT_LEAST_ZERO, at_least, ranged, subset_of

# What a checkpoint holds, by the names its parts are saved under (ema only with ema.enable,
# fault_tolerance, the counts of replica groups' absence, only with fault_tolerance.enable).
CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "ema", "fault_tolerance")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one at start-up."""

    folder: str = "checkpoint"
    """Checkpoint folder, inside job.dump_folder; each save is a step-N sub-folder. Or object storage, by URL
    (s3://bucket/run with the s3 extra, gs://bucket/run with the gcs extra), credentials from the backend's standard
    places; a step there counts once its .committed marker, written last, exists."""

    uploads_per_node: int = ranged(at_least(0), default=4)
    """With checkpoint.folder in object storage: at most this many ranks of a node upload their files at once (0: no
    limit); 4 keeps 512 ranks on 8-GPU nodes at 256 concurrent uploads, well under a bucket's request rate."""

    interval: int = ranged(at_least(1), default=500)
    """Save every this many steps (and after the last step)."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled (training waits for the write), async (a background thread writes a CPU copy) or async_with_pinned_mem
    (reused pinned/shared buffers, written by a background process)."""

    keep_latest_k: int = ranged(at_least(0), default=10)
    """Keep the newest k complete checkpoints and delete older ones; 0 keeps all."""

    keep_every: int = ranged(at_least(0), default=0)
    """Never delete checkpoints whose step is a multiple of this (0: no such exception)."""

    load_step: int = ranged(MINUS_ONE_OR_AT_LEAST_ZERO, default=-1)
    """Resume from this step's checkpoint instead of the newest (needs checkpoint.enable); -1 means the newest."""

    last_save_model_only: bool = False
    """Make the save after the last step hold the model weights only, cast to export_dtype."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights in a model-only last save."""

    exclude_from_loading: list[str] = ranged(subset_of(CHECKPOINT_PARTS), default_factory=list)
    """Parts of a checkpoint not to load on resume, e.g. optimizer,lr_scheduler,dataloader."""

    initial_load_path: str | None = None
    """A step-N folder, local or a URL (or, with initial_load_in_hf, a local Hugging Face folder) to start from when
    the run's own checkpoint folder has none."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json plus model.safetensors or a sharded index); each rank
    reads only its own slices."""

    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (a fresh optimizer, schedule and data position)."""

    verify_integrity: bool = False
    """Write a manifest of file sizes and SHA-256 checksums with every checkpoint and verify it before loading."""

    continue_on_save_error: bool = False
    """When a save fails (disk full, I/O error), log a loud error and keep training instead of stopping with exit status
    1; a failed final save (last step or stop signal) still ends the run with status 1."""

    stop_save_seconds: int = ranged(at_least(1), default=300)
    """Seconds a stop signal (SIGTERM) gives the run to reach its next stop check (at most 10 steps with several ranks)
    and save: run_train.sh and multinode_trainer.slurm pass it to torchrun as --shutdown-timeout (the wait before
    SIGKILL), and the Slurm script sends the run SIGTERM this long before the job's time limit."""
