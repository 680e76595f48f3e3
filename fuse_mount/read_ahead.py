"""The kernel's readahead for a file of the mount, chosen when it is opened: by whether all of
the file is cached.

The kernel reads ahead of a sequential reader at most the mount's ``read_ahead_kb`` (128 KiB by
default for FUSE), in FUSE reads of at most 1 MiB, and takes that figure into each file as it
is opened (``file_ra_state_init``, once the filesystem has answered the open): a later change
reaches only files opened after it. So the daemon sets it as it answers each open:

- ``WARM_KB`` for a file whose every block is cached. Several 1 MiB reads then wait at once,
  so the event loop and the reader thread that serves them work less in turns
  (docs/throughput.md, session 46).
- ``COLD_KB`` for any other. Reads ahead of what the prefetcher has fetched are demand fetches
  over the WAN, sent at once, and four times as many burst past the bottleneck's queue
  (docs/repro.md, session 46).

The setting is the mount's, not the file's: of two opens answered at the same moment, one file
may take the value meant for the other. Either value reads the right bytes, one just sooner.
"""

from __future__ import annotations

import logging
import os

from . import metrics

log = logging.getLogger(__name__)

COLD_KB = 1024
"""Readahead of a file not wholly cached: one 1 MiB FUSE read at a time (eight of the kernel's
default 128 KiB would each cost the daemon a request), the prefetcher reading further ahead."""
WARM_KB = 4096
"""Readahead of a wholly cached file: four 1 MiB FUSE reads ahead of the reader."""


class ReadAhead:
    """The mount's ``read_ahead_kb`` in ``/sys/class/bdi``, written when an open needs another
    value than the last one written."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._kb: int | None = None

    def locate(self, mountpoint: str, kb: int = COLD_KB) -> None:
        """Find the mount's setting and start it at ``kb`` (the spoke's: ``COLD_KB``, until an
        open says otherwise). This stats the mountpoint, which the filesystem's own loop
        answers: call it from a thread, once the mount is live."""
        dev = os.stat(mountpoint).st_dev
        self._path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        self.set(kb)

    def for_open(self, whole_file_cached: bool) -> None:
        """Set the readahead the file about to be opened should get, and count the open."""
        kb, label = ((WARM_KB, metrics.READ_AHEAD_WARM) if whole_file_cached
                     else (COLD_KB, metrics.READ_AHEAD_COLD))
        metrics.OPENS.labels(label).inc()
        self.set(kb)

    def set(self, kb: int) -> None:
        """Write ``kb`` unless it is the value last written (a sysfs write: no disk, no wait).
        Before ``locate``, or once a write failed (not root, say), this does nothing: reads
        then get whatever readahead the mount has."""
        if self._path is None or kb == self._kb:
            return
        try:
            with open(self._path, "w") as setting:
                setting.write(str(kb))
        except OSError as exc:
            log.warning("cannot set the readahead via %s (%s); reads keep the mount's (%s)",
                        self._path, exc.strerror, self._kb or "the kernel default")
            self._path = None
            return
        self._kb = kb
