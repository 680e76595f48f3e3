"""CPU the prefetcher costs per read, and a digest of what it decided, for synthetic patterns.

    python -m bench.prefetch_cpu [--pattern NAME]... [--repeats 3] [--batch N] [--against DIR]

The spoke daemon hands the prefetcher every FUSE read on the loop that serves the reads, so its
cost per call is a cost per read: ``Prefetcher.on_access`` (observe, then plan) by default,
or with ``--batch 8`` as the mount's pump does, ``observe`` per read and one plan per eight
reads and completions. This drives a real ``Prefetcher`` in one process,
with no mount: an in-memory LRU cache of a set capacity holds what was read or prefetched (so
free space and evictions are realistic; the "full" patterns start with the cache full of other
data, the "warm" ones find every block cached, as a second run over a warm spoke does), each
issued request completes after a modelled link delay (serialisation at
``LINK.bandwidth`` plus ``LINK.min_rtt``) through ``on_prefetch_complete``, evictions go to
``on_evicted``, and the daemon's periodic ``plan`` tick runs every ``TICK_S`` of simulated time.
Time is simulated, so every run makes the same decisions; the wall time spent inside the
prefetcher's calls is measured (best of ``--repeats``). For each pattern it prints microseconds
per ``on_access``, per read for all prefetcher calls together, and a digest of every request
issued (id, range, source, times) plus the final stats: equal digests mean equal decisions.
``--against DIR`` runs every pattern alternately on the ``neuralcache`` under DIR (say a
``git archive HEAD`` copy) and on this tree, each run in a fresh interpreter, and prints both
costs, their ratio and whether the digests agree (on a shared machine only a side-by-side
ratio means much).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

from neuralcache.blocks import BLOCK_SIZE, KEY_SHIFT, block_key, block_span
from neuralcache.catalog import Catalog
from neuralcache.events import AccessEvent, CacheView, LinkEstimate, PrefetchRequest
from neuralcache.hints import HintRecord
from neuralcache.prefetcher import Prefetcher

MIB = 1 << 20

LINK = LinkEstimate(bandwidth=125e6, min_rtt=0.02)
"""A 1 Gbit/s WAN path with a 20 ms round trip: the prefetcher's budgets follow from it."""

TICK_S = 0.05
"""The daemon's planning tick (fuse_mount/prefetch.py TICK_INTERVAL)."""

SAMPLE = 16 * 1024
"""A data-loader sample, and the random reads' size."""

RANDOM_FILE = 1 << 30
"""The random patterns read first-touch samples from one file this big."""

RANDOM_READS = 16384
"""Reads of the random patterns (256 MiB)."""

READ_INTERVAL_S = 100e-6
"""Simulated time between 16 KiB reads (160 MB/s of reading)."""

SEQ_FILES, SEQ_FILE_BYTES, SEQ_READ = 4, 256 * MIB, MIB
"""The sequential pattern: 1 MiB reads through four 256 MiB shards in name order."""

SEQ_INTERVAL_S = 4e-3
"""Simulated time between 1 MiB reads (250 MB/s)."""

HINT_SHARDS, HINT_SHARD_BYTES, WORKERS, BATCH = 8, 32 * MIB, 8, 32
"""The hinted pattern: a shuffled epoch of 16 KiB samples over eight 32 MiB shards, read by
eight data-loader workers that each take a batch of 32 samples in turn."""

ROOMY_CACHE = 2 << 30
"""Cache that holds everything a pattern reads."""

FULL_CACHE = 128 * MIB
"""Cache of the "full" patterns, filled with other data before the first read."""

OTHER_FILE = 1 << 20
"""File id of the data the full cache starts with (not in the catalog)."""

SEED = 1


class ModelCache(CacheView):
    """An LRU block cache (the prefetcher's ``CacheView``) whose eviction spares protected
    blocks, as the daemon's BlockCache does; evictions are reported to ``evicted``."""

    def __init__(self, capacity: int, prefill: bool, warm: bool = False) -> None:
        self.capacity_blocks = capacity // BLOCK_SIZE
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.protected: Callable[[int, int], bool] = lambda f, b: False
        self.warm = warm  # every block of every file is cached; free space none if prefill
        if prefill:
            base = block_key(OTHER_FILE, 0)
            self.lru = OrderedDict.fromkeys(range(base, base + self.capacity_blocks))

    def contains(self, file_id: int, block: int) -> bool:
        return self.warm or block_key(file_id, block) in self.lru

    def present_until(self, file_id: int, first: int, stop: int) -> int:
        return self._stretch_end(file_id, first, stop, True)

    def absent_until(self, file_id: int, first: int, stop: int) -> int:
        return self._stretch_end(file_id, first, stop, False)

    def _stretch_end(self, file_id: int, first: int, stop: int, present: bool) -> int:
        """Block by block, as the mount's ``MountCacheView`` walks its keys."""
        base, lru, warm = block_key(file_id, 0), self.lru, self.warm
        for block in range(first, stop):
            if (warm or base | block in lru) != present:
                return block
        return stop

    def free_bytes(self) -> int:
        if self.warm:
            return 0 if self.lru else self.capacity_blocks * BLOCK_SIZE  # lru: the prefill
        return (self.capacity_blocks - len(self.lru)) * BLOCK_SIZE

    def capacity_bytes(self) -> int:
        return self.capacity_blocks * BLOCK_SIZE

    def insert(self, file_id: int, first: int, stop: int) -> list[tuple[int, int]]:
        """Hold blocks ``[first, stop)`` as most recent; returns the (file, block)s evicted."""
        if self.warm:
            return []  # nothing to hold that is not held already
        lru = self.lru
        base = block_key(file_id, 0)
        for block in range(first, stop):
            key = base | block
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        evicted = []
        spared = 0
        mask = (1 << KEY_SHIFT) - 1
        while len(lru) > self.capacity_blocks:
            key = next(iter(lru))
            fid, block = key >> KEY_SHIFT, key & mask
            if spared < len(lru) and self.protected(fid, block):
                lru.move_to_end(key)
                spared += 1
                continue
            del lru[key]
            evicted.append((fid, block))
        return evicted


@dataclass
class Pattern:
    """A catalog, the reads (stream hint, file, offset, length) and what is timed."""

    name: str
    about: str
    catalog: Catalog
    reads: list[tuple[int, int, int, int]]
    interval: float
    capacity: int
    prefill: bool = False
    warm: bool = False  # the data is all cached already (a second run over a warm spoke)
    timed_from: int = 0  # reads before this one warm the prefetcher up (in the digest, not timed)
    hints: list[HintRecord] = field(default_factory=list)


@dataclass
class Outcome:
    access_s: float  # wall seconds inside on_access over the timed reads
    total_s: float  # wall seconds inside every prefetcher call over the timed reads
    timed_reads: int
    requests: int
    digest: str


def _random_order(n_reads: int) -> list[int]:
    rng = random.Random(SEED)
    return [s * SAMPLE for s in rng.sample(range(RANDOM_FILE // SAMPLE), n_reads)]


def _random(name: str, about: str, passes: int, capacity: int, prefill: bool,
            warm: bool = False) -> Pattern:
    catalog = Catalog([(1, "data.bin", RANDOM_FILE)])
    order = _random_order(RANDOM_READS)
    reads = [(3, 1, off, SAMPLE) for off in order] * passes
    return Pattern(name, about, catalog, reads, READ_INTERVAL_S, capacity, prefill, warm,
                   timed_from=RANDOM_READS * (passes - 1))


def _sequential(name: str, about: str, warm: bool = False) -> Pattern:
    catalog = Catalog([(i + 1, f"seq/shard-{i:03d}.bin", SEQ_FILE_BYTES)
                       for i in range(SEQ_FILES)])
    reads = [(10 + fid, fid, off, SEQ_READ) for fid in range(1, SEQ_FILES + 1)
             for off in range(0, SEQ_FILE_BYTES, SEQ_READ)]
    return Pattern(name, about, catalog, reads, SEQ_INTERVAL_S, ROOMY_CACHE, warm=warm)


def _hinted(name: str, about: str, capacity: int, prefill: bool, warm: bool = False) -> Pattern:
    """The job announces its shuffled order (one record, as HintedSampler does for an epoch
    this short); worker ``w`` reads batches ``w, w + 8, ...``, the eight in step, each worker
    with its own handle per shard."""
    catalog = Catalog([(i + 1, f"hint/shard-{i:03d}.bin", HINT_SHARD_BYTES)
                       for i in range(HINT_SHARDS)])
    samples = [(f, off) for f in range(1, HINT_SHARDS + 1)
               for off in range(0, HINT_SHARD_BYTES, SAMPLE)]
    order = random.Random(SEED).sample(samples, len(samples))
    paths = {f: f"hint/shard-{f - 1:03d}.bin" for f in range(1, HINT_SHARDS + 1)}
    items = tuple((paths[f], off, SAMPLE) for f, off in order)
    batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    reads = []
    for group in range(0, len(batches), WORKERS):
        lanes = batches[group:group + WORKERS]
        for k in range(BATCH):
            for worker, batch in enumerate(lanes):
                if k < len(batch):
                    f, off = batch[k]
                    reads.append((worker * 100 + f, f, off, SAMPLE))
    return Pattern(name, about, catalog, reads, READ_INTERVAL_S, capacity, prefill, warm,
                   hints=[HintRecord(0, items, "rank0")])


def patterns() -> list[Pattern]:
    return [
        _random("random", "first-touch random 16 KiB, 1 GiB file", 1, ROOMY_CACHE, False),
        _random("random-full", "the same, cache full of other data", 1, FULL_CACHE, True),
        _random("replay", "the random order read again (timed: 2nd pass)", 2, ROOMY_CACHE,
                False),
        _random("replay-full", "the same, cache full of other data", 2, FULL_CACHE, True),
        _random("warm", "first-touch random 16 KiB, every block cached", 1, ROOMY_CACHE,
                False, warm=True),
        _random("warm-replay", "the same read again (timed: 2nd pass)", 2, ROOMY_CACHE, False,
                warm=True),
        _random("warm-full", "every block cached, no free space", 1, FULL_CACHE, True,
                warm=True),
        _sequential("sequential", "1 MiB reads through 4 x 256 MiB shards"),
        _sequential("sequential-warm", "the same, every block cached (a warm spoke)", warm=True),
        _hinted("hinted", "8 workers, shuffled 16 KiB samples, 8 shards, hints", ROOMY_CACHE,
                False),
        _hinted("hinted-full", "the same, cache full of other data", FULL_CACHE, True),
        _hinted("hinted-warm", "the same, every block cached (a warm spoke)", ROOMY_CACHE,
                False, warm=True),
    ]


class _Feed:
    """Hands the prefetcher reads and completions: each with its own plan (``batch`` 1:
    ``on_access``, ``on_prefetch_complete``), or one plan per ``batch`` of them (``observe``,
    ``complete``), as the mount's pump does (``PUMP_BATCH``)."""

    def __init__(self, pf: Prefetcher, batch: int) -> None:
        self.pf = pf
        self.batch = batch
        self.unplanned = 0  # reads and completions handed over since the last plan

    def read(self, now: float, event: AccessEvent) -> list[PrefetchRequest]:
        if self.batch == 1:
            return self.pf.on_access(now, event)
        self.pf.observe(now, event)
        return self._counted(now)

    def completed(self, now: float, request: PrefetchRequest) -> list[PrefetchRequest]:
        if self.batch == 1:
            return self.pf.on_prefetch_complete(now, request)
        self.pf.complete(now, request)
        return self._counted(now)

    def _counted(self, now: float) -> list[PrefetchRequest]:
        self.unplanned += 1
        if self.unplanned < self.batch:
            return []
        self.unplanned = 0
        return self.pf.plan(now)


def run(pattern: Pattern, batch: int = 1) -> Outcome:
    """One simulated run; wall time is counted only inside the prefetcher's calls.

    ``batch``: reads and completions per plan (``_Feed``)."""
    clock = time.perf_counter
    cache = ModelCache(pattern.capacity, pattern.prefill, pattern.warm)
    pf = Prefetcher(pattern.catalog, cache, link=LINK)
    cache.protected = pf.is_protected
    digest = hashlib.sha256()
    inflight: list[tuple[float, int, PrefetchRequest]] = []
    link_free = 0.0
    n_requests = 0

    def issue(requests: list[PrefetchRequest], now: float) -> None:
        nonlocal link_free, n_requests
        for r in requests:
            digest.update(repr((r.request_id, r.file_id, r.first, r.count, r.source,
                                r.issued_at, r.need_at)).encode())
            link_free = max(link_free, now) + r.count * BLOCK_SIZE / LINK.bandwidth
            heapq.heappush(inflight, (link_free + LINK.min_rtt, r.request_id, r))
            n_requests += 1

    def evict(evicted: list[tuple[int, int]]) -> None:
        for fid, block in evicted:
            pf.on_evicted(fid, block)

    access_s = total_s = 0.0
    next_tick = TICK_S
    feed = _Feed(pf, batch)
    for record in pattern.hints:
        issue(pf.on_hints(0.0, record), 0.0)
    for i, (stream, fid, offset, length) in enumerate(pattern.reads):
        now = i * pattern.interval
        timed = i >= pattern.timed_from
        spent = 0.0
        while inflight and inflight[0][0] <= now:
            done_at, _, request = heapq.heappop(inflight)
            evicted = cache.insert(request.file_id, request.first, request.end)
            t0 = clock()
            evict(evicted)
            more = feed.completed(done_at, request)
            spent += clock() - t0
            issue(more, done_at)
        if now >= next_tick:
            t0 = clock()
            more = pf.plan(now)
            spent += clock() - t0
            issue(more, now)
            next_tick = now + TICK_S
        first, stop = block_span(offset, length)
        evicted = cache.insert(fid, first, stop)
        t0 = clock()
        evict(evicted)
        t1 = clock()
        requests = feed.read(now, AccessEvent(stream, fid, offset, length))
        t2 = clock()
        issue(requests, now)
        if timed:
            access_s += t2 - t1
            total_s += spent + (t2 - t0)
    stats = pf.stats()
    digest.update(repr((stats.issued_requests, stats.issued_blocks, stats.useful_blocks,
                        stats.late_blocks, stats.wasted_blocks, sorted(stats.per_source.items()))
                       ).encode())
    return Outcome(access_s, total_s, len(pattern.reads) - pattern.timed_from, n_requests,
                   digest.hexdigest()[:16])


def _run_in(tree: str, name: str, batch: int) -> Outcome:
    """One run of a pattern in a fresh interpreter importing ``neuralcache`` from ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--pattern", name,
                           "--batch", str(batch), "--json"], env=env, check=True,
                          capture_output=True, text=True)
    return Outcome(**json.loads(done.stdout))


def _compare(names: list[str], baseline: str, repeats: int, batch: int) -> int:
    """Each pattern run alternately on ``baseline`` and on this tree (best of ``repeats``)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"baseline {baseline} vs this tree {here}; us per read, best of {repeats}, "
          "runs alternating")
    print(f"{'pattern':<12} {'on_access':>9} {'base':>7} {'ratio':>6}   {'all':>7} {'base':>7} "
          f"{'ratio':>6}  same decisions")
    same_everywhere = True
    for name in names:
        runs: dict[str, list[Outcome]] = {"base": [], "new": []}
        for _ in range(repeats):
            runs["base"].append(_run_in(baseline, name, batch))
            runs["new"].append(_run_in(here, name, batch))
        base = min(runs["base"], key=lambda o: o.access_s)
        new = min(runs["new"], key=lambda o: o.access_s)
        base_all = min(o.total_s for o in runs["base"]) / base.timed_reads * 1e6
        new_all = min(o.total_s for o in runs["new"]) / new.timed_reads * 1e6
        base_acc = base.access_s / base.timed_reads * 1e6
        new_acc = new.access_s / new.timed_reads * 1e6
        same = {o.digest for o in runs["base"] + runs["new"]} == {base.digest}
        same_everywhere &= same
        print(f"{name:<12} {new_acc:>9.1f} {base_acc:>7.1f} {new_acc / base_acc:>6.2f}   "
              f"{new_all:>7.1f} {base_all:>7.1f} {new_all / base_all:>6.2f}  "
              f"{'yes' if same else 'NO'} ({new.digest})", flush=True)
    return 0 if same_everywhere else 1


def main(argv: list[str] | None = None) -> int:
    all_patterns = patterns()
    names = [p.name for p in all_patterns]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", action="append", choices=names,
                        help="run only these patterns (repeatable); default all")
    parser.add_argument("--repeats", type=int, default=3, help="runs per pattern; best counts")
    parser.add_argument("--against", metavar="DIR",
                        help="also run each pattern on the neuralcache package under DIR (e.g. "
                             "a `git archive HEAD` copy), alternating, and print the ratios")
    parser.add_argument("--batch", type=int, default=1, metavar="N",
                        help="plan once per N reads and completions, as the mount's pump does "
                             "(8); default 1: on_access and on_prefetch_complete, each planning")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    chosen = [p for p in all_patterns if not args.pattern or p.name in args.pattern]
    if args.against:
        return _compare([p.name for p in chosen], args.against, args.repeats, args.batch)
    if args.json:
        (pattern,) = chosen
        print(json.dumps(asdict(run(pattern, args.batch))))
        return 0
    print(f"{'pattern':<12} {'reads':>6} {'us/on_access':>12} {'us/read all':>11} "
          f"{'requests':>8}  digest            what")
    for pattern in chosen:
        outcomes = [run(pattern, args.batch) for _ in range(args.repeats)]
        digests = {o.digest for o in outcomes}
        if len(digests) != 1:
            print(f"{pattern.name}: runs disagree {sorted(digests)}", file=sys.stderr)
            return 1
        best = min(outcomes, key=lambda o: o.access_s)
        n = best.timed_reads
        print(f"{pattern.name:<12} {n:>6} {best.access_s / n * 1e6:>12.1f} "
              f"{min(o.total_s for o in outcomes) / n * 1e6:>11.1f} {best.requests:>8}  "
              f"{best.digest}  {pattern.about}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
