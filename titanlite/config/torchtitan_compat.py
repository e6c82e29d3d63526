"""Reading torchtitan 0.2 keys titanlite does not define (the tables are in torchtitan_keys.py).

The parser asks here only about names that are not titanlite keys, so a titanlite key always
wins. A renamed key is read as titanlite's key, a harmless torchtitan-only setting is noted
as a warning line and dropped, and anything else is a ConfigError.
"""

from __future__ import annotations

from typing import Any

from titanlite.config import torchtitan_keys
from titanlite.config.schema import (
    ConfigError,
    closest_key,
    key_types,
    toml_value,
    top_level_sections,
    unknown_name_error,
)
from titanlite.errors import closest_name

CLI_NONE_WORDS = ("none", "null")
CLI_BOOL_WORDS = ("true", "false")


def is_known_key(dotted_key: str) -> bool:
    """A titanlite key or a torchtitan 0.2 key (which may still be refused for its value)."""
    return dotted_key in key_types() or dotted_key in torchtitan_keys.ALL_KEYS


def is_known_section(section_name: str) -> bool:
    """A titanlite section or a torchtitan 0.2 one."""
    return section_name in top_level_sections() or section_name in torchtitan_keys.TORCHTITAN_SECTIONS


def closest_known_key(dotted_key: str) -> str | None:
    """The name most likely meant by an unknown key: a titanlite key in titanlite's sections,
    a torchtitan one in the sections only torchtitan has ([fault_tolerance], ...), either in
    nested tables ([quantize.linear.*], [training.dataloader]), where the two mix."""
    section = dotted_key.partition(".")[0]
    if dotted_key.count(".") > 1:
        return closest_name(dotted_key, [*key_types(), *torchtitan_keys.TORCHTITAN_ONLY])
    if section in torchtitan_keys.TORCHTITAN_SECTIONS and section not in top_level_sections():
        return closest_name(dotted_key, torchtitan_keys.TORCHTITAN_ONLY)
    return closest_key(dotted_key)


def is_bool_key(key: str) -> bool:
    """Whether a command-line option is a boolean, so that it may stand alone as a flag."""
    key = torchtitan_keys.RENAMED.get(key, key)
    if key in torchtitan_keys.TORCHTITAN_ONLY:
        return isinstance(torchtitan_keys.TORCHTITAN_ONLY[key].default, bool)
    return key_types()[key] is bool


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


def _unknown_key_error(dotted_key: str, source: str, from_cli: bool) -> ConfigError:
    """A key that is neither titanlite's nor torchtitan's, with the closest name of either."""
    suggestion = closest_known_key(dotted_key)
    if from_cli:
        return unknown_name_error(f"option '--{dotted_key}'", source, suggestion and f"--{suggestion}")
    return unknown_name_error(f"key '{dotted_key}'", source, suggestion)


def torchtitan_key(
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
        raise _unknown_key_error(dotted_key, source, from_cli)
    if from_cli:
        value = _torchtitan_cli_value(value, entry.default)
    shown_value = "none" if value is None else toml_value(value)
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
