"""What a run adds under fault tolerance (fault_tolerance.enable): the checks before it starts,
this group's torchft manager with the states a healing peer receives, and its metrics. The
machinery itself is titanlite/parallel/fault_tolerance.py."""

import dataclasses

from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint.heal import load_local_states, local_states
from titanlite.config import ConfigError, JobConfig
from titanlite.config.schema import get_value, key_types
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
        fingerprint=group_fingerprint(job_config, plan),
        # A step waits for enough groups to commit as long as a start waits for them.
        retry_seconds=job_config.comm.init_timeout_seconds,
    )
    states["fault_tolerance"] = replicas
    return replicas


# Sections whose keys decide what a step computes; every group must set them alike.
_SHARED_SECTIONS = ("model", "training", "data", "optimizer", "lr_scheduler", "parallelism", "quantize", "debug")
# Keys there that may differ between groups: where a group finds things, how fast it reads,
# and the degrees as written (-1 and its resolved value are the same layout; the resolved
# degrees are compared instead).
_LOCAL_KEYS = {
    "model.hf_assets_path",  # the tokenizer it holds shows in the model args' vocab_size
    "data.cache_folder",
    "data.prefetch",
    "data.verify_checksums",
    "training.gc_freq",
    "parallelism.data_parallel_replicate_degree",
    "parallelism.data_parallel_shard_degree",
    "parallelism.tensor_parallel_degree",
    "parallelism.pipeline_parallel_degree",
    "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree",
}


def group_fingerprint(job_config: JobConfig, plan: RunPlan) -> list[tuple[str, str]]:
    """What replica groups must run alike, as (name, value) pairs, most telling first: the
    layout (resolved degrees and ranks per group), the groups' own settings, then the keys
    that shape the model, batch, data and update, and the model args the run builds."""
    dims, ft = plan.parallel_dims, job_config.fault_tolerance
    pairs = [
        ("parallelism.data_parallel_shard_degree", dims.dp_shard),
        ("parallelism.data_parallel_replicate_degree", dims.dp_replicate),
        ("parallelism.tensor_parallel_degree", dims.tp),
        ("parallelism.pipeline_parallel_degree", dims.pp),
        ("parallelism.context_parallel_degree", dims.cp),
        ("parallelism.expert_parallel_degree", dims.ep),
        ("ranks per group (WORLD_SIZE)", dims.world_size),
        ("fault_tolerance.group_size", ft.group_size),
        ("fault_tolerance.min_replica_size", ft.min_replica_size),
        ("fault_tolerance.process_group", ft.process_group),
        ("gradient accumulation steps", plan.grad_accum_steps),
    ]
    for key in key_types():
        if key.partition(".")[0] in _SHARED_SECTIONS and key not in _LOCAL_KEYS:
            pairs.append((key, get_value(job_config, key)))
    args = plan.model_args
    if dataclasses.is_dataclass(args):
        pairs += [(f"model args {field.name}", getattr(args, field.name)) for field in dataclasses.fields(args)]
    else:
        pairs.append(("model args", repr(args)))
    return [(name, str(value)) for name, value in pairs]


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
