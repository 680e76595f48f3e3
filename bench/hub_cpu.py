"""What small block reads cost the hub: its CPU seconds per read request, and reads per second.

    python -m bench.hub_cpu [--size 256M] [--reads 20000] [--blocks 4] [--concurrency 32]
                            [--priority prefetch] [--rounds 2] [--hub-pythonpath DIR]...
                            [--workdir /var/tmp/neuralcache-bench]

First, in this process, the CPU of ``Export.read_blocks`` and its checksums alone, per way of
opening the file (open + realpath check, openat2, openat2 nowait). Then a hub subprocess
(``neuralcache hub``) exports one generated file; a ``HubClient`` in this process issues
``--reads`` random ``--blocks``-block reads, ``--concurrency`` of them outstanding, first with
the file resident in the page cache, then with it evicted before the pass. The hub's CPU
(user + system, all its threads, from ``/proc/PID/stat``) is divided by the read requests it
counted (``neuralcache_hub_requests_total{kind="read"}``, hedged copies included).
``--hub-pythonpath DIR`` adds another source tree (e.g. ``git archive HEAD`` unpacked in /tmp)
whose hub is run the same way; the trees alternate within each round, so their figures are
measured side by side. Wrap it in ``flock /tmp/nc-bench.lock``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.daemon_cpu import Usage
from bench.mount_procs import drop_page_cache, exit_on_sigterm
from bench.throughput import DEFAULT_WORKDIR, make_dataset
from fabric.checksum import range_checksums
from fabric.client import HubClient
from fabric.export import Confinement, Export
from fuse_mount.cli import parse_size
from fuse_mount.launch import START_TIMEOUT, Hub
from fuse_mount.scrape import sample, scrape
from neuralcache.blocks import BLOCK_SIZE

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZE = "256M"
DEFAULT_READS = 20_000
"""Enough hub CPU per pass (about a second) that /proc's 10 ms clock ticks add under 1 %."""
DEFAULT_BLOCKS = 4
"""16 KiB: the reads the validation bench's hub serves ~1,500 of a second."""
DEFAULT_CONCURRENCY = 32
DEFAULT_ROUNDS = 2
EXPORT_READS = 5000
"""Reads per way of opening in the in-process phase: a fraction of a second each."""
PASS_TIMEOUT = 300.0
SEED = 7
RESIDENT, EVICTED = "resident", "evicted"
READ_CHUNK = 1 << 20
"""Bytes per read() when pulling the export file into the page cache."""


@dataclass(frozen=True)
class Pass:
    tree: str
    cache: str
    seconds: float
    cpu: float  # hub CPU seconds, user + system
    requests: float  # read requests the hub counted
    inline: float  # of them read on the hub's event loop (0 for a hub without the metric)

    @property
    def cpu_per_request_us(self) -> float:
        return self.cpu / self.requests * 1e6

    @property
    def reads_per_second(self) -> float:
        return self.requests / self.seconds


def hub_counters(hub: Hub) -> tuple[float, float]:
    """Read requests the hub received, and reads it did inline, so far."""
    samples = scrape(hub.metrics_port)
    return (sample(samples, "neuralcache_hub_requests_total", kind="read"),
            sample(samples, "neuralcache_hub_reads_total", path="inline"))


def load_into_page_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_CHUNK)
        while f.readinto(buf):
            pass


async def run_reads(port: int, firsts: list[int], count: int, concurrency: int,
                    priority: str) -> float:
    """Issue the reads (``concurrency`` at a time) and return the seconds they took."""
    client = HubClient("127.0.0.1", port, name="hub-cpu-bench", connect_timeout=START_TIMEOUT)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        entry = next(e for e in await client.metadata(timeout=START_TIMEOUT) if e.kind == "f")
        todo = iter(firsts)

        async def worker() -> None:
            for first in todo:
                await client.read(entry.file_id, entry.version, first, count,
                                  deadline=trio.current_time() + PASS_TIMEOUT, priority=priority)

        started = trio.current_time()
        async with trio.open_nursery() as workers:
            for _ in range(concurrency):
                workers.start_soon(worker)
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    return elapsed


def one_pass(hub: Hub, tree: str, cache: str, data: str, firsts: list[int],
             args: argparse.Namespace) -> Pass:
    if cache == RESIDENT:
        load_into_page_cache(data)
    else:
        drop_page_cache(data)
    requests, inline = hub_counters(hub)
    before = Usage.of(hub.proc.pid)
    seconds = trio.run(run_reads, hub.port, firsts, args.blocks, args.concurrency,
                       args.priority)
    cpu = (Usage.of(hub.proc.pid) - before).cpu
    requests_after, inline_after = hub_counters(hub)
    return Pass(tree, cache, seconds, cpu, requests_after - requests, inline_after - inline)


def export_costs(data: str, firsts: list[int], count: int) -> None:
    """CPU per ``Export.read_blocks`` with its checksums, in this process, file resident: the
    hub's per-read work without its event loop, for each way of opening the file."""
    load_into_page_cache(data)
    print(f"\nExport.read_blocks + checksums, {count} blocks, resident, in one process:")
    for confinement, nowait in ((Confinement.REALPATH, False), (Confinement.OPENAT2, False),
                                (Confinement.OPENAT2, True)):
        export = Export(os.path.dirname(data), confinement=confinement)
        entry = next(e for e in export.scan() if e.kind == "f")
        started = time.process_time()
        for first in firsts:
            range_checksums(export.read_blocks(entry.file_id, entry.version, first, count,
                                               nowait=nowait))
        cpu = (time.process_time() - started) / len(firsts)
        print(f"  {confinement.value:<9}{' nowait' if nowait else '':<8}{cpu * 1e6:6.1f} us")


def report(passes: list[Pass], trees: list[str]) -> None:
    width = max(len(t) for t in trees) + 2
    print(f"\n{'tree':<{width}}{'cache':<10}{'reads/s':>10}{'hub CPU us/read':>17}{'inline':>8}")
    for p in passes:
        print(f"{p.tree:<{width}}{p.cache:<10}{p.reads_per_second:>10.0f}"
              f"{p.cpu_per_request_us:>17.1f}{p.inline / p.requests:>8.0%}")
    print("\nmedians over rounds")
    medians = {}
    for tree in trees:
        for cache in (RESIDENT, EVICTED):
            mine = [p for p in passes if (p.tree, p.cache) == (tree, cache)]
            medians[tree, cache] = (statistics.median(p.reads_per_second for p in mine),
                                    statistics.median(p.cpu_per_request_us for p in mine))
            rate, cpu = medians[tree, cache]
            print(f"{tree:<{width}}{cache:<10}{rate:>10.0f}{cpu:>17.1f}")
    for other in trees[1:]:
        for cache in (RESIDENT, EVICTED):
            base, that = medians[trees[0], cache], medians[other, cache]
            print(f"{cache}: {trees[0]} / {other}: hub CPU per read x{base[1] / that[1]:.2f}, "
                  f"reads/s x{base[0] / that[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE))
    parser.add_argument("--reads", type=int, default=DEFAULT_READS)
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--priority", choices=("demand", "prefetch"), default="prefetch",
                        help="prefetch (default) or demand; on loopback, which loses nothing, "
                             "demand reads are not hedged either (one request each)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--hub-pythonpath", type=Path, action="append", default=[],
                        help="another source tree to run a hub from, measured alongside")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR,
                        help=f"dataset space, not in the repo [{DEFAULT_WORKDIR}]")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    data = make_dataset(os.path.abspath(args.workdir), args.size)
    slots = args.size // BLOCK_SIZE - args.blocks + 1
    rng = random.Random(SEED)
    firsts = [rng.randrange(slots) for _ in range(args.reads)]
    trees = {"this": REPO, **{str(p): p.resolve() for p in args.hub_pythonpath}}
    names = list(trees)
    print(f"hub CPU bench: {args.reads} reads of {args.blocks} blocks, {args.concurrency} "
          f"outstanding, {args.priority}; load average {os.getloadavg()[0]:.2f}", flush=True)
    export_costs(data, firsts[:EXPORT_READS], args.blocks)
    passes = []
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            hub = Hub(Path(os.path.dirname(data)), tree=trees[name]).start()
            try:
                for cache in (RESIDENT, EVICTED):
                    passes.append(one_pass(hub, name, cache, data, firsts, args))
                    p = passes[-1]
                    print(f"round {round_ + 1} {name} {cache}: {p.reads_per_second:.0f} "
                          f"reads/s, {p.cpu_per_request_us:.1f} us hub CPU per read",
                          flush=True)
            finally:
                hub.stop()
    report(passes, names)


if __name__ == "__main__":
    main()
