"""Export a titanlite step-N checkpoint as a Hugging Face LlamaForCausalLM folder.

Everything is decided before anything is written: the weights present and their shapes
against the model the saved model_args build (on the meta device), the tokenizer, and
the split into output shards (huggingface_hub's splitter, run on meta tensors). The export then reads the checkpoint
one output shard at a time and writes it with safetensors, in one process without a
process group, into a temporary sibling folder that is renamed into place only when
every file is written and synced. All renaming and the q/k RoPE permutation come from
the model's state-dict adapter.
"""

import io
import json
import logging
import os
import re
import shutil
import sys
import threading
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from titanlite.checkpoint.description import ModelDescription, read_model_description
from titanlite.checkpoint.files import check_output, read_checkpoint_metadata, single_process, write_atomically
from titanlite.checkpoint.hf import EMA_PREFIX
from titanlite.data.tokenizer import HFTokenizer
from titanlite.dtypes import DTYPES
from titanlite.files import fsync_path
from titanlite.registry import get_model_spec

logger = logging.getLogger("titanlite")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
# Files of a Hugging Face tokenizer that are copied when they sit beside tokenizer.json.
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def parse_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000, '50KiB' -> 51_200; an int is bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if not match:
            raise ValueError(f"max shard size '{size}': expected a size such as 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max shard size '{size}': must be positive")
    return value


def _export_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype '{dtype}': choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype}: choose from {', '.join(DTYPES)}")
    return dtype


# --- tokenizer -------------------------------------------------------------------------


def _tokenizer_file(step_dir: Path, recorded: str | None, override: str | Path | None) -> Path | None:
    """The tokenizer.json to ship: the override (a file or its folder), else the one the
    run recorded; None for a byte-tokenizer run. A recorded file that has gone is an
    error here, before anything is written, rather than an export without a tokenizer."""
    if override is not None:
        path = Path(override)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{override}: no tokenizer.json there (give a tokenizer.json or its folder)")
        return file
    if recorded is None:
        return None
    if not Path(recorded).is_file():
        raise ValueError(
            f"{step_dir}: the run's tokenizer {recorded} no longer exists; "
            "pass --tokenizer PATH (a tokenizer.json or its folder)"
        )
    return Path(recorded)


def _special_ids(tokenizer_json: Path | None) -> dict[str, int]:
    """bos_token_id / eos_token_id as the trainer found them (HFTokenizer's rules)."""
    if tokenizer_json is None:
        return {}
    tokenizer = HFTokenizer(str(tokenizer_json))
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    return {key: value for key, value in ids.items() if value is not None}


def _copy_tokenizer(tokenizer_json: Path | None, folder: Path) -> None:
    if tokenizer_json is None:
        logger.info("no tokenizer files exported: the run used the byte tokenizer (or did not record one)")
        return
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    for name in TOKENIZER_COMPANIONS:
        if (tokenizer_json.parent / name).is_file():
            shutil.copyfile(tokenizer_json.parent / name, folder / name)
    logger.info(f"exported the tokenizer from {tokenizer_json}")


# --- which tensors, and checks -----------------------------------------------------------


def _weight_sources(step_dir: Path, metadata, adapter, names: list[str], use_ema: bool) -> dict:
    """Hugging Face name -> (saved key, titanlite name, its metadata), in titanlite's
    model order (embedding, blocks, norm, output), for every model weight."""
    prefix = EMA_PREFIX if use_ema else ""
    saved = metadata.state_dict_metadata
    if use_ema and not any(key.startswith(EMA_PREFIX) for key in saved):
        raise ValueError(f"{step_dir}: --ema asks for EMA weights but the checkpoint has no 'ema.' entries")
    missing = [prefix + name for name in names if not isinstance(saved.get(prefix + name), TensorStorageMetadata)]
    if missing:
        raise ValueError(f"{step_dir}: the checkpoint lacks {len(missing)} model weight(s), e.g. {missing[0]}")
    return {adapter.to_hf_name(name): (prefix + name, name, saved[prefix + name]) for name in names}


def _check_shapes(step_dir: Path, sources: dict, description: ModelDescription, expected: dict) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes its own model_args give
    (`expected`, as the model lays them out): the exported config.json would describe a
    different model from the weights."""
    for key, name, entry in sources.values():
        if tuple(entry.size) != expected[name]:
            raise ValueError(
                f"{step_dir}: tensor '{key}' has shape {list(entry.size)} but the checkpoint's "
                f"model_args ({description.name} {description.flavor}) give {list(expected[name])}"
            )


def _split(sources: dict, dtype: torch.dtype, limit: int | None):
    """huggingface_hub's shard split, computed on meta tensors of the export dtype (sizes
    only, no memory). Without a limit everything goes into one model.safetensors."""
    placeholders = {hf: torch.empty(entry.size, dtype=dtype, device="meta") for hf, (_, _, entry) in sources.items()}
    if limit is None:
        limit = max(1, sum(t.numel() * t.element_size() for t in placeholders.values()))
    return split_torch_state_dict_into_shards(
        placeholders, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )


# --- reading the checkpoint ---------------------------------------------------------------


class _Window(io.RawIOBase):
    """A read-only file over bytes [start, start + length) of an open file (read with
    pread), so that torch's own reader can look at one DCP item as the torch.save
    archive it is."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + offset
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, count, self._start + self._pos)
        memoryview(buffer).cast("B")[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _archive_byteorder(window) -> str:
    """The byte order a torch.save archive records ('little' when it records none, as
    archives from before the record)."""
    with zipfile.ZipFile(window) as archive:
        names = [n for n in archive.namelist() if n.endswith("/byteorder")]
        return archive.read(names[0]).decode() if names else "little"


_ALIGN = 64  # start of each tensor in the read buffer: any element size divides it


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _CheckpointReader:
    """Gives the saved tensors of a checkpoint, a group (one output shard) at a time.

    Fast path: DCP's default FileSystemWriter stores each tensor as a torch.save archive
    at a byte range of a .distcp file, and such an archive keeps the tensor's bytes
    uncompressed at a known offset. Where a tensor is in exactly that form, its bytes
    are read straight into one reused buffer of the shard's size: one copy out of the
    page cache, no per-tensor torch.load into a new tensor and no second copy into the
    destination, and no fresh memory (whose first touch is costly) after the first
    shard. The form is checked with torch's own reader (a meta-device load gives the
    tensor's dtype, shape, strides and data offset without reading the data) and
    zipfile (the byte order). Anything else (several chunks, storage transforms such as
    compression, a non-contiguous or big-endian tensor, another storage layout, an
    archive that does not parse) is read by dcp.load, which understands every layout
    DCP writes. The profile that motivated this: reading through dcp.load cost 1.9 s of
    a 4.8 s export of 1.24 GB. It stays only while it is at least 1.5x faster than DCP's
    reader alone (issue #16): benchmarks/convert.py's dcp-reader row measures that, with
    fsyncs in turn instead of _Syncer's thread; its medians were 2.5x and 3.0x (1.24 GB,
    two busy cores, 2026-11-25).
    """

    def __init__(self, step_dir: Path, metadata, largest_group: int = 0):
        """largest_group: bytes of the largest group to be loaded, so that the buffer is
        allocated once (every reallocation touches fresh memory again)."""
        self._step_dir = step_dir
        self._metadata = metadata
        self._files: dict[str, int] = {}
        self._buffer = torch.empty(largest_group, dtype=torch.uint8)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def _fd(self, relative_path: str) -> int:
        if relative_path not in self._files:
            self._files[relative_path] = os.open(self._step_dir / relative_path, os.O_RDONLY)
        return self._files[relative_path]

    def _locate(self, key: str, entry: TensorStorageMetadata) -> tuple[int, int] | None:
        """(file descriptor, offset) of the saved tensor's row-major bytes, or None if
        its form is not the plain one described in the class docstring."""
        if len(entry.chunks) != 1 or any(entry.chunks[0].offsets) or entry.chunks[0].sizes != entry.size:
            return None
        info = self._metadata.storage_data.get(MetadataIndex(key, entry.chunks[0].offsets))
        if info is None or info.transform_descriptors or sys.byteorder != "little":
            return None
        fd = self._fd(info.relative_path)
        try:
            with io.BufferedReader(_Window(fd, info.offset, info.length)) as window:
                if _archive_byteorder(window) != "little":
                    return None
                window.seek(0)
                described = torch.load(window, map_location="meta", weights_only=True)
        except Exception as error:  # not a torch.save archive as expected: let dcp.load read it
            logger.debug("%s: read through dcp.load (%s: %s)", key, type(error).__name__, error)
            return None
        if type(described) is not torch.Tensor:
            logger.debug("%s: read through dcp.load (the archive holds a %s)", key, type(described).__name__)
            return None
        nbytes = entry.size.numel() * entry.properties.dtype.itemsize
        data_offset = getattr(described.untyped_storage(), "_checkpoint_offset", None)
        if (
            described.dtype != entry.properties.dtype
            or described.shape != entry.size
            or not described.is_contiguous()
            or described.storage_offset() != 0
            or described.untyped_storage().nbytes() != nbytes
            or data_offset is None
            or data_offset + nbytes > info.length
        ):
            return None
        return fd, info.offset + data_offset

    def _read_into_buffer(self, located: dict) -> dict[str, torch.Tensor]:
        """Read the located tensors into aligned slices of the reused buffer."""
        starts, end = {}, 0
        for key, (entry, _) in located.items():
            starts[key] = end
            end += _padded(entry.size.numel() * entry.properties.dtype.itemsize)
        if self._buffer.numel() < end:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buffer = torch.empty(end, dtype=torch.uint8)
        view = memoryview(self._buffer.numpy())
        tensors = {}
        for key, (entry, (fd, offset)) in located.items():
            nbytes = entry.size.numel() * entry.properties.dtype.itemsize
            target = view[starts[key] : starts[key] + nbytes]
            while target:
                count = os.preadv(fd, [target], offset)
                if count == 0:
                    raise ValueError(f"{self._step_dir}: {key} ends early (the checkpoint file is truncated)")
                target, offset = target[count:], offset + count
            raw = self._buffer[starts[key] : starts[key] + nbytes]
            tensors[key] = raw.view(entry.properties.dtype).view(entry.size)
        return tensors

    def load(self, items: list[tuple[str, TensorStorageMetadata]]) -> dict[str, torch.Tensor]:
        """Saved key -> tensor for the given (key, metadata) pairs. The tensors of one call
        are valid until the next call (they may share the reused buffer)."""
        located, rest = {}, []
        for key, entry in items:
            where = self._locate(key, entry)
            if where is None:
                rest.append((key, entry))
            else:
                located[key] = (entry, where)
        tensors = self._read_into_buffer(located)
        if rest:
            tensors.update(_load_with_dcp(self._step_dir, rest))
        return tensors


def _load_with_dcp(step_dir: Path, items: list[tuple[str, TensorStorageMetadata]]) -> dict[str, torch.Tensor]:
    """Saved key -> a new tensor for the given (key, metadata) pairs, read by DCP's own
    FileSystemReader, which understands every layout DCP writes. One dcp.load for the whole
    group: planning a load and opening the data files per tensor cost as much as the reading
    itself."""
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in items}
    if not tensors:
        return tensors
    try:
        single_process(dcp.load, tensors, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise ValueError(
            f"{step_dir}: cannot read {next(iter(tensors))} ({type(error).__name__}); "
            "the checkpoint files may be damaged"
        ) from None
    return tensors


# --- writing --------------------------------------------------------------------------------


class _Syncer:
    """fsyncs written files on a second thread while the next shard is being written:
    the output must be on disk before the folder is renamed into place, and the disk
    writes then overlap the conversion instead of following it."""

    def __init__(self):
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def _run(self, path: Path) -> None:
        try:
            fsync_path(path)
        except BaseException as error:
            self._errors.append(error)

    def add(self, path: Path) -> None:
        thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def wait(self) -> None:
        """Join every fsync and raise the first error one met."""
        self.join()
        if self._errors:
            raise self._errors[0]


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


# --- export ----------------------------------------------------------------------------


def export_to_hf(
    step_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: str | int | None = None,
    use_ema: bool = False,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a Hugging Face LlamaForCausalLM folder from a titanlite step-N checkpoint.

    dtype is the dtype of the written weights; max_shard_size (e.g. "5GB") splits them
    into model-0000i-of-0000n.safetensors files and an index when they do not fit one;
    use_ema exports the ema.* weights; tokenizer (a tokenizer.json or its folder)
    overrides the tokenizer the run recorded. Returns out_dir. Bad input is a ValueError
    naming the path, raised before anything is written."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    dtype = _export_dtype(dtype)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    check_output(out_dir)
    metadata = read_checkpoint_metadata(step_dir)
    description = read_model_description(step_dir)
    tokenizer_json = _tokenizer_file(step_dir, description.tokenizer_path, tokenizer)
    special_ids = _special_ids(tokenizer_json)
    adapter = get_model_spec(description.name).state_dict_adapter(description.args)
    shapes = description.weight_shapes()
    sources = _weight_sources(step_dir, metadata, adapter, list(shapes), use_ema)
    _check_shapes(step_dir, sources, description, shapes)
    split = _split(sources, dtype, limit)

    def passes_through(name: str, entry: TensorStorageMetadata) -> bool:
        """Whether the saved tensor is written as it is: same dtype, and the adapter
        returns it unchanged (asked on a meta tensor, which costs nothing)."""
        probe = torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
        return entry.properties.dtype == dtype and adapter.to_hf_tensor(name, probe) is probe

    def write_shard(reader: _CheckpointReader, folder: Path, file: str, hf_names: list[str]) -> None:
        loaded = reader.load([(sources[hf][0], sources[hf][2]) for hf in hf_names])
        shard = {}
        for hf_name in hf_names:
            key, name, entry = sources[hf_name]
            # pop: each saved tensor is released as soon as its converted form exists.
            tensor = loaded.pop(key)
            if not passes_through(name, entry):
                tensor = adapter.to_hf_tensor(name, tensor).to(dtype).contiguous()
            shard[hf_name] = tensor
        save_file(shard, str(folder / file), metadata={"format": "pt"})

    def write(folder: Path) -> None:
        largest = max(
            sum(_padded(sources[hf][2].size.numel() * sources[hf][2].properties.dtype.itemsize) for hf in hf_names)
            for hf_names in split.filename_to_tensors.values()
        )
        reader, syncer = _CheckpointReader(step_dir, metadata, largest), _Syncer()
        try:
            for file, hf_names in split.filename_to_tensors.items():
                write_shard(reader, folder, file, hf_names)
                syncer.add(folder / file)
            if split.is_sharded:
                index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
                _write_json(folder / "model.safetensors.index.json", index)
            config = {**adapter.hf_config(), **special_ids, "torch_dtype": str(dtype).removeprefix("torch.")}
            _write_json(folder / "config.json", config)
            _write_json(folder / "generation_config.json", special_ids)
            _copy_tokenizer(tokenizer_json, folder)
            for path in folder.iterdir():
                if path.suffix != ".safetensors":
                    syncer.add(path)
            syncer.wait()
        finally:
            reader.close()
            syncer.join()

    write_atomically(out_dir, write)
    return out_dir
