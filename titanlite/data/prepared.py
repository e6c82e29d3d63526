"""The prepared-data format: a token stream tokenized once, read through memory maps.

A prepared folder holds

    manifest.json          written last: format and version, the tokenizer (fingerprint, BOS, EOS,
                           vocabulary size), token and document counts, the source, and every
                           other file's size and SHA-256
    tokens-00000.bin ...   the stream: every document as [bos] ids [eos], concatenated, as
                           little-endian uint16 (vocabularies up to 65,536 ids) or uint32;
                           every shard holds ``shard_tokens`` tokens but the last
    documents-00000.bin .. where each document starts in the stream, little-endian uint64,
                           ``shard_tokens`` entries per shard

Token t of the stream is element ``t % shard_tokens`` of shard ``t // shard_tokens``: finding
any token is arithmetic, whatever the folder's size.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from dataclasses import dataclass

import torch

from titanlite.files import write_text_atomically

FORMAT_NAME = "titanlite-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard

# dtype name -> (array typecode, bytes per item, torch dtype)
_DTYPES = {
    "uint16": ("H", 2, torch.uint16),
    "uint32": ("I", 4, torch.uint32),
    "uint64": ("Q", 8, torch.uint64),
}


def token_dtype(vocab_size: int) -> str:
    """The smallest stored dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _little_endian(items: array.array) -> bytes:
    if sys.byteorder == "big":
        items = array.array(items.typecode, items)
        items.byteswap()
    return items.tobytes()


# --------------------------------------------------------------------------- writing


class _ShardedArray:
    """Appends items to fixed-size shard files, hashing each file as it is written."""

    def __init__(self, folder: str, prefix: str, dtype: str, items_per_shard: int):
        self.folder, self.prefix, self.dtype = folder, prefix, dtype
        self.typecode = _DTYPES[dtype][0]
        self.items_per_shard = items_per_shard
        self.files: list[dict] = []  # name, bytes, sha256 of every finished shard
        self._file = None
        self._items_in_file = 0

    def append(self, items: array.array) -> None:
        start = 0
        while start < len(items):
            if self._file is None or self._items_in_file == self.items_per_shard:
                self._next_file()
            count = min(len(items) - start, self.items_per_shard - self._items_in_file)
            data = _little_endian(items[start : start + count])
            self._file.write(data)
            self._hash.update(data)
            self._bytes += len(data)
            self._items_in_file += count
            start += count

    def _next_file(self) -> None:
        self._close_file()
        self._name = f"{self.prefix}-{len(self.files):05d}.bin"
        self._file = open(os.path.join(self.folder, self._name), "wb")
        self._hash, self._bytes, self._items_in_file = hashlib.sha256(), 0, 0

    def _close_file(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.files.append({"name": self._name, "bytes": self._bytes, "sha256": self._hash.hexdigest()})
        self._file = None

    def close(self) -> list[dict]:
        self._close_file()
        return self.files


class PreparedWriter:
    """Writes a prepared folder's shards and, in ``finish``, its manifest.

    The caller writes into a folder nobody reads yet and renames it into place afterwards;
    the manifest is what makes a folder complete.
    """

    def __init__(self, folder: str, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens: expected >= 1, got {shard_tokens}")
        self.folder = folder
        self.dtype = token_dtype(vocab_size)
        self.shard_tokens = shard_tokens
        self._tokens = _ShardedArray(folder, "tokens", self.dtype, shard_tokens)
        self._starts = _ShardedArray(folder, "documents", "uint64", shard_tokens)
        self.token_count = 0
        self.document_count = 0

    def add(self, tokens: array.array, document_lengths: list[int]) -> None:
        """Append framed documents: ``tokens`` is their concatenation, ``document_lengths`` their sizes."""
        starts = array.array("Q")
        position = self.token_count
        for length in document_lengths:
            starts.append(position)
            position += length
        if position - self.token_count != len(tokens):
            raise ValueError(f"document lengths add up to {position - self.token_count}, got {len(tokens)} tokens")
        self._tokens.append(tokens)
        self._starts.append(starts)
        self.token_count = position
        self.document_count += len(document_lengths)

    def finish(self, tokenizer, source: dict) -> dict:
        """Close the shards and write manifest.json (to a temporary name, then renamed)."""
        files = self._tokens.close() + self._starts.close()
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype,
            "byte_order": "little",
            "shard_tokens": self.shard_tokens,
            "tokens": self.token_count,
            "documents": self.document_count,
            "tokenizer": {
                "fingerprint": tokenizer.fingerprint,
                "bos_id": tokenizer.bos_id,
                "eos_id": tokenizer.eos_id,
                "vocab_size": tokenizer.vocab_size,
            },
            "source": source,
            "files": files,
        }
        text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
        write_text_atomically(os.path.join(self.folder, MANIFEST), text)
        return manifest


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Shard:
    path: str
    items: int


class PreparedFolder:
    """A prepared folder opened for reading: its manifest checked, its files mapped lazily.

    Every problem is a ValueError whose message starts with ``label`` (the config key that
    named the folder) and the folder, then says what is wrong and what was expected.
    """

    def __init__(self, path: str, label: str = "training.dataset_path"):
        self.path = path
        self.where = f"{label} {path}"
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isdir(path):
            hint = (
                " (an unfinished prepare left it as .partial: run the prepare command again)"
                if os.path.isdir(path.rstrip("/") + ".partial")
                else ""
            )
            raise ValueError(f"{self.where}: no such prepared folder{hint}")
        if not os.path.isfile(manifest_path):
            raise ValueError(
                f"{self.where}: no {MANIFEST}, so this is not a complete prepared folder "
                "(prepare it with python -m titanlite.data.prepare)"
            )
        with open(manifest_path, "rb") as manifest_file:
            manifest_bytes = manifest_file.read()
        self.manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        self.manifest = self._parse(manifest_bytes)
        self.tokens: int = self.manifest["tokens"]
        self.documents: int = self.manifest["documents"]
        self.shard_tokens: int = self.manifest["shard_tokens"]
        self.dtype: str = self.manifest["dtype"]
        self.tokenizer_info: dict = self.manifest["tokenizer"]
        self._token_shards = self._shards("tokens", self.dtype, self.tokens)
        self._document_shards = self._shards("documents", "uint64", self.documents)
        self._mapped: dict[str, torch.Tensor] = {}

    # --- the manifest -------------------------------------------------------------------

    def _parse(self, manifest_bytes: bytes) -> dict:
        where = f"{self.where}: {MANIFEST}"
        try:
            manifest = json.loads(manifest_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise ValueError(f"{where}: not a titanlite prepared-data manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{where}: format version {manifest.get('version')!r}, this titanlite reads version "
                f"{FORMAT_VERSION}; prepare the data again"
            )
        expected = {
            "dtype": str,
            "byte_order": str,
            "shard_tokens": int,
            "tokens": int,
            "documents": int,
            "tokenizer": dict,
            "source": dict,
            "files": list,
        }
        for key, kind in expected.items():
            if not isinstance(manifest.get(key), kind):
                raise ValueError(f"{where}: expected {key!r} to be a {kind.__name__}, got {manifest.get(key)!r}")
        if manifest["dtype"] not in ("uint16", "uint32") or manifest["byte_order"] != "little":
            raise ValueError(f"{where}: unsupported token layout {manifest['dtype']} {manifest['byte_order']}")
        return manifest

    def _shards(self, prefix: str, dtype: str, items: int) -> list[_Shard]:
        """The shard files of one array, each checked to exist with the size the manifest gives."""
        files = {entry.get("name"): entry for entry in self.manifest["files"] if isinstance(entry, dict)}
        shard_count = -(-items // self.shard_tokens)
        item_bytes = _DTYPES[dtype][1]
        shards = []
        for index in range(shard_count):
            name = f"{prefix}-{index:05d}.bin"
            if name not in files:
                raise ValueError(f"{self.where}: {MANIFEST} lists no {name}, which {items} {prefix} need")
            shard_items = min(self.shard_tokens, items - index * self.shard_tokens)
            expected_bytes = shard_items * item_bytes
            file_path = os.path.join(self.path, name)
            if not os.path.isfile(file_path):
                raise ValueError(f"{self.where}: {name} is missing")
            actual_bytes = os.path.getsize(file_path)
            if actual_bytes != expected_bytes or files[name].get("bytes") != expected_bytes:
                raise ValueError(
                    f"{self.where}: {name} holds {actual_bytes} bytes, expected {expected_bytes} "
                    "(truncated or overwritten: prepare the data again)"
                )
            shards.append(_Shard(file_path, shard_items))
        return shards

    def check_tokenizer(self, tokenizer, tokenizer_label: str) -> None:
        """Refuse data prepared with another tokenizer than ``tokenizer``."""
        saved = self.tokenizer_info
        if saved.get("fingerprint") != tokenizer.fingerprint:
            raise ValueError(
                f"{self.where}: prepared with another tokenizer (fingerprint {saved.get('fingerprint')}, "
                f"{saved.get('vocab_size')} ids) than this run's ({tokenizer_label}: fingerprint "
                f"{tokenizer.fingerprint}, {tokenizer.vocab_size} ids); prepare it again with this run's tokenizer"
            )

    def verify_checksums(self, names: list[str] | None = None) -> str | None:
        """The first file (of ``names``, default all) whose SHA-256 differs from the manifest's, as a message."""
        for entry in self.manifest["files"]:
            if names is not None and entry["name"] not in names:
                continue
            digest = hashlib.sha256()
            with open(os.path.join(self.path, entry["name"]), "rb") as data_file:
                while block := data_file.read(1 << 23):
                    digest.update(block)
            if digest.hexdigest() != entry.get("sha256"):
                return (
                    f"{self.where}: {entry['name']} does not match its checksum in {MANIFEST} "
                    "(corrupted: prepare the data again)"
                )
        return None

    @property
    def file_names(self) -> list[str]:
        return [entry["name"] for entry in self.manifest["files"]]

    # --- the data -----------------------------------------------------------------------

    def _map(self, shard: _Shard, dtype: str) -> torch.Tensor:
        tensor = self._mapped.get(shard.path)
        if tensor is None:
            # A private read-only mapping: pages come from the page cache as they are touched.
            tensor = torch.from_file(shard.path, shared=False, size=shard.items, dtype=_DTYPES[dtype][2])
            self._mapped[shard.path] = tensor
        return tensor

    def copy_tokens(self, start: int, out: torch.Tensor) -> None:
        """Fill the 1-D ``out`` with stream tokens ``[start, start + len(out))``."""
        if start < 0 or start + len(out) > self.tokens:
            raise IndexError(f"{self.where}: tokens [{start}, {start + len(out)}) outside [0, {self.tokens})")
        filled = 0
        while filled < len(out):
            shard_index, offset = divmod(start + filled, self.shard_tokens)
            shard = self._map(self._token_shards[shard_index], self.dtype)
            count = min(len(out) - filled, shard.numel() - offset)
            out[filled : filled + count].copy_(shard[offset : offset + count])
            filled += count

    def document_starts(self, first: int, count: int) -> list[int]:
        """Where documents ``[first, first + count)`` start in the stream."""
        if first < 0 or first + count > self.documents:
            raise IndexError(f"{self.where}: documents [{first}, {first + count}) outside [0, {self.documents})")
        starts = []
        for document in range(first, first + count):
            shard_index, offset = divmod(document, self.shard_tokens)
            starts.append(int(self._map(self._document_shards[shard_index], "uint64")[offset]))
        return starts
