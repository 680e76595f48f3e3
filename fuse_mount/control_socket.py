"""The daemon's control socket: status, warm-up and cache commands from the ``neuralcache`` CLI.

A Unix stream socket next to the mount record (``runtime.control_socket_path``), mode 0600 and
answering only peers running as root or as the daemon's own user (checked with SO_PEERCRED,
which also covers anyone who connected before the mode was set). Messages are length-prefixed
msgpack maps (``control_protocol``). A bad request gets an error reply; nothing a client sends
or fails to read can stop the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from typing import Any, Awaitable, Callable

import trio

from fabric.client import HubClient
from fabric.protocol import MetaEntry
from neuralcache.blocks import block_count
from neuralcache.trace import read_trace

from . import control_protocol as proto
from .block_cache import BlockCache
from .block_store import BlockKey
from .fetcher import BlockFetcher
from .namespace import Namespace
from .runtime import control_socket_path
from .status import snapshot
from .warmup import PlanError, WarmupManager, plan_paths, plan_profile, select_files

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
"""Only the owner (root) may connect: the commands can empty the cache and load the hub."""
BACKLOG = 16
"""Pending connections; the CLI makes one at a time."""
RECEIVE_BYTES = 65536
"""Bytes read from a client per receive."""
VERIFY_BATCH = 1024
"""Blocks read back per cache lookup during ``cache verify`` (4 MiB held at a time)."""
DROP_BATCH = 16384
"""Blocks ``cache drop`` forgets between two chances for reads to run (64 MiB, a few ms)."""
MAX_SKIPPED_REPORTED = 20
"""Paths of a profile missing from the mount named in the reply (the count is always given)."""
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RequestError(Exception):
    """A request the daemon understood but cannot carry out; its message goes to the user."""


def _arg(request: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
         required: bool = False) -> Any:
    if name not in request:
        if required:
            raise RequestError(f"request lacks {name!r}")
        return default
    value = request[name]
    if not isinstance(value, kind):
        raise RequestError(f"{name!r} has the wrong type ({type(value).__name__})")
    return value


def _paths(request: dict[str, Any]) -> list[str]:
    paths = _arg(request, "paths", list, required=True)
    if not paths or not all(isinstance(p, str) for p in paths):
        raise RequestError("'paths' must be a non-empty list of strings")
    return paths


def _peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)[1]


class ControlServer:
    """Answers the CLI for one mount; start ``serve`` in the daemon's nursery."""

    def __init__(self, *, mountpoint: str, hub: str, cache_dir: str, namespace: Namespace,
                 cache: BlockCache, fetcher: BlockFetcher, client: HubClient) -> None:
        self.mountpoint = mountpoint
        self.hub = hub
        self.cache_dir = cache_dir
        self.namespace = namespace
        self.cache = cache
        self.client = client
        self.path = control_socket_path(mountpoint)
        self.warmup = WarmupManager(namespace, fetcher, cache_dir)
        self._ops: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "status": self._status,
            "warmup": self._warmup,
            "warmup_progress": self._warmup_progress,
            "warmup_cancel": self._warmup_cancel,
            "cache_drop": self._cache_drop,
            "cache_verify": self._cache_verify,
        }

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen (after resuming any saved warm-up) until cancelled; reports the socket path."""
        sock = await self._bind()
        inode = os.stat(self.path).st_ino
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.warmup.run)
                listeners = [trio.SocketListener(sock)]
                task_status.started(self.path)
                await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)
        finally:
            sock.close()
            # Another daemon may since have taken this mountpoint and its socket path.
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == inode:
                    os.unlink(self.path)

    async def _bind(self) -> trio.socket.SocketType:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead daemon's; a live one would still hold the mount
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(self.path)
            os.chmod(self.path, SOCKET_MODE)
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- connections -------------------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                uid = _peer_uid(stream.socket)
                if uid not in (0, os.geteuid()):
                    log.warning("control socket: refused a client running as uid %d", uid)
                    await stream.send_all(proto.encode(proto.error("permission denied")))
                    return
                await self._converse(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; nothing to answer
        except Exception:  # noqa: BLE001 - one broken conversation must not stop the daemon
            log.exception("control socket: conversation failed")

    async def _converse(self, stream: trio.SocketStream) -> None:
        reader = proto.MessageReader()
        while data := await stream.receive_some(RECEIVE_BYTES):
            try:
                bodies = reader.feed(data)
            except proto.FrameTooLarge as exc:
                await stream.send_all(proto.encode(proto.error(str(exc))))
                return
            for body in bodies:
                await stream.send_all(proto.encode(await self.answer(body)))

    async def answer(self, body: bytes) -> dict[str, Any]:
        """The reply to one message body (never raises for anything the client sent)."""
        try:
            request = proto.decode_body(body)
            op = request.get("op")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise RequestError(f"unknown request {op!r}; known: {', '.join(sorted(self._ops))}")
            return proto.ok(**await handler(request))
        except (proto.BadMessage, RequestError, PlanError) as exc:
            return proto.error(str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged with its trace
            log.exception("control request failed")
            return proto.error(f"internal error: {exc}")

    # -- requests ----------------------------------------------------------------------------

    async def _status(self, request: dict[str, Any]) -> dict[str, Any]:
        self.client.stats()  # brings the link gauges up to date first
        mount = {"mountpoint": self.mountpoint, "hub": self.hub, "pid": os.getpid(),
                 "cache_dir": self.cache_dir}
        return {"status": snapshot(mount, self.warmup.progress())}

    async def _warmup(self, request: dict[str, Any]) -> dict[str, Any]:
        profile = _arg(request, "profile", str)
        recursive = _arg(request, "recursive", bool, False)
        skipped: list[str] = []
        if profile is not None:
            try:
                trace = await trio.to_thread.run_sync(read_trace, profile)
            except OSError as exc:
                raise RequestError(f"cannot read the profile {profile}: "
                                   f"{exc.strerror or exc}") from None
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise RequestError(f"{profile} is not a neuralcache trace: {exc}") from None
            chunks, skipped = await trio.to_thread.run_sync(plan_profile, self.namespace, trace)
        else:
            chunks = await trio.to_thread.run_sync(plan_paths, self.namespace, _paths(request),
                                                   recursive)
        job = await self.warmup.submit(chunks)
        return {"job": job, "skipped_paths": skipped[:MAX_SKIPPED_REPORTED],
                "skipped": len(skipped), "cache_capacity_bytes": self.cache.policy.capacity}

    async def _warmup_progress(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"job": self.warmup.progress()}

    async def _warmup_cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        cancelled = self.warmup.cancel()
        return {"cancelled": cancelled, "job": self.warmup.progress()}

    async def _files(self, request: dict[str, Any]) -> list[MetaEntry]:
        recursive = _arg(request, "recursive", bool, False)
        return await trio.to_thread.run_sync(select_files, self.namespace, _paths(request),
                                             recursive)

    async def _cache_drop(self, request: dict[str, Any]) -> dict[str, Any]:
        files = await self._files(request)
        dropped = 0
        for entry in files:
            blocks = block_count(entry.size)
            for first in range(0, blocks, DROP_BATCH):
                dropped += self.cache.drop(
                    BlockKey(entry.file_id, entry.version, b)
                    for b in range(first, min(blocks, first + DROP_BATCH)))
                await trio.sleep(0)  # let reads in between batches of a large file
        return {"files": len(files), "dropped_blocks": dropped}

    async def _cache_verify(self, request: dict[str, Any]) -> dict[str, Any]:
        """Read back every cached block of the files; the cache drops (and counts) the ones
        failing their checksum, so the next read fetches them again."""
        files = await self._files(request)
        holds = self.cache.holds
        checked = corrupt = 0
        batch: list[BlockKey] = []

        async def verify(keys: list[BlockKey]) -> int:
            found = await self.cache.get_many(keys)
            # Not returned and gone from the cache: dropped for its checksum (a block the
            # cache evicts during this very read would count too; verify a quiet mount).
            return sum(1 for k in keys if k not in found and not holds(k))

        for entry in files:
            for block in range(block_count(entry.size)):
                key = BlockKey(entry.file_id, entry.version, block)
                if holds(key):
                    batch.append(key)
                if len(batch) >= VERIFY_BATCH:
                    checked += len(batch)
                    corrupt += await verify(batch)
                    batch = []
        if batch:
            checked += len(batch)
            corrupt += await verify(batch)
        return {"files": len(files), "checked_blocks": checked, "corrupt_blocks": corrupt}
