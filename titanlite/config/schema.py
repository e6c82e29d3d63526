"""What the parser, the torchtitan key mapping and validation share: the sections and keys
as the section files define them, how a type and a value are written in messages, and
ConfigError with its unknown-name wording."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from titanlite.config.job_config import JobConfig
from titanlite.errors import closest_name


class ConfigError(ValueError):
    """A bad configuration value, key or file, described in one line."""

    def __init__(self, message: str) -> None:
        # Callers print this after a fixed prefix on a single stderr line, so
        # any line break that sneaks in through a quoted value is folded here.
        super().__init__(" ".join(message.splitlines()))


# ---------------------------------------------------------------------------
# Sections, keys and their types, read from JobConfig and its sections
# ---------------------------------------------------------------------------


def _is_group(cls: type) -> bool:
    """A level of TOML tables holding only sections (JobConfig's quantize: [quantize.linear.float8])."""
    hints = typing.get_type_hints(cls)
    return all(dataclasses.is_dataclass(hints[f.name]) for f in dataclasses.fields(cls))


def _sections_under(prefix: str, cls: type) -> Iterator[tuple[str, type]]:
    for f in dataclasses.fields(cls):
        name, field_cls = f"{prefix}{f.name}", typing.get_type_hints(cls)[f.name]
        if _is_group(field_cls):
            yield from _sections_under(f"{name}.", field_cls)
        else:
            yield name, field_cls


@functools.cache
def section_classes() -> dict[str, type]:
    """Section name -> section dataclass, in JobConfig's field order. A section below a level
    of tables is named by its whole path ('quantize.linear.float8')."""
    return dict(_sections_under("", JobConfig))


@functools.cache
def top_level_sections() -> frozenset[str]:
    """The first part of every section's name: the tables a TOML file has at its top."""
    return frozenset(name.partition(".")[0] for name in section_classes())


def section_of(config: JobConfig, section_name: str) -> Any:
    """The section dataclass ``section_name`` names in ``config``."""
    return functools.reduce(getattr, section_name.split("."), config)


@functools.cache
def key_types() -> dict[str, Any]:
    """'section.key' -> type hint, for every key of every section."""
    hints_by_key = {}
    for section_name, section_cls in section_classes().items():
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            hints_by_key[f"{section_name}.{f.name}"] = hints[f.name]
    return hints_by_key


@functools.cache
def field_docstrings(section_cls: type) -> dict[str, str]:
    """Field name -> the string literal written right below that field, as one line.

    A docstring wrapped over several lines in its section's file reads as the same text
    written on one line, so --help does not depend on where the source breaks it."""
    class_node = ast.parse(textwrap.dedent(inspect.getsource(section_cls))).body[0]
    docs = {}
    for statement, following in itertools.pairwise(class_node.body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def get_value(config: JobConfig, dotted_key: str) -> Any:
    section_name, _, key = dotted_key.rpartition(".")
    return getattr(section_of(config, section_name), key)


def set_value(config: JobConfig, dotted_key: str, value: Any) -> None:
    section_name, _, key = dotted_key.rpartition(".")
    setattr(section_of(config, section_name), key, value)


# ---------------------------------------------------------------------------
# Types and values as messages write them
# ---------------------------------------------------------------------------


def type_name(hint: Any) -> str:
    """How a type is spelled in help text and in error messages."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + "|".join(typing.get_args(hint))
    if origin is list:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    if optional_inner(hint) is not None:
        return f"{type_name(optional_inner(hint))} or none"
    return hint.__name__


def optional_inner(hint: Any) -> Any:
    """X for a hint `X | None`, else None."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    not_none = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return not_none[0] if len(not_none) == 1 else None


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    quoted = []
    for char in text:
        if char in escapes:
            quoted.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:  # TOML forbids raw control characters.
            quoted.append(f"\\u{ord(char):04x}")
        else:
            quoted.append(char)
    return '"' + "".join(quoted) + '"'


def toml_value(value: Any) -> str:
    """``value`` written as TOML writes it (error messages quote values this way too)."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ---------------------------------------------------------------------------
# Unknown names
# ---------------------------------------------------------------------------


def closest_key(dotted_key: str) -> str | None:
    """Best guess at the key meant by an unknown 'section.key'."""
    bare_key = dotted_key.rpartition(".")[2]
    # A right key in the wrong section ([training] lr) is the most likely slip.
    same_key_elsewhere = [k for k in key_types() if k.rpartition(".")[2] == bare_key]
    if same_key_elsewhere:
        return same_key_elsewhere[0]
    return closest_name(dotted_key, key_types())


def unknown_name_error(what: str, source: str, suggestion: str | None) -> ConfigError:
    """'unknown WHAT SOURCE; did you mean ...?', or a pointer to --help when nothing is close."""
    hint = f"did you mean '{suggestion}'?" if suggestion else "see --help for the valid names"
    return ConfigError(f"unknown {what} {source}; {hint}")
