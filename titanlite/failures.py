"""The failures titanlite.train's main expects, each as one line and an exit status."""

from titanlite.checkpoint import CheckpointError
from titanlite.config import ConfigError
from titanlite.errors import DataError, NonFiniteError
from titanlite.nonfinite import SpikeError
from titanlite.parallel.fault_tolerance import FaultToleranceError

# main's line after "titanlite: " for each failure it expects, its exit status (2: the config or
# the checkpoint to start from, 1: something during training), and whether every rank meets
# the same one (then rank 0 alone prints it).
START_FAILURES = {
    ConfigError: ("config error: {error}", 2, True),
    CheckpointError: ("checkpoint error: {error}", 2, True),
    FaultToleranceError: ("fault tolerance: {error}", 1, False),  # no quorum to join
}
TRAINING_FAILURES = {
    CheckpointError: ("checkpoint error at step {step}: {error}", 1, False),
    DataError: ("data error in step {next_step}: {error}", 1, False),
    FaultToleranceError: ("fault tolerance: {error}", 1, False),
    NonFiniteError: ("non-finite values at {error}", 1, True),  # every rank: the same step, the same norm
    SpikeError: ("loss spikes at {error}", 1, True),
}


def failure(table: dict, error: Exception, rank: int, **where) -> tuple[str, int, bool]:
    """(line, exit status, whether this rank prints it) for ``error``, of one of ``table``'s kinds."""
    template, status, same_on_every_rank = next(entry for kind, entry in table.items() if isinstance(error, kind))
    return f"titanlite: {template.format(error=error, **where)}", status, rank == 0 or not same_on_every_rank
