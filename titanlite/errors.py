"""How titanlite words an error: one line, with a did-you-mean hint for a mistyped name.

Imports nothing from titanlite, so that every package may use it."""

import difflib
from collections.abc import Iterable


def one_line(error: BaseException, limit: int = 500) -> str:
    """``error``'s message as one line (whitespace collapsed, at most ``limit`` characters), or
    its type's name when it has no message."""
    text = " ".join(str(error).split())
    return text[:limit] if text else type(error).__name__


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The one name among ``choices`` that ``name`` most likely meant, or None."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> str:
    """ "KIND 'NAME' is not known (choose from A, B); did you mean 'A'?" (the hint when one is close)."""
    choices = list(choices)
    close = closest_name(name, choices)
    hint = f"; did you mean '{close}'?" if close else ""
    return f"{kind} '{name}' is not known (choose from {', '.join(choices)}){hint}"
