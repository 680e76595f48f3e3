"""``neuralcache demo``: a hub and a spoke on loopback over a generated packed-token dataset.

It reads the dataset through the mount twice - cold (every block crosses from the hub) and warm
(after a remount, from the LMDB cache) - checks every byte against the export, prints a table
and removes everything it made.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .launch import Hub, Spoke
from .scrape import sample, scrape

SHARDS = 8
WINDOWS_PER_SHARD = 512
TOKENS_PER_WINDOW = 4096
"""8 shards x 512 windows x 4,096 uint32 tokens = 64 MiB: 16 KiB per sample, as in the brief."""
SAMPLE_BYTES = TOKENS_PER_WINDOW * 4
VOCAB = 128_256
"""Token ids drawn below LLaMA-3's vocabulary size, so the shards look like the real thing."""


def make_dataset(root: Path, seed: int = 0) -> dict[str, str]:
    """Write the shards; return each one's sha256."""
    rng = np.random.default_rng(seed)
    digests = {}
    for i in range(SHARDS):
        tokens = rng.integers(0, VOCAB, size=WINDOWS_PER_SHARD * TOKENS_PER_WINDOW, dtype=np.uint32)
        name = f"train-{i:05d}.bin"
        (root / name).write_bytes(tokens.tobytes())
        digests[name] = hashlib.sha256(tokens.tobytes()).hexdigest()
    return digests


def read_pass(mnt: Path, names: list[str]) -> tuple[int, float, dict[str, str]]:
    """Read every shard in sample-sized reads, as a sequential data loader would."""
    total = 0
    digests = {}
    started = time.monotonic()
    for name in names:
        h = hashlib.sha256()
        with open(mnt / name, "rb", buffering=0) as f:
            while chunk := f.read(SAMPLE_BYTES):
                h.update(chunk)
                total += len(chunk)
        digests[name] = h.hexdigest()
    return total, time.monotonic() - started, digests


def _hits(port: int) -> tuple[float, float]:
    s = scrape(port)
    return (sample(s, "neuralcache_cache_hit_blocks_total"),
            sample(s, "neuralcache_cache_miss_blocks_total"))


def run_demo(workdir: str | None, keep: bool = False) -> int:
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="neuralcache-demo-"))
    if base.is_dir() and any(base.iterdir()):
        # The demo removes its work directory afterwards: never take a user's files with it.
        print(f"demo: {base} is not empty; name a new or empty directory", file=sys.stderr)
        return 2
    base.mkdir(parents=True, exist_ok=True)
    export = base / "export"
    export.mkdir(exist_ok=True)
    size_mib = SHARDS * WINDOWS_PER_SHARD * SAMPLE_BYTES >> 20
    print(f"demo: generating {SHARDS} packed-token shards ({size_mib} MiB) in {export}")
    expected = make_dataset(export)
    hub = Hub(export)
    spoke = Spoke(base / "mnt", base / "cache")
    rows = []
    try:
        hub.start()
        print(f"demo: hub serving {export} on {hub.address}")
        for label in ("cold", "warm"):
            mounted = time.monotonic()
            spoke.mount(hub.address, "--cache-size", "1G")
            listed = sorted(p.name for p in spoke.mountpoint.iterdir())
            print(f"demo: mounted {spoke.mountpoint} ({label} cache); namespace listed in "
                  f"{time.monotonic() - mounted:.2f} s: {len(listed)} files")
            total, seconds, digests = read_pass(spoke.mountpoint, listed)
            if digests != expected:
                print("demo: FAILED - bytes read through the mount differ from the export")
                return 1
            hits, misses = _hits(spoke.metrics_port)
            rows.append((label, total, seconds, hits / max(1.0, hits + misses)))
            print(f"demo: {label} pass read {total >> 20} MiB, every byte checked")
            spoke.umount()
            print(f"demo: unmounted {spoke.mountpoint}")
    finally:
        spoke.cleanup()
        hub.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"{'pass':<6} {'bytes':>12} {'time s':>8} {'MB/s':>8} {'cache hit ratio':>16}")
    for label, total, seconds, ratio in rows:
        print(f"{label:<6} {total:>12,} {seconds:>8.2f} {total / seconds / 1e6:>8.1f} "
              f"{ratio:>16.1%}")
    print()
    print("demo: done; " + (f"kept {base}" if keep else f"removed {base}"))
    return 0
