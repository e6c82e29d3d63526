"""Making what was written to disk last: the fsync every package shares.

Imports nothing from titanlite, so that data (a lower layer) and checkpoint may both use it."""

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder: a file so that its data lasts, a folder so that a rename
    into it or a new entry in it does."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
