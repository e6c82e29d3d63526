"""The data-parallel loader: this rank's share of each global batch, read ahead, resumable anywhere.

Training reads a global sequence of windows of ``seq_len + 1`` tokens (inputs plus the label
shifted by one). Each call of ``next_batch()`` on data-parallel rank r hands it windows
``[pos + r*b, pos + (r+1)*b)`` and moves ``pos`` by ``b * dp_degree`` (b: local batch size), so
the group as a whole reads the sequence in order, and a global batch is the same set of
windows whatever the dp degree, micro-batch size or accumulation.

The loader's state is ``pos`` (windows the whole group consumed) plus a description of the data,
never anything about the layout, so a checkpoint resumes at any world size. Where the windows
come from is a window source:

* ``PreparedWindows``: prepared folders (``prepared.py``), optionally mixed and shuffled
  (``order.py``); any window is found by arithmetic, so a rank reads only its own windows and
  a resume seeks in constant time.
* ``StreamWindows`` (``stream.py``): a raw document source tokenized on the fly, for small runs.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import weakref
from fractions import Fraction

import torch

from .order import EpochPermutation, Mixture
from .prepared import PreparedFolder
from .stream import START, StreamWindows

logger = logging.getLogger("titanlite")


class PreparedWindows:
    """The windows of one or more prepared folders, in mixture order, shuffled per epoch.

    Each folder holds ``tokens // (seq_len + 1)`` whole windows per epoch (the partial window at
    its end is never read). Folder i's j-th window in the global order is window ``j mod W_i``
    of its epoch ``j // W_i``, through that epoch's permutation when ``shuffle`` is on.
    """

    def __init__(
        self,
        folders: list[PreparedFolder],
        weights: list[Fraction],
        seq_len: int,
        shuffle: bool,
        seed: int,
        seq_len_key: str = "training.seq_len",
    ):
        self.folders = folders
        self.seq_len = seq_len
        self.tokens_per_window = seq_len + 1
        self.shuffle, self.seed = shuffle, seed
        self.mixture = Mixture(weights)
        self.windows_per_epoch = []
        for folder in folders:
            windows = folder.tokens // self.tokens_per_window
            if windows < 1:
                raise ValueError(
                    f"{folder.where}: holds {folder.tokens} tokens, fewer than one window of "
                    f"{seq_len_key} + 1 = {self.tokens_per_window}"
                )
            self.windows_per_epoch.append(windows)
        self._permutations: dict[int, tuple[int, EpochPermutation]] = {}  # source -> (epoch, its permutation)
        # Token ids are checked against this, so a corrupted file fails here, not inside an embedding.
        self._id_limit = max(folder.tokenizer_info.get("vocab_size", 0) for folder in folders)
        self.description = {
            "kind": "prepared",
            "sources": [{"folder": folder.path, "manifest_sha256": folder.manifest_sha256} for folder in folders],
            "weights": [str(weight) for weight in self.mixture.weights],
            "shuffle": shuffle,
            "seed": seed if shuffle else None,
        }

    def locate(self, window: int) -> tuple[int, int]:
        """(folder index, first stream token) of global window ``window``."""
        source, taken = self.mixture.locate(window)
        epoch, index = divmod(taken, self.windows_per_epoch[source])
        if self.shuffle:
            cached_epoch, permutation = self._permutations.get(source, (None, None))
            if cached_epoch != epoch:
                permutation = EpochPermutation(self.windows_per_epoch[source], self.seed, source, epoch)
                self._permutations[source] = (epoch, permutation)
            index = permutation(index)
        return source, index * self.tokens_per_window

    def read(self, first: int, count: int, mark: int) -> tuple[torch.Tensor, None]:
        """Windows ``[first, first + count)`` as int64 ``[count, seq_len + 1]`` (no cursor needed)."""
        windows = torch.empty(count, self.tokens_per_window, dtype=torch.int64)
        for row in range(count):
            source, start = self.locate(first + row)
            self.folders[source].copy_tokens(start, windows[row])
        largest = int(windows.max())
        if largest >= self._id_limit:
            raise ValueError(
                f"token id {largest} in windows [{first}, {first + count}) is outside the "
                f"vocabulary ({self._id_limit} ids): a prepared file is corrupted"
            )
        return windows, None

    def restore(self, cursor) -> None:
        pass  # every window is found by arithmetic


class DataLoader:
    """Yields this rank's ``(inputs, labels)`` micro-batches; a Stateful for checkpoints.

    ``columns``: what this rank keeps of each batch's rows (context parallelism keeps its chunks
    of every sequence, see titanlite/parallel/context_parallel.py), applied to the inputs and
    the labels alike; None keeps them whole. With ``prefetch`` > 0 a background thread reads
    that many micro-batches ahead (into pinned memory when ``pin_memory``), so ``next_batch()``
    only waits when reading is slower than training. What the checkpoint records is what the
    training loop consumed, never what the thread has read ahead. ``allow_changed_data`` lets a
    checkpoint of other data load (at the same window count); otherwise that is an error naming
    what changed.
    """

    def __init__(
        self,
        windows,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        prefetch: int = 0,
        pin_memory: bool = False,
        allow_changed_data: bool = False,
        columns=None,
    ):
        _require_positive_int("seq_len", windows.seq_len)
        _require_positive_int("local_batch_size", local_batch_size)
        _require_positive_int("dp_degree", dp_degree)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank: expected an int in [0, {dp_degree}), got {dp_rank!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch: expected an int >= 0, got {prefetch!r}")
        self.windows = windows
        self.seq_len = windows.seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.prefetch, self.pin_memory = prefetch, pin_memory
        # The read-ahead thread pins on this rank's GPU: a new thread's current device is
        # GPU 0, where pinning would otherwise make a context for every rank of the node.
        self._cuda_device = torch.cuda.current_device() if pin_memory else None
        self.allow_changed_data = allow_changed_data
        self.columns = columns
        self.windows_consumed = 0  # by the whole data-parallel group, so independent of the layout
        self._cursor = START  # raw streams: a document at or before windows_consumed
        self._reader: _ReadAhead | None = None

    @property
    def tokens_per_window(self) -> int:
        return self.seq_len + 1

    @property
    def tokenizer(self):
        return getattr(self.windows, "tokenizer", None)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch: int64 ``inputs`` and ``labels`` of shape [local_batch_size, seq_len]."""
        if self.prefetch == 0:
            batch = self._read(self.windows_consumed)
        else:
            if self._reader is None:
                self._reader = _ReadAhead(
                    self._read,
                    self.windows_consumed,
                    self.local_batch_size * self.dp_degree,
                    self.prefetch,
                    self._cuda_device,
                )
            batch = self._reader.get()
        position, inputs, labels, cursor = batch
        assert position == self.windows_consumed, (position, self.windows_consumed)
        self.windows_consumed += self.local_batch_size * self.dp_degree
        if cursor is not None:
            self._cursor = cursor
        return inputs, labels

    def _read(self, position: int):
        """The micro-batch that starts the group's windows at ``position`` (any thread)."""
        first = position + self.dp_rank * self.local_batch_size
        windows, cursor = self.windows.read(first, self.local_batch_size, mark=position)
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.columns is not None:
            inputs, labels = self.columns(inputs), self.columns(labels)
        if self.pin_memory:
            # Page-locked, so the copy to the GPU can run asynchronously (non_blocking=True).
            inputs, labels = inputs.pin_memory(), labels.pin_memory()  # cuda-only
        return position, inputs, labels, cursor

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def close(self) -> None:
        """Stop the read-ahead thread (it restarts on the next ``next_batch()``)."""
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    # --- Stateful --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Only layout-independent values, so a checkpoint can be loaded at another dp degree.
        return {
            "windows_consumed": self.windows_consumed,
            "seq_len": self.seq_len,
            "data": json.dumps(self.windows.description, sort_keys=True),
            "cursor": json.dumps(list(self._cursor)),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the saved position. A change of data is an error unless allowed; then the
        run continues at the same window count of the new data."""
        saved_seq_len = _read_state_int(state_dict, "seq_len")
        if saved_seq_len != self.seq_len:
            raise ValueError(
                f"dataloader state 'seq_len': checkpoint was saved with seq_len {saved_seq_len}, "
                f"this run uses {self.seq_len}; the window positions would not match"
            )
        windows_consumed = _read_state_int(state_dict, "windows_consumed")
        if windows_consumed < 0:
            raise ValueError(f"dataloader state 'windows_consumed': expected >= 0, got {windows_consumed}")
        saved = json.loads(state_dict["data"]) if state_dict.get("data") else None
        change = describe_change(saved, self.windows.description)
        if change is not None and not self.allow_changed_data:
            raise ValueError(
                f"dataloader: {change}; the saved position (window {windows_consumed}) belongs to that data "
                "(set data.allow_changed_data to continue at that window count of this run's data)"
            )
        self.close()
        self.windows_consumed = windows_consumed
        self._cursor = START
        if change is None and state_dict.get("cursor"):
            self._cursor = tuple(json.loads(state_dict["cursor"]))
        self.windows.restore(self._cursor)


class PackedLoader(DataLoader):
    """The loader over a raw document source, read on the calling thread."""

    def __init__(self, documents, tokenizer, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int):
        _require_positive_int("seq_len", seq_len)
        super().__init__(StreamWindows(documents, tokenizer, seq_len), local_batch_size, dp_rank, dp_degree)


def describe_change(saved: dict | None, current: dict) -> str | None:
    """One phrase naming what differs between the data a checkpoint was trained on and this run's.
    Prepared folders are the same data wherever they now live: their manifests say what they hold."""
    if saved is not None and _identity(saved) == _identity(current):
        return None
    if saved is None:
        return "the checkpoint does not say which data it was trained on"
    if saved.get("kind") != current.get("kind"):
        return f"the checkpoint was trained on {_what(saved)}, this run reads {_what(current)}"
    if current["kind"] == "prepared":
        saved_manifests = [source["manifest_sha256"] for source in saved["sources"]]
        if saved_manifests != [source["manifest_sha256"] for source in current["sources"]]:
            return (
                f"training.dataset_path: the checkpoint was trained on {_what(saved)}, this run reads {_what(current)}"
            )
        for key, config_key in (
            ("weights", "training.dataset_path weights"),
            ("shuffle", "data.shuffle"),
            ("seed", "data.seed"),
        ):
            if saved.get(key) != current.get(key):
                return (
                    f"{config_key}: the checkpoint was trained with {saved.get(key)}, this run uses {current.get(key)}"
                )
    if saved.get("tokenizer") != current.get("tokenizer"):
        return (
            f"model.hf_assets_path: the checkpoint was trained with tokenizer {saved.get('tokenizer')}, "
            f"this run's is {current.get('tokenizer')}"
        )
    return f"the checkpoint was trained on {_what(saved)}, this run reads {_what(current)}"


def _identity(description: dict) -> dict:
    if description.get("kind") != "prepared":
        return description
    sources = [source["manifest_sha256"] for source in description.get("sources", [])]
    return {**description, "sources": sources}


def _what(description: dict) -> str:
    if description.get("kind") == "prepared":
        folders = ", ".join(
            f"{source['folder']} (manifest {source['manifest_sha256'][:12]})" for source in description["sources"]
        )
        return f"prepared data {folders}"
    return f"{description.get('dataset')} {description.get('dataset_path') or ''}".strip()


class _ReadAhead:
    """A daemon thread that calls ``read(position)`` for successive positions into a bounded queue.

    The thread holds its loader only weakly: a loader dropped without ``close()`` is collected,
    and its thread ends instead of living on beside the training thread."""

    def __init__(self, read, first_position: int, stride: int, depth: int, cuda_device: int | None = None):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(weakref.WeakMethod(read), first_position, stride, cuda_device),
            name="titanlite-data",
            daemon=True,
        )
        self._thread.start()

    def _run(self, read_ref, position: int, stride: int, cuda_device: int | None) -> None:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)  # cuda-only
        while not self._stopping.is_set():
            read = read_ref()
            if read is None:
                return  # the loader is gone
            try:
                item = ("batch", read(position))
            except BaseException as error:  # handed to the training thread, which raises it
                item = ("error", error)
            del read  # no strong reference while waiting for room in the queue
            while not self._stopping.is_set() and read_ref() is not None:
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return
            position += stride

    def get(self):
        kind, value = self._queue.get()
        if kind == "error":
            raise value
        return value

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _read_state_int(state_dict: dict, key: str) -> int:
    if key not in state_dict:
        raise ValueError(f"dataloader state: missing key {key!r} (have {sorted(state_dict)})")
    value = state_dict[key]
    # A checkpoint may hand back a 0-d tensor instead of a Python int.
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"dataloader state {key!r}: expected an int, got {value!r}")
    return value
