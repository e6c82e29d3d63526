"""The [job], [comm] and [debug] sections: the run as a whole, its process groups' set-up
and timeouts, and its seeds."""

from dataclasses import dataclass

from titanlite.config.ranges import at_least, ranged


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

    validate_hardware: str = "h100"
    """The GPU the config is written for, by the estimator's names (h100, h200, a100, b200, mi300x, l40s), or cpu.
    On a host without a GPU (a login node) validate_only compares each rank's memory floor with this GPU's memory;
    cpu compares it with the host's, split between LOCAL_WORLD_SIZE ranks. A run that starts, and validate_only on a
    GPU host, compare it with the device they find."""

    print_config: bool = False
    """Print the whole resolved config at start-up. Either way rank 0 saves it as resolved_config.toml in dump_folder
    (a file --job.config_file reads back) and the console gets its path."""


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
