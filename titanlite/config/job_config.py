"""The job configuration: JobConfig, one field per TOML section, in --help's order.

Each section is a dataclass in the file of its concern (job.py, model.py, training.py,
optimizer.py, parallelism.py, quantize.py, checkpoint.py, metrics.py, fault_tolerance.py). Each of its fields carries a
docstring right below it; the config parser reads those docstrings and prints them as
``--help``. A field with a limited range says so beside its default (ranges.ranged), and
validation reads the range from there. Section and key names follow torchtitan 0.2's TOML
wherever the feature exists there.
"""

from dataclasses import dataclass, field

from titanlite.config.checkpoint import Checkpoint
from titanlite.config.eval import Eval
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.job import Comm, Debug, Job
from titanlite.config.metrics import Metrics, Profiling
from titanlite.config.model import Model
from titanlite.config.optimizer import EMA, LRScheduler, Optimizer
from titanlite.config.parallelism import ActivationCheckpoint, Compile, Parallelism
from titanlite.config.quantize import Quantize
from titanlite.config.training import Data, Training, Validation


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    """The run as a whole: its TOML file, output folder, description, and the validate-only check."""
    model: Model = field(default_factory=Model)
    """The model family and flavor, tokenizer, attention mask, RoPE scaling, converters and MoE routing."""
    training: Training = field(default_factory=Training)
    """The dataset, batch sizes, sequence length, steps, gradient clipping and mixed precision."""
    data: Data = field(default_factory=Data)
    """How the training data is read: its shuffle and seed, prefetching, checksums, and where it is prepared."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """The optimizer and its learning rate, betas, epsilon and weight decay."""
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    """The learning-rate schedule: linear warmup, then the decay (its share of the steps, shape and floor)."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """The parallel layout: data (FSDP, HSDP, DDP), tensor, pipeline, context and expert parallelism."""
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    """Which activations backward recomputes instead of keeping: none, full or selective."""
    compile: Compile = field(default_factory=Compile)
    """torch.compile: whether it runs, and on the model's blocks, the loss or both."""
    quantize: Quantize = field(default_factory=Quantize)
    """Quantized training; its one section, [quantize.linear.float8], trains the linear layers in float8."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Saving checkpoints, resuming from them, and the first load (a checkpoint or a Hugging Face folder)."""
    ema: EMA = field(default_factory=EMA)
    """An exponential moving average of the weights, kept beside them and saved with checkpoints."""
    metrics: Metrics = field(default_factory=Metrics)
    """What is logged each log_freq steps, and where: the console, TensorBoard, JSONL, Weights & Biases."""
    validation: Validation = field(default_factory=Validation)
    """Loss on held-out data every freq steps."""
    eval: Eval = field(default_factory=Eval)
    """Multiple-choice tasks scored every freq steps: accuracy, length-normalised accuracy, bits per byte."""
    profiling: Profiling = field(default_factory=Profiling)
    """torch.profiler traces and CUDA memory snapshots."""
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    """Replica groups that survive each other's failures (torchft)."""
    comm: Comm = field(default_factory=Comm)
    """Timeouts of process-group creation and collectives, and the NCCL flight recorder's dumps."""
    debug: Debug = field(default_factory=Debug)
    """The random seed, and whether only deterministic algorithms run."""
