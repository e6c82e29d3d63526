"""Tokenizers: a built-in byte tokenizer and a wrapper around a Hugging Face tokenizer.json.

Both expose the same small interface that the loader relies on:
``encode(text) -> list[int]`` (no special tokens added), ``decode(ids) -> str``,
``vocab_size``, ``bos_id`` and ``eos_id`` (either may be None for a Hugging Face tokenizer),
``encode_batch(texts)`` for many documents at once, and ``fingerprint``: a hash of everything
that decides the ids, which prepared data records so that it is never read with another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

# Token strings that commonly mark the start / end of a document, in order of preference.
# Used only when no tokenizer_config.json says which tokens to use.
_WELL_KNOWN_BOS_TOKENS = ("<|begin_of_text|>", "<s>")
_WELL_KNOWN_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<|endoftext|>")


def _as_int_list(ids: Iterable[int] | Any) -> list[int]:
    """Accept a list, tuple or tensor of ids (tensors have .tolist(); we avoid importing torch)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(token_id) for token_id in ids]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS. Needs no files."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258
    fingerprint = "byte-utf8-256-257"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        byte_values = bytes(token_id for token_id in _as_int_list(ids) if 0 <= token_id < 256)
        # A window can start or end in the middle of a multi-byte character, so never fail here.
        return byte_values.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package."""

    def __init__(self, tokenizer_path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                f"hf_assets_path {tokenizer_path}: the 'tokenizers' package is needed to read "
                "tokenizer.json (pip install tokenizers)"
            ) from None
        if not os.path.isfile(tokenizer_path):
            raise ValueError(f"hf_assets_path {tokenizer_path}: tokenizer.json file not found")
        try:
            self._tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as error:  # the library raises its own exception types for bad files
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"hf_assets_path {tokenizer_path}: cannot read tokenizer.json ({message})") from None
        self.path = tokenizer_path
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config = _read_tokenizer_config(os.path.join(os.path.dirname(tokenizer_path), "tokenizer_config.json"))
        self.bos_id: int | None = self._find_special_id(config, "bos_token", _WELL_KNOWN_BOS_TOKENS)
        self.eos_id: int | None = self._find_special_id(config, "eos_token", _WELL_KNOWN_EOS_TOKENS)
        with open(tokenizer_path, "rb") as tokenizer_json:
            file_hash = hashlib.sha256(tokenizer_json.read()).hexdigest()
        # The file decides the ids; the config beside it decides BOS/EOS.
        self.fingerprint = hashlib.sha256(f"{file_hash}/{self.bos_id}/{self.eos_id}".encode()).hexdigest()[:32]

    def encode(self, text: str) -> list[int]:
        # Special tokens are added by the loader (BOS/EOS around each document), not here.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into the library for many documents: far less Python per document.
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(_as_int_list(ids), skip_special_tokens=True)

    def _find_special_id(self, config: dict, config_key: str, fallback_tokens: tuple[str, ...]) -> int | None:
        configured_token = _token_content(config.get(config_key))
        if configured_token is not None:
            token_id = self._tokenizer.token_to_id(configured_token)
            if token_id is None:
                raise ValueError(
                    f"hf_assets_path {self.path}: tokenizer_config.json {config_key} "
                    f"{configured_token!r} is not in the vocabulary"
                )
            return token_id
        for token in fallback_tokens:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return None


def _read_tokenizer_config(config_path: str) -> dict:
    """The tokenizer_config.json beside tokenizer.json, or {} when there is none."""
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path, encoding="utf-8") as config_file:
            config = json.load(config_file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path}: cannot read tokenizer config as JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


def _token_content(entry: Any) -> str | None:
    """bos_token/eos_token entries are either a plain string or an AddedToken dict with 'content'."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def tokenizer_file(hf_assets_path: str | None) -> str | None:
    """The absolute path of the tokenizer.json that hf_assets_path names, or None."""
    if hf_assets_path is None:
        return None
    if os.path.isdir(hf_assets_path):
        return os.path.abspath(os.path.join(hf_assets_path, "tokenizer.json"))
    return os.path.abspath(hf_assets_path)


def build_tokenizer(hf_assets_path: str | None) -> ByteTokenizer | HFTokenizer:
    """None gives the byte tokenizer; a folder or a tokenizer.json path gives an HFTokenizer."""
    if hf_assets_path is None:
        return ByteTokenizer()
    if os.path.isdir(hf_assets_path):
        tokenizer_path = os.path.join(hf_assets_path, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise ValueError(f"hf_assets_path {hf_assets_path}: folder has no tokenizer.json")
        return HFTokenizer(tokenizer_path)
    if os.path.isfile(hf_assets_path):
        return HFTokenizer(hf_assets_path)
    raise ValueError(f"hf_assets_path {hf_assets_path}: no such file or folder (expected tokenizer.json or its folder)")
