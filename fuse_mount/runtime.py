"""Where a running spoke daemon leaves word of itself, so ``neuralcache umount`` can find it
and wait until its cache is safely flushed."""

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


class CacheBusyError(Exception):
    """Another daemon already uses this cache directory."""


@dataclass(frozen=True)
class MountRecord:
    pid: int
    mountpoint: str
    cache_dir: str
    hub: str
    metrics_port: int | None


def _record_path(mountpoint: str) -> str:
    # Callers pass resolved paths; resolving here could stat a mount not yet answering.
    digest = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(RUNTIME_DIR, f"mount-{digest}.json")


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
