"""Hub and spoke processes on this machine, driven through the CLI: the demo, the benches and the
tests start them the way a user would, and can always tear them down again."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuse_mount.scrape import sample, scrape

CLI = [sys.executable, "-m", "fuse_mount.cli"]
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str, **labels: str) -> float:
    return sample(scrape(port), name, **labels)


def _from_tree(tree: Path | None) -> dict[str, Any]:
    """``subprocess`` keywords that run the CLI from source ``tree`` (None: this interpreter's
    own path): ``python -m`` puts the working directory first on the module path."""
    if tree is None:
        return {}
    return {"cwd": str(tree), "env": {**os.environ, "PYTHONPATH": str(tree)}}


def is_mounted(path: str) -> bool:
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f)


@dataclass
class Hub:
    """A hub subprocess serving ``export``."""

    export: Path
    port: int = 0
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    tree: Path | None = None  # run the hub from this source tree (benches compare two)

    def start(self) -> "Hub":
        self.proc = subprocess.Popen(
            [*CLI, "hub", "--export", str(self.export), "--listen", f"127.0.0.1:{self.port}",
             "--metrics-port", str(self.metrics_port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **_from_tree(self.tree))
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"hub did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@dataclass
class Spoke:
    """A spoke daemon mounted at ``mountpoint``; knows how to unmount or kill it."""

    mountpoint: Path
    cache_dir: Path
    metrics_port: int = field(default_factory=free_port)
    tree: Path | None = None  # run the daemon from this source tree (benches compare two)

    def mount(self, hub: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [*CLI, "mount", str(self.mountpoint), "--hub", hub, "--cache-dir", str(self.cache_dir),
             "--metrics-port", str(self.metrics_port), *extra],
            capture_output=True, text=True, timeout=START_TIMEOUT + 30, **_from_tree(self.tree))
        if check and result.returncode != 0:
            raise RuntimeError(f"mount failed: {result.stderr}\n{self.log()}")
        return result

    def log(self) -> str:
        path = self.cache_dir / "neuralcache.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def pid(self) -> int | None:
        lock = self.cache_dir / "daemon.lock"
        with contextlib.suppress(OSError, ValueError):
            return int(lock.read_text().strip())
        return None

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_port, name, **labels)

    def umount(self) -> None:
        subprocess.run([*CLI, "umount", str(self.mountpoint)], capture_output=True, timeout=90,
                       check=True)

    def kill(self) -> None:
        """SIGKILL the daemon, as a crash would, and clear the dead mount."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def cleanup(self) -> None:
        """Teardown: whatever state the test left, leave no mount and no process."""
        if is_mounted(str(self.mountpoint)):
            with contextlib.suppress(Exception):
                self.umount()
        if is_mounted(str(self.mountpoint)) or (self.pid() and _alive(self.pid())):
            self.kill()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    return True


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
