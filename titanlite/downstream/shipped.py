"""The tasks titanlite ships, written for it and generated here from a fixed seed (no file, no
download; ``python -m titanlite.downstream.shipped NAME`` prints one as JSONL). Both test what
a model trained on Python source (the built-in corpus, python_stdlib) picks up early, with
four choices an item (chance: 25%):

    python_keywords  complete a statement's keyword, spelled right, against three misspellings
                     ("def f(x):\\n    " -> "return x" | "retrun x" | ...)
    python_brackets  close the brackets an expression left open, in the right order and number
                     ("print(len(items" -> "))" | ")" | ")))" | "])")
"""

import json
import random
import sys

from titanlite.downstream.tasks import Item, Task

# (context, the statement's correct start): contexts of everyday Python.
_KEYWORD_STATEMENTS = [
    ("def area(width, height):\n    ", "return width * height"),
    ("for line in lines:\n    if not line:\n        ", "continue"),
    ("while True:\n    item = queue.get()\n    if item is None:\n        ", "break"),
    ("def check(value):\n    if value < 0:\n        ", "raise ValueError(value)"),
    ("", "import os"),
    ("", "from collections import defaultdict"),
    ("class Node:\n    ", "def __init__(self, value):"),
    ("try:\n    data = read()\n", "except OSError:"),
    ("try:\n    handle = open(path)\n", "finally:"),
    ("if count > 10:\n    size = 'large'\n", "elif count > 5:"),
    ("if ready:\n    start()\n", "else:"),
    ("", "with open(path) as file:"),
    ("def items(self):\n    for key in self.keys:\n        ", "yield key, self[key]"),
    ("def total(values):\n    result = 0\n    ", "for value in values:"),
    ("", "class Parser:"),
    ("def reset(self):\n    ", "pass"),
    ("def run():\n    ", "global counter"),
    ("def outer():\n    count = 0\n    def inner():\n        ", "nonlocal count"),
    ("", "assert isinstance(name, str)"),
    ("values = [1, 2, 3]\n", "del values[0]"),
    ("", "lambda x: x + 1"),
    ("async def fetch(url):\n    ", "await session.get(url)"),
    ("", "async def main():"),
    ("result = value if value is not None ", "else default"),
    ("names = [name for name ", "in names if name]"),
    ("if key ", "not in table:"),
    ("if value ", "is None:"),
    ("ok = first ", "and second"),
    ("ok = first ", "or second"),
    ("", "print(len(items))"),
]

# Expressions with open brackets (the closing string is derived from them).
_BRACKET_CALLS = ["print", "len", "sorted", "list", "str", "int", "max", "min", "sum", "tuple", "set", "abs"]
_BRACKET_NAMES = ["items", "values", "names", "data", "line", "text", "count", "rows", "keys", "parts"]
_CLOSE = {"(": ")", "[": "]"}


def _misspell(word: str, rng: random.Random) -> str:
    """The word with two neighbouring letters swapped, or one letter doubled or dropped."""
    letters = [index for index, char in enumerate(word) if char.isalpha()]
    index = rng.choice(letters[:-1]) if len(letters) > 1 else letters[0]
    kind = rng.randrange(3)
    if kind == 0 and word[index + 1 : index + 2].isalpha() and word[index] != word[index + 1]:
        return word[:index] + word[index + 1] + word[index] + word[index + 2 :]
    if kind == 1:
        return word[:index] + word[index] + word[index:]
    return word[:index] + word[index + 1 :]


def python_keywords(seed: int = 0, size: int = 300) -> Task:
    rng, items = random.Random(seed), []
    for number in range(size):
        context, statement = _KEYWORD_STATEMENTS[number % len(_KEYWORD_STATEMENTS)]
        keyword, _, rest = statement.partition(" ")
        wrong = set()
        while len(wrong) < 3:
            spelled = _misspell(keyword, rng)
            if spelled != keyword:
                wrong.add(spelled + (" " + rest if rest else ""))
        choices = sorted(wrong) + [statement]
        rng.shuffle(choices)
        items.append(Item(context, tuple(choices), choices.index(statement), f"keywords-{number}"))
    return Task("python_keywords", tuple(items))


def python_brackets(seed: int = 0, size: int = 300) -> Task:
    rng, items = random.Random(seed), []
    for number in range(size):
        depth = rng.randint(1, 3)
        calls = [rng.choice(_BRACKET_CALLS) for _ in range(depth)]
        opened = ["(" for _ in calls]
        expression = "".join(f"{call}(" for call in calls)
        if rng.random() < 0.4:  # an index inside
            expression, opened = expression + f"{rng.choice(_BRACKET_NAMES)}[{rng.randrange(10)}", opened + ["["]
        else:
            expression += rng.choice(_BRACKET_NAMES)
        right = "".join(_CLOSE[bracket] for bracket in reversed(opened))
        wrong = {right[:-1], right + ")", right[::-1], right.replace(")", "]", 1)} - {right, ""}
        choices = sorted(wrong)[:3]
        while len(choices) < 3:
            choices.append(right + "]" * (len(choices) + 1))
        choices.append(right)
        rng.shuffle(choices)
        items.append(Item(expression, tuple(choices), choices.index(right), f"brackets-{number}"))
    return Task("python_brackets", tuple(items))


SHIPPED = {"python_keywords": python_keywords, "python_brackets": python_brackets}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SHIPPED:
        print(f"usage: python -m titanlite.downstream.shipped {{{','.join(SHIPPED)}}}", file=sys.stderr)
        return 2
    for item in SHIPPED[argv[0]]().items:
        print(json.dumps({"id": item.id, "context": item.context, "choices": list(item.choices), "label": item.label}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
