"""CPU time by role (spoke daemon, hub, WAN forwarder, rclone, memfs, loader), from ``/proc``.

Everything a ``bench.repro`` run starts shares the machine's cores, and the spoke daemon's event
loop is one thread: when a cold run's loader waits, the split of CPU between the daemon, the
hub, the user-space WAN forwarder and the loader says whether a process, or the machine, is
the limit. Processes are told apart by their command lines, so a run must not share the
machine with another mount, hub or forwarder (benches take ``/tmp/nc-bench.lock``).
"""

from __future__ import annotations

import os

DAEMON, HUB, FORWARDER, RCLONE, LOADER, MEMFS = ("spoke daemon", "hub", "WAN forwarder", "rclone",
                                                 "loader", "memfs")
STOLEN = "stolen by the hypervisor"
"""Not a process: the CPU time this virtual machine's host gave its CPUs to others ("steal" in
``/proc/stat``, summed over the CPUs). While that is large, every role here runs less, and
a run's time says more about the host than about the code (docs/wan-emulator.md)."""
DAEMON_LOOP = "spoke daemon's event loop"
"""The daemon's main thread, where trio runs every FUSE handler, the prefetcher and the hub
client: the one thread that cannot spread over two cores. Part of DAEMON; the rest is its
worker threads (the cache's LMDB reader and the hand-off to its writer) and its cache writer
process."""
MOUNT_WORDS = ("fuse_mount.cli", "mount")
"""The daemon's own process, the one whose main thread is DAEMON_LOOP."""
ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (DAEMON, MOUNT_WORDS),
    (DAEMON, ("fuse_mount.cache_writer",)),  # the daemon's child: its LMDB writes
    (HUB, ("fuse_mount.cli", "hub")),
    (FORWARDER, ("bench.wan_forwarder",)),
    (MEMFS, ("bench.memfs",)),
)
"""A process has a role if its argv holds all these words. rclone is told by its program name,
so its server on the hub side and its mount on the spoke side count together."""

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (index 0 is field 3, the state)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return None


def _own_seconds(fields: list[str]) -> float:
    """User + system CPU seconds of every thread of the process whose ``_stat`` this is."""
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (every thread)."""
    fields = _stat(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid}")
    return _own_seconds(fields)


def _main_thread_seconds(pid: str) -> float:
    """User + system CPU seconds of a process's main thread alone (0 if it is gone)."""
    fields = _stat(f"{pid}/task/{pid}")
    return 0.0 if fields is None else _own_seconds(fields)


def thread_schedstat(pid: int, tid: int) -> tuple[float, float]:
    """Seconds thread ``tid`` of ``pid`` has run on a CPU, and has waited for one while
    runnable (``/proc/PID/task/TID/schedstat``, in ns: a read's share is microseconds, far
    below ``/proc/PID/stat``'s 10 ms ticks). Raises ``OSError`` (or ``ValueError``, for what
    a thread leaves as it ends) if the thread is gone."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        ran, waited = f.read().split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


def stolen_ticks() -> tuple[int, int]:
    """(stolen, all) CPU ticks of the machine so far, over all its CPUs, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
    return fields[7], sum(fields)


def stolen_share_since(mark: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen since ``mark``, a ``stolen_ticks()``."""
    stolen, ticks = (now - then for now, then in zip(stolen_ticks(), mark))
    return stolen / ticks if ticks > 0 else 0.0


def _argv(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def role_of(argv: list[str]) -> str | None:
    """The role a command line plays in a run, or None."""
    if argv and os.path.basename(argv[0]) == "rclone":
        return RCLONE
    for role, words in ROLES:
        if all(w in argv for w in words):
            return role
    return None


def snapshot(loader_pid: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system, every thread) used so far per role by live processes, and
    the machine's CPU seconds ``STOLEN`` so far.

    The loader is ``loader_pid`` (this process by default) with its children, the DataLoader's
    workers: the children it has reaped are in its own ``cutime``/``cstime``, live ones are
    read one by one, so workers that exit between two snapshots still count.
    """
    loader_pid = os.getpid() if loader_pid is None else loader_pid
    out: dict[str, float] = {STOLEN: stolen_ticks()[0] / _TICK}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(name)
        if fields is None:
            continue
        pid, ppid = int(name), int(fields[1])
        if pid == loader_pid:  # with its reaped children's (cutime, cstime)
            role, seconds = LOADER, sum(map(int, fields[11:15])) / _TICK
        elif ppid == loader_pid and role_of(_argv(name)) is None:
            role, seconds = LOADER, _own_seconds(fields)
        else:
            argv = _argv(name)
            role, seconds = role_of(argv), _own_seconds(fields)
            if role == DAEMON and all(w in argv for w in MOUNT_WORDS):
                out[DAEMON_LOOP] = out.get(DAEMON_LOOP, 0.0) + _main_thread_seconds(name)
        if role is not None:
            out[role] = out.get(role, 0.0) + seconds
    return out


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per role between two snapshots (roles absent from ``after`` are gone)."""
    return {role: max(0.0, after[role] - before.get(role, 0.0)) for role in after}


def describe(cpu: dict[str, float], seconds: float) -> str:
    """``role 12.3 s (45 %)`` for each role that used a tenth of a second or more, busiest
    first, % of one core over ``seconds``; the daemon's event loop is given inside its entry."""
    def part(role: str, s: float) -> str:
        share = f"{100 * s / seconds:.0f} %"
        if role == DAEMON and DAEMON_LOOP in cpu:
            share += f", event loop {cpu[DAEMON_LOOP]:.1f} s"
        return f"{role} {s:.1f} s ({share})"

    parts = [part(role, s) for role, s in sorted(cpu.items(), key=lambda kv: -kv[1])
             if s >= 0.1 and role != DAEMON_LOOP]
    return "CPU over the loop, % of one core: " + ", ".join(parts) if parts else ""
