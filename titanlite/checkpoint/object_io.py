"""DCP's fsspec reader and writer for step folders in object storage. Imported only for a URL
(a local run never imports fsspec); classes at module level, so that the writer of an
async_with_pinned_mem save can be sent to DCP's writer process."""

import contextlib
import os

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

from titanlite.checkpoint.files import NamingReads
from titanlite.storage import upload_slot

# How a data file is read: in blocks of READ_BLOCK bytes, the last READ_BLOCKS of them kept
# (128 MiB a rank while it loads). torch.load looks at an item's end (the zip directory)
# before its start, so s3fs's default reader, one read-ahead window moved forward, fetched most
# items twice plus the window: 3.4x the checkpoint's bytes, against 1.00x with these blocks, and
# 41 requests where 16 MiB blocks made 73 (benchmarks/object_storage.py, docs/performance.md).
READ_BLOCK, READ_BLOCKS = 32 << 20, 4


class _BlockCachedFiles(FileSystem):
    """DCP's fsspec file access, with files opened for reading through a cache of blocks."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        options = {"maxblocks": READ_BLOCKS}
        with self.fs.open(
            os.fspath(path), mode, block_size=READ_BLOCK, cache_type="blockcache", cache_options=options
        ) as stream:
            yield stream


class ObjectNamingReader(NamingReads, FsspecReader):
    """DCP's fsspec reader; an error names its file, and files are read through a block cache."""

    def __init__(self, path: str):
        super().__init__(path)
        files = _BlockCachedFiles()
        files.fs = self.fs.fs
        self.fs = files


class ObjectWriter(FsspecWriter):
    """DCP's fsspec writer, without fsync (a file in object storage is durable once its upload
    completes; an fsync there falls back to a host-wide os.sync()), each rank's upload
    holding one of ``uploads_per_node`` slots of its node (0: no limit)."""

    def __init__(self, path: str, uploads_per_node: int):
        super().__init__(path, sync_files=False)
        self.folder_url = path.rstrip("/").rsplit("/", 1)[0]
        self.uploads_per_node = uploads_per_node

    def write_data(self, plan, planner):
        with upload_slot(self.folder_url, self.uploads_per_node):
            return super().write_data(plan, planner)
