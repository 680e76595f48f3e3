"""The Python FUSE ceiling: a minimal read-only pyfuse3 + trio filesystem serving files from
memory.

It mounts with the spoke's own mount options (taken from ``fuse_mount.daemon``, so the two
cannot drift apart) and the readahead the spoke gives a wholly cached file
(``fuse_mount.read_ahead.WARM_KB``), opens files with ``keep_cache`` like the spoke, and
answers a read with a slice of one in-memory ``bytes``. Whatever the spoke's read path costs
beyond this is ours to win back; only a reply made with no copy in Python is faster (below).

    python -m bench.memfs --source FILE [--source FILE ...] [--mapped] MOUNTPOINT

loads each FILE into memory and serves it as ``MOUNTPOINT/<basename of FILE>`` (one flat
directory, as ``bench.repro``'s shards are). It prints ``memfs: ready`` on stdout once the mount
answers, and unmounts on SIGTERM/SIGINT.

With ``--mapped`` each FILE is mapped read-only instead, and a read is answered with a view of
the map: the kernel copies the reply straight from the file's pages, with no copy in Python.
Not the ceiling the benches compare with (that is the plain slice above); it says what a
filesystem that replies from its cache file's pages, as the spoke could, would gain
(``bench.daemon_cpu --mapped-memfs``).
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import signal
import stat
import sys

import pyfuse3
import trio

from fuse_mount import read_ahead
from fuse_mount.daemon import SpokeConfig, mount_options
from fuse_mount.namespace import ATTR_TIMEOUT

READY_LINE = "memfs: ready"
"""Printed on stdout once the mount answers; ``bench.throughput`` waits for it."""

_FIRST_INODE = pyfuse3.ROOT_INODE + 1
"""The first file's inode; the i-th file's is ``_FIRST_INODE + i``."""


Served = bytes | memoryview
"""A file's bytes as memfs holds them: a copy in memory, or a view of a read-only map of it."""


class MemoryFilesystem(pyfuse3.Operations):
    """Read-only files in the root directory: ``files`` maps each name to its bytes."""

    enable_writeback_cache = False

    def __init__(self, files: dict[str, Served]) -> None:
        super().__init__()
        self.names = [os.fsencode(name) for name in files]
        self.data = list(files.values())
        self.inodes = {name: _FIRST_INODE + i for i, name in enumerate(self.names)}

    def _file(self, inode: int) -> Served:
        index = inode - _FIRST_INODE
        if not 0 <= index < len(self.data):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.data[index]

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            attr.st_mode = stat.S_IFDIR | 0o555
            attr.st_nlink = 2
        else:
            attr.st_mode = stat.S_IFREG | 0o444
            attr.st_nlink = 1
            attr.st_size = len(self._file(inode))
        attr.st_blksize = 4096
        attr.st_blocks = -(-attr.st_size // 512)
        attr.attr_timeout = attr.entry_timeout = ATTR_TIMEOUT
        return attr

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self._attributes(inode)

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE or name not in self.inodes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(self.inodes[name])

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for index in range(start_id, len(self.names)):
            if not pyfuse3.readdir_reply(token, self.names[index],
                                         self._attributes(_FIRST_INODE + index), index + 1):
                return

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        self._file(inode)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> Served:
        # the open checked fh; no lookup beyond the list's on the hot path
        return self.data[fh - _FIRST_INODE][off:off + size]


async def _serve(mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_unmount_on_signal)
        nursery.start_soon(_announce_when_live, mountpoint)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _announce_when_live(mountpoint: str) -> None:
    """Runs beside ``pyfuse3.main``: setting readahead stats the mount, which this process
    answers."""
    # Every byte is in memory: the readahead of a wholly cached file.
    await trio.to_thread.run_sync(read_ahead.ReadAhead().locate, mountpoint, read_ahead.WARM_KB)
    print(READY_LINE, flush=True)


async def _unmount_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memfs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, action="append",
                        help="file whose bytes to serve from memory (repeatable)")
    parser.add_argument("--mapped", action="store_true",
                        help="serve each file from a read-only map of it, replying with views")
    parser.add_argument("mountpoint")
    args = parser.parse_args(argv)
    files: dict[str, Served] = {}
    for source in args.source:
        name = os.path.basename(source)
        if name in files:
            parser.error(f"two sources named {name!r}")
        with open(source, "rb") as f:
            mapped = args.mapped and os.fstat(f.fileno()).st_size > 0  # none of an empty file
            files[name] = (memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
                           if mapped else f.read())
    fs = MemoryFilesystem(files)
    # Only the option set matters here; the hub address just names the mount in /proc/mounts.
    cfg = SpokeConfig(hub_host="memfs", hub_port=0, cache_dir="", cache_size=0,
                      mountpoint=args.mountpoint, allow_other=os.geteuid() == 0)
    options = {o for o in mount_options(cfg) if not o.startswith("fsname=")} | {"fsname=memfs"}
    pyfuse3.init(fs, args.mountpoint, options)
    try:
        trio.run(_serve, args.mountpoint)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
