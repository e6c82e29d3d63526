"""What a run adds under fault tolerance (fault_tolerance.enable): the checks before it starts,
this group's torchft manager with the states a healing peer receives, and its metrics. The
machinery itself is titanlite/parallel/fault_tolerance.py."""

from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint.heal import load_local_states, local_states
from titanlite.config import ConfigError, JobConfig
from titanlite.metrics import tags
from titanlite.parallel.fault_tolerance import ReplicaGroups, backend_problem, lighthouse_problem, torchft_missing
from titanlite.plan import RunPlan


def check_fault_tolerance_run(job_config: JobConfig) -> None:
    """With fault tolerance: torchft importable and the lighthouse answering, before anything
    is built or written (a ConfigError otherwise)."""
    section = job_config.fault_tolerance
    if not section.enable:
        return
    problem = (
        torchft_missing() or backend_problem(section) or lighthouse_problem(section.process_group_timeout_ms / 1000)
    )
    if problem is not None:
        raise ConfigError(problem)


def join_replica_groups(job_config: JobConfig, plan: RunPlan, states: dict[str, Stateful]) -> ReplicaGroups | None:
    """This group's ReplicaGroups (None without fault tolerance), added to ``states`` as the
    checkpoint part "fault_tolerance". A healing peer receives every state, the data loader's
    too: its position is the step's, and a raw stream's document cursor comes with it, so the
    healed group never tokenizes its way there from the start."""
    if not job_config.fault_tolerance.enable:
        return None
    replicas = ReplicaGroups(
        job_config.fault_tolerance,
        send_states=lambda: local_states(states),
        receive_states=lambda sent: load_local_states(states, sent),
        windows_per_group_step=plan.group_batch_size,
        quorum_timeout_seconds=job_config.comm.train_timeout_seconds,
    )
    states["fault_tolerance"] = replicas
    return replicas


def replica_group_metrics(replicas: ReplicaGroups) -> dict[str, float]:
    """Fault tolerance's numbers for every logged step (a metrics source)."""
    return {
        tags.FT_GROUPS: float(replicas.participants),
        tags.FT_HEALS: float(replicas.heals),
        tags.FT_SKIPPED: float(replicas.skipped_windows),
    }


def groups_text(plan: RunPlan) -> str:
    """How the global batch is split over replica groups ("" without fault tolerance)."""
    if plan.replica_groups == 1:
        return ""
    return f" over {plan.replica_groups} replica groups ({plan.group_batch_size} each)"
