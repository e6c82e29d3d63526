"""The values a config field may take: ``ranged`` keeps a Range in the field's metadata,
beside its default, and validation reads it from there once the whole config is merged.
The ranges several sections share are named here."""

from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """The values a field may take once the whole config is merged."""

    text: str
    """What is allowed, as an error message words it: 'training.steps must be >= 1, got 0'."""

    check: Callable[[Any], bool]
    """True for an allowed value."""


_RANGE_KEY = "range"


def ranged(allowed: Range, **field_args: Any) -> Any:
    """A dataclass field (dataclasses.field(**field_args)) whose value must lie in ``allowed``."""
    return field(metadata={_RANGE_KEY: allowed}, **field_args)


def field_range(config_field: Field) -> Range | None:
    """The range ``ranged`` gave a field, or None for a field any value of its type suits."""
    return config_field.metadata.get(_RANGE_KEY)


def at_least(low: int) -> Range:
    return Range(f">= {low}", lambda value: value >= low)


def subset_of(names: Sequence[str]) -> Range:
    return Range(f"a subset of {', '.join(names)}", lambda value: set(value) <= set(names))


POSITIVE = Range("> 0", lambda value: value > 0)
# -1 stands for a value worked out at run time (each such field's docstring says which).
MINUS_ONE_OR_POSITIVE = Range("-1 or >= 1", lambda value: value == -1 or value >= 1)
# -1 stands for "the newest".
MINUS_ONE_OR_AT_LEAST_ZERO = Range("-1 or >= 0", lambda value: value >= -1)
FRACTION = Range("in [0, 1]", lambda value: 0 <= value <= 1)
POSITIVE_OR_UNSET = Range("> 0 or unset", lambda value: value is None or value > 0)
AT_LEAST_ZERO_OR_UNSET = Range(">= 0 or unset", lambda value: value is None or value >= 0)
FRACTION_OR_UNSET = Range("in [0, 1] or unset", lambda value: value is None or 0 <= value <= 1)
# A decay of 1 would never move away from the first value.
FRACTION_BELOW_ONE = Range("in [0, 1)", lambda value: 0 <= value < 1)
