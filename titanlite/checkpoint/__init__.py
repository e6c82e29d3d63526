"""Checkpointing: atomic DCP step folders, async saves, resume at any world size."""

from titanlite.checkpoint.description import ModelDescription, read_model_description
from titanlite.checkpoint.files import CheckpointError, complete_steps, top_level_names
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.states import ModelState, OptimizerState, RNGState

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ModelDescription",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "complete_steps",
    "read_model_description",
    "top_level_names",
]
