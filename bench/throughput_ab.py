"""Source trees' warm spokes read side by side with the memfs ceiling, interleaved round by round.

    python -m bench.throughput_ab --tree base=DIR --tree change=DIR [--rounds 5] [--size 256M]
                                  [--random-reads 8192] [--from-disk] [--mount-option OPT]...
                                  [--workdir DIR]

Why: ``bench.throughput``'s ratios to memfs move with the hour by more than most changes to the
read path move them (memfs alone ran 1615-2265 MB/s sequentially in runs of one day), so
a change to the read path is judged by passes of each tree next to a memfs pass of the same
minute, not by a figure set against one measured an hour before. Each tree is a directory
holding the repository's packages (a ``git archive`` copy, or ``.``); its spoke daemon runs
from it (``PYTHONPATH``), the hub from this tree (warm passes never ask it for data).

Each tree's spoke first fills a cache of its own with one cold sequential pass. Then, per round
and pattern (sequential, and random 16 KiB reads at the same offsets for every pass, as in
``bench.throughput``): one memfs pass, then one warm pass of each tree, each on a fresh mount
over its filled cache with the cache file in the page cache (``bench.throughput``'s "warm
spoke, LMDB in page cache" row; with ``--from-disk``, evicted from it before each pass, the "LMDB
from disk" row), the trees' order rotating from round to round. Every pass
must return memfs's bytes within ``PASS_TIMEOUT``, or the bench exits 1. Per tree and pattern
it prints the MB/s as a share of the same round's memfs pass (median, min-max), the daemon's
CPU time per FUSE read (``on_cpu_seconds``: steadier than MB/s on shared cores) and in how many
rounds the tree had the best share.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

from bench import mount_procs, proc_cpu
from bench.daemon_cpu import SEQUENTIAL_READ_BYTES, reads_per_pass
from bench.read_pass import RANDOM, READ_SIZE, SEQUENTIAL, Pass, PassFailed
from bench.read_pass import run as run_pass
from bench.repro_ab import Figure, best_counts, parse_trees, rotation
from bench.throughput import (DATA_NAME, DEFAULT_WORKDIR, cache_size_for, make_dataset,
                              scratch_with_offsets)
from fuse_mount.cli import parse_size

DEFAULT_SIZE = "256M"
"""Small enough for a round of both patterns and two trees in about half a minute."""
DEFAULT_RANDOM_READS = 8192
DEFAULT_ROUNDS = 5
PASS_TIMEOUT = 300.0


def on_cpu_seconds(pid: int) -> float:
    """Seconds the live threads of ``pid`` have run on a CPU (``/proc/PID/task/*/schedstat``,
    in ns: ``/proc/PID/stat``'s clock ticks of 10 ms would cost a 256-read pass 39 us of
    resolution per read). Threads that ended are left out; a warm pass starts none."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += proc_cpu.thread_schedstat(pid, int(tid))[0]
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return total


class WrongBytes(Exception):
    """A pass returned bytes other than memfs's."""


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput_ab",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                        help="a source tree to run the spoke daemon from (two or more)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE))
    parser.add_argument("--random-reads", type=int, default=DEFAULT_RANDOM_READS)
    parser.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                        help="extra argument for every spoke mount (repeatable)")
    parser.add_argument("--from-disk", action="store_true",
                        help="evict each tree's cache file from the page cache before its pass")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    trees = parse_trees(parser, args.tree, "fuse_mount")
    if len(trees) < 2 or args.rounds < 1:
        parser.error("two or more trees and one or more rounds are needed")
    if args.size % READ_SIZE:
        parser.error("--size must be a multiple of 16 KiB")
    return args, trees


def _share(figures: list[Figure | None]) -> str:
    values = [f.value * 100 for f in figures if f is not None]
    return (f"{statistics.median(values):5.1f} % [{min(values):.1f}-{max(values):.1f}]"
            if values else "-")


def main(argv: list[str] | None = None) -> int:
    args, trees = _parse(argv)
    mount_procs.exit_on_sigterm()
    workdir = os.path.abspath(args.workdir)
    data = make_dataset(workdir, args.size)
    scratch, offsets = scratch_with_offsets(workdir, "ab", args.size, args.random_reads)
    options = ["--cache-size", str(cache_size_for(args.size)), *args.mount_option]
    reads = reads_per_pass(args.size, args.random_reads)
    mountpoint = os.path.join(scratch, "mnt")
    shares: dict[tuple[str, str], list[Figure | None]] = {(n, p): [] for n in trees
                                                          for p in reads}
    cpu: dict[tuple[str, str], list[float]] = {(n, p): [] for n in trees for p in reads}

    def spoke_pass(hub: mount_procs.Hub, name: str, pattern: str) -> tuple[Pass, float]:
        """One pass through a fresh mount of tree ``name``; the daemon's CPU seconds in it."""
        cache = os.path.join(scratch, f"cache-{name}")
        data_file = mount_procs.cache_file(cache)
        if args.from_disk and os.path.exists(data_file):
            mount_procs.drop_page_cache(data_file)
        with mount_procs.spoke(hub.address, cache, mountpoint, *options,
                               tree=trees[name]) as (spoke, _):
            pid = spoke.pid()
            assert pid is not None
            before = on_cpu_seconds(pid)
            result = run_pass(pattern, os.path.join(mountpoint, DATA_NAME),
                              offsets if pattern == RANDOM else None, PASS_TIMEOUT)
            return result, on_cpu_seconds(pid) - before

    print(f"{args.size / 1e6:.0f} MB file, {args.random_reads} random reads, "
          f"{args.rounds} rounds, cache file {'from disk' if args.from_disk else 'in RAM'}; "
          f"load average (1 min) at start {os.getloadavg()[0]:.1f}")
    try:
        with mount_procs.hub(os.path.dirname(data)) as hub:
            for name in trees:
                spoke_pass(hub, name, SEQUENTIAL)  # cold: fills the tree's cache
            for round_index in range(args.rounds):
                for pattern in reads:
                    with mount_procs.memfs(mountpoint, data) as (path,):
                        ceiling = run_pass(pattern, path, offsets if pattern == RANDOM else None,
                                           PASS_TIMEOUT)
                    line = [f"round {round_index + 1} {pattern:<10} memfs "
                            f"{ceiling.mb_per_s:6.0f} MB/s"]
                    for name in rotation(list(trees), round_index):
                        result, seconds = spoke_pass(hub, name, pattern)
                        if result.digest != ceiling.digest:
                            raise WrongBytes(f"{name}: {pattern} pass read other bytes than memfs")
                        shares[name, pattern].append(
                            Figure(result.mb_per_s / ceiling.mb_per_s, at_least=True))
                        cpu[name, pattern].append(seconds / reads[pattern] * 1e6)
                        line.append(f"{name} {result.mb_per_s:6.0f} "
                                    f"({result.mb_per_s / ceiling.mb_per_s:.1%})")
                    print("  ".join(line), flush=True)
    except (WrongBytes, PassFailed) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average (1 min) at end {os.getloadavg()[0]:.1f}; per read: sequential = per "
          f"{SEQUENTIAL_READ_BYTES >> 20} MiB FUSE read, random = per 16 KiB read")
    print(f"{'tree':<12}{'pattern':<12}{'x memfs: median [min-max]':>28}"
          f"{'daemon CPU us/read: median [min-max]':>38}{'best in':>10}")
    for pattern in reads:
        won, rounds = best_counts({n: shares[n, pattern] for n in trees})
        for name in trees:
            used = cpu[name, pattern]
            spread = f"{statistics.median(used):.1f} [{min(used):.1f}-{max(used):.1f}]"
            print(f"{name:<12}{pattern:<12}{_share(shares[name, pattern]):>28}{spread:>38}"
                  f"{won[name]:>6} of {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
