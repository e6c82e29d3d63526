"""The job configuration: one dataclass per TOML section.

Each field carries a docstring right below it; the config parser reads those
docstrings and prints them as ``--help``. A field with a limited range says so
beside its default (``ranged``), and validation reads the range from there.
Section and key names follow torchtitan 0.2's TOML wherever the feature exists there.
"""

from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field
from typing import Any, Literal, get_args

# ---------------------------------------------------------------------------
# Allowed ranges, kept in each field's metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """The values a field may take once the whole config is merged."""

    text: str
    """What is allowed, as an error message words it: 'training.steps must be >= 1, got 0'."""

    check: Callable[[Any], bool]
    """True for an allowed value."""


_RANGE_KEY = "range"


def ranged(allowed: Range, **field_args: Any) -> Any:
    """A dataclass field (dataclasses.field(**field_args)) whose value must lie in ``allowed``."""
    return field(metadata={_RANGE_KEY: allowed}, **field_args)


def field_range(config_field: Field) -> Range | None:
    """The range ``ranged`` gave a field, or None for a field any value of its type suits."""
    return config_field.metadata.get(_RANGE_KEY)


def at_least(low: int) -> Range:
    return Range(f">= {low}", lambda value: value >= low)


def subset_of(names: Sequence[str]) -> Range:
    return Range(f"a subset of {', '.join(names)}", lambda value: set(value) <= set(names))


def _is_selective_ac_option(option: str) -> bool:
    # isdigit alone accepts other scripts' digits ('٣'), which int() reads but nobody means.
    return option == "op" or (option.isascii() and option.isdigit() and int(option) >= 1)


POSITIVE = Range("> 0", lambda value: value > 0)
# -1 stands for a value worked out at run time (each such field's docstring says which).
MINUS_ONE_OR_POSITIVE = Range("-1 or >= 1", lambda value: value == -1 or value >= 1)
# -1 stands for "the newest".
MINUS_ONE_OR_AT_LEAST_ZERO = Range("-1 or >= 0", lambda value: value >= -1)
FRACTION = Range("in [0, 1]", lambda value: 0 <= value <= 1)
POSITIVE_OR_UNSET = Range("> 0 or unset", lambda value: value is None or value > 0)
AT_LEAST_ZERO_OR_UNSET = Range(">= 0 or unset", lambda value: value is None or value >= 0)
FRACTION_OR_UNSET = Range("in [0, 1] or unset", lambda value: value is None or 0 <= value <= 1)
# A decay of 1 would never move away from the first value.
FRACTION_BELOW_ONE = Range("in [0, 1)", lambda value: 0 <= value < 1)
SELECTIVE_AC_OPTION = Range("'op' or a positive integer", _is_selective_ac_option)

# The [model] keys that set an MoE model's load balancing, each under its model args' name.
MOE_BALANCING_KEYS = ("moe_aux_loss_coef", "moe_bias_update_rate")

# ---------------------------------------------------------------------------
# Dataset names, each written once
# ---------------------------------------------------------------------------

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

# ---------------------------------------------------------------------------
# The sections
# ---------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to load before command-line overrides are applied."""

    dump_folder: str = "./outputs"
    """Folder for everything the run writes (checkpoints, logs, traces)."""

    description: str = "titanlite job"
    """Free-form description of the job, printed at start-up."""

    validate_only: bool = False
    """Check the config, model, parallel layout, tokenizer and dataset, print the plan and exit without training."""

    print_config: bool = False
    """Print the whole resolved config at start-up. Either way rank 0 saves it as resolved_config.toml in dump_folder
    (a file --job.config_file reads back) and the console gets its path."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family in the registry: llama2, llama3 or qwen3."""

    flavor: str = "debugmodel"
    """Size preset of the model family, e.g. debugmodel, 7B, 8B, 70B."""

    hf_assets_path: str | None = None
    """Folder (or file) holding a Hugging Face tokenizer.json; unset means the built-in byte tokenizer."""

    moe_aux_loss_coef: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: weight of the auxiliary load-balancing loss (transformers' router_aux_loss_coef) added to the
    training loss; 0 turns it off. Unset: the flavor's value (0 for qwen3's MoE flavors)."""

    moe_bias_update_rate: float | None = ranged(AT_LEAST_ZERO_OR_UNSET, default=None)
    """MoE models only: step of the auxiliary-loss-free expert bias (DeepSeek-V3's), updated after every optimizer step
    from the token counts of all data-parallel ranks (DeepSeek-V3 uses 1e-3); 0 turns it off. Unset: the flavor's value
    (0 for qwen3's MoE flavors: a Qwen3-MoE trained with the bias does not export to transformers, which has none)."""


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
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""

    lr: float = ranged(POSITIVE, default=8e-4)
    """Peak learning rate."""

    beta1: float = ranged(FRACTION_BELOW_ONE, default=0.9)
    """Adam's first-moment decay."""

    beta2: float = ranged(FRACTION_BELOW_ONE, default=0.95)
    """Adam's second-moment decay."""

    eps: float = ranged(POSITIVE, default=1e-8)
    """Adam's denominator epsilon."""

    weight_decay: float = ranged(at_least(0), default=0.1)
    """Decoupled weight decay (applied to every parameter)."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: fused (one kernel for all tensors, on CUDA and CPU; it also skips a non-finite step on the
    device, with no wait), foreach (multi-tensor) or for-loop; the last two make the host wait for the gradient norm
    every step."""


@dataclass
class LRScheduler:
    warmup_steps: int = ranged(at_least(0), default=200)
    """Steps of linear warmup from near zero to the peak learning rate."""

    decay_ratio: float | None = ranged(FRACTION_OR_UNSET, default=None)
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); unset means decay over every step after
    warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = ranged(FRACTION, default=0.0)
    """Learning rate at the end of decay, as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = ranged(MINUS_ONE_OR_POSITIVE, default=1)
    """Number of model replicas (DDP across them; HSDP when the shard degree is also above 1)."""

    data_parallel_shard_degree: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Number of ranks each replica is sharded over (FSDP); -1 uses all ranks left after replication."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (FULL_SHARD), never (SHARD_GRAD_OP) or default (always, except the
    root)."""

    tensor_parallel_degree: int = ranged(at_least(1), default=1)
    """Ranks each layer's matrices are split over (tensor parallelism, within a node); it must divide the attention
    heads, the key/value heads, the FFN size and the world size. Data parallelism takes the ranks left over."""

    enable_sequence_parallel: bool = True
    """With tensor parallelism: split the norms' and residuals' activations along the sequence over the TP ranks
    instead of repeating them on each (less activation memory, the same collectives' volume)."""

    disable_loss_parallel: bool = False
    """With tensor parallelism: gather the vocabulary-sharded logits before the loss instead of computing the loss on
    each rank's vocabulary shard (loss parallel, which never holds the full logits)."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP's collectives with its matmuls inside compiled blocks (micro-pipelined TP); needs CUDA,
    tensor_parallel_degree > 1 and compile.enable with the model compiled."""

    expert_parallel_degree: int = ranged(at_least(1), default=1)
    """Ranks each mixture-of-experts layer's experts are split over (expert parallelism): each keeps n_experts / it
    experts and tokens travel to them by all-to-all. It borrows the FSDP ranks (it must divide the data-parallel shard
    degree and the model's experts); FSDP shards the experts over the ranks it leaves. 1: every rank holds all
    experts."""

    pipeline_parallel_degree: int = ranged(at_least(1), default=1)
    """Pipeline stages the layers are split over, one group of ranks per stage (pipeline parallelism, the outermost
    mesh dimension: across nodes). Data and tensor parallelism take the ranks left over."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe or 1F1B (one stage per rank); Interleaved1F1B, LoopedBFS or InterleavedZeroBubble
    (several stages per rank, looped); ZBVZeroBubble or DualPipeV (two stages per rank, in a V)."""

    pipeline_parallel_microbatch_size: int = ranged(at_least(1), default=1)
    """Sequences per pipeline micro-batch; it must divide training.local_batch_size, and local_batch_size / it
    micro-batches go through the pipeline per accumulation step."""

    pipeline_parallel_layers_per_stage: int | None = ranged(POSITIVE_OR_UNSET, default=None)
    """Transformer blocks per pipeline stage (the embedding and the output counted as the *_less_layers keys say);
    unset: as many stages as the schedule needs, the blocks spread evenly."""

    pipeline_parallel_first_stage_less_layers: int = ranged(at_least(0), default=1)
    """How many blocks' worth of work the embedding counts for: the first stage gets that many blocks fewer."""

    pipeline_parallel_last_stage_less_layers: int = ranged(at_least(0), default=1)
    """How many blocks' worth of work the final norm and output projection count for: the last stage gets that many
    blocks fewer."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """The stages by hand: for each stage, the names of the modules it holds (e.g. [["tok_embeddings", "layers.0"],
    ["layers.1", "norm", "output"]]; on the command line stages are separated by ';'). Overrides the layer counts."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """Activation checkpointing: none, full (every block) or selective (see selective_ac_option)."""

    selective_ac_option: str = ranged(SELECTIVE_AC_OPTION, default="2")
    """For selective mode: an integer N checkpoints every N-th block; 'op' saves only chosen matmul/attention outputs in
    every block."""


# Pipeline schedules by torchtitan's names (matched without regard to case), each with how
# its stages sit on the pp ranks: "single", one stage per rank; "loop", two or more per rank,
# rank r holding stages r, r + pp, r + 2 pp, ...; "v", exactly two per rank, rank r holding
# stages r and 2 pp - 1 - r (so the first and the last stage share rank 0).
PIPELINE_SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}


# Zero-bubble schedules split each backward into the inputs' gradient and, later, the
# weights' gradient.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def canonical_schedule(name: str) -> str | None:
    """The schedule's name as PIPELINE_SCHEDULES spells it, or None for an unknown one."""
    return next((known for known in PIPELINE_SCHEDULES if known.lower() == name.lower()), None)


# What torch.compile may wrap (compile.components).
COMPILE_COMPONENTS = ("model", "loss")


@dataclass
class Compile:
    enable: bool = False
    """Compile each transformer block with torch.compile."""

    components: list[str] = ranged(subset_of(COMPILE_COMPONENTS), default_factory=lambda: ["model"])
    """What to compile when enabled: model (each block) and/or loss."""


# What a checkpoint holds, by the names its parts are saved under (ema only with ema.enable).
CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "ema")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one at start-up."""

    folder: str = "checkpoint"
    """Checkpoint folder, inside job.dump_folder; each save is a step-N sub-folder."""

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
    """A step-N folder (or, with initial_load_in_hf, a Hugging Face folder) to start from when the run's own checkpoint
    folder has none."""

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


@dataclass
class EMA:
    enable: bool = False
    """Keep an exponential moving average of the weights, sharded like them and saved in checkpoints."""

    decay: float = ranged(FRACTION_BELOW_ONE, default=0.9999)
    """Weight of the old average at each step: ema = decay * ema + (1 - decay) * weights."""


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


@dataclass
class Comm:
    init_timeout_seconds: int = ranged(at_least(1), default=300)
    """Seconds before process-group creation, a collective before the first step ends, or a checkpoint save's or load's
    collective (waiting for the slowest writer) gives up."""

    train_timeout_seconds: int = ranged(at_least(1), default=100)
    """Seconds before a collective gives up once the first step is done (a dead or stuck rank then fails the others
    instead of hanging them)."""

    trace_buf_size: int = ranged(at_least(0), default=20000)
    """GPU runs: collective events PyTorch's NCCL flight recorder keeps per rank and writes to save_traces_folder when a
    collective times out; 0 turns it off. TORCH_NCCL_* variables already set in the environment win."""

    save_traces_folder: str = "comm_traces"
    """Folder under job.dump_folder that receives the flight recorder's dumps, one file per rank."""

    save_traces_file_prefix: str = "rank_"
    """A flight-recorder dump's file name before the rank number."""


@dataclass
class Debug:
    seed: int = 0
    """Seed for weight initialisation and every random number generator."""

    deterministic: bool = False
    """Use deterministic algorithms only (slower; needed for bitwise-reproducible GPU runs)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    ema: EMA = field(default_factory=EMA)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
