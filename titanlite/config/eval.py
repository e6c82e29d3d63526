"""The [eval] section: downstream multiple-choice evaluation during training."""

from dataclasses import dataclass, field

from titanlite.config.ranges import MINUS_ONE_OR_POSITIVE, at_least, ranged


@dataclass
class Eval:
    enable: bool = False
    """Score multiple-choice tasks every `freq` steps and after the last one; training itself is left exactly as it
    would be without (weights, data position, random state)."""

    freq: int = ranged(at_least(1), default=100)
    """Evaluate every this many training steps (and after the last one)."""

    tasks: list[str] = field(default_factory=lambda: ["python_keywords"])
    """Shipped task names (python_keywords, python_brackets: docs/eval.md) and/or paths to JSONL files of
    {"context": str, "choices": [str, ...], "label": int} lines (an optional "id")."""

    limit: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Items per task, the first ones of its file; -1 for all."""

    num_fewshot: int = ranged(at_least(0), default=0)
    """Solved items of the same task put before each item's context (the first ones that are not the item itself)."""

    local_batch_size: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Rows (one per choice) per rank per forward; -1 means training.local_batch_size."""
