"""DCP's fsspec reader and writer for step folders in object storage. Imported only for a URL
(a local run never imports fsspec); classes at module level, so that the writer of an
async_with_pinned_mem save can be sent to DCP's writer process."""

from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from titanlite.checkpoint.files import NamingReads
from titanlite.storage import upload_slot


class ObjectNamingReader(NamingReads, FsspecReader):
    """DCP's fsspec reader; an error names its file."""


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
