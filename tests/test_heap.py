"""fabric.heap: with its thresholds set, reply-sized buffers reuse freed memory (few page
faults), where by default each new one is faulted in afresh. Each case runs in a child
interpreter, so that neither the thresholds nor the heap of the test process play a part."""

from __future__ import annotations

import subprocess
import sys

_ALLOCATE = """
import random, resource, sys
from fabric.heap import keep_freed_buffers
if sys.argv[1] == "keep":
    assert keep_freed_buffers()
rng = random.Random(1)
def faults(buffers):
    live, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(buffers):  # replies of 64 KiB .. 4 MiB, eight in flight, freed in any order
        live.append(bytearray(rng.randrange(64 << 10, 4 << 20)))
        if len(live) > 8:
            live.pop(rng.randrange(len(live)))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(200)  # the heap grows to the peak in flight
print(faults(1000) / 1000)
"""

MAX_FAULTS_PER_BUFFER = 4
"""A 4 MiB buffer faulted in afresh takes a fault per 16 pages at least (fault-around); reused,
none. A few allow for the interpreter's own allocations meanwhile."""


def _faults_per_buffer(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _ALLOCATE, mode], capture_output=True,
                          text=True, check=True, timeout=60)
    return float(done.stdout)


def test_reply_buffers_reuse_freed_memory() -> None:
    default, kept = _faults_per_buffer("default"), _faults_per_buffer("keep")
    print(f"page faults per buffer: default {default:.1f}, with keep_freed_buffers {kept:.1f}")
    assert kept <= MAX_FAULTS_PER_BUFFER
