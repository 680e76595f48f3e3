"""The hub's view of its export directory: a metadata snapshot and confined block reads.

Reads are addressed by file id (taken from the snapshot), never by a path the spoke sends, and the
file opened is checked to be that very file inside the export; so no ``..`` or symlink can lead
outside the exported directory. The confinement is the kernel's where it can: ``openat2`` from
an fd of the root with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (the scan never follows a
symlink, so no path it lists holds one); elsewhere the path is opened and the fd's real path
checked. Blocking calls here are run in worker threads by the hub shell, except a ``nowait``
read, which raises ``WouldBlock`` rather than wait for the disk.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import stat
import struct
import weakref
from dataclasses import dataclass

import xxhash

from neuralcache.blocks import BLOCK_SIZE

from . import openat2
from .protocol import ErrorCode, MetaEntry

log = logging.getLogger(__name__)

_VERSION_FIELDS = struct.Struct(">QQQQ")

MAX_SYMLINK_HOPS = 40
"""Symlinks followed while resolving one target: the Linux kernel's limit (MAXSYMLINKS)."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CONFINED = openat2.RESOLVE_BENEATH | openat2.RESOLVE_NO_SYMLINKS | openat2.RESOLVE_NO_MAGICLINKS
"""No ``..`` above the root (EXDEV), no symlink at all (ELOOP), no /proc magic link."""
_GONE = {errno.ENOENT: "the file is gone", errno.ENOTDIR: "a directory on its path is gone",
         errno.ELOOP: "a component of its path is now a symlink",
         errno.EXDEV: "its path leads outside the export"}
"""Why an open finds no file of the export where the snapshot had one: answered not_found."""


class Confinement(enum.Enum):
    """How a read is kept inside the export."""

    OPENAT2 = "openat2"  # the kernel resolves beneath the root's fd, refusing any symlink
    REALPATH = "realpath"  # open by path, then check the fd's real path is under the root


class ExportError(Exception):
    """A read the export refuses or cannot serve; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class WouldBlock(Exception):
    """A ``nowait`` read would have waited for the disk (a directory or a page not cached):
    nothing was served; read again where blocking is fine."""


def content_version(st: os.stat_result) -> int:
    """A 63-bit number that changes whenever the file's content may have changed.

    ctime moves on every write, truncate or metadata change, and mtime/size/inode cover
    replace-by-rename; hashing them gives a compact token the spoke can key its cache on.
    """
    packed = _VERSION_FIELDS.pack(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return xxhash.xxh3_64_intdigest(packed) >> 1


@dataclass(frozen=True)
class _FileRef:
    rel: str  # path from the export root, through real directories only
    dev: int


class Export:
    """A read-only exported directory.

    ``confinement`` None picks ``OPENAT2`` where the kernel has it, else ``REALPATH`` (logged);
    naming one insists on it (``OPENAT2`` raises OSError where it is missing)."""

    def __init__(self, root: str, *, confinement: Confinement | None = None) -> None:
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise FileNotFoundError(errno.ENOENT, "export is not a directory", root)
        self.root = real
        root_fd = os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, root_fd)
        self._root_fd = root_fd
        self._dev = os.fstat(root_fd).st_dev
        self._files: dict[int, _FileRef] = {}
        has_openat2 = openat2.supports(root_fd, _CONFINED)
        if confinement is None:
            confinement = Confinement.OPENAT2 if has_openat2 else Confinement.REALPATH
            if not has_openat2:
                log.warning("export: openat2 is unavailable (an old kernel or a seccomp filter); "
                            "confining reads to %s by checking each file's real path", real)
        elif confinement is Confinement.OPENAT2 and not has_openat2:
            raise OSError(errno.ENOSYS, "openat2 is not available", real)
        self.confinement = confinement
        self._how = openat2.OpenHow(_OPEN_FLAGS, 0, _CONFINED)
        self._how_cached = openat2.OpenHow(_OPEN_FLAGS, 0, _CONFINED | openat2.RESOLVE_CACHED)
        # Whether read_blocks(nowait=True) can ever succeed: it needs openat2's RESOLVE_CACHED
        # (Linux 5.12), and a filesystem that takes RWF_NOWAIT (found out on the first read).
        self.nowait_reads = (confinement is Confinement.OPENAT2
                             and openat2.supports(root_fd, _CONFINED | openat2.RESOLVE_CACHED))

    def _inside(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def scan(self) -> list[MetaEntry]:
        """Walk the export (not following symlinks) and return its namespace, root first."""
        entries: list[MetaEntry] = []
        files: dict[int, _FileRef] = {}
        st = os.stat(self.root)
        entries.append(MetaEntry("", "d", stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns,
                                 st.st_ino, 0))
        stack = [("", self.root)]
        while stack:
            rel_dir, abs_dir = stack.pop()
            try:
                with os.scandir(abs_dir) as it:
                    children = sorted(it, key=lambda d: d.name)
            except OSError as exc:
                log.warning("export: cannot list %s: %s", abs_dir, exc)
                continue
            for d in children:
                rel = f"{rel_dir}/{d.name}" if rel_dir else d.name
                entry = self._entry_for(d, rel)
                if entry is None:
                    continue
                entries.append(entry)
                if entry.kind == "d":
                    stack.append((rel, d.path))
                elif entry.kind == "f":
                    files[entry.file_id] = _FileRef(rel, self._dev)
        self._files = files
        return entries

    def _entry_for(self, d: os.DirEntry, rel: str) -> MetaEntry | None:
        try:
            st = d.stat(follow_symlinks=False)
        except OSError as exc:
            log.warning("export: cannot stat %s: %s", d.path, exc)
            return None
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            if st.st_dev != self._dev:
                log.warning("export: skipping %s: another filesystem is mounted there", d.path)
                return None
            return MetaEntry(rel, "d", mode, 0, st.st_mtime_ns, st.st_ino, 0)
        if stat.S_ISREG(st.st_mode):
            return MetaEntry(rel, "f", mode, st.st_size, st.st_mtime_ns, st.st_ino,
                             content_version(st))
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(d.path)
            except OSError as exc:
                log.warning("export: cannot read symlink %s: %s", d.path, exc)
                return None
            if not self._stays_inside(rel.rpartition("/")[0], target):
                log.warning("export: skipping symlink %s: it leads outside the export", d.path)
                return None
            return MetaEntry(rel, "l", mode, len(target), st.st_mtime_ns, st.st_ino, 0, target)
        return None  # sockets, fifos, devices are not exported

    def _stays_inside(self, rel_dir: str, target: str) -> bool:
        """Whether ``target``, of a symlink in ``rel_dir``, resolves without ever stepping above
        the export root. The walk follows symlinks as the kernel will on the spoke's mirror of
        the tree, where above the root lies the mount's parent, not the hub's: so a target that
        leaves and re-enters (``../export/f``, or ``..`` after a link to ``.``) escapes there."""
        if os.path.isabs(target):
            return False
        where = [p for p in rel_dir.split("/") if p]  # the directory reached, relative to root
        pending = target.split("/")[::-1]  # components still to walk, the next one last
        hops = 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if not where:
                    return False
                where.pop()
                continue
            where.append(name)
            path = os.path.join(self.root, *where)
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
                link = os.readlink(path) if is_link else ""
            except OSError:
                continue  # missing (dangling): the rest of the target is walked by name only
            if is_link:
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    return True  # a loop: the kernel answers ELOOP, it leads nowhere
                if os.path.isabs(link):
                    return False
                where.pop()
                pending.extend(link.split("/")[::-1])
        return True

    def read_blocks(self, file_id: int, version: int, first: int, count: int, *,
                    nowait: bool = False) -> bytes | bytearray:
        """Blocks ``first`` .. ``first + count - 1`` of the file, if it still has ``version``.

        With ``nowait``, raises WouldBlock instead of waiting for the disk at any step (a path
        component not in the dentry cache, a page of the range not in the page cache): the
        caller then reads again from the start, in a thread; partial data is never returned."""
        ref = self._files.get(file_id)
        if ref is None:
            raise ExportError(ErrorCode.NOT_FOUND, f"no file with id {file_id} in the export")
        fd = self.open_confined(ref.rel, nowait=nowait)
        try:
            before = os.fstat(fd)
            self._check_identity(ref, before, file_id, version)
            # Clipped to the file, so no block number a request can carry overflows an offset
            # or sizes a buffer beyond what the file holds (a growing file is stale anyway).
            offset = first * BLOCK_SIZE
            length = min(count * BLOCK_SIZE, before.st_size - offset)
            if length <= 0:
                data: bytes | bytearray = b""
            elif nowait:
                data = self._pread_cached(fd, length, offset)
            else:
                data = os.pread(fd, length, offset)
            if content_version(os.fstat(fd)) != version:
                raise ExportError(ErrorCode.STALE, "file changed while it was read")
            return data
        except OSError as exc:
            raise ExportError(ErrorCode.IO_ERROR, f"read failed: {exc.strerror}") from None
        finally:
            os.close(fd)

    def open_confined(self, rel: str, *, nowait: bool = False) -> int:
        """An O_RDONLY fd of ``rel`` (a path from the export root), refused with ExportError
        (not_found) if it is a symlink, passes through one (openat2), or leads outside the
        export. ``nowait``: WouldBlock unless every directory on the way is cached."""
        if self.confinement is Confinement.OPENAT2:
            try:
                return openat2.openat2(self._root_fd, os.fsencode(rel),
                                       self._how_cached if nowait else self._how)
            except OSError as exc:
                if nowait and exc.errno == errno.EAGAIN:
                    raise WouldBlock(f"{rel}: a directory on the path is not cached") from None
                raise _open_failed(exc) from None
        if nowait:
            raise WouldBlock("a path open may read directories from disk")
        try:
            fd = os.open(os.path.join(self.root, rel), _OPEN_FLAGS)
        except OSError as exc:
            raise _open_failed(exc) from None
        if not self._inside(os.path.realpath(f"/proc/self/fd/{fd}")):
            os.close(fd)
            raise ExportError(ErrorCode.NOT_FOUND, "file is outside the export")
        return fd

    def _pread_cached(self, fd: int, length: int, offset: int) -> bytearray:
        """``length`` bytes at ``offset`` if all of them are in the page cache, else WouldBlock.
        RWF_NOWAIT copies what it can without waiting and stops short where it would wait or
        start I/O: at a page not cached, and (seen on Linux 6.18) at a readahead mark, which
        the blocking read in the thread then moves on. At a page not cached it starts the
        readahead, and serves the page if a fast disk has read it by the time it looks again."""
        buf = bytearray(length)
        try:
            got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
        except BlockingIOError:
            raise WouldBlock("the range is not in the page cache") from None
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            self.nowait_reads = False
            log.warning("export: %s does not take non-blocking reads; all reads go to threads",
                        self.root)
            raise WouldBlock("the filesystem has no RWF_NOWAIT") from None
        if got < length:
            raise WouldBlock("part of the range is not in the page cache")
        return buf

    def _check_identity(self, ref: _FileRef, st: os.stat_result, file_id: int,
                        version: int) -> None:
        if st.st_ino != file_id or st.st_dev != ref.dev or not stat.S_ISREG(st.st_mode):
            raise ExportError(ErrorCode.STALE, "the path now holds another file")
        if content_version(st) != version:
            raise ExportError(ErrorCode.STALE, "file changed on the hub since the snapshot")


def _open_failed(exc: OSError) -> ExportError:
    reason = _GONE.get(exc.errno or 0)
    if reason is not None:
        return ExportError(ErrorCode.NOT_FOUND, f"open refused: {reason}")
    return ExportError(ErrorCode.IO_ERROR, f"open failed: {exc.strerror}")
