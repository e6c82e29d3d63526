"""One training step under PyTorch's memory tracker, and its bytes folded into the figures
the memory estimate reports (see titanlite.estimate.memory for what each figure means).

``FSDPMemTracker`` running under an outer ``FakeTensorMode`` also counts the global-shape fake
tensors DTensor creates to infer output shapes (during gradient clipping and the optimizer
step); those are never allocated, so the trackers here ignore them.
"""

import contextlib
import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from titanlite.estimate.floor import ModelStateBytes
from titanlite.loss import cross_entropy_sum
from titanlite.parallel import clip_grad_norm_

ACTIVATION = "Activation"  # the tracker's name for what forward makes and keeps
# The tracker's category names (FSDPMemTracker's, then the plain MemTracker's used for a
# single process) folded into the figures this module reports.
_CATEGORY = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer_state",
    "Optstate": "optimizer_state",
    ACTIVATION: "activations",
    "Unsharded Param": "temporary",
    "Unsharded Grad": "temporary",
    "All Gather": "temporary",
    "Reduce Scatter": "temporary",
    "Temp": "temporary",
    "Buffer": "other",
    "Inputs": "other",
    "Other": "other",
}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary", "other")


def _snapshot_totals(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) summed over devices, by name."""
    totals: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            name = getattr(kind, "value", kind)
            totals[name] = totals.get(name, 0) + nbytes
    return totals


def _less_activations(device_snapshot: dict, saving: int) -> dict:
    """A copy of one device's tracker snapshot with ``saving`` bytes fewer activations."""
    snapshot = copy.deepcopy(device_snapshot)
    if saving:
        kind = next(kind for kind in snapshot if getattr(kind, "value", kind) == ACTIVATION)
        snapshot[kind] -= saving
        snapshot[_TOTAL_KEY] -= saving
    return snapshot


def _category_sum(totals: dict[str, int], category: str) -> int:
    """Bytes of the tracker's categories that fold into one of CATEGORIES."""
    return sum(nbytes for name, nbytes in totals.items() if _CATEGORY.get(name) == category)


class _CategoryPeaks:
    """Mixin for the memory trackers: remembers every category's own peak, and ignores
    DTensor's shape-inference tensors (see the module docstring)."""

    def _setup_extras(self) -> None:
        self.category_peaks: dict[str, int] = {}
        self._inferring_shapes = 0
        # What the eager step holds that the compiled one would not (estimate.compiled):
        # taken off the activations at every moment, so the peak is the compiled step's.
        self.compiled_savings = None

    def _update_peak_stats(self, peak_state) -> None:
        # Only the step's peak and each category's: the tracker's own method also walks every
        # tracked module at every operator for per-module peaks, which nothing here reads and
        # which took about half of a 70B model's simulation.
        saving = self.compiled_savings.bytes if self.compiled_savings is not None else 0
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY] - saving:
                self._peak_mem[device] = snapshot[_TOTAL_KEY] - saving
                self._peak_mem_snap[device] = _less_activations(snapshot, saving)
        for name, nbytes in _snapshot_totals(self._curr_mem_snap).items():
            held = nbytes - saving if name == ACTIVATION else nbytes
            self.category_peaks[name] = max(self.category_peaks.get(name, 0), held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._inferring_shapes:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    @contextlib.contextmanager
    def ignoring_shape_inference(self):
        """DTensor infers an op's output shape by running it on global-shape fake tensors in
        the active fake mode, which is ours in a fake run; nothing of that is allocated."""
        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(propagator, op_schema):
            self._inferring_shapes += 1
            try:
                return original(propagator, op_schema)
            finally:
                self._inferring_shapes -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original


class _FSDPTracker(_CategoryPeaks, FSDPMemTracker):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        self._setup_extras()


class _PlainTracker(_CategoryPeaks, MemTracker):
    """A single process has no FSDP module, which FSDPMemTracker requires."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self._setup_extras()
        self.track_external(model, optimizer)

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        # A pipeline schedule calls its stage once per micro-batch, each forward before the
        # earlier ones' backward; the tracker's per-module figures (unused here) allow one
        # call per module, so a further call only files its inputs.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            self.memory_tracking[module].input_mem = self._track_inputs_or_outputs(inputs)
            return
        super()._pre_fw_hook(module, inputs)


@dataclass
class StepMemory:
    """What the tracker saw during one step (tracker category names, bytes)."""

    at_start: dict[str, int]
    at_peak: dict[str, int]
    category_peaks: dict[str, int]
    # Under a pipeline: the activation bytes the first micro-batch holds once its forward is
    # done, what every micro-batch waiting for its backward keeps (with activation
    # checkpointing far less than its backward's peak, which recomputes a block).
    held_activations: int | None = None


def prime_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, keep_gradients: bool) -> None:
    """Create the optimizer state with one step on zero gradients, so that the measured
    step is like every step after the first (state resident during forward/backward).
    With gradient accumulation the gradients of the earlier micro-batches are resident
    during the last one, the worst; keeping the zero gradients measures that one."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    if not keep_gradients:
        optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _without_garbage_collection():
    """As in the trainer's loop, which collects at fixed steps only: what reference cycles
    (autograd's, collectives') hold stays until the step ends, not until the collector
    happens to run, which would make the peak depend on allocations before the step."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class Compiled:
    """What the simulated step runs in place of the compiled parts (titanlite.estimate.compiled):
    the loss function, and the blocks' savings to take off the eager step's activations (an
    object whose ``bytes`` say how many at each moment, or None)."""

    loss_fn: Callable = cross_entropy_sum
    savings: object = None

    def context_exited(self) -> None:
        if self.savings is not None:
            self.savings.compute_context_exited()


@contextlib.contextmanager
def _tracking(model, optimizer, inputs, savings=None):
    """The memory tracker over ``model`` and ``optimizer`` (``inputs`` filed as inputs), with
    the shape-inference tensors ignored and the garbage collector off; yields (tracker, the
    snapshot taken as tracking starts)."""
    tracker_cls = _FSDPTracker if isinstance(model, FSDPModule) else _PlainTracker
    tracker = tracker_cls(model, optimizer)
    tracker.compiled_savings = savings
    if isinstance(tracker, FSDPMemTracker):
        tracker.track_inputs(inputs)
    with tracker.ignoring_shape_inference(), tracker, _without_garbage_collection():
        yield tracker, _snapshot_totals(tracker.get_tracker_snapshot())


def _finish(
    tracker, at_start: dict[str, int], model, optimizer, max_norm: float, held_activations: int | None = None
) -> StepMemory:
    """Clip and step as the trainer does, still tracked; the step's figures."""
    clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return _figures(tracker, at_start, held_activations)


def _figures(tracker, at_start: dict[str, int], held_activations: int | None = None) -> StepMemory:
    peak = _snapshot_totals(tracker.get_tracker_snapshot("peak"))
    return StepMemory(at_start, peak, tracker.category_peaks, held_activations)


def _activations_now(tracker, at_start: dict[str, int]) -> int:
    """Activation bytes the tracker holds now, above those at the step's start (less what
    compiled blocks would not hold)."""
    now = _snapshot_totals(tracker.get_tracker_snapshot())
    saving = tracker.compiled_savings.bytes if tracker.compiled_savings is not None else 0
    return _category_sum(now, "activations") - _category_sum(at_start, "activations") - saving


@dataclass(frozen=True)
class StepRecipe:
    """How a tracked step runs, beside its model, optimizer and inputs: as the trainer runs it."""

    global_tokens: int
    """The global batch's tokens, which the summed loss is divided by."""
    max_norm: float
    """The gradient clipping's norm."""
    context: object = contextlib.nullcontext()
    """The compute context the forward runs in (autocast or none), entered once per forward."""
    loss_context: Callable = contextlib.nullcontext
    """Makes what the loss and its backward run under (loss parallel under TP)."""
    compiled: Compiled = field(default_factory=Compiled)
    """What stands in for the compiled parts (default: nothing compiled, the eager step)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.compiled.loss_fn(logits, labels) / self.global_tokens


def tracked_step(model, optimizer, batch, recipe: StepRecipe) -> StepMemory:
    """One training step as the trainer runs it, under the memory tracker. The gradients are
    left in place so that the caller can look at them."""
    inputs, labels = batch
    compiled = recipe.compiled
    with _tracking(model, optimizer, batch, compiled.savings) as (tracker, at_start):
        with recipe.loss_context():
            with recipe.context:
                logits = model(inputs)
                loss = recipe.loss(logits, labels)
            compiled.context_exited()
            del logits
            loss.backward()
        return _finish(tracker, at_start, model, optimizer, recipe.max_norm)


def tracked_stage_step(model, optimizer, microbatches, recipe: StepRecipe) -> StepMemory:
    """One pipeline stage's step under the memory tracker: ``microbatches`` is a list of
    (inputs, labels), the inputs tokens for the first stage and the previous stage's output
    (requiring grad) for the others, the labels None except on the last stage, whose loss
    is backpropagated; the others backpropagate a gradient shaped like their output. As
    torch.distributed.pipelining does with FSDP, every micro-batch but the last keeps the
    parameters gathered and accumulates unsharded gradients without reducing them; the last
    reduces (the schedule reduces after the last backward). Also records what the first
    micro-batch holds between its forward and its backward (StepMemory.held_activations)."""
    compiled = recipe.compiled
    held = None
    with _tracking(model, optimizer, microbatches, compiled.savings) as (tracker, at_start):
        for index, (inputs, labels) in enumerate(microbatches):
            last = index == len(microbatches) - 1
            # Its per-module figures (unused here) allow one call per module; the peaks stay.
            tracker.reset_mod_stats()
            if isinstance(model, FSDPModule):
                model.set_is_last_backward(last)
                model.set_reshard_after_backward(last)
                model.set_requires_gradient_sync(last)
            with recipe.loss_context():
                with recipe.context:
                    output = model(inputs)
                    if labels is not None:  # the last stage: the loss, its logits freed
                        output = recipe.loss(output, labels)
                compiled.context_exited()
                if held is None:
                    held = _activations_now(tracker, at_start)
                output.backward(None if labels is not None else torch.ones_like(output))
            del output
        return _finish(tracker, at_start, model, optimizer, recipe.max_norm, held)


def tracked_call(model, optimizer, step) -> StepMemory:
    """``step()``, whatever it runs (e.g. a real pipeline step with its optimizer step),
    under the memory tracker over ``model`` and ``optimizer``."""
    with _tracking(model, optimizer, ()) as (tracker, at_start):
        step()
        return _figures(tracker, at_start)


def fold_step(step: StepMemory) -> tuple[dict[str, int], ModelStateBytes, int]:
    """Tracker categories -> (peak breakdown, resident model state, activation peak).

    The tracker files the optimizer step's scratch tensors as optimizer state; the resident
    state is what was there when tracking started (the primed state), and anything above
    it at the peak is moved to "temporary".
    """
    peak = {category: _category_sum(step.at_peak, category) for category in CATEGORIES}
    resident_state = _category_sum(step.at_start, "optimizer_state")
    scratch = max(0, peak["optimizer_state"] - resident_state)
    peak["optimizer_state"] -= scratch
    peak["temporary"] += scratch
    peak["total"] = sum(peak[name] for name in CATEGORIES)
    measured = ModelStateBytes(
        parameters=_category_sum(step.at_start, "parameters"),
        # Each gradient's own category peak is when all of them exist, after backward.
        gradients=_category_sum(step.category_peaks, "gradients"),
        optimizer_state=resident_state,
    )
    return peak, measured, _category_sum(step.category_peaks, "activations")
