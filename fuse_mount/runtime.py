"""Where a running spoke daemon leaves word of itself: a record so ``neuralcache umount`` can find
it and wait until its cache is safely flushed, and a control socket beside it for the other
commands (``status``, ``warmup``, ``cache``), which find the mount from any path inside it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import IO, Iterator

RUNTIME_DIR = os.environ.get("NEURALCACHE_RUNTIME_DIR", "/run/neuralcache")
"""One small JSON file per mount lives here (tmpfs: gone after a reboot, as the mounts are)."""
RECORD_SUFFIX = ".json"
"""The mount record: ``mount-<hash of the mountpoint>.json``."""
SOCKET_SUFFIX = ".sock"
"""The control socket beside it: ``mount-<hash>.sock``."""


class CacheBusyError(Exception):
    """Another daemon already uses this cache directory."""


@dataclass(frozen=True)
class MountRecord:
    pid: int
    mountpoint: str
    cache_dir: str
    hub: str
    metrics_port: int | None


def _runtime_path(mountpoint: str, suffix: str) -> str:
    # Callers pass resolved paths; resolving here could stat a mount not yet answering.
    digest = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(RUNTIME_DIR, f"mount-{digest}{suffix}")


def _record_path(mountpoint: str) -> str:
    return _runtime_path(mountpoint, RECORD_SUFFIX)


def control_socket_path(mountpoint: str) -> str:
    """The daemon's control socket, next to its record (``mountpoint`` already resolved)."""
    return _runtime_path(mountpoint, SOCKET_SUFFIX)


def write_record(record: MountRecord) -> None:
    os.makedirs(RUNTIME_DIR, exist_ok=True)
    path = _record_path(record.mountpoint)
    tmp = f"{path}.{record.pid}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, path)


def read_record(mountpoint: str) -> MountRecord | None:
    try:
        with open(_record_path(mountpoint)) as f:
            return MountRecord(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def remove_record(mountpoint: str, pid: int) -> None:
    record = read_record(mountpoint)
    if record is not None and record.pid == pid:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_record_path(mountpoint))


def live_records() -> list[MountRecord]:
    """Records of daemons still running, by mountpoint."""
    try:
        names = os.listdir(RUNTIME_DIR)
    except FileNotFoundError:
        return []
    records = []
    for name in names:
        if name.startswith("mount-") and name.endswith(RECORD_SUFFIX):
            try:
                with open(os.path.join(RUNTIME_DIR, name)) as f:
                    record = MountRecord(**json.load(f))
            except (OSError, ValueError, TypeError):
                continue
            if pid_alive(record.pid):
                records.append(record)
    return sorted(records, key=lambda r: r.mountpoint)


def _inside(path: str, mountpoint: str) -> str | None:
    """``path`` relative to ``mountpoint`` ("" for the mountpoint itself), or None."""
    if path == mountpoint:
        return ""
    prefix = mountpoint.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def find_mount(path: str, records: list[MountRecord]) -> tuple[MountRecord, str] | None:
    """The mount holding ``path`` and the path inside it, or None.

    The path is tried as given (made absolute) before symlinks are resolved, so a symlink
    inside the mount names itself rather than what it points to, while a path through a
    symlinked mountpoint (``/data`` -> ``/mnt/data``) is still found.
    """
    for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        best = None
        for record in records:
            rel = _inside(candidate, record.mountpoint)
            deeper = best is None or len(record.mountpoint) > len(best[0].mountpoint)
            if rel is not None and deeper:
                best = (record, rel)
        if best is not None:
            return best
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


@contextlib.contextmanager
def cache_lock(cache_dir: str) -> Iterator[IO[str]]:
    """Hold an exclusive lock on the cache directory for the daemon's lifetime."""
    os.makedirs(cache_dir, exist_ok=True)
    f = open(os.path.join(cache_dir, "daemon.lock"), "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise CacheBusyError(
                f"cache directory {cache_dir} is in use by another daemon (pid {holder})") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield f
    finally:
        f.close()
