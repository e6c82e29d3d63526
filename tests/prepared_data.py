"""Small corpora and prepared folders for the data tests."""

import json
import os
import random
from pathlib import Path

from titanlite.data.prepare import prepare

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")


def make_documents(seed: int, count: int, max_words: int = 40) -> list[str]:
    """``count`` documents of 0 to ``max_words`` words (some empty, some non-ASCII), reproducibly."""
    generator = random.Random(seed)
    documents = []
    for index in range(count):
        words = [generator.choice(WORDS) for _ in range(generator.randint(0, max_words))]
        documents.append(f"{seed}.{index} " * (index % 3 == 0) + " ".join(words) + (" ✓" if index % 7 == 0 else ""))
    return documents


def write_jsonl(path: Path, documents: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents), encoding="utf-8")
    return path


def prepare_documents(
    folder: Path, documents: list[str], shard_tokens: int = 1000, workers: int = 1, hf_assets_path: str | None = None
) -> Path:
    """``documents`` as JSON lines beside ``folder``, prepared into ``folder``."""
    source = write_jsonl(folder.parent / f"{folder.name}-source" / "part.jsonl", documents)
    prepare(
        "text",
        str(source),
        str(folder),
        hf_assets_path=hf_assets_path,
        workers=workers,
        shard_tokens=shard_tokens,
        progress=False,
    )
    return folder


def exit_abruptly(*args) -> None:
    """Stands in for a worker's task: the process ends at once, as one killed by the kernel does."""
    os._exit(1)
