"""Multiple-choice tasks: one JSON object a line, {"context": str, "choices": [str, ...],
"label": int} with an optional "id"; and the token rows that score an item's choices.

A task is named by a path to such a file, or by the name of a task titanlite ships
(``shipped.py``, which says what each measures). A choice is scored by the sum of its tokens'
log-probabilities after the context, the tokens split as lm-evaluation-harness splits them:
the context's trailing spaces move to the choice, the pair is encoded whole, and the choice's
tokens are what follows the context's own encoding.
"""

import dataclasses
import json
from pathlib import Path

import torch

IGNORE_INDEX = -100  # a label the loss leaves out (torch's default ignore_index)


@dataclasses.dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int
    id: str


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    items: tuple[Item, ...]


def shipped_tasks() -> list[str]:
    from titanlite.downstream.shipped import SHIPPED

    return sorted(SHIPPED)


def _item(line: str, where: str, number: int) -> Item:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}: not a JSON object ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    context, choices, label = record.get("context"), record.get("choices"), record.get("label")
    if not isinstance(context, str):
        raise ValueError(f'{where}: "context" must be a string')
    if not isinstance(choices, list) or not all(isinstance(choice, str) for choice in choices):
        raise ValueError(f'{where}: "choices" must be a list of strings')
    if not choices:
        raise ValueError(f'{where}: "choices" is empty')
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise ValueError(f'{where}: "label" must be an integer from 0 to {len(choices) - 1}, got {label!r}')
    return Item(context, tuple(choices), label, str(record.get("id", number)))


def read_task(name_or_path: str, limit: int = -1) -> Task:
    """The task's first ``limit`` items (-1: all). ValueError, one line naming the file and the
    line, for a missing file or a malformed item."""
    from titanlite.downstream.shipped import SHIPPED

    path = Path(name_or_path)
    if name_or_path in SHIPPED and not path.exists():
        task = SHIPPED[name_or_path]()
        return Task(task.name, task.items if limit == -1 else task.items[:limit])
    if not path.is_file():
        raise ValueError(f"eval.tasks: {name_or_path}: no such file, nor a shipped task ({', '.join(shipped_tasks())})")
    items = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if limit != -1 and len(items) == limit:
                break
            if line.strip():
                items.append(_item(line, f"{path}:{number}", number))
    if not items:
        raise ValueError(f"eval.tasks: {path}: holds no item")
    return Task(path.stem, tuple(items))


def with_fewshot(task: Task, shots: int) -> Task:
    """Each item's context after ``shots`` solved items of the task (the first ones but itself)."""
    if shots == 0:
        return task
    solved = [f"{item.context}{item.choices[item.label]}\n\n" for item in task.items]
    items = []
    for index, item in enumerate(task.items):
        examples = [text for other, text in enumerate(solved) if other != index][:shots]
        items.append(dataclasses.replace(item, context="".join(examples) + item.context))
    return Task(task.name, tuple(items))


def split_pair(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context tokens, choice tokens), split as lm-evaluation-harness splits them."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, choice = context[:-spaces], context[-spaces:] + choice
    whole = tokenizer.encode(context + choice)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


def choice_row(tokenizer, context: str, choice: str, seq_len: int) -> tuple[list[int], list[int], bool]:
    """(inputs, labels, truncated) of one choice: [bos] + context + choice, cut from the left to
    seq_len + 1 tokens, the labels IGNORE_INDEX except at the choice's tokens."""
    context_ids, choice_ids = split_pair(tokenizer, context, choice)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    tokens = bos + context_ids + choice_ids
    truncated = len(tokens) > seq_len + 1
    tokens = tokens[-(seq_len + 1) :]
    scored = min(len(choice_ids), len(tokens) - 1)  # the choice's tokens that have a token before them
    inputs, labels = scored_row(tokens, scored)
    return inputs, labels, truncated


def scored_row(tokens: list[int], scored: int) -> tuple[list[int], list[int]]:
    """(inputs, labels) of a row whose last ``scored`` tokens are scored: the labels
    IGNORE_INDEX before them."""
    return tokens[:-1], [IGNORE_INDEX] * (len(tokens) - 1 - scored) + tokens[len(tokens) - scored :]


def padded_batch(rows: list[tuple[list[int], list[int]]], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) tensors of (inputs, labels) rows padded on the right to ``width``: pad
    token 0, label IGNORE_INDEX (a causal model's earlier positions never see the padding)."""
    inputs = torch.tensor([row + [0] * (width - len(row)) for row, _ in rows], device=device)
    labels = torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for _, row in rows], device=device)
    return inputs, labels
