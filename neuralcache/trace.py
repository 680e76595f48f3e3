"""Block-access traces: what a run read, in order, for offline replay against any prefetcher.

File format (``--record-trace FILE`` writes it; ``bench/traces.py`` generates it): a stream of
msgpack values, appendable while a run is going on. The first is a header map
``{"format": "neuralcache-trace", "v": 1}``; each later value is an array:

* ``["f", file_id, path, size]`` - a file-table entry (before the first read of that file);
* ``["r", t, actor, stream, file_id, offset, length]`` - one read at time ``t`` (seconds) by
  ``actor`` (the reading thread or process if known, else the stream), with ``stream`` the hint
  the prefetcher is given (the file handle);
* ``["h", t, hint]`` - a hint record as announced (the map of ``neuralcache.hints``' wire format).

A trace that ends in a partial value (a run killed mid-write) is read up to the last whole one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

import msgpack
import numpy as np

from neuralcache.catalog import Catalog
from neuralcache.hints import HintRecord, record_map

TRACE_FORMAT = "neuralcache-trace"
TRACE_VERSION = 1

READ_DTYPE = np.dtype([("t", "f8"), ("actor", "i8"), ("stream", "i8"), ("file_id", "i8"),
                       ("offset", "i8"), ("length", "i8")])
"""Columns of ``Trace.reads``."""

FLUSH_BYTES = 1 << 20
"""TraceWriter buffers this much before writing."""


@dataclass
class Trace:
    """A whole trace in memory: reads as a numpy record array sorted by time."""

    files: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (path, size)
    reads: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=READ_DTYPE))
    hints: list[tuple[float, HintRecord]] = field(default_factory=list)
    meta: dict[str, object] = field(default_factory=dict)

    def catalog(self) -> Catalog:
        """The file table as a prefetcher catalog."""
        return Catalog([(fid, path, size) for fid, (path, size) in self.files.items()])

    @property
    def data_bytes(self) -> int:
        """Total size of the files in the table."""
        return sum(size for _, size in self.files.values())


class TraceEncoder:
    """Pure encoder: each call returns the bytes to append (the mount does the writing)."""

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)
        self._known: set[int] = set()

    def header(self, meta: dict[str, object] | None = None) -> bytes:
        return self._packer.pack({"format": TRACE_FORMAT, "v": TRACE_VERSION,
                                  "meta": meta or {}})

    def file(self, file_id: int, path: str, size: int) -> bytes:
        self._known.add(file_id)
        return self._packer.pack(["f", file_id, path, size])

    def knows(self, file_id: int) -> bool:
        """True once a file-table entry for ``file_id`` has been encoded."""
        return file_id in self._known

    def read(self, t: float, actor: int, stream: int, file_id: int, offset: int,
             length: int) -> bytes:
        return self._packer.pack(["r", t, actor, stream, file_id, offset, length])

    def hint(self, t: float, record: HintRecord) -> bytes:
        return self._packer.pack(["h", t, record_map(record)])


class TraceWriter:
    """Buffers encoded values and writes them to a binary file in large chunks."""

    def __init__(self, out: BinaryIO, meta: dict[str, object] | None = None) -> None:
        self.out = out
        self.encoder = TraceEncoder()
        self._buf = bytearray(self.encoder.header(meta))

    def file(self, file_id: int, path: str, size: int) -> None:
        self._append(self.encoder.file(file_id, path, size))

    def read(self, t: float, actor: int, stream: int, file_id: int, offset: int,
             length: int) -> None:
        self._append(self.encoder.read(t, actor, stream, file_id, offset, length))

    def hint(self, t: float, record: HintRecord) -> None:
        self._append(self.encoder.hint(t, record))

    def _append(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        self.out.write(bytes(self._buf))
        self._buf.clear()
        self.out.flush()


def _values(data: bytes) -> Iterator[object]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    while True:
        try:
            yield unpacker.unpack()
        except msgpack.OutOfData:
            return


def parse_trace(data: bytes) -> Trace:
    """Decode a trace from bytes."""
    values = _values(data)
    header = next(values, None)
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise ValueError("not a neuralcache trace")
    if header.get("v") != TRACE_VERSION:
        raise ValueError(f"unsupported trace version {header.get('v')}")
    trace = Trace(meta=dict(header.get("meta") or {}))
    rows: list[tuple] = []
    for value in values:
        if not isinstance(value, list) or not value:
            raise ValueError(f"bad trace value {value!r}")
        kind = value[0]
        if kind == "r":
            rows.append(tuple(value[1:7]))
        elif kind == "f":
            trace.files[value[1]] = (value[2], value[3])
        elif kind == "h":
            hint = value[2]
            trace.hints.append((value[1], HintRecord(
                hint["epoch"], tuple((p, o, n) for p, o, n in hint["items"]),
                hint.get("source", ""), bool(hint.get("exact", False)))))
        else:
            raise ValueError(f"unknown trace record kind {kind!r}")
    reads = np.array(rows, dtype=READ_DTYPE) if rows else np.empty(0, dtype=READ_DTYPE)
    trace.reads = reads[np.argsort(reads["t"], kind="stable")]
    trace.hints.sort(key=lambda th: th[0])
    return trace


def read_trace(path: str) -> Trace:
    """Load a trace file."""
    with open(path, "rb") as f:
        return parse_trace(f.read())


def write_trace(path: str, trace: Trace) -> None:
    """Write a whole trace (files first, then reads and hints merged by time)."""
    with open(path, "wb") as f:
        writer = TraceWriter(f, trace.meta)
        for fid, (p, size) in sorted(trace.files.items()):
            writer.file(fid, p, size)
        hints = iter(trace.hints)
        pending = next(hints, None)
        for r in trace.reads.tolist():
            while pending is not None and pending[0] <= r[0]:
                writer.hint(*pending)
                pending = next(hints, None)
            writer.read(*r)
        while pending is not None:
            writer.hint(*pending)
            pending = next(hints, None)
        writer.flush()
