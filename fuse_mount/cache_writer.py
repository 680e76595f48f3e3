"""The cache's LMDB writes, in a process of their own.

py-lmdb lets go of the GIL around every put, and a writer thread must then win it back from
the event loop before its next one. With the loop busy serving reads that took a 4096-block
batch from 0.08 s to several seconds (``python -m bench.write_contention``): during a cold
hinted shuffle the unwritten blocks piled up to 12,000, and gathering each batch from them
stopped the loop for up to a quarter of a second. A child process has a GIL of its own. The
daemon hands it each batch over a socket pair, from a worker thread that waits with the GIL
released, and gets back where each value landed, as an offset in the cache file (each process
maps the file at its own address).

Messages both ways are a 4-byte big-endian length and a msgpack body. A request is
``[base, new slots, put keys, put bytes, delete keys, stamp keys, stamp values]``: the daemon's
map address, then flat lists. A key goes as two ints, its slot and its block (the daemon's int
keys, ``key_space``, outgrow msgpack's 64 bits past 4,096 slots); "new slots" are the ``(file
id, version)`` pairs of the slots added since the child's last request (all of them for a new
child), from which it rebuilds each key's ``BlockKey``. Stamp values are three per row: stamp,
size and address or None (addresses in the daemon's map). The answer is ``["ok",
offsets]``, each put's value's offset in the file in the puts' order, or ``["error", text]``.
The child leaves when the socket closes, so it never outlives the daemon, even one killed with
SIGKILL.
"""

from __future__ import annotations

import logging
import signal
import socket
import struct
import subprocess
import sys
from itertools import chain, repeat
from typing import Any, Iterable

import msgpack

from .block_store import BlockKey, BlockStore, Written
from .key_space import BLOCK_BITS, KeySpace

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
STOP_WAIT = 10.0
"""Seconds the child gets to finish its batch and exit once its socket is closed."""


class CacheWriteError(Exception):
    """A batch was not written: the child reported an error (disk or map full) or went away."""


def _send(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _receive_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buf


def _receive(sock: socket.socket) -> bytearray | None:
    """One message's body, or None if the other side closed the socket."""
    head = _receive_exactly(sock, _LENGTH.size)
    return None if head is None else _receive_exactly(sock, _LENGTH.unpack(head)[0])


class CacheWriter:
    """``BlockStore.write_batch`` for the daemon, run by a child process (started at the first
    batch, and again at the batch after one that found it gone).

    ``map_base`` is where this process maps the cache file (``BlockStore.map_base``): it goes
    to the child with the addresses in this process's map, which the child turns into its own;
    the child answers with offsets in the file. ``keys`` names the batches' int keys. One batch
    at a time: the cache's write lock sees to that.
    """

    def __init__(self, path: str, capacity: int, map_base: int | None, keys: KeySpace) -> None:
        self._path = path
        self._capacity = capacity
        self._base = map_base
        self._keys = keys
        self._slots_sent = 0  # slots the running child knows
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), self._path,
                 str(self._capacity)], pass_fds=[theirs.fileno()])
        self._sock = ours
        self._slots_sent = 0
        return ours

    def write_batch(self, puts: dict[int, bytes], deletes: Iterable[int],
                    stamps: dict[int, tuple[int, int, int | None]],
                    extents: Iterable[int] = (), unpacked: Iterable[int] = ()
                    ) -> Written:
        """Write one batch (all or nothing) and return where each put block now lies in this
        process's map, as ``BlockStore.write_batch`` does (``extents`` and ``unpacked`` by the
        keys of their first blocks); blocks until the child has committed it."""
        sock = self._sock or self._start()
        versions = self._keys.versions[self._slots_sent:]
        # Flat lists, built in C rather than a list per key in Python: this holds the GIL,
        # which the event loop wants.
        request = msgpack.packb([
            self._base, list(chain.from_iterable(versions)), _slots_and_blocks(puts),
            list(puts.values()), _slots_and_blocks(deletes), _slots_and_blocks(stamps),
            list(chain.from_iterable(stamps.values())), _slots_and_blocks(extents),
            _slots_and_blocks(unpacked)])
        try:
            _send(sock, request)
            answer = _receive(sock)
        except OSError as exc:
            self._stop()
            raise CacheWriteError(f"the cache writer process is gone ({exc})") from exc
        if answer is None:
            self._stop()
            raise CacheWriteError("the cache writer process exited")
        self._slots_sent += len(versions)
        status, *result = msgpack.unpackb(answer)
        if status != "ok":
            raise CacheWriteError(result[0])
        offsets, stored_extents = result
        base = self._base
        if base is None:
            return Written({}, stored_extents)
        return Written({key: base + offset for key, offset in zip(puts, offsets)
                        if offset is not None}, stored_extents)

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                log.error("the cache writer process did not exit; killing it")
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Let the child finish and exit (call after the last batch)."""
        self._stop()


_SLOT_SPAN = 1 << BLOCK_BITS


def _slots_and_blocks(keys: Iterable[int]) -> list[int]:
    """Int keys as a flat list of (slot, block) pairs, made in C."""
    return list(chain.from_iterable(map(divmod, keys, repeat(_SLOT_SPAN))))


def _groups(flat: list[Any], size: int) -> list[Any]:
    """``[a, b, c, d, e, f]``, size 3 -> ``[(a, b, c), (d, e, f)]``."""
    return list(zip(*[iter(flat)] * size))


def _write(store: BlockStore, slots: list[tuple[int, int]], request: Any
           ) -> tuple[list[int | None], bool]:
    """Write one request; the offset of each put's value in the file, in the puts' order, and
    whether its extents were stored.
    ``slots``, the ``(file id, version)`` of each slot so far, grows by the request's new ones."""
    (their_base, new_slots, put_keys, datas, deletes, stamp_keys, stamp_values, extents,
     unpacked) = request
    slots.extend(_groups(new_slots, 2))

    def block_keys(flat: list[int]) -> list[BlockKey]:
        return [BlockKey(*slots[slot], block) for slot, block in _groups(flat, 2)]
    base = store.map_base
    shift = None if base is None or their_base is None else base - their_base
    puts = dict(zip(block_keys(put_keys), datas))
    stamps = {key: (stamp, size,
                    address + shift if address is not None and shift is not None else None)
              for key, (stamp, size, address) in zip(block_keys(stamp_keys),
                                                     _groups(stamp_values, 3))}
    written = store.write_batch(puts, block_keys(deletes), stamps, block_keys(extents),
                                block_keys(unpacked))
    if base is None:
        return [], written.extents
    return ([None if (address := written.addresses.get(key)) is None else address - base
             for key in puts], written.extents)


def main(argv: list[str]) -> int:
    """The child: write each batch that arrives until the socket closes."""
    fd, path, capacity = int(argv[0]), argv[1], int(argv[2])
    # A Ctrl-C at the daemon's terminal reaches its whole process group: the daemon then
    # flushes its last blocks through this process, which must still be here to write them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    store = BlockStore(path, capacity)
    slots: list[tuple[int, int]] = []
    try:
        while (body := _receive(sock)) is not None:
            try:
                answer = ["ok", *_write(store, slots, msgpack.unpackb(body))]
            except Exception as exc:  # fails this batch (the daemon logs it), not the writer
                answer = ["error", f"{type(exc).__name__}: {exc}"]
            _send(sock, msgpack.packb(answer))
    except ConnectionError:
        pass  # the daemon went away mid-batch (killed): what is committed stays, as after a crash
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
