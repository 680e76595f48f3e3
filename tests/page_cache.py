"""Page-cache control for tests that must see a file's pages leave RAM."""

from __future__ import annotations

import os
from pathlib import Path


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache (written out first, since dirty pages
    stay; pages a process has mapped stay too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
