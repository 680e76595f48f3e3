"""Keep freed reply buffers in the process's heap, so the next reply reuses their pages.

A hub reads every reply into a buffer of its own (up to a 4 MiB chunk on a fast path), and a
spoke receives every reply into one. glibc's malloc serves blocks this large from fresh
``mmap`` mappings, or from the top of the heap, which it trims back to the kernel as soon as
128 KiB lie free there; its adaptive threshold keeps some of them, not all. Each new buffer
was then new memory, which the kernel faulted in and zeroed a page at a time
(``tests/test_heap.py`` counts the faults for a mix of reply sizes, with and without). With
a fixed mmap threshold above any reply and a trim threshold of some tens of MiB, freed
buffers stay mapped and the next ones reuse them: on loopback the hub's CPU per GB moved fell
by 15 %, the spoke's by 22 % (docs/transport.md, "Reply buffers kept in the heap").
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters, from glibc's ``malloc.h``."""

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap: every reply buffer (chunks are at most 4 MiB),
and glibc's largest allowed value on 64-bit systems."""

TRIM_THRESHOLD = 64 << 20
"""Free memory the heap keeps at its top before giving any back: more than a hub's or a spoke's
replies in flight take at their peak (a few dozen MiB), so the heap settles at that peak."""


def keep_freed_buffers() -> bool:
    """Set this process's malloc thresholds (see the module docstring). Call it once at start,
    before the first reply; False (and a log line) where the C library is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("no mallopt in this C library: reply buffers are allocated fresh each time")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD,
                                                                  TRIM_THRESHOLD)):
        log.info("mallopt refused the heap thresholds: reply buffers are allocated fresh")
        return False
    return True
