"""Build a JobConfig from dataclass defaults, a TOML file and command-line options.

Precedence is command line > TOML file > dataclass default. Every mistake a user
can make in either source is reported as a one-line ConfigError that names the
offending key or file, so a run fails before it allocates anything.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 has no tomllib; tomli is the same parser.
    import tomli as tomllib

from titanlite.config import torchtitan_keys
from titanlite.config.job_config import CHECKPOINT_PARTS, JobConfig

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
CLI_NONE_WORDS = ("none", "null")
CLI_BOOL_WORDS = ("true", "false")
COMPILE_COMPONENTS = ("model", "loss")
# What a training checkpoint holds besides the model, by name (checkpoint.exclude_from_loading).


class ConfigError(ValueError):
    """A bad configuration value, key or file, described in one line."""

    def __init__(self, message: str) -> None:
        # Callers print this after a fixed prefix on a single stderr line, so
        # any line break that sneaks in through a quoted value is folded here.
        super().__init__(" ".join(message.splitlines()))


# ---------------------------------------------------------------------------
# The schema: sections, keys and their types, read from job_config.py
# ---------------------------------------------------------------------------


@functools.cache
def _section_classes() -> dict[str, type]:
    """Section name -> section dataclass, in JobConfig's field order."""
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


@functools.cache
def _key_types() -> dict[str, Any]:
    """'section.key' -> type hint, for every key of every section."""
    key_types = {}
    for section_name, section_cls in _section_classes().items():
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            key_types[f"{section_name}.{f.name}"] = hints[f.name]
    return key_types


@functools.cache
def field_docstrings(section_cls: type) -> dict[str, str]:
    """Field name -> the string literal written right below that field."""
    class_node = ast.parse(textwrap.dedent(inspect.getsource(section_cls))).body[0]
    docs = {}
    for statement, following in zip(class_node.body, class_node.body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _type_name(hint: Any) -> str:
    """How a type is spelled in help text and in error messages."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + "|".join(typing.get_args(hint))
    if origin is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if _optional_inner(hint) is not None:
        return f"{_type_name(_optional_inner(hint))} or none"
    return hint.__name__


def _optional_inner(hint: Any) -> Any:
    """X for a hint `X | None`, else None."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    not_none = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return not_none[0] if len(not_none) == 1 else None


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
            items = [item.strip() for item in value.split(",") if item.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise _Mismatch
        return [_convert(item, typing.get_args(hint)[0], from_cli) for item in items]
    inner = _optional_inner(hint)
    if inner is not None:
        # TOML has no null: an unset optional is simply left out of the file.
        if from_cli and value.strip().lower() in CLI_NONE_WORDS:
            return None
        return _convert(value, inner, from_cli)
    scalar_converters = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
    if hint not in scalar_converters:
        raise TypeError(f"job_config.py uses a field type the parser does not know: {hint!r}")
    return scalar_converters[hint](value, from_cli)


def _convert_for_key(key: str, value: Any, source: str, from_cli: bool) -> Any:
    hint = _key_types()[key]
    try:
        return _convert(value, hint, from_cli)
    except _Mismatch:
        given = repr(value) if from_cli else f"{_toml_value(value)} ({type(value).__name__})"
        raise ConfigError(f"{key} {source} expects {_type_name(hint)}, got {given}") from None


# ---------------------------------------------------------------------------
# Unknown names
# ---------------------------------------------------------------------------


def _closest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _closest_key(dotted_key: str) -> str | None:
    """Best guess at the key meant by an unknown 'section.key'."""
    bare_key = dotted_key.rpartition(".")[2]
    # A right key in the wrong section ([training] lr) is the most likely slip.
    same_key_elsewhere = [k for k in _key_types() if k.rpartition(".")[2] == bare_key]
    if same_key_elsewhere:
        return same_key_elsewhere[0]
    return _closest(dotted_key, list(_key_types()))


def _unknown_name_error(what: str, source: str, suggestion: str | None) -> ConfigError:
    hint = f"did you mean '{suggestion}'?" if suggestion else "see --help for the valid names"
    return ConfigError(f"unknown {what} {source}; {hint}")


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
        raise ConfigError(f"invalid TOML in {path}: {error}") from None


def _flatten(prefix: str, table: dict[str, Any]):
    """('prefix.key', value) for every leaf of a nested TOML table ([quantize.linear.float8])."""
    for key, value in table.items():
        dotted_key = f"{prefix}.{key}"
        if isinstance(value, dict) and dotted_key not in _key_types() and dotted_key not in torchtitan_keys.ALL_KEYS:
            yield from _flatten(dotted_key, value)
        else:
            yield dotted_key, value


def _apply_toml(config: JobConfig, toml_data: dict[str, Any], path: str, warnings: dict[str, str]) -> None:
    source = f"in {path}"
    for section_name, table in toml_data.items():
        torchtitan_section = section_name in torchtitan_keys.TORCHTITAN_SECTIONS
        if section_name not in _section_classes() and not torchtitan_section:
            # A top-level `steps = 5` is most likely a key that lost its [section].
            suggestion = _closest(section_name, list(_section_classes())) or _closest_key(section_name)
            raise _unknown_name_error(f"section '{section_name}'", source, suggestion)
        if not isinstance(table, dict):
            raise ConfigError(f"'{section_name}' {source} must be a table ([{section_name}]), got {_toml_value(table)}")
        for dotted_key, value in _flatten(section_name, table):
            if dotted_key not in _key_types():
                dotted_key = _torchtitan_key(dotted_key, value, source, path, False, warnings)
                if dotted_key is None:
                    continue
            _set(config, dotted_key, _convert_for_key(dotted_key, value, source, from_cli=False))


# ---------------------------------------------------------------------------
# torchtitan 0.2 keys titanlite does not implement (torchtitan_keys.py)
# ---------------------------------------------------------------------------


def _key_in_toml(dotted_key: str) -> str:
    """'quantize.linear.float8.recipe_name' -> '[quantize.linear.float8] recipe_name'."""
    table, _, key = dotted_key.rpartition(".")
    return f"[{table}] {key}"


def _torchtitan_cli_value(text: str, default: Any) -> Any:
    """A command-line string as the type of torchtitan's default, where it reads as one."""
    if text.strip().lower() in CLI_NONE_WORDS:
        return None
    if isinstance(default, bool):
        return text.lower() == "true" if text.lower() in CLI_BOOL_WORDS else text
    if isinstance(default, list):
        return [item.strip() for item in text.split(",") if item.strip()]
    for number_type in (int, float):
        if isinstance(default, number_type):
            try:
                return number_type(text)
            except ValueError:
                return text
    return text


def _torchtitan_key(
    dotted_key: str, value: Any, source: str, where: str, from_cli: bool, warnings: dict[str, str]
) -> str | None:
    """Handle a key titanlite does not define: the titanlite key to set it on (a renamed
    torchtitan key), or None once a harmless torchtitan setting has been noted in `warnings`.
    Anything else is a ConfigError."""
    shown_key = f"--{dotted_key}" if from_cli else _key_in_toml(dotted_key)
    if dotted_key in torchtitan_keys.RENAMED:
        new_key = torchtitan_keys.RENAMED[dotted_key]
        new_shown = f"--{new_key}" if from_cli else _key_in_toml(new_key)
        warnings[dotted_key] = (
            f"titanlite: warning: {where}: {shown_key} is torchtitan's name for {new_shown}; read as {new_shown}"
        )
        return new_key
    entry = torchtitan_keys.TORCHTITAN_ONLY.get(dotted_key)
    if entry is None:
        section_name = dotted_key.partition(".")[0]
        if section_name in _section_classes():
            suggestion = _closest_key(dotted_key)
        else:
            suggestion = _closest(dotted_key, list(torchtitan_keys.TORCHTITAN_ONLY))
        if from_cli:
            raise _unknown_name_error(f"option '--{dotted_key}'", source, suggestion and f"--{suggestion}")
        raise _unknown_name_error(f"key '{dotted_key}'", source, suggestion)
    if from_cli:
        value = _torchtitan_cli_value(value, entry.default)
    shown_value = "none" if value is None else _toml_value(value)
    if not entry.is_harmless(value):
        raise ConfigError(
            f"{dotted_key} = {shown_value} {source} is a torchtitan setting titanlite does not implement: "
            f"{entry.advice}"
        )
    warnings[dotted_key] = (
        f"titanlite: warning: {where}: {shown_key} = {shown_value} is a torchtitan setting "
        "titanlite does not implement; ignored (harmless at this value)"
    )
    return None


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
        if key not in _key_types() and key not in torchtitan_keys.ALL_KEYS:
            section_name = key.partition(".")[0]
            if section_name in torchtitan_keys.TORCHTITAN_SECTIONS and section_name not in _section_classes():
                suggestion = _closest(key, list(torchtitan_keys.TORCHTITAN_ONLY))
            else:
                suggestion = _closest_key(key)
            raise _unknown_name_error(f"option '--{key}'", "on the command line", suggestion and f"--{suggestion}")
        next_token = argv[index + 1] if index + 1 < len(argv) else None
        if has_equals:
            value, index = inline_value, index + 1
        elif _is_bool_key(key):
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


def _is_bool_key(key: str) -> bool:
    key = torchtitan_keys.RENAMED.get(key, key)
    if key in torchtitan_keys.TORCHTITAN_ONLY:
        return isinstance(torchtitan_keys.TORCHTITAN_ONLY[key].default, bool)
    return _key_types()[key] is bool


def _config_file_from_cli(cli_pairs: list[tuple[str, str]]) -> str | None:
    """The TOML path named by the last --job.config_file, if any."""
    path = None
    for key, value in cli_pairs:
        if key == "job.config_file":
            path = _convert_for_key(key, value, "on the command line", from_cli=True)
    return path


# ---------------------------------------------------------------------------
# Range and consistency rules, checked once everything is merged
# ---------------------------------------------------------------------------


def _is_selective_ac_option(option: str) -> bool:
    return option == "op" or (option.isascii() and option.isdigit() and int(option) >= 1)


def _minus_one_or_positive(number: int) -> bool:
    return number == -1 or number >= 1


# (key, what is allowed, check). Every key listed here must exist in job_config.py.
RANGE_RULES: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("training.steps",                              ">= 1",                    lambda v: v >= 1),
    ("training.local_batch_size",                   ">= 1",                    lambda v: v >= 1),
    ("training.global_batch_size",                  "-1 or >= 1",              _minus_one_or_positive),
    ("training.seq_len",                            ">= 1",                    lambda v: v >= 1),
    ("training.max_norm",                           ">= 0",                    lambda v: v >= 0),
    ("training.gc_freq",                            ">= 1",                    lambda v: v >= 1),
    ("optimizer.lr",                                "> 0",                     lambda v: v > 0),
    ("optimizer.beta1",                             "in [0, 1)",               lambda v: 0 <= v < 1),
    ("optimizer.beta2",                             "in [0, 1)",               lambda v: 0 <= v < 1),
    ("optimizer.eps",                               "> 0",                     lambda v: v > 0),
    ("optimizer.weight_decay",                      ">= 0",                    lambda v: v >= 0),
    ("lr_scheduler.warmup_steps",                   ">= 0",                    lambda v: v >= 0),
    ("lr_scheduler.decay_ratio",                    "in [0, 1] or unset",      lambda v: v is None or 0 <= v <= 1),
    ("lr_scheduler.min_lr_factor",                  "in [0, 1]",               lambda v: 0 <= v <= 1),
    ("parallelism.data_parallel_replicate_degree",  "-1 or >= 1",              _minus_one_or_positive),
    ("parallelism.data_parallel_shard_degree",      "-1 or >= 1",              _minus_one_or_positive),
    ("activation_checkpoint.selective_ac_option",   "'op' or a positive integer", _is_selective_ac_option),
    ("compile.components",                          "a subset of model, loss", lambda v: set(v) <= set(COMPILE_COMPONENTS)),
    ("checkpoint.interval",                         ">= 1",                    lambda v: v >= 1),
    ("checkpoint.keep_latest_k",                    ">= 0",                    lambda v: v >= 0),
    ("checkpoint.keep_every",                       ">= 0",                    lambda v: v >= 0),
    ("checkpoint.load_step",                        "-1 or >= 0",              lambda v: v >= -1),
    ("checkpoint.exclude_from_loading",             f"a subset of {', '.join(CHECKPOINT_PARTS)}", lambda v: set(v) <= set(CHECKPOINT_PARTS)),
    ("checkpoint.stop_save_seconds",                ">= 1",                    lambda v: v >= 1),
    ("ema.decay",                                   "in [0, 1)",               lambda v: 0 <= v < 1),
    ("metrics.log_freq",                            ">= 1",                    lambda v: v >= 1),
    ("metrics.peak_tflops",                         ">= 0",                    lambda v: v >= 0),
    ("validation.local_batch_size",                 "-1 or >= 1",              _minus_one_or_positive),
    ("validation.seq_len",                          "-1 or >= 1",              _minus_one_or_positive),
    ("validation.freq",                             ">= 1",                    lambda v: v >= 1),
    ("validation.steps",                            "-1 or >= 1",              _minus_one_or_positive),
    ("profiling.profile_freq",                      ">= 1",                    lambda v: v >= 1),
    ("comm.init_timeout_seconds",                   ">= 1",                    lambda v: v >= 1),
    ("comm.train_timeout_seconds",                  ">= 1",                    lambda v: v >= 1),
    ("comm.trace_buf_size",                         ">= 0",                    lambda v: v >= 0),
    ("training.skip_nonfinite_steps",               ">= 0",                    lambda v: v >= 0),
    ("data.prefetch",                               ">= 0",                    lambda v: v >= 0),
)  # fmt: skip


def _check_one_inferred_degree(config: JobConfig) -> None:
    # -1 means "whatever is left of the world size", which only one degree can take.
    inferred = [
        f"parallelism.{f.name}"
        for f in dataclasses.fields(config.parallelism)
        if f.name.endswith("_degree") and getattr(config.parallelism, f.name) == -1
    ]
    if len(inferred) > 1:
        raise ConfigError(f"at most one parallelism degree may be -1, got -1 for {' and '.join(inferred)}")


# Datasets that read no path: a path given to one of them would be silently ignored.
_DATASETS_WITHOUT_PATH = ("python_stdlib",)
_DATASETS_NEEDING_PATH = ("prepared", "text", "huggingface")


def _check_dataset_path(section: str, dataset: str, dataset_path: str | None) -> None:
    if dataset in _DATASETS_NEEDING_PATH and dataset_path is None:
        raise ConfigError(f"{section}.dataset_path must be set when {section}.dataset is '{dataset}'")
    if dataset in _DATASETS_WITHOUT_PATH and dataset_path is not None:
        raise ConfigError(
            f"{section}.dataset_path ({dataset_path}) is set, but {section}.dataset '{dataset}' reads no path; "
            f"unset it, or pick the dataset that reads it (prepared, text, huggingface, c4, c4_test)"
        )


def _check_dataset_has_path(config: JobConfig) -> None:
    _check_dataset_path("training", config.training.dataset, config.training.dataset_path)


def _check_validation(config: JobConfig) -> None:
    validation = config.validation
    if not validation.enable:
        return
    _check_dataset_path("validation", validation.dataset, validation.dataset_path)
    if validation.seq_len > config.training.seq_len:
        raise ConfigError(
            f"validation.seq_len ({validation.seq_len}) must not exceed training.seq_len ({config.training.seq_len}), "
            "the length the model's position tables are built for"
        )


def _check_hf_seed(config: JobConfig) -> None:
    checkpoint = config.checkpoint
    if not checkpoint.initial_load_in_hf:
        return
    if checkpoint.initial_load_path is None:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")
    if not checkpoint.initial_load_model_only:
        raise ConfigError(
            "checkpoint.initial_load_model_only must be true with checkpoint.initial_load_in_hf "
            "(a Hugging Face folder holds weights only)"
        )


def _check_load_step(config: JobConfig) -> None:
    # Without checkpoint.enable the run's own checkpoint folder is never read, so the step
    # would be ignored and the run would silently start from scratch.
    checkpoint = config.checkpoint
    if checkpoint.load_step >= 0 and not checkpoint.enable:
        raise ConfigError(
            f"checkpoint.load_step ({checkpoint.load_step}) needs checkpoint.enable "
            "(it picks a step-N folder of the run's own checkpoint folder)"
        )


CONSISTENCY_RULES: tuple[Callable[[JobConfig], None], ...] = (
    _check_one_inferred_degree,
    _check_dataset_has_path,
    _check_hf_seed,
    _check_load_step,
    _check_validation,
)


def validate(config: JobConfig) -> None:
    """Raise ConfigError for the first value out of its allowed range."""
    for key, allowed, is_allowed in RANGE_RULES:
        value = _get(config, key)
        if not is_allowed(value):
            raise ConfigError(f"{key} must be {allowed}, got {value!r}")
    for check in CONSISTENCY_RULES:
        check(config)


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def _get(config: JobConfig, dotted_key: str) -> Any:
    section_name, key = dotted_key.split(".")
    return getattr(getattr(config, section_name), key)


def _set(config: JobConfig, dotted_key: str, value: Any) -> None:
    section_name, key = dotted_key.split(".")
    setattr(getattr(config, section_name), key, value)


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
        if key not in _key_types():
            key = _torchtitan_key(key, value, "on the command line", "command line", True, warnings)
            if key is None:
                continue
        _set(config, key, _convert_for_key(key, value, "on the command line", from_cli=True))
    validate(config)
    return config, list(warnings.values())


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Return the JobConfig for `argv` (default: sys.argv[1:]); raise ConfigError if it is bad.

    torchtitan 0.2 keys that titanlite ignores or renames print one warning line each on
    stderr, from rank 0 only (RANK unset counts as rank 0), once the whole config is valid,
    and not again after run_train.sh's preflight showed them (TITANLITE_CONFIG_WARNINGS_SHOWN).
    """
    config, warnings = parse_args_with_warnings(argv)
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("TITANLITE_CONFIG_WARNINGS_SHOWN"):
        for line in warnings:
            print(line, file=sys.stderr)
    return config


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
    if dotted_key not in _key_types():
        raise _unknown_name_error(f"key '{dotted_key}'", "for --get", _closest_key(dotted_key))
    return _show_default(_get(config, dotted_key))


def _show_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def format_help() -> str:
    """Usage, then every section with each key's type, default and docstring."""
    lines = [USAGE, "", HELP_INTRO]
    for section_name, section_cls in _section_classes().items():
        defaults = section_cls()
        docs = field_docstrings(section_cls)
        lines += ["", f"[{section_name}]"]
        for f in dataclasses.fields(section_cls):
            type_name = _type_name(_key_types()[f"{section_name}.{f.name}"])
            default = _show_default(getattr(defaults, f.name))
            lines.append(f"  --{section_name}.{f.name}  ({type_name}, default: {default})")
            doc = docs.get(f.name, "")
            lines += textwrap.wrap(doc, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for every key, unset optionals included as None."""
    return dataclasses.asdict(config)


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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def to_toml(config: JobConfig) -> str:
    """The config as TOML text that parses back to an equal JobConfig."""
    lines = []
    for section_name, values in to_dict(config).items():
        lines.append(f"[{section_name}]")
        for key, value in values.items():
            # TOML has no null, and a left-out optional key reads back as unset.
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
