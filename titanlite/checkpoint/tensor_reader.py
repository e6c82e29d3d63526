"""Reading the tensors of a DCP checkpoint in one process, one group at a time, for the
Hugging Face export.

DCP's FileSystemWriter stores each chunk of a tensor (one per rank that held a shard of
it) as a torch.save archive at a byte range of a .distcp file. CheckpointReader reads
such chunks straight into their places in one reused buffer, and hands anything else to
DCP's own reader (load_with_dcp). benchmarks/convert.py measures it against DCP's reader
alone, on a checkpoint written by 2 FSDP ranks: the reader stays only while it is at
least 1.5x faster.
"""

import dataclasses
import io
import logging
import os
import sys
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from titanlite.checkpoint.files import reader_for, single_process
from titanlite.storage import ObjectPath

logger = logging.getLogger("titanlite")


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


def buffer_bytes(entries: list[TensorStorageMetadata]) -> int:
    """The read buffer a CheckpointReader needs to hold these tensors at once."""
    return sum(_padded(entry.size.numel() * entry.properties.dtype.itemsize) for entry in entries)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One saved chunk of a tensor: where its row-major bytes are, and where in the whole
    tensor they go (DCP's chunk offsets and sizes)."""

    fd: int
    file_offset: int
    offsets: torch.Size
    sizes: torch.Size


class CheckpointReader:
    """Gives the saved tensors of a checkpoint, a group (one output shard) at a time.

    Fast path: DCP's default FileSystemWriter stores each chunk of a tensor (the whole
    tensor for a process that held it whole, one shard for each FSDP or TP rank) as a
    torch.save archive at a byte range of a .distcp file, and such an archive keeps the
    chunk's bytes uncompressed at a known offset. Where every chunk of a tensor is in
    exactly that form, the chunks are read straight into one reused buffer of the output
    shard's size, each placed by its offsets in the whole tensor: a chunk that is one run
    of the tensor's bytes (an FSDP shard: whole rows) is read in place, any other (a TP
    shard of columns) through a reused scratch buffer and one strided copy. One copy out
    of the page cache, no per-tensor torch.load into a new tensor, no second copy into the
    destination, and no fresh memory (whose first touch is costly) after the first shard.
    The form is checked with torch's own reader (a meta-device load gives the chunk's
    dtype, shape, strides and data offset without reading the data) and zipfile (the
    byte order). Anything else (chunks that do not tile the tensor, storage transforms
    such as compression, a non-contiguous or big-endian chunk, another storage layout, an
    archive that does not parse) is read by dcp.load, which understands every layout DCP
    writes. It stays only while it is at least 1.5x faster than DCP's reader alone:
    benchmarks/convert.py measures both on a checkpoint written by 2 FSDP ranks (figures
    in docs/performance.md).
    """

    def __init__(self, step_dir: Path, metadata, largest_group: int = 0):
        """largest_group: bytes of the largest group to be loaded, so that the buffer is
        allocated once (every reallocation touches fresh memory again)."""
        self._step_dir = step_dir
        self._metadata = metadata
        self._files: dict[str, int] = {}
        self._buffer = torch.empty(largest_group, dtype=torch.uint8)
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._buffer = self._scratch = torch.empty(0, dtype=torch.uint8)

    def _fd(self, relative_path: str) -> int:
        if relative_path not in self._files:
            self._files[relative_path] = os.open(self._step_dir / relative_path, os.O_RDONLY)
        return self._files[relative_path]

    def _locate_chunk(self, key: str, chunk, dtype: torch.dtype) -> Piece | None:
        """Where one saved chunk's row-major bytes are, or None if its archive is not the
        plain form described in the class docstring."""
        info = self._metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
        if info is None or info.transform_descriptors:
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
        nbytes = chunk.sizes.numel() * dtype.itemsize
        data_offset = getattr(described.untyped_storage(), "_checkpoint_offset", None)
        if (
            described.dtype != dtype
            or described.shape != chunk.sizes
            or not described.is_contiguous()
            or described.storage_offset() != 0
            or described.untyped_storage().nbytes() != nbytes
            or data_offset is None
            or data_offset + nbytes > info.length
        ):
            return None
        return Piece(fd, info.offset + data_offset, chunk.offsets, chunk.sizes)

    def locate(self, key: str, entry: TensorStorageMetadata) -> list[Piece] | None:
        """The pieces of the saved tensor, or None if it is to be read by dcp.load. The
        chunks must cover the tensor: DCP writes them without overlap, so their sizes
        adding up to the tensor's means that they tile it. A checkpoint in object storage
        (no file to pread) is read by dcp.load."""
        if (
            isinstance(self._step_dir, ObjectPath)
            or sys.byteorder != "little"
            or sum(c.sizes.numel() for c in entry.chunks) != entry.size.numel()
        ):
            return None
        pieces = []
        for chunk in entry.chunks:
            if chunk.sizes.numel() == 0:  # an empty shard (more ranks than rows): nothing saved to read
                continue
            piece = self._locate_chunk(key, chunk, entry.properties.dtype)
            if piece is None:
                return None
            pieces.append(piece)
        return pieces

    def _scratch_bytes(self, nbytes: int) -> memoryview:
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return memoryview(self._scratch.numpy())[:nbytes]

    def _read(self, key: str, piece: Piece, target: memoryview) -> None:
        offset = piece.file_offset
        while target:
            count = os.preadv(piece.fd, [target], offset)
            if count == 0:
                raise ValueError(f"{self._step_dir}: {key} ends early (the checkpoint file is truncated)")
            target, offset = target[count:], offset + count

    def _place(self, key: str, tensor: torch.Tensor, piece: Piece, buffer: memoryview) -> None:
        """Read one piece into its place in `tensor` (a view of `buffer`, which starts at
        tensor's first byte)."""
        region = tensor[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes, strict=True))]
        nbytes = region.numel() * region.element_size()
        if region.is_contiguous():  # one run of bytes: read in place
            start = (region.storage_offset() - tensor.storage_offset()) * tensor.element_size()
            self._read(key, piece, buffer[start : start + nbytes])
            return
        scratch = self._scratch_bytes(nbytes)
        self._read(key, piece, scratch)
        region.copy_(self._scratch[:nbytes].view(tensor.dtype).view(piece.sizes))

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
        for key, (entry, pieces) in located.items():
            nbytes = entry.size.numel() * entry.properties.dtype.itemsize
            raw = self._buffer[starts[key] : starts[key] + nbytes]
            tensor = raw.view(entry.properties.dtype).view(entry.size)
            for piece in pieces:
                self._place(key, tensor, piece, view[starts[key] : starts[key] + nbytes])
            tensors[key] = tensor
        return tensors

    def load(self, items: list[tuple[str, TensorStorageMetadata]]) -> dict[str, torch.Tensor]:
        """Saved key -> tensor for the given (key, metadata) pairs. The tensors of one call
        are valid until the next call (they may share the reused buffer)."""
        located, rest = {}, []
        for key, entry in items:
            pieces = self.locate(key, entry)
            if pieces is None:
                rest.append((key, entry))
            else:
                located[key] = (entry, pieces)
        tensors = self._read_into_buffer(located)
        if rest:
            tensors.update(load_with_dcp(self._step_dir, rest))
        return tensors


def load_with_dcp(step_dir: Path, items: list[tuple[str, TensorStorageMetadata]]) -> dict[str, torch.Tensor]:
    """Saved key -> a new tensor for the given (key, metadata) pairs, read by DCP's own
    FileSystemReader, which understands every layout DCP writes. One dcp.load for the whole
    group: planning a load and opening the data files per tensor cost as much as the reading
    itself."""
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in items}
    if not tensors:
        return tensors
    try:
        single_process(dcp.load, tensors, storage_reader=reader_for(step_dir), no_dist=True)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise ValueError(
            f"{step_dir}: cannot read {next(iter(tensors))} ({type(error).__name__}); "
            "the checkpoint files may be damaged"
        ) from None
    return tensors
