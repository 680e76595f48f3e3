"""Helpers for the foundation's socket-level tests: metric reads, a hub in a nursery, and an
in-process TCP proxy that can rewrite or hold back the hub's replies."""

from __future__ import annotations

import dataclasses
import functools
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import trio
from prometheus_client import REGISTRY

from fabric.client import HubClient
from fabric.export import Export
from fabric.hub import HubServer
from fabric.protocol import FrameDecoder, Message, ReadManyReply, ReadReply, encode

TEST_LIMIT = 20
"""Seconds any one socket test may take before it is failed rather than left hanging."""


AsyncTest = Callable[..., Awaitable[None]]


def trio_test_within(limit: float) -> Callable[[AsyncTest], Callable[..., None]]:
    """Run an async test body in its own trio run, failing it after ``limit`` seconds: for a
    test whose own waits are longer than ``TEST_LIMIT`` (else those waits never get to fail)."""
    def decorate(fn: AsyncTest) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            async def main() -> None:
                with trio.fail_after(limit):
                    await fn(*args, **kwargs)
            trio.run(main)
        return wrapper
    return decorate


trio_test = trio_test_within(TEST_LIMIT)
"""Run an async test body in its own trio run, failing it if it hangs."""


LOCALHOST = "127.0.0.1"

EVICTED_READ_TRIES = 20
"""How many times a test drops a file's pages and reads it before it gives up on seeing the read
find them gone. A nowait read that finds a page missing starts the kernel's readahead, and on a
fast disk that read can finish before the nowait read looks at the page again, which then finds
it cached and serves it. On this machine's virtual disk, with two busy processes beside the test,
that happened for many tries in a row, then not for many."""

EVICTED_READ_PAUSE = 0.05
"""Seconds between those tries, so that together they outlast such a run."""


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of a process-global metric sample (0 if the labelled child does not exist)."""
    value = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def listener_port(listeners: list[trio.SocketListener]) -> int:
    return listeners[0].socket.getsockname()[1]


@dataclasses.dataclass
class RunningHub:
    """A hub serving in a nursery; ``stop`` cancels it (closing its listeners and connections)."""

    server: HubServer
    port: int
    scope: trio.CancelScope

    def stop(self) -> None:
        self.scope.cancel()


async def start_hub(nursery: trio.Nursery, export: Export | str, port: int = 0,
                    **hub_kwargs: int) -> RunningHub:
    """Start a hub on 127.0.0.1 (``port`` 0 picks a free port) and return once it listens.

    The export is scanned first, as the hub CLI does: reads are served by file id, so the hub
    must know the files before a spoke that kept its namespace across a hub restart asks."""
    if not isinstance(export, Export):
        export = Export(export)
    export.scan()
    server = HubServer(export, **hub_kwargs)
    scope = trio.CancelScope()

    async def serve(*, task_status: trio.TaskStatus[int]) -> None:
        with scope:
            await server.serve(LOCALHOST, port, task_status=_PortStatus(task_status))

    bound = await nursery.start(serve)
    return RunningHub(server, bound, scope)


class _PortStatus:
    """Adapts ``serve``'s started(listeners) to started(port)."""

    def __init__(self, inner: trio.TaskStatus[int]) -> None:
        self._inner = inner

    def started(self, listeners: list[trio.SocketListener]) -> None:
        self._inner.started(listener_port(listeners))


@asynccontextmanager
async def running_client(port: int, **kwargs: float) -> AsyncIterator[HubClient]:
    """A connected HubClient whose ``run`` loop is cancelled on exit."""
    kwargs.setdefault("connect_timeout", 1.0)
    client = HubClient(LOCALHOST, port, **kwargs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        yield client
        nursery.cancel_scope.cancel()


def flip_reply(msg: ReadReply | ReadManyReply) -> ReadReply | ReadManyReply:
    """The same reply with one bit of its block data flipped (the checksums left as they were;
    in a reply to several ranges, the range holding the middle byte)."""
    flipped = bytearray(msg.data)
    flipped[len(flipped) // 2] ^= 0x01
    return dataclasses.replace(msg, data=bytes(flipped))


Rewrite = Callable[[Message], Awaitable[Message]]


@dataclasses.dataclass
class CorruptFirst:
    """A proxy ``Rewrite`` that flips a bit in the first block-carrying reply of ``kind`` and
    passes everything else unchanged; ``corrupted`` counts what it flipped."""

    kind: type
    corrupted: int = 0

    async def __call__(self, msg: Message) -> Message:
        if isinstance(msg, self.kind) and msg.data and not self.corrupted:
            self.corrupted += 1
            return flip_reply(msg)
        return msg


@dataclasses.dataclass
class ReportLoss:
    """A proxy ``Rewrite``: every read reply says its connection's TCP resent another segment,
    or ``share`` of the reply's data if that is more (the running total, as the hub reports)."""

    share: float = 0.0
    resent: int = 0

    async def __call__(self, msg: Message) -> Message:
        if isinstance(msg, (ReadReply, ReadManyReply)):
            self.resent += max(1448, int(self.share * len(msg.data)))
            return dataclasses.replace(msg, retransmitted=self.resent)
        return msg


@dataclasses.dataclass
class Proxy:
    """A TCP proxy in front of a hub: spoke->hub bytes pass unchanged, hub->spoke frames are decoded
    and handed to ``rewrite`` (which may alter or delay them) before being re-encoded."""

    upstream_port: int
    rewrite: Rewrite
    port: int = 0
    connections: int = 0
    closed: int = 0  # connection pairs that ended (either side went away)

    async def _pipe_up(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        async for data in src:
            await dst.send_all(data)
        await dst.send_eof()

    async def _pipe_down(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        async for data in src:
            for msg in decoder.feed(data):
                await dst.send_all(encode(await self.rewrite(msg)))

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            async with await trio.open_tcp_stream(LOCALHOST, self.upstream_port) as upstream:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pipe_up, client, upstream)
                    await self._pipe_down(upstream, client)
                    nursery.cancel_scope.cancel()
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # either side went away; the proxy just drops the pair
        finally:
            self.closed += 1
            await trio.aclose_forcefully(client)

    async def serve(self, *, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host=LOCALHOST)
        self.port = listener_port(listeners)
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)
