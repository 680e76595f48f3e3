"""The loopback row's ceiling: plain TCP between two Python processes, nothing else.

``bench.transport`` runs it before the fabric's loopback rows, as ``bench.throughput`` runs a
memory-served FUSE filesystem beside the mount. A source process writes one buffer over and
over on each connection, a sink process reads each connection into one buffer, a thread per
connection on both sides: no protocol, no file, no checksums, no event loop. The connections
are set up as the fabric's bulk connections are (kernel BBR, no Nagle). What it measures is
what this machine's kernel moves over loopback between two processes, so the fabric's loopback
row, which does all of that and more per byte, stays below it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from fabric.transport import tcp

SEND_BYTES = 4 * 1024 * 1024
"""One ``sendall``: the size of the fabric's largest reply (``MAX_READ_BLOCKS`` blocks)."""

RECORD_BYTES = 4 * 1024 * 1024
"""The sink records a delivery each time a connection has read about this much, as the
fabric's load records one 4 MiB prefetch read: a few thousand entries per run, not one per
``recv``."""

BULK_CONGESTION = "bbr"
"""The kernel congestion control the hub gives its bulk connections (``HubServer``'s default)."""

RECEIVE_TIMEOUT = 1.0
"""Seconds a sink thread waits in one ``recv`` before it looks at the clock again."""


def serve(host: str, port: int) -> None:
    """Accept connections forever and feed each from a thread; prints ``ready PORT`` once
    listening (what ``bench.transport`` waits for). Ends with the process."""
    listener = socket.create_server((host, port))
    print(f"ready {listener.getsockname()[1]}", flush=True)
    payload = bytes(SEND_BYTES)
    while True:
        conn, _ = listener.accept()
        tcp.configure(conn, BULK_CONGESTION)
        threading.Thread(target=_feed, args=(conn, payload), daemon=True).start()


def _feed(conn: socket.socket, payload: bytes) -> None:
    with conn:
        try:
            while True:
                conn.sendall(payload)
        except OSError:  # the sink closed the connection: the run is over
            return


def receive(host: str, port: int, duration: float, connections: int) -> dict[str, Any]:
    """Read ``connections`` connections for ``duration`` seconds; the result in the shape of
    ``bench.transport``'s loads (no demand reads, no controller; the CPU of every thread)."""
    socks = [socket.create_connection((host, port)) for _ in range(connections)]
    for sock in socks:
        tcp.configure(sock, BULK_CONGESTION)
        sock.settimeout(RECEIVE_TIMEOUT)
    delivered: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    start, cpu_start = time.monotonic(), time.process_time()
    threads = [threading.Thread(target=_drain, args=(sock, start, duration, delivered, errors))
               for sock in socks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = time.process_time() - cpu_start
    for sock in socks:
        sock.close()
    if errors:
        raise errors[0]
    return {"delivered": sorted(delivered), "demand": [], "model": [], "cpu_seconds": cpu}


def _drain(sock: socket.socket, start: float, duration: float,
           delivered: list[tuple[float, int]], errors: list[BaseException]) -> None:
    """Read ``sock`` until ``duration`` is over, recording what arrived (``list.append`` is
    atomic, so the threads share ``delivered`` without a lock)."""
    view = memoryview(bytearray(SEND_BYTES))
    pending = 0
    try:
        while True:
            try:
                got = sock.recv_into(view)
            except socket.timeout:
                got = None
            if got == 0:
                raise ConnectionError("the TCP source closed a connection before the run ended")
            pending += got or 0
            at = time.monotonic() - start
            if pending and (pending >= RECORD_BYTES or at >= duration):
                delivered.append((at, pending))
                pending = 0
            if at >= duration:
                return
    except OSError as exc:
        errors.append(exc)
