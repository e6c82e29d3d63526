"""Checkpointing: atomic DCP step folders, async saves, resume at any world size."""

from titanlite.checkpoint.files import CheckpointError, complete_steps, top_level_names
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.states import ModelState, OptimizerState, RNGState

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "complete_steps",
    "top_level_names",
]
