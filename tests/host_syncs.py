"""Count, at the dispatcher, the operations that make the host wait for the device.

A host sync is any operation whose result the host needs before it can go on: a tensor's
value read into Python (``.item()``, ``bool()``, ``float()``, a tensor passed where a
number is expected: all of them reach ``aten._local_scalar_dense``; ``.tolist()`` and
``.numpy()``, which on a GPU copy to the host first), an output whose size depends on the
values (``nonzero``, ``masked_select``, ``unique``, reading or writing through a boolean
mask unless that is a ``masked_fill_``), a comparison answered as a Python bool (``equal``,
``is_nonzero``, ``allclose``), and any copy from an accelerator into host memory.

``HostSyncs`` is a ``TorchDispatchMode``: it sees every operator call that reaches the
dispatcher from Python or from C++ above it (autograd's backward, composite operators after
decomposition, the conversion of a tensor argument into a number), on any device, so on the
CPU it catches the syncs that would stall a GPU. On the CPU ``tolist`` and ``numpy`` read
memory without any operator, so the mode wraps those two methods while it is on (in its own
thread: the data loader's reader thread is not the training loop).

It does not see what a kernel, or DTensor's own dispatch, calls inside its implementation.
On CUDA ``torch.cuda.set_sync_debug_mode`` covers those (benchmarks/gpu_check.py); on the
CPU the trainer's were audited once with torch.profiler (docs/reliability.md).
"""

import threading
import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Operators that return a host value or a data-dependent shape: the host waits for the
# device whatever the arguments.
SYNCING = {
    aten._local_scalar_dense,
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
# Tensor methods that read a CPU tensor's memory without any operator (on another device
# they copy it to the host first, which the dispatcher sees): HostSyncs wraps them.
READ_WITHOUT_DISPATCH = ("tolist", "numpy")
# Operators that copy into their destination: a sync when it is in host memory and the
# source is not.
COPIES = {aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize}
# Indexing with a boolean mask finds the mask's true elements first (a nonzero), except
# where index_put_ becomes a masked_fill_ (see _is_masked_fill).
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
MASK_DTYPES = (torch.bool, torch.uint8)


def _device(value) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


def _copies_to_host(func, args, kwargs) -> bool:
    if func is aten._to_copy:
        source, target = _device(args[0]), kwargs.get("device")
    else:  # copy_(self, src): self is the destination
        target, source = _device(args[0]), _device(args[1])
    if source is None or target is None:
        return False
    return torch.device(target).type == "cpu" and source.type != "cpu"


def _masks(indices) -> list[torch.Tensor]:
    return [index for index in tree_leaves(indices) if isinstance(index, torch.Tensor) and index.dtype in MASK_DTYPES]


def _is_masked_fill(args, kwargs, in_host_memory) -> bool:
    """index_put_(self, [mask], value) with one mask on self's device and one value in host
    memory (what ``tensor[mask] = 0`` passes, also on CUDA) runs as masked_fill_, which needs
    no nonzero (canDispatchToMaskedFill in ATen's TensorAdvancedIndexing.cpp)."""
    self, indices, value = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    tensors = [index for index in tree_leaves(indices) if isinstance(index, torch.Tensor)]
    return (
        not accumulate
        and len(tensors) == 1
        and tensors[0].dtype in MASK_DTYPES
        and tensors[0].device == self.device
        and value.numel() == 1
        and in_host_memory(value, self)
    )


def _in_cpu_memory(value: torch.Tensor, destination: torch.Tensor) -> bool:
    return value.device.type == "cpu"


def is_host_sync(func, args, kwargs, in_host_memory=_in_cpu_memory) -> bool:
    """Whether this operator call makes the host wait for the device. ``in_host_memory(value,
    destination)``: whether a value written into ``destination`` would be in host memory on
    an accelerator (on the CPU every tensor is, so HostSyncs asks where it came from)."""
    packet = func.overloadpacket
    if packet in SYNCING:
        return True
    if packet in COPIES:
        return _copies_to_host(packet, args, kwargs)
    if packet not in INDEXING or not _masks(args[1]):
        return False
    return packet is aten.index or not _is_masked_fill(args, kwargs, in_host_memory)


class HostSyncs(TorchDispatchMode):
    """Counts host syncs by operator, where each came from, and every other operator call
    (by operator too, so that a test can tell that the work it watched really ran).

    Use it as a context manager, once or several times (the counts add up)."""

    def __init__(self):
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.where: list[str] = []  # the Python line that made each sync, innermost frames first
        self.other_ops: Counter[str] = Counter()
        # Tensors made from Python numbers or literals (lift_fresh), by id: the only values
        # that stay in host memory on an accelerator too.
        self._from_python: dict[int, weakref.ref] = {}

    def __enter__(self):
        self._thread = threading.get_ident()
        self._originals = {name: getattr(torch.Tensor, name) for name in READ_WITHOUT_DISPATCH}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counting(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counting(self, name: str, original):
        def read(tensor, *args, **kwargs):
            # Another device's tensor reaches the dispatcher as a copy to the host instead.
            if tensor.device.type == "cpu" and threading.get_ident() == self._thread:
                self.syncs[f"Tensor.{name}"] += 1
                self.where.append(f"Tensor.{name}: {_caller()}")
            return original(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_host_sync(func, args, kwargs, self._in_host_memory):
            self.syncs[str(func)] += 1
            self.where.append(f"{func}: {_caller()}")
        else:
            self.other_ops[str(func.overloadpacket)] += 1
        result = func(*args, **kwargs)
        if func.overloadpacket is aten.lift_fresh:
            self._remember_from_python(result)
        return result

    def _remember_from_python(self, tensor: torch.Tensor) -> None:
        if len(self._from_python) > 1000:  # forget the dead ones now and then
            self._from_python = {key: ref for key, ref in self._from_python.items() if ref() is not None}
        self._from_python[id(tensor)] = weakref.ref(tensor)

    def _in_host_memory(self, value: torch.Tensor, destination: torch.Tensor) -> bool:
        if destination.device.type != "cpu":
            return value.device.type == "cpu"
        ref = self._from_python.get(id(value))
        return ref is not None and ref() is value

    def report(self) -> str:
        return "; ".join(self.where) or "none"


def _caller() -> str:
    """The innermost frames outside torch and this file: the code that asked for the sync."""
    frames = [
        frame
        for frame in traceback.extract_stack()[:-2]
        if "/torch/" not in frame.filename and frame.filename != __file__
    ]
    lines = [f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}: {frame.line}" for frame in frames]
    return " <- ".join(lines[::-1][:3])
