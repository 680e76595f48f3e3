"""The TOML config file: keys follow the CLI, errors name the key, flags beat the file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuse_mount import config
from fuse_mount.cli import build_parser, parse_size

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "deploy" / "neuralcache.toml"
NO_ENV: dict[str, str] = {}
BASE = ["mount", "/mnt/x", "--hub", "h:1", "--cache-dir", "/c"]


def parse(argv: list[str], toml: str | None = None, tmp: Path | None = None):
    """Parse ``argv`` with ``toml`` as the config file (none if None)."""
    if toml is not None:
        assert tmp is not None
        path = tmp / "neuralcache.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    return config.parse_args(build_parser(), argv, env={config.CONFIG_ENV: ""})


def apply_error(toml: str) -> str:
    with pytest.raises(config.ConfigError) as info:
        config.apply(build_parser(), tomllib.loads(toml), "test.toml")
    return str(info.value)


def test_without_a_file_the_built_in_defaults_apply() -> None:
    args = parse(BASE)
    assert args.cache_size == parse_size("10G")
    assert args.hub_timeout == 60.0 and args.prefetch is True and args.metrics_port is None


def test_the_file_overrides_defaults_and_flags_override_the_file(tmp_path: Path) -> None:
    toml = ('[log]\nlevel = "debug"\n'
            '[mount]\ncache_size = "20G"\nprefetch = false\nhub_timeout = 5\n')
    args = parse([*BASE, "--cache-size", "30G"], toml, tmp_path)
    assert args.cache_size == parse_size("30G")  # flag beats file
    assert args.prefetch is False and args.hub_timeout == 5.0  # file beats default
    assert args.log_level == "debug"
    assert parse([*BASE, "--prefetch"], toml, tmp_path).prefetch is True


def test_the_file_may_supply_required_options_and_the_mountpoint(tmp_path: Path) -> None:
    toml = '[mount]\nmountpoint = "/mnt/data"\nhub = "hub.internal:7070"\ncache_dir = "/nvme"\n'
    args = parse(["mount", "--foreground"], toml, tmp_path)
    assert (args.mountpoint, args.hub, args.cache_dir) == ("/mnt/data", ("hub.internal", 7070),
                                                           "/nvme")
    assert args.foreground
    assert parse(["mount", "/elsewhere"], toml, tmp_path).mountpoint == "/elsewhere"
    hub = parse(["hub"], '[hub]\nexport = "/data"\nlisten = "0.0.0.0:0"\n', tmp_path)
    assert (hub.export, hub.listen) == ("/data", ("0.0.0.0", 0))


def test_required_options_are_still_required_without_the_file(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["mount", "--hub", "h:1", "--cache-dir", "/c"])
    assert "mountpoint" in capsys.readouterr().err


@pytest.mark.parametrize("toml, words", [
    ('[mount]\ncache_sise = "1G"\n', ["[mount]", "cache_sise", "did you mean 'cache_size'"]),
    ('[mount]\nforeground = true\n', ["[mount]", "'foreground'"]),
    ('[spoke]\nhub = "h:1"\n', ["unknown key 'spoke'"]),
    ('[log]\nlevel = "loud"\n', ["[log] level", "'loud' is not one of"]),
    ('[mount]\ncache_size = true\n', ["[mount] cache_size", "expected a string", "boolean"]),
    ('[mount]\ncache_size = "lots"\n', ["[mount] cache_size", "not a size"]),
    ('[mount]\nhub = "nohost"\n', ["[mount] hub", "HOST:PORT"]),
    ('[mount]\nhub_timeout = "soon"\n', ["[mount] hub_timeout", "expected a number"]),
    ('[mount]\nprefetch = "yes"\n', ["[mount] prefetch", "expected a boolean"]),
    ('[hub]\nmetrics_port = 9100.5\n', ["[hub] metrics_port", "expected an integer"]),
    ('[hub]\nmetrics_port = true\n', ["[hub] metrics_port", "expected an integer"]),
    ('mount = 3\n', ["[mount] must be a table"]),
])
def test_bad_keys_and_values_are_errors_naming_the_key(toml: str, words: list[str]) -> None:
    message = apply_error(toml)
    for word in words:
        assert word in message, message


def test_nothing_is_applied_when_any_key_is_bad() -> None:
    parser = build_parser()
    with pytest.raises(config.ConfigError):
        config.apply(parser, tomllib.loads('[mount]\ncache_size = "1G"\nbogus = 1\n'), "t")
    assert parser.parse_args(BASE).cache_size == parse_size("10G")


def test_a_bad_file_stops_the_command_with_its_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(BASE, "[mount\n", tmp_path)
    assert info.value.code == 2 and "neuralcache.toml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--config", str(tmp_path / "absent.toml"), *BASE])
    assert "absent.toml" in capsys.readouterr().err


def test_which_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = tmp_path / "system.toml"
    monkeypatch.setattr(config, "DEFAULT_PATH", str(system))
    assert config.config_path(BASE, {}) is None  # the default path is read only if it exists
    system.write_text("")
    assert config.config_path(BASE, {}) == str(system)
    assert config.config_path(BASE, {config.CONFIG_ENV: "/env.toml"}) == "/env.toml"
    assert config.config_path(BASE, {config.CONFIG_ENV: ""}) is None
    assert config.config_path(["--config", "/flag.toml", *BASE],
                              {config.CONFIG_ENV: "/env.toml"}) == "/flag.toml"


# Options with their flag syntax, TOML syntax and parsed value, for the precedence property.
OPTIONS = {
    "cache_size": (st.integers(1, 1 << 40), lambda v: ["--cache-size", str(v)], str, int),
    "hub_timeout": (st.floats(0.5, 1e4), lambda v: ["--hub-timeout", repr(v)], repr, float),
    "metrics_port": (st.integers(1, 65535), lambda v: ["--metrics-port", str(v)], str, int),
    "prefetch": (st.booleans(), lambda v: ["--prefetch" if v else "--no-prefetch"],
                 lambda v: str(v).lower(), bool),
}


@settings(max_examples=60, deadline=None)
@given(file_values=st.fixed_dictionaries({}, optional={k: o[0] for k, o in OPTIONS.items()}),
       flag_values=st.fixed_dictionaries({}, optional={k: o[0] for k, o in OPTIONS.items()}))
def test_precedence_is_default_then_file_then_flag(tmp_path_factory: pytest.TempPathFactory,
                                                   file_values: dict, flag_values: dict) -> None:
    toml = "[mount]\n" + "".join(f"{k} = {OPTIONS[k][2](v)}\n" for k, v in file_values.items())
    flags = [arg for k, v in flag_values.items() for arg in OPTIONS[k][1](v)]
    args = parse([*BASE, *flags], toml, tmp_path_factory.mktemp("cfg"))
    defaults = build_parser().parse_args(BASE)
    for key in OPTIONS:
        expected = flag_values.get(key, file_values.get(key, getattr(defaults, key)))
        assert getattr(args, key) == expected, key


# --- the shipped example ---------------------------------------------------------------------

def _documented_keys(text: str) -> dict[str, set[str]]:
    """Keys per table, set or commented out (``# key = value``)."""
    keys: dict[str, set[str]] = {}
    table = None
    for line in text.splitlines():
        if m := re.match(r"^\[(\w+)\]$", line):
            table = keys.setdefault(m.group(1), set())
        elif table is not None and (m := re.match(r"^#?\s?(\w+) = ", line)):
            table.add(m.group(1))
    return keys


def test_the_example_documents_every_option() -> None:
    parser = build_parser()
    subs = config.subcommands(parser)
    expected = {name: set(config.settable(subs[name])) for name in config.SECTIONS}
    expected["log"] = set(config.LOG_KEYS)
    assert _documented_keys(EXAMPLE.read_text()) == expected


def test_the_example_loads_and_its_values_are_the_defaults() -> None:
    example = config.load(str(EXAMPLE))
    configured = build_parser()
    config.apply(configured, example, str(EXAMPLE))
    plain = config.subcommands(build_parser())
    for name in config.SECTIONS:
        options = config.settable(plain[name])
        for key in example[name]:
            action = options[key]
            if action.required or not action.option_strings:
                continue  # required options have no default; the example shows a value
            assert config.subcommands(configured)[name].get_default(key) == action.default, key
    assert example["log"]["level"] == build_parser().get_default("log_level")
