"""docs/deploy: the systemd units, the notify protocol they rely on, the lifecycle script and the
Kubernetes DaemonSet, each checked as far as this machine allows."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from fuse_mount import config, sd_notify
from fuse_mount.cli import build_parser
from fuse_mount.launch import CLI, Hub, Spoke, free_port

from .conftest import needs_fuse

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
VENV = Path(sys.executable).parent.parent
SHIPPED_VENV = "/opt/neuralcache/venv"
SHIPPED_CONFIG = "/etc/neuralcache/neuralcache.toml"
NOTIFY_WAIT = 30.0
"""Seconds a fake service manager waits for a notification (a mount takes about one)."""
SCRIPT_TIMEOUT = 120


# --- sd_notify -------------------------------------------------------------------------------

def test_states_encode_as_lines_and_refuse_what_the_protocol_cannot_carry() -> None:
    assert sd_notify.encode_state({"READY": 1, "STATUS": "mounted /mnt"}) == (
        b"READY=1\nSTATUS=mounted /mnt\n")
    for bad in ({"STATUS": "two\nlines"}, {"ready": 1}, {"A=B": 1}):
        with pytest.raises(ValueError):
            sd_notify.encode_state(bad)


def test_socket_names_map_to_unix_addresses() -> None:
    assert sd_notify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sd_notify.socket_address("@abstract/name") == "\0abstract/name"
    assert sd_notify.socket_address("vsock:2:1234") is None


def _manager(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(NOTIFY_WAIT)
    return sock


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_reaches_a_datagram_socket(tmp_path: Path, abstract: bool) -> None:
    name = f"@neuralcache-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with _manager(sd_notify.socket_address(name)) as manager:
        assert sd_notify.notify({"NOTIFY_SOCKET": name}, READY=1, STATUS="ok")
        assert manager.recv(4096) == b"READY=1\nSTATUS=ok\n"


def test_notify_without_a_manager_is_a_quiet_no_op(tmp_path: Path) -> None:
    assert not sd_notify.notify({}, READY=1)
    assert not sd_notify.notify({"NOTIFY_SOCKET": str(tmp_path / "nobody")}, READY=1)


# --- systemd units ---------------------------------------------------------------------------

def _unit(name: str) -> dict[str, list[str]]:
    """``Key=value`` settings of a unit file (keys may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("name", ["neuralcache-spoke.service", "neuralcache-hub.service"])
def test_units_pass_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    # verify insists that ExecStart exists: point it at this venv's neuralcache, as the
    # lifecycle script does when it installs the unit.
    rendered = tmp_path / name
    rendered.write_text((DEPLOY / name).read_text().replace(SHIPPED_VENV, str(VENV)))
    result = subprocess.run(["systemd-analyze", "verify", str(rendered)],
                            capture_output=True, text=True, timeout=60)
    complaints = [line for line in result.stderr.splitlines() if name in line]
    assert result.returncode == 0 and not complaints, result.stderr


def test_units_notify_restart_and_start_after_the_network() -> None:
    for name in ("neuralcache-spoke.service", "neuralcache-hub.service"):
        unit = _unit(name)
        assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
        assert unit["Restart"] == ["on-failure"]
        assert "network-online.target" in unit["After"] and "network-online.target" in unit["Wants"]
    spoke = _unit("neuralcache-spoke.service")
    assert spoke["KillSignal"] == ["SIGTERM"]  # the daemon unmounts and flushes on SIGTERM
    for sandbox in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts"):
        assert sandbox not in spoke  # a private mount namespace would hide the mount


@pytest.mark.parametrize("name, command", [("neuralcache-spoke.service", "mount"),
                                           ("neuralcache-hub.service", "hub")])
def test_unit_command_lines_parse_with_the_example_config(name: str, command: str) -> None:
    argv = shlex.split(_unit(name)["ExecStart"][0])
    assert argv[0] == f"{SHIPPED_VENV}/bin/neuralcache" and argv[2] == SHIPPED_CONFIG
    argv[2] = str(DEPLOY / "neuralcache.toml")
    args = config.parse_args(build_parser(), argv[1:], env={})
    assert args.command == command
    if command == "mount":
        assert args.foreground and args.mountpoint and args.hub and args.cache_dir


def _config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neuralcache.toml"
    path.write_text(text)
    return path


@needs_fuse
def test_spoke_tells_its_manager_ready_once_mounted_and_stopping_on_sigterm(
        tmp_path: Path, hub: Hub, export: tuple[Path, dict[str, bytes]]) -> None:
    spoke = Spoke(tmp_path / "mnt", tmp_path / "cache")
    spoke.mountpoint.mkdir()
    cfg = _config_file(tmp_path, f'[mount]\nmountpoint = "{spoke.mountpoint}"\n'
                                 f'hub = "{hub.address}"\ncache_dir = "{spoke.cache_dir}"\n')
    name = f"@neuralcache-test-spoke-{os.getpid()}"
    with _manager(sd_notify.socket_address(name)) as manager:
        proc = subprocess.Popen([*CLI, "--config", str(cfg), "mount", "--foreground"],
                                env={**os.environ, "NOTIFY_SOCKET": name},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ready = manager.recv(4096).decode()
            assert ready.startswith("READY=1\nSTATUS=mounted ")
            rel, data = next((r, d) for r, d in export[1].items() if len(d) > 4096)
            assert (spoke.mountpoint / rel).read_bytes() == data  # READY means it answers
            proc.send_signal(signal.SIGTERM)
            assert manager.recv(4096).decode().startswith("STOPPING=1\n")
            assert proc.wait(60) == 0, proc.stderr.read()
            assert not os.path.ismount(spoke.mountpoint)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            spoke.cleanup()


def test_hub_tells_its_manager_ready_once_listening(
        tmp_path: Path, export: tuple[Path, dict[str, bytes]]) -> None:
    port = free_port()
    cfg = _config_file(tmp_path, f'[hub]\nexport = "{export[0]}"\nlisten = "127.0.0.1:{port}"\n')
    name = f"@neuralcache-test-hub-{os.getpid()}"
    with _manager(sd_notify.socket_address(name)) as manager:
        proc = subprocess.Popen([*CLI, "--config", str(cfg), "hub"],
                                env={**os.environ, "NOTIFY_SOCKET": name},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert manager.recv(4096).decode().startswith("READY=1\nSTATUS=serving ")
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        finally:
            proc.kill()
            proc.wait(10)


# --- lifecycle script ------------------------------------------------------------------------

def _neuralcache_mounts(mountpoint: Path) -> list[str]:
    with open("/proc/mounts") as f:
        return [line for line in f if line.split()[1] == str(mountpoint)]


def _wait_dead(pid: int) -> None:
    deadline = time.monotonic() + NOTIFY_WAIT
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}")


def _run_script(env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(DEPLOY / "on_create.sh")], env=env, capture_output=True,
                            text=True, timeout=SCRIPT_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_lifecycle_script_without_an_install_or_a_package_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "NEURALCACHE_HUB": "127.0.0.1:1",
           "NEURALCACHE_MOUNTPOINT": str(tmp_path / "mnt"),
           "NEURALCACHE_CACHE_DIR": str(tmp_path / "cache"),
           "NEURALCACHE_CONFIG": str(tmp_path / "neuralcache.toml"),
           "NEURALCACHE_VENV": str(tmp_path / "venv"), "NEURALCACHE_INIT": "direct"}
    env.pop("NEURALCACHE_PACKAGE", None)
    result = subprocess.run(["bash", str(DEPLOY / "on_create.sh")], env=env, capture_output=True,
                            text=True, timeout=SCRIPT_TIMEOUT)
    assert result.returncode == 1
    assert "has no neuralcache: pass --package" in result.stderr
    assert not (tmp_path / "venv").exists()  # nothing installed from a guessed name


@needs_fuse
def test_lifecycle_script_is_idempotent_and_repairs_a_dead_mount(
        tmp_path: Path, hub: Hub, export: tuple[Path, dict[str, bytes]]) -> None:
    spoke = Spoke(tmp_path / "mnt", tmp_path / "cache")
    cfg = tmp_path / "etc" / "neuralcache.toml"
    env = {**os.environ, "NEURALCACHE_HUB": hub.address,
           "NEURALCACHE_MOUNTPOINT": str(spoke.mountpoint),
           "NEURALCACHE_CACHE_DIR": str(spoke.cache_dir), "NEURALCACHE_CACHE_SIZE": "64M",
           "NEURALCACHE_METRICS_PORT": str(spoke.metrics_port),
           "NEURALCACHE_METRICS_ADDR": "127.0.0.1", "NEURALCACHE_CONFIG": str(cfg),
           # An installed venv: no apt-get or pip; no systemd here, and never the host's.
           "NEURALCACHE_VENV": str(VENV), "NEURALCACHE_INIT": "direct",
           # As if run from a notify service: the detached daemon must not speak for it.
           "NOTIFY_SOCKET": f"@neuralcache-test-script-{os.getpid()}"}

    def assert_one_working_mount() -> None:
        mounts = _neuralcache_mounts(spoke.mountpoint)
        assert len(mounts) == 1 and mounts[0].split()[2] == "fuse.neuralcache", mounts
        for rel, data in export[1].items():
            assert (spoke.mountpoint / rel).read_bytes() == data, rel

    manager = _manager(sd_notify.socket_address(env["NOTIFY_SOCKET"]))
    try:
        first = _run_script(env)
        assert "wrote" in first.stdout and "answers" in first.stdout
        manager.setblocking(False)
        with pytest.raises(BlockingIOError):
            manager.recv(4096)
        loaded = config.load(str(cfg))["mount"]
        assert (loaded["hub"], loaded["cache_size"]) == (hub.address, "64M")
        pid = spoke.pid()
        second = _run_script(env)
        assert "left alone" in second.stdout and "wrote" not in second.stdout
        assert spoke.pid() == pid
        assert_one_working_mount()

        os.kill(pid, signal.SIGKILL)  # a crash: the kernel mount stays, with nobody behind it
        _wait_dead(pid)
        assert _neuralcache_mounts(spoke.mountpoint)
        with pytest.raises(OSError):
            os.listdir(spoke.mountpoint)
        third = _run_script(env)
        assert "answers" in third.stdout and spoke.pid() != pid, third.stdout
        assert_one_working_mount()
    finally:
        manager.close()
        spoke.cleanup()
    assert not _neuralcache_mounts(spoke.mountpoint)


FAKE_SYSTEMCTL = """#!/bin/bash
# Stands in for systemctl: logs each call; "restart" runs the unit's ExecStart detached.
echo "$*" >>"$FAKE_LOG"
if [ "$1" = restart ]; then
    cmd=$(sed -n 's/^ExecStart=//p' "$NEURALCACHE_UNIT_DIR/$2")
    setsid $cmd </dev/null >>"$FAKE_LOG" 2>&1 &
fi
"""


@needs_fuse
def test_lifecycle_script_under_systemd_installs_the_unit_and_waits_for_the_mount(
        tmp_path: Path, hub: Hub, export: tuple[Path, dict[str, bytes]]) -> None:
    spoke = Spoke(tmp_path / "mnt", tmp_path / "cache")
    bin_dir, unit_dir, cfg = tmp_path / "bin", tmp_path / "units", tmp_path / "neuralcache.toml"
    bin_dir.mkdir()
    unit_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "NEURALCACHE_HUB": hub.address, "NEURALCACHE_MOUNTPOINT": str(spoke.mountpoint),
           "NEURALCACHE_CACHE_DIR": str(spoke.cache_dir), "NEURALCACHE_METRICS_PORT": "",
           "NEURALCACHE_CONFIG": str(cfg), "NEURALCACHE_VENV": str(VENV),
           "NEURALCACHE_INIT": "systemd", "NEURALCACHE_UNIT_DIR": str(unit_dir)}
    try:
        _run_script(env)
        unit = (unit_dir / "neuralcache-spoke.service").read_text()
        assert f"ExecStart={VENV}/bin/neuralcache --config {cfg} mount --foreground" in unit
        assert f"RequiresMountsFor={spoke.cache_dir}\n" in unit
        calls = log.read_text().splitlines()
        assert calls[:3] == ["daemon-reload", "enable -q neuralcache-spoke.service",
                             "restart neuralcache-spoke.service"], calls
        rel, data = next((r, d) for r, d in export[1].items() if len(d) > 4096)
        assert (spoke.mountpoint / rel).read_bytes() == data
        second = _run_script(env)
        assert "left alone" in second.stdout
        assert log.read_text().splitlines().count("restart neuralcache-spoke.service") == 1
        assert len(_neuralcache_mounts(spoke.mountpoint)) == 1
    finally:
        spoke.cleanup()


# --- Kubernetes ------------------------------------------------------------------------------

def test_daemonset_mounts_bidirectionally_and_is_scraped() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text())}
    pod = docs["DaemonSet"]["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    container = pod["spec"]["containers"][0]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(container["ports"][0]["containerPort"])
    assert container["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["mnt"]["mountPropagation"] == "Bidirectional"
    assert volumes["mnt"]["hostPath"]["path"] and volumes["cache"]["hostPath"]["path"]
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}

    toml = docs["ConfigMap"]["data"]["neuralcache.toml"]
    cfg = tomllib.loads(toml)
    mount = cfg["mount"]
    # The FUSE mount sits inside the propagated volume, one level down (the volume itself is a
    # mount point already), and the metrics listen where Prometheus is told to look.
    assert Path(mount["mountpoint"]).parent == Path(mounts["mnt"]["mountPath"])
    assert str(mount["metrics_port"]) == annotations["prometheus.io/port"]
    assert mount["metrics_addr"] == "0.0.0.0"
    assert mount["cache_dir"] == mounts["cache"]["mountPath"]
    config.apply(build_parser(), cfg, "daemonset.yaml")  # every key is valid
    command = container["command"][-1]
    assert f"mkdir -p {mount['mountpoint']}" in command and "--foreground" in command
