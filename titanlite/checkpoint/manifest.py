"""A checkpoint's integrity: its manifest of file sizes and SHA-256s, and DCP's byte ranges.

With ``checkpoint.verify_integrity``, rank 0 writes ``.manifest.json`` (every file's size
and SHA-256) into a step folder before it is renamed into place (in object storage: before
its commit marker, reading every file back once); a load checks the sizes
whenever a manifest exists and the checksums when the option is on. Every load also checks
each file against the byte ranges DCP's ``.metadata`` records, so a truncated file is named.
"""

import hashlib
import json
import os
from pathlib import Path

from titanlite.checkpoint.files import CheckpointError, reader_for
from titanlite.storage import ObjectPath

MANIFEST = ".manifest.json"
_HASH_CHUNK = 1 << 20


def _sha256(path: Path | ObjectPath) -> str:
    """The file's SHA-256, read in 1 MiB chunks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path | ObjectPath) -> None:
    """Write the folder's MANIFEST, {file name: {size, sha256}} for every other file, and fsync it."""
    files = {
        entry.name: {"size": entry.stat().st_size, "sha256": _sha256(entry)}
        for entry in sorted(folder.iterdir(), key=lambda entry: entry.name)
        if entry.is_file() and entry.name != MANIFEST
    }
    if isinstance(folder, ObjectPath):
        (folder / MANIFEST).write_text(json.dumps(files, indent=1))
        return
    with open(folder / MANIFEST, "w") as file:
        json.dump(files, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def _read_manifest(folder: Path | ObjectPath) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())
        return {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: the integrity manifest is damaged ({type(error).__name__}: {error})") from None


def verify_manifest(folder: Path | ObjectPath, checksums: bool) -> bool:
    """Check every file the folder's manifest lists: its size, and its SHA-256 when
    `checksums`. Raises CheckpointError naming the first file that differs; returns
    whether there was a manifest to check against."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return False
    for name, (size, sha256) in manifest.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the integrity manifest lists it)")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{path}: size mismatch, {actual} bytes instead of {size} "
                "(the file was truncated or changed after it was saved)"
            )
        if checksums and _sha256(path) != sha256:
            raise CheckpointError(f"{path}: sha256 mismatch (the file changed after it was saved)")
    return True


def check_data_files(folder: Path | ObjectPath) -> None:
    """Check that every data file DCP's .metadata refers to exists and is long enough for
    the byte ranges it records: a truncated shard is named before DCP reads it."""
    storage = reader_for(folder).read_metadata().storage_data or {}
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint's .metadata refers to it)")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{path}: truncated, {size} bytes but the checkpoint's .metadata places data up to byte {end}"
            )
