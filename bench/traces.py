"""Synthetic block-access traces of PyTorch data loading, for offline prefetcher evaluation.

Each trace comes from a small model of a DataLoader: ``workers`` processes, ``prefetch_factor``
batches each in flight, batch b handled by worker b % workers, a consumer (the GPU step) taking
batches in order no faster than one per ``step``; an epoch starts when the previous one has been
consumed (non-persistent workers). Reading is instantaneous here (the simulator adds the link);
a worker spends ``SAMPLE_CPU_S`` decoding each sample. The step is chosen so that the node reads
``DEMAND_RATE`` bytes/s in steady state: 24 x 16 KiB per 20 ms, 79 % of a 200 Mbit/s link, as in
the brief's benchmark. Workers of one rank share one descriptor per file (opened before fork), so
they share a stream hint; a small-file data set opens every file anew.

Traces (each ``EPOCHS`` epochs): ``seq8``/``seq64`` (a), ``ddp8`` (b), ``shuffle`` (c),
``shuffle_hinted`` (d), ``tar`` (e), ``smallfiles`` (f), and two extra ones: ``fixed_shuffle``
(one shuffled order every epoch with a cache half the data: what epoch replay is for) and
``records`` (headers of an irregular repeating record layout: where strides fail).

Usage: ``python -m bench.traces --out DIR [--quick]`` writes ``DIR/NAME.trace`` files.
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from neuralcache.hints import HintRecord
from neuralcache.trace import READ_DTYPE, Trace, write_trace

SAMPLE_BYTES = 16 * 1024
BATCH = 24
PREFETCH_FACTOR = 4
DEMAND_RATE = BATCH * SAMPLE_BYTES / 0.020
"""Node-wide read rate in steady state (bytes/s): the brief's batch of 24 x 16 KiB per 20 ms."""

SAMPLE_CPU_S = 0.002
"""Worker time per sample (decode, collate); 2.4 batches load concurrently at steady state."""

EPOCHS = 3
READ_CHUNK = 128 * 1024
"""Largest FUSE read (max_read): whole-shard readers read in chunks of this size."""

SHARDS = 8
TAR_SHARDS = 16
SMALL_FILE_MEAN = 110_000
RECORD_PATTERN = (3, 7, 2, 5, 9, 4)
"""Record sizes in blocks of the irregular layout; the reader reads each record's first block."""

Read = tuple[int, int, int]  # file_id, offset, length
Sample = list[Read]
Batch = list[Sample]


@dataclass
class Files:
    """A file table under construction."""

    table: dict[int, tuple[str, int]]

    def add(self, path: str, size: int) -> int:
        fid = len(self.table) + 1
        self.table[fid] = (path, size)
        return fid

    def path(self, fid: int) -> str:
        return self.table[fid][0]


class Recorder:
    """Collects reads and hints across epochs and runs the loader timing model."""

    def __init__(self, files: Files) -> None:
        self.files = files
        self.rows: list[tuple[float, int, int, int, int, int]] = []
        self.hints: list[tuple[float, HintRecord]] = []
        self.epoch_starts: list[int] = []
        self.t = 0.0
        self._handles = 0

    def new_handle(self) -> int:
        self._handles += 1
        return 1_000_000 + self._handles

    def epoch(self, ranks: list[list[Batch]], workers: int, step: float,
              stream_of: Callable[[int, int], int], hints: list[list[Read]] | None = None
              ) -> None:
        """One epoch: ``ranks[r][b]`` is rank r's batch b; ranks step in lockstep."""
        self.epoch_starts.append(len(self.rows))
        if hints is not None:
            for r, items in enumerate(hints):
                self.hints.append((self.t, HintRecord(
                    len(self.epoch_starts) - 1,
                    tuple((self.files.path(f), o, n) for f, o, n in items), str(r))))
        outstanding = workers * PREFETCH_FACTOR
        nbatches = len(ranks[0])
        free = [[self.t] * workers for _ in ranks]
        consumed: list[float] = []
        for b in range(nbatches):
            dispatch = self.t if b < outstanding else consumed[b - outstanding]
            ready = 0.0
            for r, batches in enumerate(ranks):
                w = b % workers
                t = max(dispatch, free[r][w])
                for sample in batches[b]:
                    for fid, off, length in sample:
                        self.rows.append((t, r * 1000 + w, stream_of(r, fid), fid, off, length))
                    t += SAMPLE_CPU_S
                free[r][w] = t
                ready = max(ready, t)
            consumed.append(max(ready, consumed[-1] + step) if consumed else ready)
        self.t = consumed[-1] + step

    def trace(self, name: str, **meta: object) -> Trace:
        rows = sorted(self.rows, key=lambda r: r[0])
        reads = np.array(rows, dtype=READ_DTYPE)
        # Epochs never overlap in time, so sorting keeps each epoch's reads contiguous.
        return Trace(dict(self.files.table), reads, self.hints,
                     {"name": name, "epoch_starts": self.epoch_starts, **meta})


def _shards(files: Files, total: int) -> tuple[list[int], int]:
    size = total // SHARDS // SAMPLE_BYTES * SAMPLE_BYTES
    return [files.add(f"tokens/shard-{i:05d}.bin", size) for i in range(SHARDS)], size


def _sample_reads(shards: list[int], shard_size: int, index: int) -> Sample:
    per = shard_size // SAMPLE_BYTES
    return [(shards[index // per], index % per * SAMPLE_BYTES, SAMPLE_BYTES)]


def _batches(samples: list[Sample], batch: int = BATCH) -> list[Batch]:
    return [samples[i:i + batch] for i in range(0, len(samples) - batch + 1, batch)]


def packed(name: str, total: int, workers: int, order: str, hinted: bool = False,
           cache_fraction: float | None = None) -> Trace:
    """Packed token shards read sample by sample: sequential, reshuffled, or one fixed shuffle."""
    files = Files({})
    shards, shard_size = _shards(files, total)
    n = len(shards) * shard_size // SAMPLE_BYTES
    rec = Recorder(files)
    step = BATCH * SAMPLE_BYTES / DEMAND_RATE
    for epoch in range(EPOCHS):
        if order == "sequential":
            indices = list(range(n))
        else:
            indices = list(range(n))
            random.Random(7 if order == "fixed" else 1000 + epoch).shuffle(indices)
        samples = [_sample_reads(shards, shard_size, i) for i in indices]
        batches = _batches(samples)
        hints = [[r for b in batches for s in b for r in s]] if hinted else None
        rec.epoch([batches], workers, step, lambda r, fid: fid, hints)
    meta: dict[str, object] = {"workers": workers}
    if cache_fraction is not None:
        meta["cache_fraction"] = cache_fraction
    return rec.trace(name, **meta)


def ddp(name: str, total: int, ranks: int = 8, workers: int = 4) -> Trace:
    """Ranks with DistributedSampler(shuffle=False): rank r reads samples r, r+ranks, ..."""
    files = Files({})
    shards, shard_size = _shards(files, total)
    n = len(shards) * shard_size // SAMPLE_BYTES
    rec = Recorder(files)
    step = ranks * BATCH * SAMPLE_BYTES / DEMAND_RATE
    for _ in range(EPOCHS):
        per_rank = [[_sample_reads(shards, shard_size, i) for i in range(r, n, ranks)]
                    for r in range(ranks)]
        rec.epoch([_batches(s) for s in per_rank], workers, step,
                  lambda r, fid: r * 1000 + fid)
    return rec.trace(name, ranks=ranks, workers=workers)


def tar(name: str, total: int, workers: int = 8) -> Trace:
    """WebDataset-style tar shards: shuffled shard order per epoch, each shard read whole."""
    files = Files({})
    size = total // TAR_SHARDS // READ_CHUNK * READ_CHUNK
    shards = [files.add(f"tars/train-{i:05d}.tar", size) for i in range(TAR_SHARDS)]
    rec = Recorder(files)
    step = BATCH * SAMPLE_BYTES / DEMAND_RATE
    handles: dict[int, int] = {}  # shard -> handle of the worker reading it this epoch
    for epoch in range(EPOCHS):
        order = list(shards)
        random.Random(2000 + epoch).shuffle(order)
        per_worker: list[list[Batch]] = []
        for w in range(workers):
            samples: list[Sample] = []
            for fid in order[w::workers]:
                handles[fid] = rec.new_handle()
                for off in range(0, size, SAMPLE_BYTES):
                    chunk = off // READ_CHUNK * READ_CHUNK
                    reads = [(fid, chunk, READ_CHUNK)] if off == chunk else []
                    samples.append(reads)
            per_worker.append(_batches(samples))
        nb = min(len(b) for b in per_worker)
        batches = [per_worker[b % workers][b // workers] for b in range(nb * workers)]
        rec.epoch([batches], workers, step, lambda r, fid: handles[fid])
    return rec.trace(name, workers=workers)


def small_files(name: str, total: int, workers: int = 8) -> Trace:
    """One sample per file (about 110 KB), random order each epoch, each file opened anew."""
    files = Files({})
    rng = random.Random(5)
    count = total // SMALL_FILE_MEAN
    ids = [files.add(f"images/img-{i:06d}.jpg", rng.randint(90_000, 130_000))
           for i in range(count)]
    rec = Recorder(files)
    step = BATCH * SMALL_FILE_MEAN / DEMAND_RATE
    for epoch in range(EPOCHS):
        order = list(ids)
        random.Random(3000 + epoch).shuffle(order)
        samples = [[(fid, 0, files.table[fid][1])] for fid in order]
        rec.epoch([_batches(samples)], workers, step, lambda r, fid: rec.new_handle())
    return rec.trace(name, workers=workers)


def records(name: str, total: int, workers: int = 8) -> Trace:
    """Headers of records laid out with a repeating irregular size pattern, in record order."""
    files = Files({})
    fid = files.add("records/data.rec", total)
    offsets = []
    pos, k = 0, 0
    while (pos + RECORD_PATTERN[k % len(RECORD_PATTERN)]) * 4096 <= total:
        offsets.append(pos * 4096)
        pos += RECORD_PATTERN[k % len(RECORD_PATTERN)]
        k += 1
    rec = Recorder(files)
    step = BATCH * 4096 / DEMAND_RATE
    for _ in range(EPOCHS):
        samples = [[(fid, off, 4096)] for off in offsets]
        rec.epoch([_batches(samples)], workers, step, lambda r, f: f)
    return rec.trace(name, workers=workers)


def generate(name: str, total: int) -> Trace:
    """Build the named trace over a data set of about ``total`` bytes."""
    makers: dict[str, Callable[[], Trace]] = {
        "seq8": lambda: packed(name, total, 8, "sequential"),
        "seq64": lambda: packed(name, total, 64, "sequential"),
        "ddp8": lambda: ddp(name, total),
        "shuffle": lambda: packed(name, total, 8, "shuffled"),
        "shuffle_hinted": lambda: packed(name, total, 8, "shuffled", hinted=True),
        "tar": lambda: tar(name, total),
        "smallfiles": lambda: small_files(name, total),
        "fixed_shuffle": lambda: packed(name, total, 8, "fixed", cache_fraction=0.5),
        "records": lambda: records(name, total // 4),
    }
    return makers[name]()


TRACE_NAMES = ["seq8", "seq64", "ddp8", "shuffle", "shuffle_hinted", "tar", "smallfiles",
               "fixed_shuffle", "records"]
FULL_BYTES = 256 * 1024 * 1024
QUICK_BYTES = 64 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for NAME.trace files")
    parser.add_argument("--quick", action="store_true", help="64 MiB data sets instead of 256")
    parser.add_argument("names", nargs="*", default=TRACE_NAMES)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.names:
        trace = generate(name, QUICK_BYTES if args.quick else FULL_BYTES)
        path = os.path.join(args.out, f"{name}.trace")
        write_trace(path, trace)
        print(f"{path}: {len(trace.reads)} reads, {len(trace.files)} files, "
              f"{trace.data_bytes / 2**20:.0f} MiB, {len(trace.hints)} hint records")


if __name__ == "__main__":
    main()
