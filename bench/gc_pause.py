"""How long a full garbage collection stops the spoke's event loop, by cache size.

The daemon keeps a few objects per cached block (its key in the LRU policy, its value's address);
a full collection walks every tracked object, and while it runs no FUSE read is answered and no
hub reply is read. This fills an LMDB block store with ``--blocks`` small values (the index is
what matters, not the bytes), opens a ``BlockCache`` over it as a remounted daemon does, and times
``gc.collect()``: as opened, and after ``freeze_long_lived``, which the daemon calls once it has
loaded its namespace and index.

    python -m bench.gc_pause [--blocks 131072 1048576] [--workdir DIR]

To compare another source tree (say a ``git archive`` of an older commit in DIR), run this file
with that tree first on the path: ``PYTHONPATH=DIR python bench/gc_pause.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import trio

from fuse_mount.block_cache import BlockCache
from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.daemon import freeze_long_lived

VALUE = bytes(16)
"""Each block's stored bytes: tiny, so a million-block index builds in seconds."""
MAP_BYTES_PER_BLOCK = 512
"""LMDB map reserved per block: its rows in three tables (head, tail, stamp) with keys and
page overhead, with room to spare (the map is address space; the file grows as written)."""
BATCH = 65536
"""Puts per LMDB write transaction while filling the store."""
ROUNDS = 5
"""Collections timed per cache size; the median is reported."""


def fill(path: str, blocks: int) -> BlockStore:
    """A store holding ``blocks`` blocks of a few files, as a cold run would leave it."""
    store = BlockStore(path, blocks * MAP_BYTES_PER_BLOCK)
    for start in range(0, blocks, BATCH):
        keys = [BlockKey(b // 4096, 1, b % 4096) for b in range(start, min(start + BATCH, blocks))]
        stamps = dict.fromkeys(keys, (0, len(VALUE), None))  # the rows the index is read from
        store.write_batch(dict.fromkeys(keys, VALUE), [], stamps)
    return store


def _median_collection_ms() -> float:
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def full_collection_ms(blocks: int, workdir: str) -> tuple[float, int, float]:
    """Median ms of a full collection with a cache of ``blocks`` loaded, the objects it tracks,
    and the median ms once the daemon's startup freeze has run."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        store = fill(os.path.join(tmp, "blocks.lmdb"), blocks)
        cache: BlockCache | None = None

        async def open_cache() -> BlockCache:  # BlockCache makes trio objects: needs a loop
            return BlockCache(store, blocks * len(VALUE) * 2)

        try:
            cache = trio.run(open_cache)
            gc.collect()
            walked, tracked = _median_collection_ms(), len(gc.get_objects())
            freeze_long_lived()
            try:
                return walked, tracked, _median_collection_ms()
            finally:
                gc.unfreeze()
        finally:
            if cache is not None:
                cache.close()
            else:
                store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gc_pause",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[131072, 1048576],
                        help="cache sizes in 4 KiB blocks [131072 (512 MiB), 1048576 (4 GiB)]")
    parser.add_argument("--workdir", default="/var/tmp/neuralcache-bench",
                        help="where the temporary LMDB stores go (never the repo)")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    print(f"{'blocks':>10} {'cache':>9} {'full collection':>16} {'tracked objects':>16}"
          f" {'after the freeze':>17}")
    for blocks in args.blocks:
        ms, tracked, frozen_ms = full_collection_ms(blocks, args.workdir)
        print(f"{blocks:>10,} {blocks * 4096 / 2**30:>7.1f} G {ms:>13.1f} ms {tracked:>16,}"
              f" {frozen_ms:>14.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
