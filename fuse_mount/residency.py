"""Is this memory in RAM? ``mincore(2)`` over mapped memory, for the inline warm read.

The event loop may read an LMDB value itself only if touching it cannot wait for the disk,
that is if every page under it is in the page cache. ``mincore`` answers that for a mapped
file without touching the pages (for a file the caller may write, as the daemon may its own
cache file: the kernel hides other files' page cache from it). Addresses of read-only
buffers, such as LMDB's views, are taken through the buffer protocol (``ctypes`` maps only
writable ones); at about a microsecond each, that is done when blocks are written or read
in the reader thread, not on every read.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from typing import Iterable, Iterator

import numpy as np

PAGE_SIZE = mmap.PAGESIZE
_PAGE_MASK = ~(PAGE_SIZE - 1)
MERGE_GAP_PAGES = 4
"""Buffers at most this many pages apart are checked with one ``mincore`` call over the gap
too: a syscall costs more here than a few more bytes of result, and a gap page that is not
resident only sends the read the slow, always-correct way."""
MAX_CHECK_PAGES = 4096
"""Pages one ``mincore`` call asks about (16 MiB): the result vector is sized for this once, and
a longer stretch is asked about in pieces of this size."""
DEFAULT_WILL_NEED_BYTES = 128 * 1024
"""What one WILLNEED call reads where sysfs does not say (``will_need_limit``): the kernel's
default readahead."""
_MAX_CHECK_BYTES = MAX_CHECK_PAGES * PAGE_SIZE
_MERGE_GAP_BYTES = MERGE_GAP_PAGES * PAGE_SIZE
_RESIDENT_BIT = 1  # mincore sets the lowest bit of a page's byte if the page is resident
_LOW_BIT = bytes(b & _RESIDENT_BIT for b in range(256))  # translate table: byte -> its low bit


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable layout since 3.3)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0

_libc = ctypes.CDLL(None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_mincore.restype = ctypes.c_int
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def buffer_address(buffer: object) -> int:
    """The address of a contiguous buffer's first byte (read-only ones too); thread-safe."""
    view = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(view), _PYBUF_SIMPLE)  # raises if it has no buffer
    address: int = view.buf or 0
    _release_buffer(ctypes.byref(view))
    return address


class ResidencyProbe:
    """Answers "are all these pages resident?" with as few syscalls as it can.

    Not thread-safe (one result vector): one per thread that asks, in the daemon the event
    loop's.
    """

    def __init__(self) -> None:
        self._vector = ctypes.create_string_buffer(MAX_CHECK_PAGES)

    def all_resident(self, addresses: list[int], length: int) -> bool:
        """True if every page of ``[address, address + length)`` for every address is in RAM
        now, so touching them cannot wait for the disk. False if any is not, or if the kernel
        does not say (the caller then takes the path that may wait)."""
        return self.spans_resident(_spans(addresses, length))

    def stretch_resident(self, address: int, length: int) -> bool:
        """``all_resident`` over one stretch ``[address, address + length)`` of the map (one
        value), with one ``mincore`` call."""
        return self._span_resident(address & _PAGE_MASK, address + length)

    def spans_resident(self, spans: list[tuple[int, int]]) -> bool:
        """``all_resident`` over page-aligned spans ``[start, end)`` (``merged_spans``)."""
        for start, end in spans:
            if not self._span_resident(start, end):
                return False
        return True

    def _span_resident(self, start: int, end: int) -> bool:
        """``start`` page-aligned; every page of ``[start, end)`` resident?

        Asked in pieces of ``MAX_CHECK_PAGES``: a prefetch window's cached blocks reach 64 MiB
        at a time (``PrefetchPump._page_in``), and answering False for any stretch that long
        had each window's pages "read" from the disk again on a warm mount, in the reader
        thread (then) that the warm reads wait for.
        """
        for piece in range(start, end, _MAX_CHECK_BYTES):
            length = min(end - piece, _MAX_CHECK_BYTES)
            if _mincore(piece, length, self._vector) != 0:
                return False  # e.g. ENOMEM (unmapped): do not guess
            pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
            if ctypes.string_at(self._vector, pages).translate(_LOW_BIT).find(0) >= 0:
                return False
        return True


def will_need_limit(path: str | os.PathLike[str]) -> int:
    """The most one WILLNEED call (``MADV_WILLNEED``, ``POSIX_FADV_WILLNEED``) reads of a file.

    The kernel reads at most the larger of the device's readahead and its largest request of
    the range a call names, from its start, and silently drops the rest
    (``force_page_cache_ra``): 8 MiB on this machine (``read_ahead_kb`` 8192), as little as
    128 KiB on a node left at its defaults. Read from the queue of the file's block device in
    sysfs (a partition's is its disk's); ``DEFAULT_WILL_NEED_BYTES`` where sysfs has none
    (tmpfs, overlays). Longer stretches are asked for in pieces of this size, none smaller:
    the calls are made from a thread that must win the GIL back from the event loop after each
    one (docs/throughput.md, session 55)."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        return DEFAULT_WILL_NEED_BYTES
    block = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (f"{block}/queue", f"{block}/../queue"):
        try:
            with open(f"{queue}/read_ahead_kb") as ra, open(f"{queue}/max_sectors_kb") as io:
                kib = max(int(ra.read()), int(io.read()))
        except (OSError, ValueError):
            continue
        return max(kib * 1024, PAGE_SIZE)
    return DEFAULT_WILL_NEED_BYTES


def will_need(addresses: list[int], length: int, piece: int) -> None:
    """Ask the kernel to start reading every page of ``[address, address + length)`` for each
    address (``madvise(MADV_WILLNEED)``), so that a run's pages come from the disk together
    rather than one fault at a time; over the same stretches ``all_resident`` checks; ``piece``:
    the mapped file's ``will_need_limit``. Advice only: a failure is ignored."""
    will_need_spans(_spans(addresses, length), piece)


def will_need_spans(spans: list[tuple[int, int]], piece: int) -> None:
    """``will_need`` over page-aligned spans ``[start, end)`` (``merged_spans``)."""
    for start, end in spans:
        for at, length in advice_pieces(start, end, piece):
            _madvise(at, length, mmap.MADV_WILLNEED)


def advice_pieces(start: int, end: int, piece: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` as ``(start, length)`` pieces of at most ``piece`` bytes (a multiple
    of the page size), one per WILLNEED call (see ``will_need_limit``)."""
    for at in range(start, end, piece):
        yield at, min(end - at, piece)


def run_stretch(first: int, last: int, count: int, length: int) -> tuple[int, int] | None:
    """``(start, length)`` of the stretch of the map from the value at ``first`` to the end of
    the one at ``last``, if ``count`` values of ``length`` bytes between them could lie there
    side by side (a run's values written together do), as one span of ``_spans`` would hold
    them; else None. A stretch is a guess at where the values between lie: good for advice
    (``will_need``), not to decide that touching them cannot wait for the disk."""
    low, high = min(first, last), max(first, last) + length
    if high - low > count * (length + PAGE_SIZE) + _MERGE_GAP_BYTES:
        return None
    return low, high - low


def _spans(addresses: list[int], length: int) -> list[tuple[int, int]]:
    """Page-aligned stretches ``[start, end)`` covering ``[address, address + length)`` for
    every address, as few as the gap rule allows: a run's values written together lie side by
    side in the map, and then one stretch from the first to the last covers them all; else
    values at most ``MERGE_GAP_PAGES`` apart share one."""
    if not addresses:
        return []
    low, high = min(addresses), max(addresses) + length
    if high - low <= len(addresses) * (length + PAGE_SIZE) + _MERGE_GAP_BYTES:
        return [(low & _PAGE_MASK, high)]
    return merged_spans(zip(addresses, itertools.repeat(length)))


def merged_spans(stretches: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Page-aligned spans ``[start, end)``, in address order, covering every stretch ``(start,
    length)`` of the map; stretches at most ``MERGE_GAP_PAGES`` apart share one."""
    spans: list[tuple[int, int]] = []
    for start, length in sorted(stretches):
        end = start + length
        start &= _PAGE_MASK
        if spans and start <= spans[-1][1] + _MERGE_GAP_BYTES:
            if end > spans[-1][1]:
                spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def value_spans(places: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """``merged_spans`` of the stretches ``(places[i], lengths[i])``, in any order, computed
    with numpy: a prefetch window names up to 64 MiB of values at a time, each by its own
    place (a run's values need not lie between its first and last ones'), and the event loop
    merges them (``bench.read_path_costs``: "pages_to_read, the whole store as one window")."""
    if not places.size:
        return []
    order = np.argsort(places, kind="stable")
    places, lengths = places[order], lengths[order]
    starts = places & _PAGE_MASK
    reach = np.maximum.accumulate(places + lengths)  # end of the span each stretch is in so far
    breaks = np.flatnonzero(starts[1:] > reach[:-1] + _MERGE_GAP_BYTES)
    firsts = np.concatenate(([0], breaks + 1))
    lasts = np.append(breaks, places.size - 1)
    return list(zip(starts[firsts].tolist(), reach[lasts].tolist()))


def file_resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of a file in the page cache, asked through a mapping that touches nothing (the
    benches and tests check what a mount reads of its cache file)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    vector = ctypes.create_string_buffer(-(-size // PAGE_SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            if _mincore(buffer_address(view), size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            view.release()
    return sum(vector.raw.translate(_LOW_BIT)) * PAGE_SIZE
