"""Asking the kernel for pages: a long stretch comes in whole, not only a readahead's worth."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from fuse_mount.residency import (DEFAULT_WILL_NEED_BYTES, advice_pieces, buffer_address,
                                  file_resident_bytes, will_need_limit, will_need_spans)

STRETCH_BYTES = 32 << 20
"""Longer than one WILLNEED call reads on this machine (8 MiB, its ``read_ahead_kb``)."""
RESIDENT_TIMEOUT = 30.0
PIECE = 128 * 1024


@pytest.mark.parametrize("start,end", [(0, 1), (0, PIECE), (4096, 3 * PIECE + 5), (8192, 8192)])
def test_advice_pieces_cover_the_stretch_in_aligned_pieces_no_longer_than_the_limit(
        start: int, end: int) -> None:
    pieces = list(advice_pieces(start, end, PIECE))
    assert all(0 < length <= PIECE for _, length in pieces)
    assert all(at % 4096 == 0 for at, _ in pieces)
    covered = [offset for at, length in pieces for offset in range(at, at + length)]
    assert covered == list(range(start, end))


def test_without_a_block_device_the_limit_is_the_kernels_default_readahead() -> None:
    assert will_need_limit("/proc/self/stat") == DEFAULT_WILL_NEED_BYTES  # no block device
    assert will_need_limit("/no/such/file") == DEFAULT_WILL_NEED_BYTES


def test_a_long_stretch_asked_for_comes_into_the_page_cache_whole(tmp_path: Path) -> None:
    """In pieces of the file's ``will_need_limit``: a piece longer than what the kernel reads
    per call would leave the rest of it out."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(STRETCH_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # DONTNEED skips dirty pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if file_resident_bytes(str(path)) > STRETCH_BYTES // 2:
            pytest.skip("this filesystem keeps the file in the page cache")
        with mmap.mmap(fd, STRETCH_BYTES, prot=mmap.PROT_READ) as mapped:
            mapped.madvise(mmap.MADV_RANDOM)  # as LMDB maps the cache file: no readahead
            view = memoryview(mapped)
            try:
                base = buffer_address(view)
                will_need_spans([(base, base + STRETCH_BYTES)], will_need_limit(path))
            finally:
                view.release()
            deadline = time.monotonic() + RESIDENT_TIMEOUT
            while file_resident_bytes(str(path)) < STRETCH_BYTES:
                assert time.monotonic() < deadline, (
                    f"{file_resident_bytes(str(path)) >> 20} MiB of {STRETCH_BYTES >> 20} came in")
                time.sleep(0.05)
    finally:
        os.close(fd)
