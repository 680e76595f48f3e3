"""The pyfuse3 operations of a spoke: a read-only view of the hub's snapshot.

Namespace calls are answered from the local snapshot; reads go to the BlockFetcher. Every
handler goes through ``fuse_handler`` so that only FUSEError ever reaches pyfuse3.
"""

from __future__ import annotations

import errno
import itertools
import os

import pyfuse3

from fabric.protocol import MetaEntry

from . import metrics
from .errors import fuse_handler
from .fetcher import BlockFetcher
from .namespace import Namespace, Node

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


class SpokeFilesystem(pyfuse3.Operations):
    """Read-only FUSE filesystem over a namespace snapshot and a block fetcher."""

    enable_writeback_cache = False

    def __init__(self, namespace: Namespace, fetcher: BlockFetcher) -> None:
        super().__init__()
        self.namespace = namespace
        self.fetcher = fetcher
        self._handles: dict[int, MetaEntry] = {}
        self._next_fh = itertools.count(1)

    def _node(self, inode: int) -> Node:
        node = self.namespace.node(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    @fuse_handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        node = self.namespace.lookup(parent_inode, os.fsdecode(name))
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.namespace.attributes(node)

    @fuse_handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self.namespace.attributes(self._node(inode))

    @fuse_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if node.entry.kind != "l":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.entry.target)

    @fuse_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self._node(fh)
        children = node.listing
        for index in range(start_id, len(children)):
            name, inode = children[index]
            attrs = self.namespace.attributes(self.namespace.nodes[inode])
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attrs, index + 1):
                return

    @fuse_handler
    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.kind != "f":
            raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
        fh = next(self._next_fh)
        self._handles[fh] = node.entry
        # The snapshot pins each file's version for the mount's lifetime, so pages the kernel
        # cached for this inode stay valid across opens.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @fuse_handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        entry = self._handles.get(fh)
        if entry is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            data = await self.fetcher.read(entry, off, size)
        except Exception:
            metrics.READS.labels("error").inc()
            raise
        metrics.READS.labels("ok").inc()
        return data

    @fuse_handler
    async def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

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
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @fuse_handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []
