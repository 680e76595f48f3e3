"""Hub, spoke and rclone processes on the two sides of an emulated WAN, as context managers that
always stop what they started and unmount what they mounted.

Everything is started through its command line, the way a user would. Processes on a side run
with ``WanLink.command`` (``nsenter --net``): they get that side's network but keep the host's
mount namespace, so their FUSE mounts are visible to the DataLoader here. A spoke's metrics
endpoint listens on the spoke namespace's own loopback, so it is scraped with a socket created
in that namespace.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.parser import text_string_to_metric_families

from bench.repro_stats import Samples
from bench.wan import HUB, SPOKE, WanLink
from fuse_mount.launch import CLI as NEURALCACHE, is_mounted
from fuse_mount.runtime import pid_alive, read_record

LOOPBACK = "127.0.0.1"
START_WAIT = 60.0
"""Seconds a hub, an rclone server or an rclone mount gets to come up."""
STOP_WAIT = 10.0
"""Seconds a process gets to exit after SIGTERM before it is killed."""
UMOUNT_WAIT = 120.0
"""Seconds ``neuralcache umount`` may take: it waits for the daemon to flush its cache."""
POLL = 0.05
"""Seconds between checks while waiting for a mount or a listening port."""
RCLONE_READ_AHEAD = "256M"
"""The brief's rclone peer: ``--vfs-cache-mode full --vfs-read-ahead 256M``."""


def free_port(link: WanLink, side: str, host: str) -> int:
    """A TCP port free right now on ``host`` inside ``side``'s namespace."""
    with contextlib.closing(link.socket(side)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, wait: float = STOP_WAIT) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds: a process gets the chance to unmount
    cleanly."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until(predicate: Callable[[], bool], what: str, proc: subprocess.Popen | None = None,
                timeout: float = START_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout:g} s")
        time.sleep(POLL)


def _listening(link: WanLink, side: str, host: str, port: int) -> bool:
    with contextlib.closing(link.socket(side)) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "log ends:\n" + "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"no log: {exc}"


# --- NeuralCache --------------------------------------------------------------------------------

@contextlib.contextmanager
def hub(link: WanLink, export: str, log_path: str) -> Iterator[str]:
    """``neuralcache hub`` in the hub namespace; yields its ``HOST:PORT``."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            link.command(HUB, [*NEURALCACHE, "hub", "--export", export,
                               "--listen", f"{link.hub_addr}:0"]),
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # "hub: serving DIR on HOST:PORT"
        if "serving" not in line:
            proc.wait(STOP_WAIT)
            raise RuntimeError(f"hub did not start ({proc.returncode}); {_log_tail(log_path)}")
        yield f"{link.hub_addr}:{line.rsplit(':', 1)[1]}"
    finally:
        stop_process(proc)


@dataclass(frozen=True)
class SpokeMount:
    mountpoint: str
    cache_dir: str
    metrics_port: int  # on the spoke namespace's loopback


@contextlib.contextmanager
def spoke(link: WanLink, hub_address: str, cache_dir: str, mountpoint: str, cache_size: int,
          log_path: str, options: list[str] | None = None) -> Iterator[SpokeMount]:
    """``neuralcache mount`` with the daemon in the spoke namespace, logging to ``log_path``
    (outside the cache directory, which a bench may wipe); ``neuralcache umount`` when done (a
    lazy unmount and a kill if that fails)."""
    os.makedirs(mountpoint, exist_ok=True)
    os.makedirs(cache_dir, exist_ok=True)
    metrics_port = free_port(link, SPOKE, LOOPBACK)
    result = None
    try:
        result = subprocess.run(
            link.command(SPOKE, [*NEURALCACHE, "mount", "--hub", hub_address,
                                 "--cache-dir", cache_dir, "--cache-size", str(cache_size),
                                 "--metrics-port", str(metrics_port),
                                 "--log-file", log_path, *(options or ()),
                                 mountpoint]),
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=START_WAIT)
        if result.returncode != 0:
            raise RuntimeError(f"mount failed: {result.stderr.strip()}\n"
                               f"{_log_tail(log_path)}")
        yield SpokeMount(mountpoint, cache_dir, metrics_port)
    finally:
        unmount_spoke(mountpoint)


def drop_cached(path: str) -> None:
    """``neuralcache cache drop PATH``: a file of a spoke mount out of its cache."""
    result = subprocess.run([*NEURALCACHE, "cache", "drop", path], capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=START_WAIT)
    if result.returncode != 0:
        raise RuntimeError(f"cache drop failed: {result.stderr.strip()}")


def unmount_spoke(mountpoint: str) -> None:
    """Unmount, waiting for the daemon's flush; lazily unmount and kill it if that fails."""
    record = read_record(os.path.realpath(mountpoint))
    if is_mounted(mountpoint):
        result = subprocess.run([*NEURALCACHE, "umount", mountpoint], capture_output=True,
                                text=True, timeout=UMOUNT_WAIT)
        if result.returncode != 0:
            print(f"repro: {result.stderr.strip()}; unmounting lazily")
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False)
    if record is not None and pid_alive(record.pid):
        print(f"repro: spoke daemon {record.pid} still running; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)


def scrape(link: WanLink, side: str, port: int) -> Samples:
    """``/metrics`` of an endpoint on ``side``'s loopback, keyed like ``fuse_mount.scrape``."""
    sock = link.socket(side)
    sock.settimeout(10.0)
    sock.connect((LOOPBACK, port))
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10.0)
    connection.sock = sock  # the request goes out over the namespace's socket
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- rclone ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def rclone_server(link: WanLink, export: str, config: str, log_path: str) -> Iterator[str]:
    """``rclone serve http`` of ``export`` in the hub namespace; yields its URL."""
    port = free_port(link, HUB, link.hub_addr)
    proc = subprocess.Popen(
        link.command(HUB, ["rclone", "serve", "http", export, "--addr",
                           f"{link.hub_addr}:{port}", "--read-only", "--config", config,
                           "--log-file", log_path]),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        _wait_until(lambda: _listening(link, SPOKE, link.hub_addr, port), "rclone serve http",
                    proc)
        yield f"http://{link.hub_addr}:{port}/"
    finally:
        stop_process(proc)


@contextlib.contextmanager
def rclone_mount(link: WanLink, url: str, cache_dir: str, mountpoint: str, cache_size: int,
                 config: str, log_path: str) -> Iterator[str]:
    """``rclone mount`` of ``url`` with the brief's VFS options, in the spoke namespace; yields
    the mountpoint once the kernel shows the mount. SIGTERM makes rclone unmount and exit."""
    os.makedirs(mountpoint, exist_ok=True)
    os.makedirs(cache_dir, exist_ok=True)
    proc = subprocess.Popen(
        link.command(SPOKE, ["rclone", "mount", ":http:", mountpoint, "--http-url", url,
                             "--read-only", "--vfs-cache-mode", "full",
                             "--vfs-read-ahead", RCLONE_READ_AHEAD,
                             "--vfs-cache-max-size", str(cache_size), "--cache-dir", cache_dir,
                             "--config", config, "--log-file", log_path]),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        _wait_until(lambda: is_mounted(mountpoint), "rclone mount", proc)
        yield mountpoint
    finally:
        stop_process(proc)
        if is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False)
