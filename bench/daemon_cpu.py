"""What a warm read costs the daemon: CPU time and sleeps per pass, spoke beside memfs.

    python -m bench.daemon_cpu [--size 256M] [--random-reads 4096] [--rounds 2] [--from-disk]
                               [--mapped-memfs] [--idle SECONDS] [--mount-option OPT]...
                               [--workdir DIR]

``bench.throughput`` says how fast; this says where the daemon's side of it goes. It fills a
spoke cache once (a cold sequential pass), then runs the same read passes as
``bench.throughput`` (``bench.read_pass``, 16 KiB reads, a fresh mount per pass), memfs and warm
spoke interleaved, and for each pass reports, from ``/proc/PID``: the filesystem process's CPU
seconds (user + system, all threads), the part of it its main thread ran (where trio runs
every FUSE handler: one thread, so one core at most) and the time that thread waited for a CPU
while runnable (``schedstat``), and its voluntary and involuntary context switches per FUSE
read. On two cores shared with others, CPU time per pass is steadier than MB/s, and the
switches show what a thread hand-off per read costs. With ``--from-disk`` the cache file is
evicted from the page cache before every spoke pass (``bench.throughput``'s "LMDB from disk"
rows; memfs still serves from memory). With ``--mapped-memfs`` each round also measures memfs
serving the dataset from a read-only map of it (``bench.memfs --mapped``, target ``memmap``):
replies copied by the kernel straight from the file's pages, as a spoke replying from its cache
file's pages would have them, with nothing else of the spoke's work.

With ``--idle SECONDS`` it also measures what a mount nobody reads costs, as a node's mount
sits between jobs: the daemon's CPU and its wake-ups (voluntary switches) per second over
``SECONDS``, once over the filled cache and once over an empty one (``--rounds 0`` measures
only that).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


from bench import mount_procs, proc_cpu
from bench.read_pass import MB, RANDOM, READ_SIZE, SEQUENTIAL
from bench.read_pass import run as run_pass
from bench.throughput import (DATA_NAME, DEFAULT_WORKDIR, cache_size_for, make_dataset,
                              scratch_with_offsets)
from fuse_mount.cli import parse_size

DEFAULT_SIZE = "256M"
DEFAULT_RANDOM_READS = 4096
DEFAULT_ROUNDS = 2
PASS_TIMEOUT = 300.0
IDLE_SETTLE_SECONDS = 2.0
"""Wait after an idle measure's mount before its window opens: the mount's own start-up work
(reading the index, the first ticks) is not idling."""
SEQUENTIAL_READ_BYTES = 1 << 20
"""Sequential FUSE reads are ~1 MiB, the most the kernel sends (bench.throughput counts them): a
sequential figure per read is per this many bytes."""


@dataclass(frozen=True)
class Usage:
    cpu: float  # seconds, user + system, every thread
    loop_cpu: float  # seconds the main thread ran
    loop_wait: float  # seconds the main thread was runnable but waited for a CPU
    voluntary: int
    involuntary: int

    @classmethod
    def of(cls, pid: int) -> "Usage":
        voluntary = involuntary = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                for line in (task / "status").read_text().splitlines():
                    name, _, value = line.partition(":")
                    if name == "voluntary_ctxt_switches":
                        voluntary += int(value)
                    elif name == "nonvoluntary_ctxt_switches":
                        involuntary += int(value)
            except OSError:  # a thread that ended meanwhile
                continue
        loop_cpu, loop_wait = proc_cpu.thread_schedstat(pid, pid)
        return cls(proc_cpu.cpu_seconds(pid), loop_cpu, loop_wait, voluntary, involuntary)

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(self.cpu - other.cpu, self.loop_cpu - other.loop_cpu,
                     self.loop_wait - other.loop_wait, self.voluntary - other.voluntary,
                     self.involuntary - other.involuntary)


def reads_per_pass(size: int, random_reads: int) -> dict[str, int]:
    """FUSE reads in a pass of each pattern over a ``size``-byte file, to give CPU per read."""
    return {SEQUENTIAL: max(1, size // SEQUENTIAL_READ_BYTES), RANDOM: random_reads}


def _memfs_pid(mountpoint: str) -> int:
    """The memfs process serving ``mountpoint`` (found by its command line)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"bench.memfs" in argv and os.fsencode(mountpoint) in argv:
                return int(entry.name)
    raise RuntimeError(f"no memfs process for {mountpoint}")


def _measure(target: str, pattern: str, pid: int, path: str, offsets: str | None,
             reads: int) -> str:
    before = Usage.of(pid)
    result = run_pass(pattern, path, offsets, PASS_TIMEOUT)
    used = Usage.of(pid) - before
    per_read = 1e6 / reads
    return (f"{target:<7}{pattern:<12}{result.mb_per_s:>8.0f} MB/s{used.cpu:>8.2f} s CPU"
            f"{used.cpu * per_read:>9.0f} us/read{used.loop_cpu * per_read:>10.0f} us"
            f"{used.loop_wait * per_read:>10.0f} us{used.voluntary / reads:>9.2f}"
            f"{used.involuntary / reads:>9.2f}")


def _measure_idle(state: str, pid: int, seconds: float) -> str:
    time.sleep(IDLE_SETTLE_SECONDS)
    before = Usage.of(pid)
    time.sleep(seconds)
    used = Usage.of(pid) - before
    return (f"idle, {state:<14}{used.cpu * 1e3 / seconds:>8.2f} ms CPU/s"
            f"{used.loop_cpu * 1e3 / seconds:>8.2f} ms main thread/s"
            f"{used.voluntary / seconds:>8.1f} wake-ups/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.daemon_cpu",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE))
    parser.add_argument("--random-reads", type=int, default=DEFAULT_RANDOM_READS)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                        help="extra argument for the spoke mount, e.g. "
                             "--mount-option=--no-prefetch (repeatable)")
    parser.add_argument("--from-disk", action="store_true",
                        help="evict the spoke's cache file from the page cache before each "
                             "spoke pass")
    parser.add_argument("--mapped-memfs", action="store_true",
                        help="also measure memfs replying with views of a map of the dataset")
    parser.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                        help="also measure an unread mount's CPU over this long, over the "
                             "filled cache and over an empty one")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    if args.size % READ_SIZE:
        parser.error("--size must be a multiple of 16 KiB")
    mount_procs.exit_on_sigterm()
    workdir = os.path.abspath(args.workdir)
    data = make_dataset(workdir, args.size)
    scratch, offsets = scratch_with_offsets(workdir, "cpu", args.size, args.random_reads)
    cache, mountpoint = os.path.join(scratch, "cache"), os.path.join(scratch, "mnt")
    cache_file = mount_procs.cache_file(cache)
    spoke_options = ["--cache-size", str(cache_size_for(args.size)), *args.mount_option]
    reads = reads_per_pass(args.size, args.random_reads)
    print(f"load average (1 min) at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"per read: sequential = per 1 MiB FUSE read, random = per 16 KiB read")
    print(f"{'target':<7}{'pattern':<12}{'speed':>13}{'daemon CPU':>14}{'CPU':>16}"
          f"{'main thr.':>13}{'its wait':>13}{'vol sw':>9}{'invol sw':>9}")
    try:
        with mount_procs.hub(os.path.dirname(data)) as hub:
            with mount_procs.spoke(hub.address, cache, mountpoint, *spoke_options):
                run_pass(SEQUENTIAL, os.path.join(mountpoint, DATA_NAME), None, PASS_TIMEOUT)
            for _ in range(args.rounds):
                for pattern in (SEQUENTIAL, RANDOM):
                    pattern_offsets = offsets if pattern == RANDOM else None
                    for target in ("memfs", "memmap") if args.mapped_memfs else ("memfs",):
                        with mount_procs.memfs(mountpoint, data,
                                               mapped=target == "memmap") as (path,):
                            print(_measure(target, pattern, _memfs_pid(mountpoint), path,
                                           pattern_offsets, reads[pattern]), flush=True)
                    if args.from_disk:
                        mount_procs.drop_page_cache(cache_file)
                    with mount_procs.spoke(hub.address, cache, mountpoint,
                                           *spoke_options) as (spoke, _):
                        pid = spoke.pid()
                        assert pid is not None
                        path = os.path.join(mountpoint, DATA_NAME)
                        print(_measure("spoke", pattern, pid, path, pattern_offsets,
                                       reads[pattern]), flush=True)
            if args.idle > 0:
                empty = os.path.join(scratch, "empty-cache")
                for state, cache_dir in (("cache filled", cache), ("cache empty", empty)):
                    with mount_procs.spoke(hub.address, cache_dir, mountpoint,
                                           *spoke_options) as (spoke, _):
                        pid = spoke.pid()
                        assert pid is not None
                        print(_measure_idle(state, pid, args.idle), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average (1 min) at end {os.getloadavg()[0]:.1f}; MB/s is {MB:.0e} bytes/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
