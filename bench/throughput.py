"""Read throughput of the mount beside the local file and the Python FUSE ceiling.

    python -m bench.throughput [--size 1G] [--random-reads N] [--rounds 3] [--quick]
                               [--mount-option OPT]... [--pass-timeout S] [--workdir DIR]

One file of ``--size`` random bytes is read two ways in 16 KiB ``pread`` calls by one reader
process per pass (``bench.read_pass``): sequentially from start to end, and at ``--random-reads``
distinct random 16 KiB-aligned offsets (the same offsets, in the same order, for every target;
the descriptor is marked ``POSIX_FADV_RANDOM`` so that no target's kernel readahead turns a
16 KiB read into a larger one). The targets, all measured in one run:

- local: the file itself, its pages evicted first (``posix_fadvise(DONTNEED)``), so from disk;
- memfs ceiling: the same bytes served from memory by ``bench.memfs`` (minimal pyfuse3 + trio,
  the spoke's mount options and readahead): what any Python FUSE filesystem can reach;
- cold spoke: ``neuralcache mount`` over an empty cache, hub on loopback, the hub's file evicted;
- warm spoke: unmounted and mounted again over the filled cache (the unmount drops the mount's
  page cache), the LMDB file's pages evicted, so blocks come from LMDB on disk like local's;
- warm spoke, LMDB in page cache: mounted once more without evicting the LMDB file.

Every FUSE pass gets a fresh mount, so no pass reads pages another one left in the kernel. Each
pass hashes what it read; every target must return the local file's bytes. A pass that hangs
past ``--pass-timeout`` is killed and reported as failed. Every pass runs ``--rounds`` times,
targets interleaved; the table shows medians. MB/s is 10**6 bytes per second of wall time,
ratios are to the memfs ceiling of the same run.

The dataset stays in ``WORKDIR/export-SIZE`` for the next run; caches and mountpoints are made in
``WORKDIR/run-PID`` and removed, every mount unmounted and every process stopped, even on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field

import numpy as np

from bench import mount_procs, proc_cpu
from bench.read_pass import MB, RANDOM, READ_SIZE, SEQUENTIAL, Pass, PassFailed
from bench.read_pass import run as run_pass
from fuse_mount.cli import parse_size
from fuse_mount.launch import Hub
from fuse_mount.scrape import sample, scrape

DEFAULT_SIZE = "1G"
QUICK_SIZE = "256M"
"""``--quick``: small enough to iterate on in under a minute on two shared cores."""
DEFAULT_RANDOM_READS = 16384
"""A quarter of a 1 GiB file's 16 KiB slots: enough reads that per-read cost dominates."""
QUICK_RANDOM_READS = 4096
DEFAULT_ROUNDS = 3
"""Every pass runs this many times, targets interleaved, and the table shows medians: the two
cores are shared, so a single pass can catch someone else's burst."""
SEED = 20240611
"""Fixes the dataset's bytes and the random offsets, so runs are comparable."""
WRITE_CHUNK = 64 * 1024 * 1024
"""Bytes generated and written per step while making the dataset."""
MIN_CACHE_SIZE = 2 << 30
"""The spoke's ``--cache-size``: the issue's 2G, or twice the dataset if that is larger."""
DEFAULT_PASS_TIMEOUT = 300.0
"""Seconds a pass may take before its reader is killed and the pass counts as hung (a healthy
cold pass over 1 GiB takes well under a minute here)."""
DEFAULT_WORKDIR = "/var/tmp/neuralcache-bench"
DATA_NAME = "data.bin"


def random_offsets(size: int, count: int) -> np.ndarray:
    """``count`` distinct READ_SIZE-aligned offsets in random order (no read repeats another)."""
    slots = size // READ_SIZE
    if count > slots:
        raise SystemExit(f"--random-reads {count} exceeds the {slots} 16 KiB slots of the file")
    return np.random.default_rng(SEED + 1).permutation(slots)[:count] * READ_SIZE


def cache_size_for(size: int) -> int:
    """The spoke's ``--cache-size`` over a ``size``-byte dataset (``MIN_CACHE_SIZE``)."""
    return max(MIN_CACHE_SIZE, 2 * size)


def scratch_with_offsets(workdir: str, prefix: str, size: int, count: int) -> tuple[str, str]:
    """A new scratch directory ``WORKDIR/PREFIX-PID`` (the caller removes it) and in it the
    ``random_offsets`` of a ``size``-byte file, saved for ``bench.read_pass``: both paths."""
    scratch = os.path.join(workdir, f"{prefix}-{os.getpid()}")
    os.makedirs(scratch)
    offsets = os.path.join(scratch, "offsets.npy")
    np.save(offsets, random_offsets(size, count))
    return scratch, offsets


def make_dataset(workdir: str, size: int) -> str:
    """``WORKDIR/export-SIZE/data.bin`` of random bytes, made once and reused."""
    path = os.path.join(workdir, f"export-{size}", DATA_NAME)
    done = os.path.join(workdir, f"export-{size}.complete")  # outside the export: not served
    if os.path.exists(done) and os.path.getsize(path) == size:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"making {size / MB:.0f} MB dataset {path}", flush=True)
    rng = np.random.default_rng(SEED)
    with open(path, "wb") as f:
        for start in range(0, size, WRITE_CHUNK):
            f.write(rng.bytes(min(WRITE_CHUNK, size - start)))
    with open(done, "w"):
        pass
    return path


def _spoke_stats(port: int) -> str:
    """Hit ratio, mean FUSE read size and where warm runs were read (on the event loop or in
    the reader thread) of the spoke behind metrics ``port``."""
    m = scrape(port)
    hits = sample(m, "neuralcache_cache_hit_blocks_total")
    misses = sample(m, "neuralcache_cache_miss_blocks_total")
    reads = sample(m, "neuralcache_reads_total", outcome="ok")
    cache_bytes = sample(m, "neuralcache_read_bytes_total", source="cache")
    hub_bytes = sample(m, "neuralcache_read_bytes_total", source="hub")
    blocks = hits + misses
    ratio = hits / blocks if blocks else 0.0
    mean_read = (cache_bytes + hub_bytes) / reads / 1024 if reads else 0.0
    inline = sample(m, "neuralcache_cache_run_reads_total", path="inline")
    threaded = sample(m, "neuralcache_cache_run_reads_total", path="reader_thread")
    return (f"hit ratio {ratio:.1%} ({hits:.0f} of {blocks:.0f} blocks), "
            f"{cache_bytes / MB:.1f} MB from cache, {hub_bytes / MB:.1f} MB from hub, "
            f"{reads:.0f} FUSE reads of {mean_read:.0f} KiB on average, "
            f"runs read {inline:.0f} inline / {threaded:.0f} in the reader thread")


LOCAL = "local file (from disk)"
CEILING = "memfs ceiling"
COLD = "cold spoke (hub on loopback)"
WARM = "warm spoke (LMDB from disk)"
HOT = "warm spoke (LMDB in page cache)"
TARGETS = (LOCAL, CEILING, COLD, WARM, HOT)
TARGET_RATIOS = {SEQUENTIAL: 0.70, RANDOM: 0.50}
"""The issue's goals for the warm spoke, as fractions of the memfs ceiling."""


@dataclass
class Results:
    """Every pass of a run by (target, pattern), failures, and the spoke's counters."""

    passes: dict[tuple[str, str], list[Pass]] = field(default_factory=dict)
    failures: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    stats: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, target: str, pattern: str, result: Pass, stolen: float) -> None:
        """``stolen``: the share of the machine's CPUs its hypervisor took during the pass
        (``bench.proc_cpu.STOLEN``), printed beside the pass: it slows every target alike."""
        self.passes.setdefault((target, pattern), []).append(result)
        print(f"  {target}, {pattern}: {result.mb_per_s:.1f} MB/s "
              f"({100 * stolen:.0f} % of the CPUs stolen)", flush=True)

    def fail(self, target: str, pattern: str, error: str) -> None:
        self.failures.setdefault((target, pattern), []).append(error)
        print(f"  {target}, {pattern}: FAILED: {error}", flush=True)

    def median(self, target: str, pattern: str) -> float | None:
        passes = self.passes.get((target, pattern))
        return statistics.median(p.mb_per_s for p in passes) if passes else None

    def wrong(self) -> list[str]:
        """(target, pattern) cells whose bytes differ from the local file's."""
        expected = {pattern: passes[0].digest for (target, pattern), passes
                    in self.passes.items() if target == LOCAL}
        return [f"{target} {pattern}" for (target, pattern), passes in self.passes.items()
                if any(p.digest != expected.get(pattern, p.digest) for p in passes)]


class Bench:
    """The passes of one run, sharing one dataset, one hub and one scratch directory."""

    def __init__(self, data: str, offsets: np.ndarray, scratch: str, cache_size: int,
                 mount_options: list[str], pass_timeout: float) -> None:
        self.data = data
        self.pass_timeout = pass_timeout
        self.mount_options = mount_options
        self.scratch = scratch
        self.offsets_file = os.path.join(scratch, "offsets.npy")
        np.save(self.offsets_file, offsets)
        self.cache_size = str(cache_size)
        self.mountpoint = os.path.join(scratch, "mnt")
        self.results = Results()

    def _pass(self, target: str, pattern: str, path: str) -> None:
        offsets = self.offsets_file if pattern == RANDOM else None
        mark = proc_cpu.stolen_ticks()
        try:
            result = run_pass(pattern, path, offsets, self.pass_timeout)
            self.results.add(target, pattern, result, proc_cpu.stolen_share_since(mark))
        except PassFailed as exc:
            self.results.fail(target, pattern, str(exc))

    def local(self) -> None:
        for pattern in (SEQUENTIAL, RANDOM):
            mount_procs.drop_page_cache(self.data)
            self._pass(LOCAL, pattern, self.data)

    def memfs(self) -> None:
        for pattern in (SEQUENTIAL, RANDOM):
            with mount_procs.memfs(self.mountpoint, self.data) as (path,):
                self._pass(CEILING, pattern, path)

    def _spoke_pass(self, hub: Hub, cache: str, target: str, pattern: str) -> None:
        with mount_procs.spoke(hub.address, cache, self.mountpoint,
                               "--cache-size", self.cache_size, *self.mount_options) as (sp, _):
            self._pass(target, pattern, os.path.join(self.mountpoint, DATA_NAME))
            self.results.stats[(target, pattern)] = _spoke_stats(sp.metrics_port)

    def spokes(self, hub: Hub) -> None:
        """Cold passes over empty caches; warm ones over the cache the cold sequential pass filled,
        its LMDB file evicted (from disk) or left in the page cache by the pass before."""
        filled = os.path.join(self.scratch, "cache-filled")
        unfilled = os.path.join(self.scratch, "cache-random-only")
        for cache, pattern in ((filled, SEQUENTIAL), (unfilled, RANDOM)):
            mount_procs.drop_page_cache(self.data)  # the hub reads from disk too
            self._spoke_pass(hub, cache, COLD, pattern)
        shutil.rmtree(unfilled)
        lmdb_file = mount_procs.cache_file(filled)
        for pattern in (SEQUENTIAL, RANDOM):
            mount_procs.drop_page_cache(lmdb_file)
            self._spoke_pass(hub, filled, WARM, pattern)
            self._spoke_pass(hub, filled, HOT, pattern)
        shutil.rmtree(filled)


def format_table(results: Results) -> str:
    """The one table: median MB/s and its ratio to the ceiling's, per access pattern."""
    header = (f"{'target':<33}{'sequential':>12}{'x ceiling':>11}"
              f"{'random 16K':>12}{'x ceiling':>11}")
    lines = [header, f"{'':<33}{'MB/s':>12}{'':>11}{'MB/s':>12}", "-" * len(header)]
    for target in TARGETS:
        cells = []
        for pattern, digits in ((SEQUENTIAL, 0), (RANDOM, 1)):
            value = results.median(target, pattern)
            ceiling = results.median(CEILING, pattern)
            cells.append(f"{value:>12.{digits}f}" if value is not None else f"{'failed':>12}")
            cells.append(f"{value / ceiling:>11.0%}" if value is not None and ceiling
                         else f"{'-':>11}")
        lines.append(f"{target:<33}{''.join(cells)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, help=f"dataset size [{DEFAULT_SIZE}]")
    parser.add_argument("--random-reads", type=int,
                        help=f"16 KiB random reads per pass [{DEFAULT_RANDOM_READS}]")
    parser.add_argument("--rounds", type=int,
                        help=f"times every pass is run; the table shows medians [{DEFAULT_ROUNDS}]")
    parser.add_argument("--quick", action="store_true",
                        help=f"defaults of {QUICK_SIZE}, {QUICK_RANDOM_READS} reads, 1 round")
    parser.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                        help="extra argument for every neuralcache mount, e.g. "
                             "--mount-option=--no-prefetch (repeatable)")
    parser.add_argument("--pass-timeout", type=float, default=DEFAULT_PASS_TIMEOUT,
                        help=f"kill a pass's reader after this many s [{DEFAULT_PASS_TIMEOUT:g}]")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR,
                        help=f"dataset and scratch space, not in the repo [{DEFAULT_WORKDIR}]")
    args = parser.parse_args(argv)
    size = args.size or parse_size(QUICK_SIZE if args.quick else DEFAULT_SIZE)
    reads = args.random_reads or (QUICK_RANDOM_READS if args.quick else DEFAULT_RANDOM_READS)
    rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS)
    if size % READ_SIZE:
        parser.error("--size must be a multiple of 16 KiB")
    mount_procs.exit_on_sigterm()
    load_at_start = os.getloadavg()[0]  # the cores are shared: say how busy they were

    workdir = os.path.abspath(args.workdir)
    data = make_dataset(workdir, size)
    scratch = os.path.join(workdir, f"run-{os.getpid()}")
    os.makedirs(scratch)
    bench = Bench(data, random_offsets(size, reads), scratch, cache_size_for(size),
                  args.mount_option, args.pass_timeout)
    print(f"file {size / MB:.0f} MB; sequential: {size // READ_SIZE} reads of 16 KiB; "
          f"random: {reads} reads of 16 KiB; {rounds} round(s); mount options: "
          f"{' '.join(args.mount_option) or 'defaults'}", flush=True)
    try:
        with mount_procs.hub(os.path.dirname(data)) as hub:
            for r in range(rounds):
                print(f"round {r + 1}/{rounds}", flush=True)
                bench.local()
                bench.memfs()
                bench.spokes(hub)
            hub_sent = mount_procs.hub_sent_bytes(hub)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average (1 min) at start {load_at_start:.1f}, at end {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    results = bench.results
    print()
    print(format_table(results))
    print()
    for (target, pattern), stats in results.stats.items():
        print(f"{target}, {pattern}: {stats}")
    print(f"hub sent {hub_sent / MB:.1f} MB in all")
    for pattern, goal in TARGET_RATIOS.items():
        for target in (WARM, HOT):
            value, ceiling = results.median(target, pattern), results.median(CEILING, pattern)
            verdict = (f"{value / ceiling:.0%} {'met' if value / ceiling >= goal else 'MISSED'}"
                       if value is not None and ceiling else "no figure")
            print(f"target: {target} {pattern} >= {goal:.0%} of the ceiling: {verdict}")
    for (target, pattern), errors in results.failures.items():
        print(f"FAILED {len(errors)} {pattern} pass(es) of {target}: {errors[0]}")
    wrong = results.wrong()
    print("bytes: " + (f"WRONG in {', '.join(wrong)}" if wrong
                       else "every completed pass returned the local file's bytes"))
    return 1 if wrong or results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
