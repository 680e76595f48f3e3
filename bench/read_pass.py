"""One timed pass of 16 KiB reads over a file, run in a child process that can be killed.

A read stuck in a FUSE filesystem sleeps where only a fatal signal reaches it, so the bench
cannot time it out in its own process. ``run`` starts

    python -m bench.read_pass sequential|random PATH [--offsets FILE.npy]

and SIGKILLs it past the timeout; the child prints its ``Pass`` as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

READ_SIZE = 16 * 1024
"""Bytes per read call: the issue's 16 KiB, a typical sample or record size."""
DROP_BEHIND = 8 * 1024 * 1024
"""Bytes a pass reads before it evicts them from the page cache again. On this VM, memory the
guest has not touched for a few seconds goes back to the host (virtio-balloon free page
reporting) and costs ~450 MB/s to touch again; recycling the same few MiB of page cache keeps
that artefact out of every target's figure, and no target re-reads what it read."""
MB = 1e6
SEQUENTIAL = "sequential"
RANDOM = "random"


@dataclass(frozen=True)
class Pass:
    """One timed pass over a file: bytes read, wall seconds, xxh3-64 of the bytes in read order."""

    nbytes: int
    seconds: float
    digest: str

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / MB


class PassFailed(Exception):
    """The pass hung past its timeout or its reader failed (an I/O error, a crash)."""


def sequential_pass(path: str) -> Pass:
    """Read ``path`` start to end in READ_SIZE preads."""
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    digest = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        offset = 0
        while n := os.preadv(fd, [buf], offset):
            digest.update(view[:n])
            offset += n
            if offset % DROP_BEHIND == 0:
                os.posix_fadvise(fd, offset - DROP_BEHIND, DROP_BEHIND, os.POSIX_FADV_DONTNEED)
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    return Pass(offset, seconds, digest.hexdigest())


def random_pass(path: str, offsets: np.ndarray) -> Pass:
    """READ_SIZE preads at ``offsets``, in order, with kernel readahead off for the descriptor
    (``POSIX_FADV_RANDOM``), so no target turns a 16 KiB read into a larger one."""
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    digest = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        started = time.perf_counter()
        total = 0
        for offset in offsets.tolist():
            n = os.preadv(fd, [buf], offset)
            digest.update(view[:n])
            total += n
            if total % DROP_BEHIND == 0:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    return Pass(total, seconds, digest.hexdigest())


def run(pattern: str, path: str, offsets_file: str | None, timeout: float) -> Pass:
    """The pass, in a child process killed after ``timeout`` seconds (raising PassFailed)."""
    argv = [sys.executable, "-m", "bench.read_pass", pattern, path]
    if offsets_file is not None:
        argv += ["--offsets", offsets_file]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # run() has SIGKILLed the reader
        raise PassFailed(f"{pattern} pass over {path} hung for {timeout:g} s") from None
    if done.returncode != 0:
        raise PassFailed(f"{pattern} pass over {path} failed: {done.stderr.strip()[-500:]}")
    return Pass(**json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.read_pass", description=__doc__)
    parser.add_argument("pattern", choices=[SEQUENTIAL, RANDOM])
    parser.add_argument("path")
    parser.add_argument("--offsets", help="random pass: .npy file of byte offsets")
    args = parser.parse_args(argv)
    if args.pattern == SEQUENTIAL:
        result = sequential_pass(args.path)
    elif args.offsets is None:
        parser.error("a random pass needs --offsets")
    else:
        result = random_pass(args.path, np.load(args.offsets))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
