"""The mount's control files: a hidden ``.neuralcache`` directory holding the write-only ``hints``.

A training job announces its upcoming reads by writing hint records (``neuralcache.hints``' wire
format) to ``MOUNT/.neuralcache/hints``. Each open handle gets its own decoder, so records may
be split across writes and several announcers may write at once. The directory is reachable by
name but not listed in the root, so ``ls -R`` or ``find`` over the dataset never see it (and it
hides an export entry of the same name).

Malformed data fails the write with EINVAL and is counted; the handle then refuses further
writes, since its framing can no longer be trusted. A record cut off by the close is counted.
Nothing here raises anything but ``FUSEError``; the filesystem delegates to it by inode/handle.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from typing import Callable

import pyfuse3

from neuralcache.hints import CONTROL_FILE, HintDecoder, HintFormatError, HintRecord

from . import metrics
from .namespace import ATTR_TIMEOUT, ROOT_INODE

log = logging.getLogger(__name__)

CONTROL_DIR, HINTS_NAME = CONTROL_FILE.split("/")

DIR_MODE = 0o555
"""The control directory: anyone may look inside, no one may add to it."""
HINTS_MODE = 0o222
"""The hints file: anyone may write (announce), no one may read."""


class ControlFiles:
    """Inodes, attributes and handles of the control directory and its hints file."""

    def __init__(self, first_inode: int, on_record: Callable[[HintRecord], None],
                 uid: int = 0, gid: int = 0) -> None:
        self.dir_inode = first_inode
        self.hints_inode = first_inode + 1
        self._on_record = on_record
        self._uid, self._gid = uid, gid
        self._created_ns = time.time_ns()
        self._decoders: dict[int, HintDecoder | None] = {}  # fh -> decoder; None once poisoned

    def owns(self, inode: int) -> bool:
        """True for the control directory's and the hints file's inodes."""
        return inode in (self.dir_inode, self.hints_inode)

    def owns_handle(self, fh: int) -> bool:
        return fh in self._decoders

    def lookup(self, parent_inode: int, name: str) -> pyfuse3.EntryAttributes | None:
        """The control entry ``name`` in ``parent_inode``, or None if it is not one."""
        if parent_inode == ROOT_INODE and name == CONTROL_DIR:
            return self.attributes(self.dir_inode)
        if parent_inode == self.dir_inode:
            if name == HINTS_NAME:
                return self.attributes(self.hints_inode)
            raise pyfuse3.FUSEError(errno.ENOENT)
        return None

    def attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        if inode == self.dir_inode:
            attr.st_mode = stat.S_IFDIR | DIR_MODE
            attr.st_nlink = 2
        else:
            attr.st_mode = stat.S_IFREG | HINTS_MODE
            attr.st_nlink = 1
        attr.st_size = 0
        attr.st_blksize = 4096
        attr.st_uid, attr.st_gid = self._uid, self._gid
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self._created_ns
        attr.attr_timeout = attr.entry_timeout = ATTR_TIMEOUT
        return attr

    def listing(self, inode: int) -> list[tuple[str, int]]:
        """Children of a control directory, for readdir."""
        return [(HINTS_NAME, self.hints_inode)] if inode == self.dir_inode else []

    def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                fields: pyfuse3.SetattrFields) -> pyfuse3.EntryAttributes:
        """Accept only what ``open(hints, "w")`` implies (truncation to 0, time stamps)."""
        if (inode != self.hints_inode or fields.update_mode or fields.update_uid
                or fields.update_gid or (fields.update_size and attr.st_size != 0)):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self.attributes(inode)

    def open(self, inode: int, flags: int, fh: int) -> pyfuse3.FileInfo:
        if inode == self.dir_inode:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_WRONLY:
            raise pyfuse3.FUSEError(errno.EACCES)  # write-only: there is nothing to read
        self._decoders[fh] = HintDecoder()
        # direct_io: every write reaches us in order, none is held in the page cache.
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    def write(self, fh: int, data: bytes) -> int:
        """Decode what the handle has written so far; hand over the complete records."""
        decoder = self._decoders.get(fh)
        if decoder is None:
            metrics.HINT_ERRORS.inc()
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            records = decoder.feed(data)
        except HintFormatError as exc:
            log.warning("rejected hint data written to %s: %s", CONTROL_FILE, exc)
            self._decoders[fh] = None
            metrics.HINT_ERRORS.inc()
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        for record in records:
            metrics.HINT_RECORDS.inc()
            self._on_record(record)
        return len(data)

    def release(self, fh: int) -> None:
        """Closed: a record cut off at the end is counted (close cannot fail: a FLUSH handler
        would cost every close of every data file a round trip to this process)."""
        decoder = self._decoders.pop(fh, None)
        if decoder is not None and decoder.pending:
            log.warning("%s closed with %d bytes of an unfinished hint record", CONTROL_FILE,
                        decoder.pending)
            metrics.HINT_ERRORS.inc()
