"""Linux ``openat2(2)`` through ctypes: Python's ``os`` module has no binding for it.

The hub opens every exported file with it, relative to an fd of the export root, so the kernel
itself refuses a path that would leave the root or pass through a symlink, in one system call,
instead of a path open followed by a ``realpath`` walk that ``lstat``s every component.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

RESOLVE_NO_MAGICLINKS = 0x02
"""Refuse /proc-style "magic" links (``/proc/self/fd/N``), which jump anywhere."""
RESOLVE_NO_SYMLINKS = 0x04
"""Refuse any symlink in the path, with ELOOP."""
RESOLVE_BENEATH = 0x08
"""Refuse an absolute path or a ``..`` that would step above the starting directory, with EXDEV."""
RESOLVE_CACHED = 0x20
"""Resolve from the dentry cache only, failing with EAGAIN rather than reading a directory from
disk (Linux 5.12; earlier kernels answer EINVAL)."""

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}
"""openat2's system call number: 437 in the generic table both of these share (Linux 5.6)."""
_UNAVAILABLE = (errno.ENOSYS, errno.EPERM)
"""What a kernel without openat2 answers, or a seccomp filter that does not know it (Docker's
older default profiles answer EPERM to system calls they do not list)."""


class OpenHow(ctypes.Structure):
    """``struct open_how`` of <linux/openat2.h>; the kernel only reads it, so one instance
    can serve every call (from any thread) that opens with the same flags."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NUMBER = _SYS_OPENAT2.get(platform.machine())
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(OpenHow))


def openat2(dirfd: int, path: bytes, how: OpenHow) -> int:
    """A new fd for ``path`` resolved from ``dirfd`` as ``how`` says; OSError as ``os.open``
    raises it (ENOSYS where this machine has no openat2)."""
    if _NUMBER is None:
        raise OSError(errno.ENOSYS, f"openat2 is not known on {platform.machine()}")
    while True:
        fd = _syscall(ctypes.c_long(_NUMBER), ctypes.c_int(dirfd), ctypes.c_char_p(path),
                      ctypes.byref(how), _HOW_SIZE)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), os.fsdecode(path))


def supports(dirfd: int, resolve: int) -> bool:
    """Whether this kernel opens with ``resolve`` (probed on ``dirfd`` itself, ``.``); False
    when openat2 is missing or blocked, or a flag is unknown to it."""
    try:
        os.close(openat2(dirfd, b".", OpenHow(os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                                              resolve)))
    except OSError as exc:
        if exc.errno in (*_UNAVAILABLE, errno.EINVAL):
            return False
        if exc.errno == errno.EAGAIN:
            return True  # known, only the root's dentry is not cached at this instant
        raise
    return True
