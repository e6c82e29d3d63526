"""From a run's data settings to its window source: what the trainer calls.

    windows = open_windows("prepared", "data/web:0.7,data/code:0.3", tokenizer, seq_len=2048,
                           hf_assets_path=..., shuffle=True, seed=0, cache_folder="~/.cache/titanlite")

* ``prepared``: one prepared folder, or several with weights, ``"FOLDER:WEIGHT,FOLDER:WEIGHT"``.
* ``python_stdlib`` (the built-in corpus): prepared with the run's tokenizer into
  ``cache_folder`` on first use, then read like any prepared folder.
* every other dataset: a raw stream, tokenized as it is read (``stream.py``).
"""

from __future__ import annotations

import os
from fractions import Fraction

from .loader import PreparedWindows
from .prepared import PreparedFolder
from .sources import build_documents
from .stream import StreamWindows

# A raw stream makes every rank tokenize the whole stream: from this dp degree on, that is
# at least this many times a rank's own share, worth a warning.
STREAM_WARNING_DP_DEGREE = 4


def parse_mixture(spec: str, key: str = "training.dataset_path") -> list[tuple[str, Fraction]]:
    """``"FOLDER"`` or ``"FOLDER:WEIGHT,FOLDER:WEIGHT,..."`` -> [(folder, weight)], weights > 0."""
    entries = [entry.strip() for entry in spec.split(",")]
    if len(entries) == 1 and ":" not in entries[0]:
        return [(entries[0], Fraction(1))]
    mixture = []
    for entry in entries:
        folder, separator, weight_text = entry.rpartition(":")
        if not separator or not folder:
            raise ValueError(f"{key} {spec!r}: entry {entry!r} is not FOLDER:WEIGHT")
        try:
            weight = Fraction(weight_text.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{key} {spec!r}: weight {weight_text!r} of {folder} is not a number") from None
        if weight <= 0:
            raise ValueError(f"{key} {spec!r}: weight {weight_text} of {folder} must be > 0")
        mixture.append((folder.strip(), weight))
    folders = [folder for folder, _ in mixture]
    if len(set(folders)) != len(folders):
        raise ValueError(f"{key} {spec!r}: a folder is named twice")
    return mixture


def open_prepared(
    spec: str,
    tokenizer,
    tokenizer_label: str,
    seq_len: int,
    shuffle: bool,
    seed: int,
    key: str = "training.dataset_path",
    section: str = "training",
) -> PreparedWindows:
    mixture = parse_mixture(spec, key)
    folders = []
    for folder_path, _ in mixture:
        folder = PreparedFolder(folder_path, key)
        folder.check_tokenizer(tokenizer, tokenizer_label)
        folders.append(folder)
    weights = [weight for _, weight in mixture]
    return PreparedWindows(folders, weights, seq_len, shuffle, seed, seq_len_key=f"{section}.seq_len")


def open_windows(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    seq_len: int,
    *,
    hf_assets_path: str | None,
    shuffle: bool,
    seed: int,
    cache_folder: str,
    split: str = "train",
    section: str = "training",
):
    """The window source for a run; every problem is a one-line ValueError naming the key or file.
    ``section`` is the config section the dataset keys belong to (training or validation)."""
    tokenizer_label = f"model.hf_assets_path {hf_assets_path}" if hf_assets_path else "the byte tokenizer"
    if dataset == "prepared":
        key = f"{section}.dataset_path"
        if not dataset_path:
            raise ValueError(f"{key}: the prepared folder (or FOLDER:WEIGHT,... mixture) is required")
        return open_prepared(dataset_path, tokenizer, tokenizer_label, seq_len, shuffle, seed, key, section)
    if dataset == "python_stdlib":
        from .prepare import cached_stdlib  # here, not at the top: see the package docstring

        folder = cached_stdlib(split, tokenizer, hf_assets_path, cache_folder)
        return open_prepared(folder, tokenizer, tokenizer_label, seq_len, shuffle, seed, "data.cache_folder", section)
    documents = build_documents(dataset, dataset_path, split)
    path = os.path.abspath(dataset_path) if dataset_path and os.path.exists(dataset_path) else dataset_path
    return StreamWindows(documents, tokenizer, seq_len, {"dataset": dataset, "dataset_path": path, "split": split})


def stream_warning(windows, dataset: str, dp_degree: int, section: str = "training") -> str | None:
    """The warning a raw stream of ``section``.dataset deserves at this dp degree, or None."""
    if not isinstance(windows, StreamWindows) or dp_degree < STREAM_WARNING_DP_DEGREE:
        return None
    return (
        f"{section}.dataset {dataset} is tokenized as it is read: every one of the {dp_degree} data-parallel "
        f"ranks tokenizes the whole stream, {dp_degree}x its own share. Prepare it once with "
        f"python -m titanlite.data.prepare and set {section}.dataset = 'prepared' (see docs/data.md)"
    )


def verify_share(windows, rank: int, world_size: int) -> str | None:
    """Check the SHA-256 of this rank's share of the prepared files (every world_size-th file,
    so the ranks together check each file once); the first mismatch as a message, or None."""
    if not isinstance(windows, PreparedWindows):
        return None
    files = [(folder, name) for folder in windows.folders for name in folder.file_names]
    for folder, name in files[rank::world_size]:
        error = folder.verify_checksums([name])
        if error is not None:
            return error
    return None
