"""Build a JobConfig from dataclass defaults, a TOML file and command-line options, and write
one back out (--help, TOML, one value for a launch script).

Precedence is command line > TOML file > dataclass default. Every mistake a user
can make in either source is reported as a one-line ConfigError that names the
offending key or file, so a run fails before it allocates anything. Keys titanlite
does not define go to torchtitan_compat; the merged config goes through validation.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
import sys
import textwrap
import typing
from collections.abc import Iterator
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 has no tomllib; tomli is the same parser.
    import tomli as tomllib

from titanlite.config.job_config import JobConfig
from titanlite.config.schema import (
    ConfigError,
    closest_key,
    field_docstrings,
    get_value,
    key_types,
    optional_inner,
    section_classes,
    section_of,
    set_value,
    toml_value,
    type_name,
    unknown_name_error,
)
from titanlite.config.torchtitan_compat import (
    CLI_BOOL_WORDS,
    CLI_NONE_WORDS,
    closest_known_key,
    is_bool_key,
    is_known_key,
    is_known_section,
    torchtitan_key,
)
from titanlite.config.validation import validate
from titanlite.errors import closest_name

USAGE = (
    "usage: python -m titanlite.train [--job.config_file PATH] [--section.key VALUE ...]\n"
    "       python -m titanlite.config [same options]   (dry run: print the resolved config)"
)
HELP_INTRO = (
    "Values come from the TOML file given by --job.config_file, then from the command line;\n"
    "the command line wins. Options take --section.key VALUE or --section.key=VALUE.\n"
    "A boolean alone (--section.key) means true; lists are comma-separated (model,loss);\n"
    "'none' unsets an optional value."
)


# ---------------------------------------------------------------------------
# Converting one raw value (a CLI string or a TOML value) to its field type
# ---------------------------------------------------------------------------


class _Mismatch(Exception):
    """Raised by the converters below; the caller knows the key and source."""


def _to_bool(value: Any, from_cli: bool) -> bool:
    if from_cli and value.lower() in CLI_BOOL_WORDS:
        return value.lower() == "true"
    if not from_cli and isinstance(value, bool):
        return value
    raise _Mismatch


def _to_int(value: Any, from_cli: bool) -> int:
    if from_cli:
        try:
            return int(value)
        except ValueError:
            raise _Mismatch from None
    # bool is a subclass of int, so `true` would otherwise pass as 1.
    if type(value) is int:
        return value
    raise _Mismatch


def _to_float(value: Any, from_cli: bool) -> float:
    if not from_cli and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _Mismatch
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise _Mismatch from None
    # nan slips past every range check (all comparisons are false), so refuse it here.
    if not math.isfinite(number):
        raise _Mismatch
    return number


def _to_str(value: Any, from_cli: bool) -> str:
    if isinstance(value, str):
        return value
    raise _Mismatch


def _convert(value: Any, hint: Any, from_cli: bool) -> Any:
    """Return `value` as type `hint`; CLI values arrive as strings, TOML values typed."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if isinstance(value, str) and value in typing.get_args(hint):
            return value
        raise _Mismatch
    if origin is list:
        if from_cli:
            # A list of lists is written "a,b;c": ';' between the outer items.
            separator = ";" if typing.get_origin(typing.get_args(hint)[0]) is list else ","
            items = [item.strip() for item in value.split(separator) if item.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise _Mismatch
        return [_convert(item, typing.get_args(hint)[0], from_cli) for item in items]
    inner = optional_inner(hint)
    if inner is not None:
        # TOML has no null: an unset optional is simply left out of the file.
        if from_cli and value.strip().lower() in CLI_NONE_WORDS:
            return None
        return _convert(value, inner, from_cli)
    scalar_converters = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
    if hint not in scalar_converters:
        raise TypeError(f"a config section uses a field type the parser does not know: {hint!r}")
    return scalar_converters[hint](value, from_cli)


def _convert_for_key(key: str, value: Any, source: str, from_cli: bool) -> Any:
    hint = key_types()[key]
    try:
        return _convert(value, hint, from_cli)
    except _Mismatch:
        given = repr(value) if from_cli else f"{toml_value(value)} ({type(value).__name__})"
        raise ConfigError(f"{key} {source} expects {type_name(hint)}, got {given}") from None


# ---------------------------------------------------------------------------
# The TOML file
# ---------------------------------------------------------------------------


def _load_toml_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as toml_file:
            return tomllib.load(toml_file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (from --job.config_file)") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not valid UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        # The parser's message ends with "(at line N, column M)".
        raise ConfigError(f"invalid TOML in {path}: {_named_twice(path, str(error)) or error}") from None


_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)$")
_DECLARED_TWICE = re.compile(r"^Cannot declare \((.*)\) twice")
_TABLE_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(r"^\s*([A-Za-z0-9_\-\.\s\"']+?)\s*=")


def _named_twice(path: str, message: str) -> str | None:
    """tomllib's "Cannot overwrite a value (at line N, ...)" as the key the file sets twice
    ("training.steps is set twice (line N)", read from line N and the table above it), and
    its "Cannot declare ('training',) twice" as the table; None for any other error."""
    at_line = _AT_LINE.search(message)
    if at_line is None:
        return None
    line_number = int(at_line.group(1))
    declared = _DECLARED_TWICE.match(message)
    if declared:
        table = ".".join(ast.literal_eval(f"({declared.group(1)})"))
        return f"[{table}] is declared twice (line {line_number}); give each table once"
    if not message.startswith("Cannot overwrite a value"):
        return None
    with open(path, encoding="utf-8") as toml_file:
        lines = toml_file.read().splitlines()[:line_number]
    key = _KEY_LINE.match(lines[-1]) if lines else None
    if key is None:
        return None
    headers = (_TABLE_HEADER.match(line) for line in reversed(lines[:-1]))
    table = next((header.group(1) for header in headers if header), None)
    dotted = ".".join(part.strip().strip("\"'") for part in key.group(1).split("."))
    return f"{table + '.' if table else ''}{dotted} is set twice (line {line_number}); set each key once"


def _flatten(prefix: str, table: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """('prefix.key', value) for every leaf of a nested TOML table ([quantize.linear.float8])."""
    for key, value in table.items():
        dotted_key = f"{prefix}.{key}"
        if isinstance(value, dict) and not is_known_key(dotted_key):
            yield from _flatten(dotted_key, value)
        else:
            yield dotted_key, value


def _apply_toml(config: JobConfig, toml_data: dict[str, Any], path: str, warnings: dict[str, str]) -> None:
    source = f"in {path}"
    for section_name, table in toml_data.items():
        if not is_known_section(section_name):
            # A top-level `steps = 5` is most likely a key that lost its [section].
            suggestion = closest_name(section_name, section_classes()) or closest_key(section_name)
            raise unknown_name_error(f"section '{section_name}'", source, suggestion)
        if not isinstance(table, dict):
            raise ConfigError(f"'{section_name}' {source} must be a table ([{section_name}]), got {toml_value(table)}")
        for dotted_key, value in _flatten(section_name, table):
            if dotted_key not in key_types():
                dotted_key = torchtitan_key(dotted_key, value, source, path, False, warnings)
                if dotted_key is None:
                    continue
            set_value(config, dotted_key, _convert_for_key(dotted_key, value, source, from_cli=False))


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    """Turn argv into (dotted key, raw value text) pairs, in order."""
    pairs = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--"):
            raise ConfigError(
                f"unexpected argument '{token}' on the command line; options look like --section.key VALUE"
            )
        key, has_equals, inline_value = token[2:].partition("=")
        if not is_known_key(key):
            suggestion = closest_known_key(key)
            raise unknown_name_error(f"option '--{key}'", "on the command line", suggestion and f"--{suggestion}")
        next_token = argv[index + 1] if index + 1 < len(argv) else None
        if has_equals:
            value, index = inline_value, index + 1
        elif is_bool_key(key):
            # A bare boolean flag means true; an explicit true/false may follow it.
            if next_token is not None and next_token.lower() in CLI_BOOL_WORDS:
                value, index = next_token, index + 2
            else:
                value, index = "true", index + 1
        elif next_token is None or next_token.startswith("--"):
            raise ConfigError(f"option --{key} on the command line is missing its value")
        else:
            value, index = next_token, index + 2
        pairs.append((key, value))
    return pairs


def _config_file_from_cli(cli_pairs: list[tuple[str, str]]) -> str | None:
    """The TOML path named by the last --job.config_file, if any."""
    path = None
    for key, value in cli_pairs:
        if key == "job.config_file":
            path = _convert_for_key(key, value, "on the command line", from_cli=True)
    return path


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def parse_args_with_warnings(argv: list[str] | None = None) -> tuple[JobConfig, list[str]]:
    """parse_args, also returning the warning lines for torchtitan keys titanlite ignores or
    renames (one line per key) instead of printing them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help())
        raise SystemExit(0)
    cli_pairs = _split_cli(argv)
    config = JobConfig()
    warnings: dict[str, str] = {}
    config_file = _config_file_from_cli(cli_pairs)
    if config_file is not None:
        _apply_toml(config, _load_toml_file(config_file), config_file, warnings)
    for key, value in cli_pairs:
        if key not in key_types():
            key = torchtitan_key(key, value, "on the command line", "command line", True, warnings)
            if key is None:
                continue
        set_value(config, key, _convert_for_key(key, value, "on the command line", from_cli=True))
    validate(config)
    return config, list(warnings.values())


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Return the JobConfig for `argv` (default: sys.argv[1:]); raise ConfigError if it is bad.

    torchtitan 0.2 keys that titanlite ignores or renames print one warning line each on
    stderr, from rank 0 only (RANK unset counts as rank 0), once the whole config is valid,
    and not again after run_train.sh's preflight showed them (TITANLITE_CONFIG_WARNINGS_SHOWN).
    """
    config, warnings = parse_args_with_warnings(argv)
    show_config_warnings(warnings)
    return config


def show_config_warnings(lines: list[str]) -> None:
    """Print a config's warning lines on stderr, from rank 0 only (RANK unset counts as
    rank 0), and not again after run_train.sh's preflight showed them."""
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("TITANLITE_CONFIG_WARNINGS_SHOWN"):
        for line in lines:
            print(line, file=sys.stderr)


def parse_args_or_exit(argv: list[str] | None = None) -> JobConfig:
    """parse_args, but a ConfigError becomes one stderr line and exit status 2."""
    try:
        return parse_args(argv)
    except ConfigError as error:
        print(f"titanlite: config error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def value_text(config: JobConfig, dotted_key: str) -> str:
    """One key's value written as on the command line (300, true, model,loss, none), for
    launch scripts that read a setting with `python -m titanlite.config --get KEY`."""
    if dotted_key not in key_types():
        raise unknown_name_error(f"key '{dotted_key}'", "for --get", closest_key(dotted_key))
    return _show_default(get_value(config, dotted_key))


def _show_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def format_help() -> str:
    """Usage, then every section with what it holds, and each key's type, default and docstring."""
    lines = [USAGE, "", HELP_INTRO]
    # What each of JobConfig's fields holds, once above its first section ([quantize] is a
    # level of tables above [quantize.linear.float8]).
    section_docs = dict(field_docstrings(JobConfig))  # a copy (the reader caches): shown ones are popped
    for section_name, section_cls in section_classes().items():
        defaults = section_cls()
        docs = field_docstrings(section_cls)
        lines += ["", f"[{section_name}]"]
        section_doc = section_docs.pop(section_name.partition(".")[0], "")
        lines += textwrap.wrap(section_doc, width=88, initial_indent="  ", subsequent_indent="  ")
        for f in dataclasses.fields(section_cls):
            shown_type = type_name(key_types()[f"{section_name}.{f.name}"])
            default = _show_default(getattr(defaults, f.name))
            lines.append(f"  --{section_name}.{f.name}  ({shown_type}, default: {default})")
            doc = docs.get(f.name, "")
            lines += textwrap.wrap(doc, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for every key, unset optionals included as None; a section
    below a level of tables nested as in TOML ({"quantize": {"linear": {"float8": {...}}}})."""
    return dataclasses.asdict(config)


def to_toml(config: JobConfig) -> str:
    """The config as TOML text that parses back to an equal JobConfig."""
    lines = []
    for section_name in section_classes():
        lines.append(f"[{section_name}]")
        for key, value in dataclasses.asdict(section_of(config, section_name)).items():
            # TOML has no null, and a left-out optional key reads back as unset.
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
