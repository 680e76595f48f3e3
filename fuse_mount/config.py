"""The TOML config file: a node's settings in one place, with command-line flags still winning.

``[hub]`` and ``[mount]`` hold the options of the subcommands of the same name, keyed by the
option's name with underscores (``--cache-size`` is ``cache_size``); ``[log] level`` is
``--log-level``. The keys are read off the argument parser itself, so every option the CLI has,
the file has too, with the same value syntax ("20G", "HOST:PORT") and the same checks.

Precedence is built-in defaults < file < flags: the file's values become the parser's defaults
before the command line is parsed, so an explicit flag always overrides them and an option the
file supplies is no longer required on the command line.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from typing import Any, Mapping, Sequence

DEFAULT_PATH = "/etc/neuralcache/neuralcache.toml"
"""Read when it exists and neither ``--config`` nor ``$NEURALCACHE_CONFIG`` names another file."""
CONFIG_ENV = "NEURALCACHE_CONFIG"
"""Names the config file; set to the empty string to read none (tests, one-off runs)."""

SECTIONS = ("hub", "mount")
"""Tables that set the options of the subcommand of the same name."""
LOG_KEYS = {"level": "log_level"}
"""``[log]`` keys -> the top-level options they set."""
PER_RUN = frozenset({"help", "foreground", "ready_fd"})
"""Options that describe one invocation, not a node's setup; the file may not set them (a
``foreground = true`` would leave no way to ask for the background from the command line)."""

_TOML_TYPE = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "an array", dict: "a table"}


class ConfigError(Exception):
    """The config file cannot be read or names an option wrongly; the message says where."""


def load(path: str) -> dict[str, Any]:
    """Parse the file; syntax errors and a missing file become ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: {exc}") from None


def config_path(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> str | None:
    """The file to read: ``--config``, else ``$NEURALCACHE_CONFIG``, else DEFAULT_PATH if
    present."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        return known.config or None
    if CONFIG_ENV in env:
        return env[CONFIG_ENV] or None
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommand parsers by name (argparse has no public accessor for them)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of ``parser`` a config file may set, by key."""
    return {a.dest: a for a in parser._actions
            if a.dest not in PER_RUN and a.dest is not argparse.SUPPRESS
            and not isinstance(a, argparse._SubParsersAction)}


def _describe(value: Any) -> str:
    kind = _TOML_TYPE.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})"


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A TOML value -> what the flag would have parsed to, or ConfigError naming ``where``."""
    if action.nargs == 0:  # a flag: --prefetch/--no-prefetch, --verbose
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected a boolean, got {_describe(value)}")
        return value
    if action.nargs in ("*", "+"):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected an array, got {_describe(value)}")
        return [_convert_one(action, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _convert_one(action, value, where)


def _convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    if isinstance(value, bool):  # a TOML boolean is a Python int: refuse it before the int test
        expected = {int: "an integer", float: "a number"}.get(kind, "a string")
        raise ConfigError(f"{where}: expected {expected}, got {_describe(value)}")
    if kind is int:
        if not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        result: Any = value
    elif kind is float:
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        result = float(value)
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        result = value
    else:  # a parsing function such as parse_size: give it the text the flag would carry
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        try:
            result = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ConfigError(f"{where}: {result!r} is not one of {choices}")
    return result


def _unknown(where: str, key: str, known: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; known: {', '.join(sorted(known))}")


def _table(config: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table, got {_describe(table)}")
    return table


def apply(parser: argparse.ArgumentParser, config: dict[str, Any], source: str) -> None:
    """Make the file's values ``parser``'s defaults; validate every key before changing anything."""
    subs = subcommands(parser)
    known_tables = [*SECTIONS, "log"]
    for name in config:
        if name not in known_tables:
            raise _unknown(source, name, known_tables)
    plan: list[tuple[argparse.ArgumentParser, argparse.Action, Any]] = []
    top = settable(parser)
    for key, value in _table(config, "log", source).items():
        if key not in LOG_KEYS:
            raise _unknown(f"{source}: [log]", key, list(LOG_KEYS))
        action = top[LOG_KEYS[key]]
        plan.append((parser, action, convert(action, value, f"{source}: [log] {key}")))
    for name in SECTIONS:
        options = settable(subs[name])
        for key, value in _table(config, name, source).items():
            if key not in options:
                raise _unknown(f"{source}: [{name}]", key, list(options))
            action = options[key]
            plan.append((subs[name], action, convert(action, value, f"{source}: [{name}] {key}")))
    for target, action, value in plan:
        target.set_defaults(**{action.dest: value})
        action.required = False
        if not action.option_strings and action.nargs is None:
            action.nargs = "?"  # a positional the file supplies may be left off the command line


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               env: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """``parser.parse_args`` with the config file's values under the command line's."""
    args = list(sys.argv[1:] if argv is None else argv)
    path = config_path(args, env)
    if path is not None:
        try:
            apply(parser, load(path), path)
        except ConfigError as exc:
            parser.error(str(exc))
    return parser.parse_args(args)
