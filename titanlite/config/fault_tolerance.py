"""The [fault_tolerance] section: replica groups that survive each other's failures (torchft).

Each replica group is one torchrun job with its own inner layout; torchft's lighthouse (its
address in the TORCHFT_LIGHTHOUSE environment variable) forms a quorum of the live groups at
every step. See docs/reliability.md."""

from dataclasses import dataclass
from typing import Literal

from titanlite.config.ranges import at_least, ranged


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one of fault_tolerance.group_size replica groups through torchft (pip install 'titanlite[ft]'): a
    failed group drops out while the others go on, and a restarted one heals from a live peer's memory."""

    replica_id: int = ranged(at_least(0), default=0)
    """This group's index, in [0, group_size): it picks the group's share of every global batch."""

    group_size: int = ranged(at_least(0), default=0)
    """How many replica groups the job has (0 is torchtitan's unset; enable needs >= 1). training.global_batch_size is
    the batch of all of them together; each group reads its share of it."""

    min_replica_size: int = ranged(at_least(1), default=1)
    """Fewest live groups that may commit a step; with fewer, the step is retried until more join, for at most
    comm.init_timeout_seconds."""

    process_group: Literal["gloo", "nccl"] = "gloo"
    """Backend of the gradient all-reduce across groups: gloo (any device) or nccl (CUDA)."""

    process_group_timeout_ms: int = ranged(at_least(1), default=10000)
    """Milliseconds before a collective across groups, a quorum or a heal gives up; the step is then not committed and
    is retried with the groups still alive."""

    semi_sync_method: str | None = None
    """torchtitan's DiLoCo / local SGD; titanlite synchronises every step and refuses any value here."""


def fault_tolerance_problem(section: FaultTolerance) -> str | None:
    """What is wrong between the section's keys (one line), or None. Only read with enable."""
    if not section.enable:
        return None
    if section.semi_sync_method is not None:
        return (
            f"fault_tolerance.semi_sync_method = {section.semi_sync_method!r}: titanlite synchronises the groups at "
            "every step and has no DiLoCo or local SGD; remove the key"
        )
    if section.group_size < 1:
        return "fault_tolerance.enable needs fault_tolerance.group_size >= 1 (the number of replica groups)"
    if section.replica_id >= section.group_size:
        return (
            f"fault_tolerance.replica_id must lie in [0, {section.group_size}) (fault_tolerance.group_size), "
            f"got {section.replica_id}"
        )
    if section.min_replica_size > section.group_size:
        return (
            f"fault_tolerance.min_replica_size ({section.min_replica_size}) must not exceed "
            f"fault_tolerance.group_size ({section.group_size}): no step could ever commit"
        )
    return None
