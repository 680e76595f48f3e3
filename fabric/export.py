"""The hub's view of its export directory: a metadata snapshot and confined block reads.

Reads are addressed by file id (taken from the snapshot), never by a path the spoke sends, and the
file opened is checked to be that very file inside the export; so no ``..`` or symlink can lead
outside the exported directory. Blocking calls here are run in worker threads by the hub shell.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from dataclasses import dataclass

import xxhash

from neuralcache.blocks import BLOCK_SIZE

from .protocol import ErrorCode, MetaEntry

log = logging.getLogger(__name__)

_VERSION_FIELDS = struct.Struct(">QQQQ")

MAX_SYMLINK_HOPS = 40
"""Symlinks followed while resolving one target: the Linux kernel's limit (MAXSYMLINKS)."""


class ExportError(Exception):
    """A read the export refuses or cannot serve; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def content_version(st: os.stat_result) -> int:
    """A 63-bit number that changes whenever the file's content may have changed.

    ctime moves on every write, truncate or metadata change, and mtime/size/inode cover
    replace-by-rename; hashing them gives a compact token the spoke can key its cache on.
    """
    packed = _VERSION_FIELDS.pack(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return xxhash.xxh3_64_intdigest(packed) >> 1


@dataclass(frozen=True)
class _FileRef:
    path: str  # absolute path on the hub
    dev: int


class Export:
    """A read-only exported directory."""

    def __init__(self, root: str) -> None:
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise FileNotFoundError(errno.ENOENT, "export is not a directory", root)
        self.root = real
        self._dev = os.stat(real).st_dev
        self._files: dict[int, _FileRef] = {}

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
                    files[entry.file_id] = _FileRef(d.path, self._dev)
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

    def read_blocks(self, file_id: int, version: int, first: int, count: int) -> bytes:
        """Blocks ``first`` .. ``first + count - 1`` of the file, if it still has ``version``."""
        ref = self._files.get(file_id)
        if ref is None:
            raise ExportError(ErrorCode.NOT_FOUND, f"no file with id {file_id} in the export")
        try:
            fd = os.open(ref.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            missing = exc.errno in (errno.ENOENT, errno.ELOOP)
            code = ErrorCode.NOT_FOUND if missing else ErrorCode.IO_ERROR
            raise ExportError(code, f"open failed: {exc.strerror}") from None
        try:
            before = os.fstat(fd)
            self._check_identity(ref, fd, before, file_id, version)
            # Clipped to the file, so no block number a request can carry overflows an offset
            # or sizes a buffer beyond what the file holds (a growing file is stale anyway).
            offset = first * BLOCK_SIZE
            length = min(count * BLOCK_SIZE, before.st_size - offset)
            data = os.pread(fd, length, offset) if length > 0 else b""
            if content_version(os.fstat(fd)) != version:
                raise ExportError(ErrorCode.STALE, "file changed while it was read")
            return data
        except OSError as exc:
            raise ExportError(ErrorCode.IO_ERROR, f"read failed: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _check_identity(self, ref: _FileRef, fd: int, st: os.stat_result, file_id: int,
                        version: int) -> None:
        if st.st_ino != file_id or st.st_dev != ref.dev or not stat.S_ISREG(st.st_mode):
            raise ExportError(ErrorCode.STALE, "the path now holds another file")
        if not self._inside(os.path.realpath(f"/proc/self/fd/{fd}")):
            raise ExportError(ErrorCode.NOT_FOUND, "file is outside the export")
        if content_version(st) != version:
            raise ExportError(ErrorCode.STALE, "file changed on the hub since the snapshot")
