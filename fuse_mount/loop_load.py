"""How busy the daemon's event loop is, from the kernel's scheduler statistics of its thread.

Every read of the mount, the prefetcher, the hub client's requests and replies and the cache's
hand-offs share one trio loop. When that loop has work nearly all the time, a FUSE request
waits behind the work queued before it, and readers slow down while the daemon's CPU stays below
one core: the loop may also be waiting for a core the data loader's workers hold. The kernel
counts both for every thread (``/proc/PID/task/TID/schedstat``: time on a CPU, time runnable but
waiting for one), so they are read when scraped, at no cost to the loop itself (a trio
instrument would run twice in every scheduler round). It also counts the thread's page faults
that had to read the disk (``/proc/PID/task/TID/stat``, major faults): each one stopped the
loop, and every FUSE request behind it, until the disk answered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

NANOSECONDS = 1e9


MAJOR_FAULTS_FIELD = 9
"""Index of ``majflt`` among the fields of ``/proc/.../stat`` after the command name."""


@dataclass(frozen=True)
class ThreadTimes:
    """Seconds a thread has run on a CPU, and waited, runnable, for one; and how many times it
    waited for the disk to page memory in (major faults)."""

    cpu_seconds: float
    runqueue_seconds: float
    disk_waits: int


def thread_times(tid: int) -> ThreadTimes | None:
    """The kernel's counts for thread ``tid`` of this process; None where it keeps none (no
    ``/proc``, or a kernel built without scheduler statistics) or the thread is gone."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            on_cpu, waiting, _slices = f.read().split()
        with open(f"/proc/self/task/{tid}/stat") as f:
            faults = f.read().rsplit(")", 1)[1].split()[MAJOR_FAULTS_FIELD]
        return ThreadTimes(int(on_cpu) / NANOSECONDS, int(waiting) / NANOSECONDS, int(faults))
    except (OSError, ValueError, IndexError):
        return None


class WatchedThread:
    """A thread of this process (the daemon's event loop, the cache's reader thread), once
    ``watch`` was called from it."""

    def __init__(self) -> None:
        self.tid: int | None = None

    def watch(self) -> None:
        """Call from the thread itself."""
        self.tid = threading.get_native_id()

    def times(self) -> ThreadTimes | None:
        return None if self.tid is None else thread_times(self.tid)
