"""A TCP proxy between spoke and hub that corrupts block data, to prove the spoke rejects it.

Usage: python -m tests.corrupting_proxy HUB_HOST:PORT always|once  (prints its port)
"""

from __future__ import annotations

import dataclasses
import sys

import trio

from fabric.protocol import FrameDecoder, ReadManyReply, ReadReply, encode


async def main(target: str, mode: str) -> None:
    host, port = target.rsplit(":", 1)
    corrupted = 0

    async def pipe_up(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        async for data in src:
            await dst.send_all(data)

    async def pipe_down(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        nonlocal corrupted
        decoder = FrameDecoder()
        async for data in src:
            for msg in decoder.feed(data):
                blocks = isinstance(msg, (ReadReply, ReadManyReply)) and msg.data
                if blocks and (mode == "always" or corrupted == 0):
                    flipped = bytearray(msg.data)
                    flipped[len(flipped) // 2] ^= 0x01
                    msg = dataclasses.replace(msg, data=bytes(flipped))
                    corrupted += 1
                await dst.send_all(encode(msg))

    async def handle(client: trio.SocketStream) -> None:
        async with await trio.open_tcp_stream(host, int(port)) as upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pipe_up, client, upstream)
                await pipe_down(upstream, client)
                nursery.cancel_scope.cancel()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handle, listeners)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2])
