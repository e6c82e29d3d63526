"""How titanlite words an error: one line, with a did-you-mean hint for a mistyped name.

Imports nothing from titanlite, so that every package may use it."""

import difflib
import sys
import time
import traceback
from collections.abc import Iterable

# How long a rank that leaves a failure's line to rank 0 waits before it exits.
QUIET_RANK_EXIT_DELAY_SECONDS = 3


def one_line(error: BaseException, limit: int = 500) -> str:
    """``error``'s message as one line (whitespace collapsed, at most ``limit`` characters), or
    its type's name when it has no message."""
    text = " ".join(str(error).split())
    return text[:limit] if text else type(error).__name__


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The one name among ``choices`` that ``name`` most likely meant, or None. Closeness
    ignores case, so a name that differs from a choice in case alone gets that choice ('8b'
    means '8B': a difference of case in a two-letter name is too large a share for difflib
    otherwise), and 'gpipee' is close to 'GPipe'."""
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> str:
    """ "KIND 'NAME' is not known (choose from A, B); did you mean 'A'?" (the hint when one is close)."""
    choices = list(choices)
    close = closest_name(name, choices)
    hint = f"; did you mean '{close}'?" if close else ""
    return f"{kind} '{name}' is not known (choose from {', '.join(choices)}){hint}"


class NonFiniteError(RuntimeError):
    """A step produced NaN or inf gradients and no more skips were allowed."""


class DataError(RuntimeError):
    """The training data turned out to be unreadable after the run started."""


def collective_failure_line(error: BaseException, rank: int, step: int, flight_recorder_dump: str | None) -> str:
    """The line for a collective that failed on this rank: most often another rank died or
    hung, whose own log tells why; the error's first line and where NCCL's record went."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = "" if flight_recorder_dump is None else f"; NCCL flight recorder dump: {flight_recorder_dump}"
    return (
        f"titanlite: rank {rank}: a collective failed after step {step} (did another "
        f"rank die or hang? see its log): {first_line[:300]}{where}"
    )


def report_failure(line: str, status: int, printed: bool = True, show_traceback: bool = False) -> int:
    """Print a command's failure as ``line`` on stderr (and the traceback being handled, with
    ``show_traceback``); returns the exit ``status``. A rank whose line another rank prints
    passes ``printed=False``."""
    if printed:
        print(line, file=sys.stderr)
        if show_traceback:
            traceback.print_exc()
    else:
        # Rank 0 prints this same line. torchrun stops every rank as soon as one exits, so
        # a quicker exit here could kill rank 0 before it has printed.
        time.sleep(QUIET_RANK_EXIT_DELAY_SECONDS)
    return status
