"""The [training], [data] and [validation] sections: what is read, in which order and batch,
at which precision, and the held-out data; with the dataset names, each written once."""

from dataclasses import dataclass
from typing import Literal, get_args

from titanlite.config.ranges import MINUS_ONE_OR_POSITIVE, POSITIVE, at_least, ranged

# Raw sources are tokenized as they are read (titanlite.data.sources reads exactly these).
# They are grouped by what they make of dataset_path, which validation checks.
DatasetWithoutPath = Literal["python_stdlib"]  # built in: a path would be silently ignored
DatasetNeedingPath = Literal["text", "huggingface"]  # nothing to read without a path
DatasetWithDefaultPath = Literal["c4", "c4_validation", "c4_test"]  # a path replaces their usual place
RawDataset = Literal[DatasetWithoutPath, DatasetNeedingPath, DatasetWithDefaultPath]
# Folders made by python -m titanlite.data.prepare.
PreparedDataset = Literal["prepared"]
TrainingDataset = Literal[PreparedDataset, RawDataset]

# Literal flattens nested Literals, so these are plain tuples of names, in the order above.
RAW_DATASETS = get_args(RawDataset)
TRAINING_DATASETS = get_args(TrainingDataset)


@dataclass
class Training:
    dataset: TrainingDataset = "python_stdlib"
    """Dataset: prepared (folders made by python -m titanlite.data.prepare, read through memory maps: the path that
    scales), python_stdlib (built in; prepared into data.cache_folder on first use), or raw sources tokenized as they
    are read: text (.txt/.jsonl/.jsonl.gz files at dataset_path), huggingface (datasets.load_dataset(dataset_path)),
    torchtitan's c4 / c4_validation (allenai/c4 'en' on the Hub) and c4_test (JSON lines in tests/assets/c4_test)."""

    dataset_path: str | None = None
    """For prepared: a prepared folder, or a mixture 'FOLDER:WEIGHT,FOLDER:WEIGHT' (weights > 0, normalised); for text:
    a file or folder; for huggingface: the name or folder given to datasets.load_dataset; for c4 / c4_test: another
    place than their default. python_stdlib takes none."""

    local_batch_size: int = ranged(at_least(1), default=8)
    """Sequences per micro-batch on each data-parallel rank."""

    global_batch_size: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Sequences per optimizer step over all ranks; -1 means local_batch_size x dp degree (no accumulation)."""

    seq_len: int = ranged(at_least(1), default=2048)
    """Tokens per training sequence."""

    max_norm: float = ranged(at_least(0), default=1.0)
    """Clip the global gradient 2-norm to this value; 0 disables clipping (the norm is still logged)."""

    steps: int = ranged(at_least(1), default=10000)
    """Number of optimizer steps to train for."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of parameters during forward/backward (FSDP all-gathers in it); the sharded master copy stays float32."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which FSDP reduce-scatters and all-reduces gradients."""

    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP CPUOffloadPolicy)."""

    gc_freq: int = ranged(at_least(1), default=50)
    """Run Python's garbage collector every this many steps (automatic collection is disabled in the loop)."""

    skip_nonfinite_steps: int = ranged(at_least(0), default=0)
    """Steps in a row whose gradient norm is NaN/inf that may be skipped (no update) before training stops; 0 stops at
    the first."""

    skip_spike_steps: bool = False
    """Skip (no update, as a non-finite step: Adam's moments and step count unchanged, the learning-rate schedule moves
    on) a step whose loss over the global batch or gradient norm exceeds mean + spike_sigmas x standard deviation of
    the last spike_window accepted steps, once half a window was accepted. Decided on the device, every rank alike;
    skipped steps never enter the window. The window is saved with checkpoints."""

    spike_window: int = ranged(at_least(4), default=128)
    """Accepted steps whose loss and gradient norm the spike test compares a step with (skip_spike_steps)."""

    spike_sigmas: float = ranged(POSITIVE, default=6.0)
    """How many standard deviations above the window's mean a loss or gradient norm is a spike (skip_spike_steps)."""

    spike_max_in_a_row: int = ranged(at_least(0), default=16)
    """Spike steps in a row after which training stops with an error: the loss has moved to a level the window will
    never accept (skip_spike_steps); 0 never stops."""

    z_loss_coef: float = ranged(at_least(0), default=0.0)
    """Output z-loss: add z_loss_coef x logsumexp(logits)^2, averaged over the target tokens as the loss is, to the
    training loss (1e-4 is typical; 0 adds none). Logged as loss_metrics/z_loss; the logged loss and the validation
    loss stay the cross entropy. Not the MoE router's model.moe_z_loss_coef."""


@dataclass
class Data:
    shuffle: bool = True
    """Shuffle the window order of prepared data (and of python_stdlib) anew every epoch, seeded by data.seed; raw
    sources are always read in order."""

    seed: int = 0
    """Seed of the window shuffle: the same seed gives the same global order on every layout."""

    prefetch: int = ranged(at_least(0), default=2)
    """Micro-batches a background thread reads ahead of the training loop (into pinned memory on CUDA); 0 reads on the
    training thread."""

    verify_checksums: bool = True
    """At start-up, check every prepared file's SHA-256 against its manifest (the ranks share the work); sizes are
    always checked."""

    allow_changed_data: bool = False
    """Resume from a checkpoint trained on other data (folders, mixture, shuffle, seed, tokenizer) at the same global
    window count, instead of stopping with an error that names the change."""

    cache_folder: str = "~/.cache/titanlite"
    """Where python_stdlib is prepared with the run's tokenizer on first use."""


@dataclass
class Validation:
    enable: bool = False
    """Compute the loss on held-out data every `freq` steps."""

    dataset: TrainingDataset = "python_stdlib"
    """Held-out dataset, named as training.dataset names it: prepared (one folder made by python -m
    titanlite.data.prepare; each data-parallel rank reads only its own windows and nothing is tokenized during
    training), python_stdlib (the standard library's held-out files, prepared into data.cache_folder on first use),
    or a raw source tokenized by every rank at every evaluation, for small data (c4 and c4_validation read allenai/c4's
    validation split, huggingface the 'validation' split)."""

    dataset_path: str | None = None
    """For prepared: the prepared folder (not a mixture); for text: a file or folder; for huggingface: the name or
    folder given to datasets.load_dataset; for c4 / c4_test: another place than their default. python_stdlib takes
    none."""

    local_batch_size: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Sequences per rank per validation step; -1 means training.local_batch_size, the only size pipeline parallelism
    takes (the held-out batches go through the training pipeline, whose micro-batch shapes are fixed)."""

    seq_len: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Tokens per validation sequence; -1 means training.seq_len, the only length pipeline parallelism takes."""

    freq: int = ranged(at_least(1), default=10)
    """Validate every this many training steps (and after the last one)."""

    steps: int = ranged(MINUS_ONE_OR_POSITIVE, default=10)
    """Validation batches per evaluation; -1 means the whole held-out set."""
