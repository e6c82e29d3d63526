"""Document sources: each yields documents (strings) in a fixed order, from the start, every time.

The loader calls a source again at each epoch, so every source must be repeatable and
deterministic: the same documents in the same order on every rank and every run.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import sysconfig
from collections.abc import Callable, Iterator

from titanlite.config import RAW_DATASETS as DATASETS  # named once, in config/training.py

STDLIB_SPLITS = ("train", "validation")

# Every Nth standard-library file (in sorted order) is held out as the validation split.
STDLIB_VALIDATION_EVERY = 50
# Third-party packages live under the stdlib root on many installs; they differ per machine.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEXT_FILE_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")

# torchtitan 0.2's dataset names, read from the same places torchtitan reads them so that its
# TOML files carry over: c4 and c4_validation are the "en" configuration of allenai/c4 on the
# Hub (train and validation splits, streamed); c4_test is a small local sample of it, JSON
# lines with a "text" field in a folder, at torchtitan's path unless dataset_path says otherwise.
C4_HUB_NAME = "allenai/c4"
C4_CONFIG_NAME = "en"
C4_TEST_DEFAULT_PATH = "tests/assets/c4_test"
C4_TEST_SUFFIXES = (".json", ".jsonl", ".jsonl.gz")


# --------------------------------------------------------------------------- python_stdlib


@functools.cache
def _stdlib_python_files(stdlib_root: str) -> tuple[str, ...]:
    """Relative paths of all .py files under the stdlib root, sorted; cached since epochs re-list."""
    relative_paths = []
    for folder, subfolders, file_names in os.walk(stdlib_root):
        subfolders[:] = [name for name in subfolders if name not in _STDLIB_EXCLUDED_DIRS]
        for file_name in file_names:
            if file_name.endswith(".py"):
                full_path = os.path.join(folder, file_name)
                relative_paths.append(os.path.relpath(full_path, stdlib_root).replace(os.sep, "/"))
    return tuple(sorted(relative_paths))


def stdlib_split_files(split: str) -> list[str]:
    """Relative paths of the standard-library files that belong to ``split``."""
    if split not in STDLIB_SPLITS:
        raise ValueError(f"python_stdlib split {split!r}: expected one of {', '.join(STDLIB_SPLITS)}")
    stdlib_root = sysconfig.get_paths()["stdlib"]
    want_validation = split == "validation"
    return [
        relative_path
        for index, relative_path in enumerate(_stdlib_python_files(stdlib_root))
        if (index % STDLIB_VALIDATION_EVERY == 0) == want_validation
    ]


def python_stdlib_documents(split: str) -> Iterator[str]:
    """The Python standard library's own source files as documents (built in, no download)."""
    stdlib_root = sysconfig.get_paths()["stdlib"]
    relative_paths = stdlib_split_files(split)  # validates split before the generator starts
    return _read_stdlib_files(stdlib_root, relative_paths)


def _read_stdlib_files(stdlib_root: str, relative_paths: list[str]) -> Iterator[str]:
    for relative_path in relative_paths:
        try:
            with open(os.path.join(stdlib_root, relative_path), "rb") as source_file:
                text = source_file.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            # A few stdlib test fixtures are deliberately not UTF-8; unreadable files are skipped too.
            continue
        if text.strip():  # empty __init__.py files would only add BOS/EOS pairs
            yield text


# --------------------------------------------------------------------------- text files


def list_text_files(path: str, suffixes: tuple[str, ...] = _TEXT_FILE_SUFFIXES) -> list[str]:
    """The files at ``path`` (a file, or a folder searched recursively) whose names end in ``suffixes``."""
    wanted = ", ".join(suffixes[:-1]) + " or " + suffixes[-1]
    if os.path.isfile(path):
        if not path.endswith(suffixes):
            raise ValueError(f"dataset_path {path}: expected a {wanted} file")
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"dataset_path {path}: no such file or folder")
    found = []
    for folder, _, file_names in os.walk(path):
        found.extend(os.path.join(folder, name) for name in file_names if name.endswith(suffixes))
    if not found:
        raise ValueError(f"dataset_path {path}: folder has no {wanted} files")
    # Sort by path relative to the root so the order is the same wherever the folder lives.
    return sorted(found, key=lambda file_path: os.path.relpath(file_path, path).replace(os.sep, "/"))


def _read_txt_document(file_path: str) -> str:
    try:
        with open(file_path, encoding="utf-8") as text_file:
            return text_file.read()
    except UnicodeDecodeError:
        raise ValueError(f"{file_path}: file is not valid UTF-8 text") from None


def _read_jsonl_documents(file_path: str) -> Iterator[str]:
    opener = gzip.open if file_path.endswith(".gz") else open
    try:
        with opener(file_path, "rt", encoding="utf-8") as jsonl_file:
            for line_number, line in enumerate(jsonl_file, start=1):
                if line.strip():  # tolerate blank lines, e.g. a trailing newline
                    yield _text_field(line, file_path, line_number)
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        # A truncated or non-gzip .gz file, or bytes that are not UTF-8.
        raise ValueError(f"{file_path}: cannot read as UTF-8 JSON lines ({error})") from None


def _text_field(line: str, file_path: str, line_number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError(f"{file_path}:{line_number}: line is not valid JSON") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{file_path}:{line_number}: expected a JSON object with a string 'text' field")
    return record["text"]


def text_file_documents(path: str, suffixes: tuple[str, ...] = _TEXT_FILE_SUFFIXES) -> Iterator[str]:
    """Documents from .txt files (one per file) and JSON-lines files (.json, .jsonl, .jsonl.gz:
    one per line, 'text'), of those whose names end in ``suffixes``."""
    file_paths = list_text_files(path, suffixes)  # listed now so a bad path fails at the call, not later
    return _read_text_files(file_paths)


def _read_text_files(file_paths: list[str]) -> Iterator[str]:
    for file_path in file_paths:
        if file_path.endswith(".txt"):
            yield _read_txt_document(file_path)
        else:
            yield from _read_jsonl_documents(file_path)


# --------------------------------------------------------------------------- Hugging Face


def huggingface_documents(path: str, split: str, config_name: str | None = None) -> Iterator[str]:
    """The 'text' field of a Hugging Face dataset, streamed so nothing is downloaded up front."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"dataset_path {path}: the 'datasets' package is needed to read Hugging Face datasets "
            "(pip install datasets)"
        ) from None
    records = datasets.load_dataset(path, name=config_name, split=split, streaming=True)
    return _text_fields(records, path)


def _text_fields(records, path: str) -> Iterator[str]:
    for index, record in enumerate(records):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"dataset_path {path}: record {index} has no string 'text' field")
        yield text


# --------------------------------------------------------------------------- builder


def build_documents(dataset: str, dataset_path: str | None, split: str = "train") -> Callable[[], Iterator[str]]:
    """A zero-argument callable that yields the documents from the beginning each time it is called.

    ``split`` selects the python_stdlib, huggingface and c4 split; text and c4_test have no
    splits (point dataset_path at another folder for validation data), and c4_validation is
    always allenai/c4's validation split.
    """
    if dataset == "python_stdlib":
        # dataset_path is ignored: the corpus is whatever Python is running.
        stdlib_split_files(split)  # validate the split name now
        open_documents = functools.partial(python_stdlib_documents, split)
        description = f"python_stdlib split {split!r}"
    elif dataset in ("text", "huggingface"):
        if not dataset_path:
            raise ValueError(f"dataset {dataset!r}: dataset_path is required")
        if dataset == "text":
            open_documents = functools.partial(text_file_documents, dataset_path)
            description = f"dataset_path {dataset_path}"
        else:
            open_documents = functools.partial(huggingface_documents, dataset_path, split)
            description = f"dataset_path {dataset_path} split {split!r}"
    elif dataset in ("c4", "c4_validation"):
        hub_path = dataset_path or C4_HUB_NAME
        c4_split = "validation" if dataset == "c4_validation" else split
        open_documents = functools.partial(huggingface_documents, hub_path, c4_split, C4_CONFIG_NAME)
        description = f"dataset {dataset} ({hub_path}, {C4_CONFIG_NAME!r}, split {c4_split!r})"
    elif dataset == "c4_test":
        folder = dataset_path or C4_TEST_DEFAULT_PATH
        open_documents = functools.partial(text_file_documents, folder, C4_TEST_SUFFIXES)
        description = f"dataset c4_test at {folder}"
    else:
        raise ValueError(f"dataset {dataset!r}: expected one of {', '.join(DATASETS)}")
    _require_a_document(open_documents, description)
    return open_documents


def _require_a_document(open_documents: Callable[[], Iterator[str]], description: str) -> None:
    """Fail before training starts if the source is empty (and surface path errors now)."""
    documents = open_documents()
    try:
        next(iter(documents))
    except StopIteration:
        raise ValueError(f"{description}: dataset has no documents") from None
    finally:
        close = getattr(documents, "close", None)
        if close is not None:
            close()
