"""Per-rank memory of one training step, estimated in a single process without allocating it.

``estimate_memory(job_config, world_size)`` pretends to be rank 0 of ``world_size`` ranks:
a fake process group (collectives do nothing), the model built on meta and parallelised by
the registry's own parallelize function (the config's activation checkpointing, FSDP
layout and mixed-precision policy), then materialised as fake tensors (shapes, dtypes and
storage sizes, no data). One training step (forward, summed cross-entropy, backward,
gradient clipping, optimizer step) runs on a fake ``[local_batch_size, seq_len]`` batch under
PyTorch's ``FSDPMemTracker``, which files every storage under a category and records the
peak. Rank 0 holds the largest shard when a dimension does not split evenly, so its
figures are the most any rank needs.

What each figure means (bytes on one rank):

* ``parameters``: the sharded parameters (FSDP's padded shard storage, in the parameter
  dtype, float32 for the master weights).
* ``gradients``: the sharded gradients once backward is done.
* ``optimizer_state``: the tensors in ``optimizer.state`` (Adam: two moments plus a
  one-element step counter per parameter).
* ``activations``: the largest amount the tracker files as "Activation" during the step:
  tensors produced in forward (and recomputed by activation checkpointing) that are held
  for backward, including the logits and the loss's float32 copies.
* ``temporary``: at the peak moment, everything transient: unsharded parameters and their
  all-gather buffers, unsharded gradients and reduce-scatter buffers, gradients of
  activations during backward ("Temp"), and the optimizer step's scratch tensors.
* ``other``: buffers (the RoPE tables), the input batch and, when enabled, the EMA copy.

The measured step is a steady-state one: the optimizer state is created before tracking
starts (a step on zero gradients), because from the second step on it stays resident
during forward and backward; a first step alone would miss it.

Choices to know about:

* Compile is forced off: compiling would cost minutes, and compiled blocks change only how
  much scratch memory fused kernels need (usually less), not the resident state; the
  estimate is for eager execution and so errs on the high side.
* The mesh and the fake tensors are CPU ones whatever ``device_type`` says (it is only
  recorded): this process needs no accelerator, and byte counts do not depend on the
  device. Not counted: the CUDA caching allocator's rounding of each block to 512 bytes
  and its fragmentation, the CUDA context and library workspaces (which are not tensors),
  and NCCL buffers. ``fits`` takes a reserve for these.
* With gradient accumulation the last micro-batch is measured, with the earlier ones'
  gradients resident (as unpadded shards: a few rows per parameter less than FSDP's).
* With CPU offload the sharded parameters, gradients and optimizer state are taken out
  of the total as host memory; the device copies FSDP makes of each unit's shards before
  the all-gather are not modelled, so offloaded estimates are rougher.
* ``FSDPMemTracker`` running under an outer ``FakeTensorMode`` also counts the global-shape
  fake tensors DTensor creates to infer output shapes (during gradient clipping and the
  optimizer step); those are never allocated, so the tracker here ignores them.
"""

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from titanlite.config import ConfigError, JobConfig
from titanlite.optim import build_optimizer
from titanlite.optim.ema import EMA
from titanlite.parallel import ParallelDims, clip_grad_norm_, compute_context
from titanlite.registry import get_model_args, get_model_spec

# The tracker's category names (FSDPMemTracker's, then the plain MemTracker's used for a
# single process) folded into the figures this module reports.
_CATEGORY = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer_state",
    "Optstate": "optimizer_state",
    "Activation": "activations",
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


class EstimateError(RuntimeError):
    """The estimate cannot run in this process (e.g. a real process group is already up)."""


@dataclass(frozen=True)
class ModelStateBytes:
    """The three figures that do not depend on the batch: bytes per rank."""

    parameters: int
    gradients: int
    optimizer_state: int


@dataclass
class MemoryEstimate:
    """One rank's memory for one steady-state training step; every figure is in bytes.

    ``peak`` is the breakdown at the moment the total is highest (keys: CATEGORIES and
    "total"); ``measured`` holds the resident parameters, gradients and optimizer state
    the tracker saw; ``exact`` the same three by arithmetic; ``activations`` the largest
    activation footprint during the step (not necessarily at the peak moment).
    """

    world_size: int
    strategy: str
    device_type: str
    local_batch_size: int
    seq_len: int
    peak: dict[str, int]
    activations: int
    measured: ModelStateBytes
    exact: ModelStateBytes
    num_params: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.peak["total"]

    def lines(self) -> list[str]:
        """A short human-readable report, one line per figure."""
        gib = 2**30
        out = [
            f"memory per rank ({self.strategy}, {self.world_size} rank(s), batch {self.local_batch_size} x "
            f"{self.seq_len}, {self.num_params / 1e9:.2f} B params): peak {self.peak_bytes / gib:.2f} GiB",
        ]
        for name in CATEGORIES:
            out.append(f"  {name:<16} {self.peak[name] / gib:8.2f} GiB at the peak")
        out.append(f"  largest activation footprint {self.activations / gib:.2f} GiB")
        for name in ("parameters", "gradients", "optimizer_state"):
            out.append(
                f"  {name:<16} tracked {getattr(self.measured, name) / gib:.3f} GiB, "
                f"arithmetic {getattr(self.exact, name) / gib:.3f} GiB"
            )
        out.extend(f"  note: {note}" for note in self.notes)
        return out


def fits(estimate: MemoryEstimate, memory_bytes: int, reserve_bytes: int = 0) -> tuple[bool, int]:
    """Whether the step fits in ``memory_bytes`` per rank, keeping ``reserve_bytes`` aside for
    what is not tensors (CUDA context, allocator fragmentation). Returns (fits, headroom);
    a negative headroom is how much is missing."""
    headroom = memory_bytes - reserve_bytes - estimate.peak_bytes
    return headroom >= 0, headroom


# --- exact arithmetic -------------------------------------------------------------------


def _shard_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """(padded, actual) dim-0 rows of ``rank``'s shard: FSDP splits dim 0 like torch.chunk
    and pads every shard's storage to the first (largest) one."""
    padded = math.ceil(rows / shards)
    return padded, max(0, min(padded, rows - rank * padded))


def exact_model_state_bytes(
    model: nn.Module, shards: int, optimizer_name: str = "AdamW", rank: int = 0
) -> ModelStateBytes:
    """Parameters, gradients and Adam state of one rank, computed from the parameter shapes
    of an unsharded (e.g. meta) model.

    FSDP keeps each sharded parameter, and the gradient reduce-scattered into it, in a
    storage padded to the largest shard; Adam's moments are ``zeros_like`` the parameter's
    local shard, so they are not padded; its step counter is one float32 per parameter.
    """
    if optimizer_name not in ("AdamW", "Adam"):
        raise ValueError(f"no arithmetic for optimizer {optimizer_name}")
    padded_bytes = local_bytes = count = 0
    for param in model.parameters():
        row_elems = param.numel() // param.shape[0] if param.dim() else 1
        padded, actual = _shard_rows(param.shape[0], shards, rank) if param.dim() else (1, 1)
        padded_bytes += padded * row_elems * param.element_size()
        local_bytes += actual * row_elems * param.element_size()
        count += 1
    step_bytes = count * torch.empty((), dtype=torch.float32).element_size()
    return ModelStateBytes(padded_bytes, padded_bytes, 2 * local_bytes + step_bytes)


def device_memory_bytes(device_type: str, ranks_per_node: int) -> tuple[int, str]:
    """(bytes one rank can use, what they are): the local GPU's capacity, or on CPU the
    host's physical memory split between the node's ranks."""
    if device_type == "cuda":
        properties = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return properties.total_memory, f"the GPU ({properties.name})"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(ranks_per_node, 1), f"the host's memory / {ranks_per_node} rank(s) on this node"


def step_floor_bytes(
    model: nn.Module,
    vocab_size: int,
    shards: int,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    cpu_offload: bool,
) -> dict[str, int]:
    """What one rank surely holds at once during a step, by arithmetic on Python ints (no
    tensor is made, so any batch size is safe to ask about): the sharded weights and Adam
    state (unless offloaded), and the logits in the compute dtype beside the float32
    log-probabilities the loss keeps for backward. The real peak is higher (activations,
    gradients, all-gathered units); scripts/estimate.py simulates it."""
    state = exact_model_state_bytes(model, shards)
    return {
        "weights and Adam state": 0 if cpu_offload else state.parameters + state.optimizer_state,
        "logits": local_batch_size * seq_len * vocab_size * (compute_bytes + 4),
    }


# --- the training step and its tracker ------------------------------------------------------


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss (titanlite.train.cross_entropy_sum, which this room may not import;
    a test keeps the two equal): the float32 copy of the logits is a large activation."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _snapshot_totals(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) summed over devices, by name."""
    totals: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            name = getattr(kind, "value", kind)
            totals[name] = totals.get(name, 0) + nbytes
    return totals


def _category_sum(totals: dict[str, int], category: str) -> int:
    """Bytes of the tracker's categories that fold into one of CATEGORIES."""
    return sum(nbytes for name, nbytes in totals.items() if _CATEGORY.get(name) == category)


class _CategoryPeaks:
    """Mixin for the memory trackers: remembers every category's own peak, and ignores
    DTensor's shape-inference tensors (see the module docstring)."""

    def _setup_extras(self) -> None:
        self.category_peaks: dict[str, int] = {}
        self._inferring_shapes = 0

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        for name, nbytes in _snapshot_totals(self._curr_mem_snap).items():
            self.category_peaks[name] = max(self.category_peaks.get(name, 0), nbytes)

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


@dataclass
class _StepMemory:
    """What the tracker saw during one step (tracker category names, bytes)."""

    at_start: dict[str, int]
    at_peak: dict[str, int]
    category_peaks: dict[str, int]


def _prime_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, keep_gradients: bool) -> None:
    """Create the optimizer state with one step on zero gradients, so that the measured
    step is like every step after the first (state resident during forward/backward).
    With gradient accumulation the gradients of the earlier micro-batches are resident
    during the last one, the worst; keeping the zero gradients measures that one."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    if not keep_gradients:
        optimizer.zero_grad(set_to_none=True)


def _tracked_step(model, optimizer, batch, global_tokens: int, max_norm: float, context) -> _StepMemory:
    """One training step as the trainer runs it, under the memory tracker. The gradients are
    left in place so that the caller can look at them."""
    inputs, labels = batch
    tracker_cls = _FSDPTracker if isinstance(model, FSDPModule) else _PlainTracker
    tracker = tracker_cls(model, optimizer)
    if isinstance(tracker, FSDPMemTracker):
        tracker.track_inputs(batch)
    with tracker.ignoring_shape_inference(), tracker:
        at_start = _snapshot_totals(tracker.get_tracker_snapshot())
        with context:
            logits = model(inputs)
            loss = summed_cross_entropy(logits, labels) / global_tokens
        del logits
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return _StepMemory(at_start, _snapshot_totals(tracker.get_tracker_snapshot("peak")), tracker.category_peaks)


def _fold(step: _StepMemory) -> tuple[dict[str, int], ModelStateBytes, int]:
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


# --- building the run -------------------------------------------------------------------------


def _resolve_dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    parallelism = job_config.parallelism
    try:
        return ParallelDims.resolve(
            parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree, world_size
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _build_model(job_config: JobConfig, parallel_dims: ParallelDims, mesh) -> tuple[nn.Module, nn.Module, object]:
    """(parallelised model still on meta, an unsharded meta copy for the arithmetic, args),
    built exactly as the trainer builds them."""
    spec = get_model_spec(job_config.model.name)
    args = get_model_args(job_config.model.name, job_config.model.flavor).with_seq_len(job_config.training.seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
        reference = spec.model_cls(args)
    model = spec.parallelize_fn(model, parallel_dims, mesh, job_config)
    return model, reference, args


def _batch_layout(job_config: JobConfig, parallel_dims: ParallelDims) -> tuple[int, int]:
    """(target tokens in the global batch, micro-batches per step), checked as the trainer does."""
    training = job_config.training
    try:
        global_batch, accumulation = parallel_dims.batch_plan(training.local_batch_size, training.global_batch_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return global_batch * training.seq_len, accumulation


def _without_compile(job_config: JobConfig) -> JobConfig:
    """A copy of the config with compile off (see the module docstring)."""
    return dataclasses.replace(job_config, compile=dataclasses.replace(job_config.compile, enable=False))


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    """Rank 0 of a fake process group of ``world_size`` ranks, destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if world_size == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def estimate_memory(job_config: JobConfig, world_size: int, device_type: str = "cuda") -> MemoryEstimate:
    """Estimate rank 0's memory for one training step of ``job_config`` on ``world_size`` ranks.

    Runs in the calling process with a fake process group and fake tensors: nothing of the
    model's size is allocated. Raises EstimateError when a real process group is already
    initialised (the fake one would replace it) and ConfigError for an invalid layout.
    """
    if dist.is_initialized():
        raise EstimateError(
            "estimate_memory needs a process without a process group (it starts a fake one); "
            "call it before init_process_group, or from a separate process"
        )
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, not {world_size}")
    start = time.perf_counter()
    notes = []
    if job_config.compile.enable:
        notes.append("compile is forced off in the estimate; compiled blocks may need a little less scratch memory")
        job_config = _without_compile(job_config)
    parallel_dims = _resolve_dims(job_config, world_size)
    training = job_config.training
    global_tokens, accumulation = _batch_layout(job_config, parallel_dims)
    if accumulation > 1:
        notes.append(
            f"{accumulation} micro-batches per step: measured the last, with the earlier ones' gradients resident"
        )

    with _fake_process_group(world_size):
        # The mesh is a CPU one: the fake backend serves any device, and CPU fake tensors
        # need no accelerator in this process. Byte counts do not depend on the device.
        mesh = parallel_dims.build_mesh("cpu")
        model, reference, args = _build_model(job_config, parallel_dims, mesh)
        # allow_non_fake_inputs: to_empty reads the meta parameters, which are not fake.
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")  # no init_weights: fake tensors have no values
            model.train()
            optimizer = build_optimizer(model.parameters(), job_config.optimizer)
            _prime_optimizer(model, optimizer, keep_gradients=accumulation > 1)
            ema_bytes = _ema_bytes(model, job_config)
            batch = tuple(
                torch.randint(0, args.vocab_size, (training.local_batch_size, training.seq_len)) for _ in range(2)
            )
            context = compute_context(parallel_dims, training.mixed_precision_param, "cpu")
            step = _tracked_step(model, optimizer, batch, global_tokens, training.max_norm, context)

    peak, measured, activations = _fold(step)
    _add_untracked(peak, ema_bytes, training.enable_cpu_offload, notes)
    shards = parallel_dims.dp_shard if parallel_dims.world_size > 1 else 1
    return MemoryEstimate(
        world_size=world_size,
        strategy=parallel_dims.strategy,
        device_type=device_type,
        local_batch_size=training.local_batch_size,
        seq_len=training.seq_len,
        peak=peak,
        activations=activations,
        measured=measured,
        exact=exact_model_state_bytes(reference, shards, job_config.optimizer.name),
        num_params=sum(p.numel() for p in reference.parameters()),
        seconds=time.perf_counter() - start,
        notes=notes,
    )


def _add_untracked(peak: dict[str, int], ema_bytes: int, cpu_offload: bool, notes: list[str]) -> None:
    """Correct the peak breakdown, in place, for what the tracker cannot see or place."""
    if ema_bytes:
        notes.append("the EMA copy of the weights is counted under 'other' (from its tensors, outside the tracker)")
        peak["other"] += ema_bytes
        peak["total"] += ema_bytes
    if cpu_offload:
        offloaded = peak["parameters"] + peak["gradients"] + peak["optimizer_state"]
        notes.append(f"CPU offload: {offloaded / 2**30:.2f} GiB of sharded state is in host memory, not in the total")
        for name in ("parameters", "gradients", "optimizer_state"):
            peak[name] = 0
        peak["total"] -= offloaded


def _ema_bytes(model: nn.Module, job_config: JobConfig) -> int:
    """Bytes of the EMA's averages (clones of the floating-point state), 0 when disabled.
    They are made before the tracker starts, which therefore never sees them."""
    if not job_config.ema.enable:
        return 0
    ema = EMA(model, job_config.ema.decay)
    return sum(_local(t).numel() * t.element_size() for t in ema.averages.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- the same step on real tensors (for checking the estimate) ----------------------------------


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_real_memory(job_config: JobConfig) -> dict[str, int]:
    """On this rank of an initialised (e.g. gloo) process group, with real CPU tensors: build
    the model as the trainer does, run the same steady-state step under the tracker and
    return this rank's bytes: "parameters", "gradients" and "optimizer_state" counted from
    the real tensors' storages, and "activations" and "peak" as the tracker measured them."""
    job_config = _without_compile(job_config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    parallel_dims = _resolve_dims(job_config, world_size)
    training = job_config.training
    mesh = parallel_dims.build_mesh("cpu")
    model, _, args = _build_model(job_config, parallel_dims, mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=job_config.debug.seed, buffer_device=torch.device("cpu"))
    model.train()
    global_tokens, accumulation = _batch_layout(job_config, parallel_dims)
    optimizer = build_optimizer(model.parameters(), job_config.optimizer)
    # Weight decay in the priming step nudges the weights; nothing here reads them.
    _prime_optimizer(model, optimizer, keep_gradients=accumulation > 1)
    generator = torch.Generator().manual_seed(job_config.debug.seed)
    batch = tuple(
        torch.randint(0, args.vocab_size, (training.local_batch_size, training.seq_len), generator=generator)
        for _ in range(2)
    )
    context = compute_context(parallel_dims, training.mixed_precision_param, "cpu")
    step = _tracked_step(model, optimizer, batch, global_tokens, training.max_norm, context)
    peak, _, activations = _fold(step)
    params = list(model.parameters())
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _storage_bytes(
            t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ),
        "activations": activations,
        "peak": peak["total"],
    }
