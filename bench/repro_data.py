"""The reproduction's dataset: packed token shards like the reference's C4 set, and the PyTorch
``Dataset`` that reads them one window per sample.

A shard is a flat file of ``windows`` windows; a window is ``TOKENS_PER_WINDOW`` little-endian
uint32 token ids (16 KiB), the layout a packed, pre-tokenized LLaMA corpus has on disk. Sample
``i`` is window ``i % windows`` of shard ``i // windows``, read with one ``pread`` - what a
map-style dataset over packed shards does, and exactly the (path, offset, length) the hints
sampler announces (:func:`ShardLayout.ranges`).

torch is imported only by :class:`PackedTokenShards`, so the layout and the generator work
without it (the smoke test checks that).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

TOKENS_PER_WINDOW = 4096
"""Tokens per sample: the reference's 4,096-token sequences."""
TOKEN_DTYPE = np.dtype("<u4")
"""uint32 token ids, little-endian: LLaMA-3's vocabulary does not fit 16 bits."""
WINDOW_BYTES = TOKENS_PER_WINDOW * TOKEN_DTYPE.itemsize
"""16 KiB per sample, the brief's sample size."""
VOCAB_SIZE = 128_256
"""LLaMA-3's vocabulary; generated ids are uniform below it (incompressible, like real ids)."""
SHARD_NAME = "c4-train.{:05d}-of-{:05d}.tokens"
MANIFEST = "manifest.json"
"""Written last, so a directory with a manifest holds a complete dataset of that layout."""
WRITE_WINDOWS = 4096
"""Windows generated and written per step (64 MiB) while making a shard."""


@dataclass(frozen=True)
class ShardLayout:
    """How many shards of how many windows; maps a sample index to its bytes."""

    shards: int
    windows: int  # windows per shard

    def __post_init__(self) -> None:
        if self.shards < 1 or self.windows < 1:
            raise ValueError(f"need at least one shard of one window, got {self}")

    @classmethod
    def for_size(cls, total_bytes: int, shards: int) -> ShardLayout:
        """The layout of ``shards`` equal shards holding at most ``total_bytes`` between them."""
        return cls(shards, max(1, total_bytes // (shards * WINDOW_BYTES)))

    @property
    def samples(self) -> int:
        return self.shards * self.windows

    @property
    def total_bytes(self) -> int:
        return self.samples * WINDOW_BYTES

    def shard_name(self, shard: int) -> str:
        return SHARD_NAME.format(shard, self.shards)

    def locate(self, index: int) -> tuple[str, int]:
        """(shard file name, byte offset) of sample ``index``."""
        if not 0 <= index < self.samples:
            raise IndexError(f"sample {index} outside 0..{self.samples - 1}")
        shard, window = divmod(index, self.windows)
        return self.shard_name(shard), window * WINDOW_BYTES

    def ranges(self, index: int) -> list[tuple[str, int, int]]:
        """The reads sample ``index`` causes, as ``HintedSampler``'s ``index_to_ranges`` wants."""
        name, offset = self.locate(index)
        return [(name, offset, WINDOW_BYTES)]


def read_layout(root: str) -> ShardLayout | None:
    """The layout recorded in ``root``'s manifest, or None if there is no complete dataset."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            fields = json.load(f)
        return ShardLayout(int(fields["shards"]), int(fields["windows"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_dataset(root: str, layout: ShardLayout, seed: int) -> float:
    """Write ``layout``'s shards of random token ids under ``root``; returns seconds taken.

    Nothing is written if ``root`` already holds this layout (the manifest says so), so repeated
    runs reuse the data; a different or incomplete one is overwritten.
    """
    if read_layout(root) == layout:
        return 0.0
    started = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    manifest = os.path.join(root, MANIFEST)
    if os.path.exists(manifest):
        os.unlink(manifest)
    for name in os.listdir(root):  # shards of an older layout would be exported too
        if name.endswith(".tokens"):
            os.unlink(os.path.join(root, name))
    rng = np.random.default_rng(seed)
    for shard in range(layout.shards):
        with open(os.path.join(root, layout.shard_name(shard)), "wb") as out:
            left = layout.windows
            while left:
                n = min(left, WRITE_WINDOWS)
                tokens = rng.integers(0, VOCAB_SIZE, size=n * TOKENS_PER_WINDOW, dtype=np.uint32)
                out.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
                left -= n
            out.flush()
            os.fsync(out.fileno())
    with open(manifest, "w") as f:
        json.dump({**asdict(layout), "tokens_per_window": TOKENS_PER_WINDOW,
                   "dtype": TOKEN_DTYPE.str, "seed": seed}, f)
    return time.perf_counter() - started


class PackedTokenShards:
    """Map-style PyTorch dataset: sample ``i`` is one window, as int32 token ids, plus how long
    its ``pread`` took (the loop's per-read latency, comparable across every target).

    File descriptors are opened lazily in each worker (a forked worker must not share the
    parent's) and cached for the life of the worker, like a real shard reader.
    """

    def __init__(self, root: str, layout: ShardLayout) -> None:
        self.root = root
        self.layout = layout
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.layout.samples

    def _fd(self, name: str) -> int:
        if self._pid != os.getpid():  # forked into a worker: the inherited cache is the parent's
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(os.path.join(self.root, name), os.O_RDONLY)
        return fd

    def close(self) -> None:
        """Close this process's descriptors (an open file would keep a mount busy)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __getitem__(self, index: int) -> tuple[Any, float]:
        import torch

        name, offset = self.layout.locate(index)
        fd = self._fd(name)
        started = time.perf_counter()
        data = os.pread(fd, WINDOW_BYTES, offset)
        seconds = time.perf_counter() - started
        if len(data) != WINDOW_BYTES:
            raise OSError(f"short read of sample {index}: {len(data)} of {WINDOW_BYTES} bytes")
        tokens = np.frombuffer(data, dtype=TOKEN_DTYPE).astype(np.int32)
        return torch.from_numpy(tokens), seconds
