"""The one place where exceptions become errno values for the kernel.

FUSE handlers may raise only ``pyfuse3.FUSEError``; every handler is wrapped by ``fuse_handler``,
which maps what the fabric, the cache or a bug raised to an errno, counts it and logs it.
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from fabric.client import ChecksumError, HubUnavailable, RemoteError
from fabric.protocol import ErrorCode

from . import metrics
from .fetcher import ShortReadError

log = logging.getLogger(__name__)

T = TypeVar("T")


def errno_for(exc: BaseException) -> int:
    """The errno a reader should see for ``exc``."""
    if isinstance(exc, RemoteError) and exc.code in (ErrorCode.STALE, ErrorCode.NOT_FOUND):
        return errno.ESTALE  # the file changed or vanished on the hub since the snapshot
    if isinstance(exc, ShortReadError):
        return errno.ESTALE
    if isinstance(exc, (HubUnavailable, ChecksumError, RemoteError)):
        return errno.EIO
    return errno.EIO


def fuse_handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap a pyfuse3 handler so it raises nothing but FUSEError."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError as exc:
            metrics.FS_ERRORS.labels(errno.errorcode.get(exc.errno, str(exc.errno))).inc()
            raise
        except Exception as exc:
            code = errno_for(exc)
            if isinstance(exc, (HubUnavailable, ChecksumError, RemoteError, ShortReadError)):
                log.error("%s failed: %s", fn.__name__, exc)
            else:
                log.exception("%s failed unexpectedly", fn.__name__)
            metrics.FS_ERRORS.labels(errno.errorcode[code]).inc()
            raise pyfuse3.FUSEError(code) from None

    return wrapper
