"""Stateful views of the model, the optimizer and the random generators.

Model and optimizer state go through torch.distributed.checkpoint.state_dict, which gives
parameter-name keys and sharded (DTensor) values, so DCP can reshard them on load to any
other layout.
"""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.description import MODEL_ARGS, ModelDescription, refuse_other_model
from titanlite.registry import MODELS


class ModelState(Stateful):
    """The weights, plus a description of the model (registry name, flavor and every
    hyper-parameter) under "model_args", so that tools reading a checkpoint know what
    model it holds and a resume into another model shape fails with a clear message."""

    def __init__(self, model: nn.Module, description: ModelDescription):
        self.model, self.description = model, description
        # One dict for every save and load, handed to DCP as it is.
        self._recorded = description.to_state()

    def state_dict(self) -> dict:
        return {**get_model_state_dict(self.model), MODEL_ARGS: self._recorded}

    def stored_names(self, names: list[str], stored: set[str]) -> dict[str, str]:
        """Weight name -> the name a checkpoint holding the keys `stored` keeps it under, for
        each weight of `names` that it holds under another torchtitan spelling only."""
        spec = MODELS.get(self.description.name)
        if spec is None:  # a model outside the registry (a test's): its own names only
            return {}
        adapter = spec.state_dict_adapter(self.description.args)
        renamed = {}
        for name in names:
            if name not in stored:
                other = [spelling for spelling in adapter.torchtitan_names(name) if spelling in stored]
                if other:
                    renamed[name] = other[0]
        return renamed

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.pop(MODEL_ARGS, None)
        # dcp.load fills the dict that state_dict() handed it, so what the checkpoint recorded
        # is now in self._recorded too: compare it with the run's own description, and record
        # the run's again for the saves to come.
        self._recorded = self.description.to_state()
        mismatch = None if saved is None else self.description.mismatch(saved)
        if mismatch is not None:
            raise ValueError(mismatch)
        set_model_state_dict(self.model, state_dict)

    def refuse_other_model(self, step_dir: Path, run_folder: Path) -> None:
        """Before the load: CheckpointError when `step_dir` records another model than this."""
        refuse_other_model(step_dir, self.description, run_folder)


class OptimizerState(Stateful):
    """Adam's moments and step counts. A checkpoint's settings of each parameter group
    (learning rate, betas, eps, weight decay, kernel) are not loaded: the resuming run's
    config, and its schedule's rate for the step, are what its next step uses."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's load replaces each group's settings with the saved ones, silently keeping
        # e.g. an old weight decay or the rate the old schedule set; ours are put back.
        own = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, settings in zip(self.optimizer.param_groups, own, strict=True):
            group.update(settings)


def plain_tensors(state):
    """``state`` (nested dicts and lists) with every tensor subclass that only wraps one tensor
    of its own shape and dtype replaced by that tensor, a DTensor's local one rebuilt around
    it: torchao's weights under FSDP float8 all-gathers, and the optimizer moments and EMA
    copies made from them (their empty_like and clone keep the subclass). A checkpoint then
    holds plain tensors, which any process reads (DCP would pickle the subclass, loadable only
    where torchao is imported), and a load fills the wrapped tensors in place. Containers
    without such a tensor come back as they are (the same objects)."""
    if isinstance(state, dict):
        plain = {key: plain_tensors(value) for key, value in state.items()}
        return state if all(plain[key] is value for key, value in state.items()) else plain
    if isinstance(state, list):
        plain = [plain_tensors(value) for value in state]
        return state if all(new is old for new, old in zip(plain, state, strict=True)) else plain
    if isinstance(state, DTensor):
        inner = _wrapped(state._local_tensor)
        if inner is None:
            return state
        return DTensor.from_local(
            inner, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, torch.Tensor):
        inner = _wrapped(state)
        return state if inner is None else inner
    return state


def _wrapped(tensor: torch.Tensor) -> torch.Tensor | None:
    """The one tensor of its own shape and dtype that a wrapper subclass holds, or None."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(type(tensor), "__tensor_flatten__"):
        return None
    names, _ = tensor.__tensor_flatten__()
    alike = [getattr(tensor, name) for name in names]
    alike = [inner for inner in alike if inner.shape == tensor.shape and inner.dtype == tensor.dtype]
    return alike[0] if len(alike) == 1 else None


class RNGState(Stateful):
    """The CPU (and CUDA) generator states. Every rank seeds alike and draws alike, so one
    copy serves all ranks and any world size."""

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()  # cuda-only
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])  # cuda-only
