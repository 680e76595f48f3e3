"""The pyfuse3 operations of a spoke: a read-only view of the hub's snapshot.

Namespace calls are answered from the local snapshot; reads go to the BlockFetcher, and each
read is queued for the prefetch pump. The mount is not mounted "ro" (the hints control
file takes writes), so read-only is enforced here: opening a data file for writing fails with
EROFS, as does every call that would change the namespace. Every handler goes through
``fuse_handler`` so that only FUSEError ever reaches pyfuse3.
"""

from __future__ import annotations

import errno
import itertools
import os
from typing import NoReturn

import pyfuse3
import trio

from fabric.protocol import MetaEntry
from neuralcache.hints import HintRecord

from . import metrics
from .block_store import RunBytes
from .control import ControlFiles
from .errors import fuse_handler
from .exact_reads import ExactReadFiles
from .fetcher import BlockFetcher
from .namespace import Namespace, Node
from .prefetch import PrefetchPump
from .read_ahead import ReadAhead

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
_READS_OK = metrics.READS.labels("ok")
_READS_FAILED = metrics.READS.labels("error")


class SpokeFilesystem(pyfuse3.Operations):
    """Read-only FUSE filesystem over a namespace snapshot and a block fetcher."""

    enable_writeback_cache = False

    def __init__(self, namespace: Namespace, fetcher: BlockFetcher, pump: PrefetchPump,
                 read_ahead: ReadAhead) -> None:
        super().__init__()
        self.namespace = namespace
        self.fetcher = fetcher
        self.pump = pump
        self.read_ahead = read_ahead
        self.control = ControlFiles(namespace.next_free_inode, self._on_hints,
                                    namespace.uid, namespace.gid)
        self.exact_reads = ExactReadFiles()
        self._handles: dict[int, MetaEntry] = {}
        self._next_fh = itertools.count(1)

    def _node(self, inode: int) -> Node:
        node = self.namespace.node(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        if self.control.owns(inode):
            return self.control.attributes(inode)
        return self.namespace.attributes(self._node(inode))

    def _on_hints(self, record: HintRecord) -> None:
        self.exact_reads.note(trio.current_time(), record)
        self.pump.on_hints(record)

    def _refuse_change(self, inode: int) -> NoReturn:
        """Nothing in the mount may be created, removed, renamed or changed."""
        raise pyfuse3.FUSEError(errno.EPERM if self.control.owns(inode) else errno.EROFS)

    @fuse_handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        control = self.control.lookup(parent_inode, os.fsdecode(name))
        if control is not None:
            return control
        node = self.namespace.lookup(parent_inode, os.fsdecode(name))
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.namespace.attributes(node)

    @fuse_handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self._attributes(inode)

    @fuse_handler
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.control.owns(inode):
            return self.control.setattr(inode, attr, fields)
        self._node(inode)
        raise pyfuse3.FUSEError(errno.EROFS)

    @fuse_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if node.entry.kind != "l":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.entry.target)

    @fuse_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode == self.control.dir_inode:
            return inode
        if self.control.owns(inode) or not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        children = self.control.listing(fh) if self.control.owns(fh) else self._node(fh).listing
        for index in range(start_id, len(children)):
            name, inode = children[index]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attributes(inode),
                                         index + 1):
                return

    @fuse_handler
    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if self.control.owns(inode):
            return self.control.open(inode, flags, next(self._next_fh))
        node = self._node(inode)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.kind != "f":
            raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
        fh = next(self._next_fh)
        self._handles[fh] = node.entry
        # The snapshot pins each file's version for the mount's lifetime, so pages the kernel
        # cached for this inode stay valid across opens. Direct I/O: the reads as the job made
        # them, with no readahead (exact_reads.py).
        direct = self.exact_reads.wants(trio.current_time(), node.entry.path)
        if direct:
            metrics.EXACT_OPENS.inc()
        else:
            # The kernel takes the readahead into the file once this open is answered.
            self.read_ahead.for_open(self.fetcher.holds_whole(node.entry))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=direct)

    @fuse_handler
    async def read(self, fh: int, off: int, size: int) -> RunBytes:
        entry = self._handles.get(fh)
        if entry is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        length = min(size, entry.size - off)
        if length > 0:
            # Queued before the fetch: the prefetcher must see a read before the completion of
            # a prefetch it waits for (else "late" counts as "useful"). The pump only runs
            # while this read waits (hub, LMDB) or after it is answered; the read pays the append.
            self.pump.on_read(fh, entry, off, length)
        try:
            data = await self.fetcher.read(entry, off, size)
        except Exception:
            _READS_FAILED.inc()
            raise
        _READS_OK.inc()
        return data

    @fuse_handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if not self.control.owns_handle(fh):
            raise pyfuse3.FUSEError(errno.EBADF)  # data files are never open for writing
        return self.control.write(fh, buf)

    @fuse_handler
    async def release(self, fh: int) -> None:
        self._handles.pop(fh, None)
        self.control.release(fh)

    @fuse_handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo,
                                                           pyfuse3.EntryAttributes]:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._refuse_change(new_parent_inode)

    @fuse_handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._refuse_change(parent_inode)

    @fuse_handler
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self._refuse_change(parent_inode_old)

    @fuse_handler
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        self._refuse_change(inode)

    @fuse_handler
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._refuse_change(inode)

    @fuse_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = self.namespace.total_blocks
        st.f_bfree = st.f_bavail = 0
        st.f_files = len(self.namespace)
        st.f_ffree = st.f_favail = 0
        st.f_namemax = 255
        return st

    @fuse_handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # ENOSYS, not ENOATTR: the kernel then answers every later xattr call itself, which
        # saves `ls -l` a daemon round trip per file (90 % of listing a 100,000-file tree).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @fuse_handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        raise pyfuse3.FUSEError(errno.ENOSYS)
