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
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)  # [quantize.linear.float8]: a section two levels down
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    ema: EMA = field(default_factory=EMA)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
