"""What a busy event loop does to the cache's LMDB writes, in a thread and in a process.

py-lmdb gives up the GIL around every put. A writer thread must win it back for the next one
from whatever else runs Python, and the daemon's event loop, serving reads, always does. This
times batches of ``--blocks`` 4 KiB blocks written by ``BlockStore.write_batch`` in a thread
and by the ``CacheWriter`` process, each with the process otherwise idle and with a stand-in
for the loop running (Python work between short system calls, as the loop's FUSE and socket
calls are), with the stand-in's speed meanwhile: what the writer costs the loop.

    python -m bench.write_contention [--blocks 4096] [--batches 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import threading
import time
from typing import Callable, Hashable

from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.cache_writer import CacheWriter
from fuse_mount.key_space import KeySpace
from neuralcache.blocks import BLOCK_SIZE

LOOP_WORK = 300
"""Additions per stand-in loop turn between its system calls (about 10 us of Python)."""


class BusyLoop:
    """A thread that stands in for the event loop: Python work, then a pipe write and read
    (system calls that release the GIL, as the loop's do); counts its turns."""

    def __init__(self) -> None:
        self.turns = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        r, w = os.pipe()
        try:
            while not self._stop.is_set():
                total = 0
                for i in range(LOOP_WORK):
                    total += i
                os.write(w, b"x")
                os.read(r, 1)
                self.turns += 1
        finally:
            os.close(r)
            os.close(w)

    def __enter__(self) -> "BusyLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def time_batches(write: Callable[..., object], key: Callable[[int], Hashable], batches: int,
                 blocks: int) -> list[float]:
    """Times of ``batches`` writes of ``blocks`` blocks each, block ``b`` named ``key(b)``."""
    data = os.urandom(BLOCK_SIZE)
    times = []
    for n in range(batches):
        puts = {key(n * blocks + i): data for i in range(blocks)}
        started = time.perf_counter()
        write(puts, [], dict.fromkeys(puts, (1, BLOCK_SIZE, None)))
        times.append(time.perf_counter() - started)
    return times


def loop_rate(seconds: float) -> float:
    """The stand-in loop's turns per second with nothing else running."""
    with BusyLoop() as loop:
        time.sleep(seconds)
    return loop.turns / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4096, help="blocks per batch [4096]")
    parser.add_argument("--batches", type=int, default=5, help="batches per case [5]")
    args = parser.parse_args()
    capacity = 4 * args.batches * args.blocks * BLOCK_SIZE
    idle_rate = loop_rate(2.0)
    print(f"stand-in loop alone: {idle_rate:,.0f} turns/s")
    print("| writer | loop running | batch median (s) | batch max (s) | blocks written/s "
          "| loop speed while writing |")
    print("|---|---|---|---|---|---|")
    for where in ("thread", "process"):
        for busy in (False, True):
            with tempfile.TemporaryDirectory(prefix="nc-write-contention-") as path:
                store = BlockStore(path, capacity)
                keys = KeySpace()
                writer = CacheWriter(store.path, store.capacity, store.map_base, keys)
                write = store.write_batch if where == "thread" else writer.write_batch
                # The store takes BlockKeys, the writer process the daemon's int keys.
                key: Callable[[int], Hashable] = (functools.partial(BlockKey, 1, 1)
                                                  if where == "thread"
                                                  else functools.partial(keys.key, 1, 1))
                if where == "process":
                    write({}, [], {})  # start the child before the clock does
                result: list[float] = []
                run = threading.Thread(target=lambda: result.extend(
                    time_batches(write, key, args.batches, args.blocks)))
                started = time.perf_counter()
                if busy:
                    with BusyLoop() as loop:
                        run.start()
                        run.join()
                    speed = loop.turns / (time.perf_counter() - started) / idle_rate
                    rate = f"{100 * speed:.0f} % of alone"
                else:
                    run.start()
                    run.join()
                    rate = "–"
                writer.close()
                store.close()
            print(f"| {where} | {'yes' if busy else 'no'} | {statistics.median(result):.3f} "
                  f"| {max(result):.3f} | {args.blocks * len(result) / sum(result):,.0f} "
                  f"| {rate} |")


if __name__ == "__main__":
    main()
