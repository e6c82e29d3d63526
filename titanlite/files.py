"""Making what was written to disk last: the fsync every package shares.

Imports nothing from titanlite, so that data (a lower layer) and checkpoint may both use it."""

import os
import tempfile
import threading
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder: a file so that its data lasts, a folder so that a rename
    into it or a new entry in it does."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader, or a crash, sees the old file or the
    whole new one: written beside it, fsynced, renamed over it, and the rename fsynced."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class BackgroundSyncer:
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
