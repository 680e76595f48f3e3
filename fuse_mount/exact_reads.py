"""Which files to open without the kernel's readahead: those a job's hints say it reads only
with read calls of the announced ranges (``exact`` hint records, ``HintedSampler(...,
exact_reads=True)``).

Why: with the page cache in the way, a shuffled 16 KiB ``pread`` is widened by the kernel's
readahead whenever the pages just before the sample are cached (6.x kernels' "context"
readahead), and the bytes past the sample belong to some other, later sample that is rarely
prefetched yet, so the read waits a WAN round trip for them (docs/prefetcher.md, "Exact reads").

Why only on request: a file opened with direct I/O cannot be mapped shared (the kernel answers
``mmap`` with ENODEV unless the daemon asks for FUSE_DIRECT_IO_ALLOW_MMAP, which libfuse 3.14
cannot), and ``np.memmap`` maps shared. So a file is opened this way only while an exact record
naming it is fresh: ``EXACT_READS_TTL`` after the last one, so a later job on the same mount
that maps the file is not refused.

Sans-IO: plain object, ``now`` passed in.
"""

from __future__ import annotations

from neuralcache.catalog import normalize_path
from neuralcache.hints import HintRecord

EXACT_READS_TTL = 600.0
"""Seconds a file stays opened without readahead after the last exact record naming it. Each
epoch announces again, and a DataLoader's workers open their files at its start; ten minutes
also covers files first opened well into a long epoch."""


class ExactReadFiles:
    """Paths (mount-relative) that exact hint records named, each until its expiry."""

    def __init__(self, ttl: float = EXACT_READS_TTL) -> None:
        self.ttl = ttl
        self._until: dict[str, float] = {}

    def note(self, now: float, record: HintRecord) -> None:
        """Remember the files of an exact record; forget the expired ones."""
        if not record.exact:
            return
        self._until = {path: until for path, until in self._until.items() if until > now}
        until = now + self.ttl
        for path in {path for path, _, _ in record.items}:
            self._until[normalize_path(path)] = until

    def wants(self, now: float, path: str) -> bool:
        """Whether a file opened now should be read without readahead."""
        return self._until.get(normalize_path(path), 0.0) > now
