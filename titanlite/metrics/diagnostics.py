"""Start-up and early-step diagnostics for the three FSDP mistakes that cost the most:

1. the sharding matched nothing (one FSDP unit for the whole model, so every rank holds
   and gathers everything at once): count the FSDP units and warn when a multi-block
   model has fewer than one per block plus the root;
2. the mixed-precision setting did not reach the computation: report the dtype the model
   actually computes in during the first forward, and warn when it is not the one asked for;
3. one phase dominates memory: report the peak after forward, after backward and after
   the optimizer step for the first few steps.

Each rank LOG_RANK shows also logs its own local trainable parameter MiB (LOG_RANK=0,1,...
shows uneven shards), and the global and local shape of each parameter of one block, which
shows how tensor parallelism and FSDP split it.
"""

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlite.metrics.memory import MemoryMonitor

logger = logging.getLogger("titanlite")
SAMPLE_UNITS = 4


def fsdp_unit_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules fully_shard was applied to ("<root>" for the model)."""
    return [name or "<root>" for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def checkpointed_block_count(model: nn.Module) -> int:
    return sum(isinstance(module, CheckpointWrapper) for module in model.modules())


def local_trainable_mib(model: nn.Module) -> float:
    """MiB of trainable parameters this rank holds (its shards under FSDP)."""
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
    return total / 2**20


def shard_shapes(block: nn.Module) -> str:
    """'name [global shape] -> [this rank's shape]' for each parameter of ``block``."""
    shapes = []
    for name, param in block.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        name = name.removeprefix(_CHECKPOINT_PREFIX)  # the names of the model, with or without AC
        shapes.append(f"{name} {list(param.shape)} -> {list(local.shape)}")
    return ", ".join(shapes)


def wrap_problem(unit_names: list[str], n_blocks: int, sharded: bool, roots: int = 1) -> str | None:
    """Why the sharding looks wrong, or None. Each block should be a unit of its own,
    plus the root that holds the embeddings, final norm and output (one root per model part:
    ``roots`` of them for the stages of a pipeline)."""
    if not sharded or n_blocks < 2:
        return None
    if len(unit_names) <= roots:
        return (
            f"only {len(unit_names)} FSDP unit(s) for a model of {n_blocks} blocks: per-block sharding "
            "matched nothing, so every rank gathers the whole model at once"
        )
    if len(unit_names) < n_blocks + roots:
        what = "the root" if roots == 1 else f"the {roots} pipeline stages' roots"
        return (
            f"{len(unit_names)} FSDP units for {n_blocks} blocks (expected {n_blocks + roots}: one per block "
            f"plus {what})"
        )
    return None


def log_startup(
    model: nn.Module,
    settings: dict[str, object],
    n_blocks: int,
    sharded: bool,
    rank: int,
    parts: list[nn.Module] | None = None,
) -> list[str]:
    """Log the resolved parallel settings and the sharding; returns the FSDP unit names.
    ``model.layers`` holds the blocks; ``parts``: the model parts, each sharded as a model of
    its own (the stages of a pipeline on this rank, which ``model`` holds under the whole
    model's names), default ``[model]``."""
    parts = [model] if parts is None else parts
    units = [name for part in parts for name in fsdp_unit_names(part)]
    logger.info("parallel settings: %s", ", ".join(f"{key}={value}" for key, value in settings.items()))
    samples = ", ".join(units[:SAMPLE_UNITS]) + (", ..." if len(units) > SAMPLE_UNITS else "")
    logger.info(
        "FSDP units: %d (%s); activation-checkpointed blocks: %d of %d",
        len(units),
        samples or "none",
        checkpointed_block_count(model),
        n_blocks,
    )
    problem = wrap_problem(units, n_blocks, sharded, roots=len(parts))
    if problem:
        logger.warning("!!! SHARDING PROBLEM: %s !!!", problem)
    if len(model.layers) > 0:  # a pipeline stage may hold no block (only the embedding, say)
        name, first_block = next(iter(model.layers.items()))
        logger.info("parameter shards of block %s on rank %d: %s", name, rank, shard_shapes(first_block))
    logger.info("rank %d: local trainable parameters %.2f MiB", rank, local_trainable_mib(model))
    return units


def log_stages(pipeline_plan, stage_indices: list[int], parts: list[nn.Module], rank: int) -> None:
    """Which modules each pipeline stage on this rank holds, its parameters (whole) and the
    MiB of them this rank keeps (its shards under FSDP or TP)."""
    for index, part in zip(stage_indices, parts, strict=True):
        modules = pipeline_plan.stage_modules[index]
        logger.info(
            "rank %d: pipeline stage %d of %d holds %s (%.2f M params, local %.2f MiB)",
            rank,
            index,
            pipeline_plan.num_stages,
            ", ".join(modules),
            sum(param.numel() for param in part.parameters()) / 1e6,
            local_trainable_mib(part),
        )


class ComputeDtypeProbe:
    """Records the dtype of the model's output (the logits, from its last matmul) in the
    first forward: what mixed precision really computes in, whatever the config says.
    The hook sits on the model itself, outside the separately compiled blocks. Given several
    model parts (a pipeline's stages on this rank), the output of the first one to run
    counts (a stage before the last one outputs hidden states, in the same dtype)."""

    def __init__(self, model: nn.Module | list[nn.Module], expected: torch.dtype):
        self.expected, self.seen = expected, None
        parts = model if isinstance(model, list) else [model]
        self._handles = [part.register_forward_hook(self._record) for part in parts]

    def _record(self, module, inputs, output) -> None:
        self.seen = output.dtype
        for handle in self._handles:
            handle.remove()

    def report(self) -> None:
        """Log the dtype seen (once, after the first step) and warn on a mismatch."""
        if self.seen is None:
            return
        seen, self.seen = self.seen, None
        if seen != self.expected:
            logger.warning(
                "!!! MIXED PRECISION PROBLEM: the model computes in %s, the config asks for %s !!!",
                str(seen).removeprefix("torch."),
                str(self.expected).removeprefix("torch."),
            )
        else:
            logger.info("the model computes in %s, as configured", str(seen).removeprefix("torch."))


class PhaseMemory:
    """Peak memory after forward, after backward and after the optimizer step, for the
    first `steps` steps. The peak is reset at the start of each of those steps, so each
    figure is the highest point since the step began.

    Under pipeline parallelism (``interleaved``) the schedule runs the micro-batches'
    forwards and backwards in turns, so there is no moment "after forward": the figures are
    after the schedule's forward and backward, and after the optimizer."""

    PHASES = ("forward", "backward", "optimizer")
    PIPELINE_PHASES = ("backward", "optimizer")
    PIPELINE_NAMES = {"backward": "forward+backward"}  # what "backward" covers under a schedule

    def __init__(self, monitor: MemoryMonitor, steps: int = 3, interleaved: bool = False):
        self.monitor, self.steps_left = monitor, steps
        self.peaks: dict[str, float] = {}
        self.phases = self.PIPELINE_PHASES if interleaved else self.PHASES
        self.names = self.PIPELINE_NAMES if interleaved else {}

    @property
    def active(self) -> bool:
        return self.steps_left > 0

    def start_step(self) -> None:
        if self.active:
            self.peaks = {}
            self.monitor.reset_peak()

    def mark(self, phase: str) -> None:
        if self.active and phase not in self.peaks:
            self.peaks[phase] = self.monitor.phase_peak_gib()

    def end_step(self, step: int) -> dict[str, float]:
        """Log and return this step's peaks (empty once the first steps are over)."""
        if not self.active:
            return {}
        self.steps_left -= 1
        logger.info(
            "step %d peak memory (%s): %s",
            step,
            self.monitor.kind,
            ", ".join(
                f"after {self.names.get(phase, phase)} {self.peaks.get(phase, 0.0):.3f} GiB" for phase in self.phases
            ),
        )
        return dict(self.peaks)
