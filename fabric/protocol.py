"""The hub<->spoke wire protocol, sans-IO: bytes in, messages out (and back).

A frame is a 4-byte big-endian payload length followed by a msgpack array ``[kind, ...fields]``.
Every request carries an id chosen by the spoke, so many requests can be in flight on one
connection and replies may come back in any order. Nothing here touches a socket or a clock
(the h11 style): the trio shells in ``hub.py`` and ``client.py`` feed bytes and send bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack

from neuralcache.blocks import block_count

PROTOCOL_VERSION = 7
"""Bumped on any incompatible change; the hub refuses a hello outside
``OLDEST_PROTOCOL_VERSION .. PROTOCOL_VERSION``. Version 2 added ``ReadRequest.priority``,
version 3 ``ReadReply.retransmitted``, version 4 ``ReadManyRequest`` and ``ReadManyReply``,
version 5 ``Hello.role``, version 6 ``PacingLimit``, version 7 ``Hello.link`` and
``Mirror``. A hub serves every older spoke, so upgrade hubs first."""

OLDEST_PROTOCOL_VERSION = 1
"""Oldest spoke protocol a hub still serves: version 1 sends 5-field ReadRequests (all demand)."""

PRIORITY_VERSION = 2
"""First protocol version whose ReadRequest carries a priority."""

LOSS_REPORT_VERSION = 3
"""First protocol version whose ReadReply reports the hub's TCP retransmissions."""

READ_MANY_VERSION = 4
"""First protocol version whose spokes may ask for several ranges in one request."""

PACING_LIMIT_VERSION = 6
"""First protocol version whose spokes may send ``PacingLimit``."""

MIRROR_VERSION = 7
"""First protocol version whose spokes may name a connection (``Hello.link``) and send
``Mirror``."""

MAX_FRAME = 16 * 1024 * 1024
"""Largest payload accepted: a 4 MiB read reply plus headroom. Anything larger is an attack or a
bug."""

MAX_READ_BLOCKS = 1024
"""Largest range one read request may ask for (4 MiB of 4 KiB blocks); clients split larger ones.
Also the most blocks all the ranges of one ReadManyRequest may add up to."""

MAX_READ_RANGES = 64
"""Most ranges one ReadManyRequest may carry: a 64 KiB prefetch chunk of 16 KiB samples holds 4,
a 4 MiB one on a fast path up to 256; more ranges per request save little once the request's
fixed cost is shared by tens of them."""

META_CHUNK_ENTRIES = 4096
"""Metadata entries per reply frame, so a 100,000-file tree streams in ~25 frames of < 1 MiB."""

_HEADER = struct.Struct(">I")
CHECKSUM_BYTES = 8
"""Each block's xxh3-64 checksum travels as 8 big-endian bytes."""


class ProtocolError(Exception):
    """The peer sent something this protocol cannot accept; the connection must be closed."""


class ErrorCode:
    """Typed errors a hub returns for one request (the connection stays up)."""

    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    STALE = "stale"  # the file's version on the hub is not the one asked for
    IO_ERROR = "io_error"
    VERSION_MISMATCH = "version_mismatch"

    ALL = frozenset({BAD_REQUEST, NOT_FOUND, STALE, IO_ERROR, VERSION_MISMATCH})


class Role:
    """What a connection carries (``Hello.role``, protocol version >= 5): each end sets the
    connection's TCP congestion control by it (``fabric.transport.tcp``)."""

    BULK = "bulk"  # prefetch chunks, the pipe the spoke's controller keeps full
    DEMAND = "demand"  # small reads a reader is blocked on, one or two at a time

    ALL = frozenset({BULK, DEMAND})


@dataclass(frozen=True)
class Hello:
    """First message from the spoke. A spoke of version 4 or older sends no ``role`` (None),
    and its connections are all taken as bulk. ``link`` (version >= 7, with a role) numbers
    the connection among the spoke's own, for ``Mirror``; None: it cannot be named."""

    KIND: ClassVar[int] = 1
    version: int
    client: str
    role: str | None = None
    link: int | None = None


@dataclass(frozen=True)
class Welcome:
    """The hub's answer to a compatible hello."""

    KIND: ClassVar[int] = 2
    version: int
    export: str


@dataclass(frozen=True)
class MetaRequest:
    """Ask for a snapshot of the export's namespace."""

    KIND: ClassVar[int] = 3
    req_id: int


@dataclass(frozen=True)
class MetaEntry:
    """One file, directory or symlink of the export, as the spoke will present it."""

    path: str  # relative to the export root, "/"-separated; "" is the root
    kind: str  # "f" regular file, "d" directory, "l" symlink
    mode: int  # permission bits only
    size: int
    mtime_ns: int
    file_id: int  # stable identity of the file on the hub
    version: int  # changes whenever the file's content may have changed
    target: str = ""  # symlink target (relative, never leaving the export)

    KINDS: ClassVar[frozenset[str]] = frozenset({"f", "d", "l"})

    def to_wire(self) -> list[Any]:
        return [self.path, self.kind, self.mode, self.size, self.mtime_ns, self.file_id,
                self.version, self.target]

    @classmethod
    def from_wire(cls, raw: Any) -> "MetaEntry":
        _expect(isinstance(raw, list) and len(raw) == 8, "metadata entry must be an 8-item array")
        path, kind, mode, size, mtime_ns, file_id, version, target = raw
        _expect(isinstance(path, str) and isinstance(target, str), "entry path/target not text")
        _expect(isinstance(kind, str) and kind in cls.KINDS, f"unknown entry kind {kind!r}")
        for v in (mode, size, mtime_ns, file_id, version):
            _expect(isinstance(v, int) and not isinstance(v, bool), "entry field not an integer")
        _expect(size >= 0 and file_id >= 0 and version >= 0, "negative entry field")
        return cls(path, kind, mode, size, mtime_ns, file_id, version, target)


@dataclass(frozen=True)
class MetaReply:
    """A chunk of the snapshot; ``done`` marks the last chunk."""

    KIND: ClassVar[int] = 4
    req_id: int
    entries: tuple[MetaEntry, ...]
    done: bool


class Priority:
    """How urgently a spoke needs a read (``ReadRequest.priority``, protocol version >= 2)."""

    DEMAND = 0  # a reader is blocked on it: served before any queued prefetch
    PREFETCH = 1  # a guess about the future: served with what demand leaves

    ALL = frozenset({DEMAND, PREFETCH})


@dataclass(frozen=True)
class ReadRequest:
    """Ask for ``count`` blocks of one version of one file, starting at block ``first``."""

    KIND: ClassVar[int] = 5
    req_id: int
    file_id: int
    version: int
    first: int
    count: int
    priority: int = Priority.DEMAND


@dataclass(frozen=True)
class ReadReply:
    """Block data (concatenated; the last block may be short) and one checksum per block."""

    KIND: ClassVar[int] = 6
    req_id: int
    first: int
    data: bytes | memoryview  # a view of the frame's buffer from ``decode_owned_payload``
    checksums: bytes  # CHECKSUM_BYTES per block
    retransmitted: int | None = None
    """Bytes the hub's TCP has sent more than once on this connection so far (version >= 3):
    the loss that TCP repairs below the spoke, which its congestion controller cannot see."""


@dataclass(frozen=True)
class ReadManyRequest:
    """Ask for several block ranges at once (version >= 4): prefetch of many small samples
    costs one request and one reply on each side instead of one per sample. ``ranges`` holds
    ``(file_id, version, first, count)`` tuples, answered in order."""

    KIND: ClassVar[int] = 8
    req_id: int
    priority: int
    ranges: tuple[tuple[int, int, int, int], ...]

    @property
    def blocks(self) -> int:
        return sum(r[3] for r in self.ranges)


@dataclass(frozen=True)
class ReadManyReply:
    """The answer to every range of a ReadManyRequest, in one frame. Range ``i``'s bytes are
    the next ``sizes[i]`` bytes of ``data`` (the last block of a range may be short; a failed
    range has none), and its checksums the next one per block of them. A failed range is
    listed in ``errors`` as ``(index, code, message)``: one range's error is that range's
    alone."""

    KIND: ClassVar[int] = 9
    req_id: int
    sizes: tuple[int, ...]
    data: bytes | memoryview  # as ``ReadReply.data``
    checksums: bytes
    errors: tuple[tuple[int, str, str], ...]
    retransmitted: int

    def parts(self) -> list[tuple[bytes | memoryview, bytes]]:
        """Each range's ``(data, checksums)``, in order (empty for a failed range).

        A range's data is a view of the reply's, not a copy (the whole ``data`` when there is
        one range): the spoke then copies each byte once, where it joins a read's ranges."""
        if len(self.sizes) == 1:
            return [(self.data, self.checksums)]
        out: list[tuple[bytes | memoryview, bytes]] = []
        view, at, sums_at = memoryview(self.data), 0, 0
        for size in self.sizes:
            nsums = block_count(size) * CHECKSUM_BYTES
            out.append((view[at:at + size], self.checksums[sums_at:sums_at + nsums]))
            at += size
            sums_at += nsums
        return out


@dataclass(frozen=True)
class PacingLimit:
    """The most bytes per second the hub's TCP may send on this connection: the spoke's
    controller sets the rate, and a connection's own kernel BBR, which that pacing keeps
    short of data, would otherwise burst its replies well above it (docs/transport.md)."""

    KIND: ClassVar[int] = 10
    rate: int


@dataclass(frozen=True)
class Mirror:
    """The request in the next frame is one of a pair, sent on two connections of this spoke,
    whose reply belongs on the connection that said hello with ``link`` (version >= 7). The hub
    serves whichever copy comes first, there, and drops the other. A lost request segment
    holds every request behind it on its connection for a round trip, and the replies they
    then get all at once overfill the bottleneck: two copies on two connections seldom wait
    both (docs/transport.md, "Requests on two connections")."""

    KIND: ClassVar[int] = 11
    link: int


@dataclass(frozen=True)
class ErrorReply:
    """A request failed on the hub; ``code`` is one of ErrorCode."""

    KIND: ClassVar[int] = 7
    req_id: int
    code: str
    message: str


Message = Union[Hello, Welcome, MetaRequest, MetaReply, ReadRequest, ReadReply, ReadManyRequest,
                ReadManyReply, PacingLimit, Mirror, ErrorReply]


def _expect(cond: bool, why: str) -> None:
    if not cond:
        raise ProtocolError(why)


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_priority(v: Any) -> bool:
    return _is_uint(v) and v in Priority.ALL


def _fields(msg: Message) -> list[Any]:
    if isinstance(msg, MetaReply):
        return [msg.req_id, [e.to_wire() for e in msg.entries], msg.done]
    if isinstance(msg, ReadManyRequest):
        return [msg.req_id, msg.priority, [list(r) for r in msg.ranges]]
    if isinstance(msg, ReadManyReply):
        return [msg.req_id, list(msg.sizes), msg.data, msg.checksums,
                [list(e) for e in msg.errors], msg.retransmitted]
    fields = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
    if isinstance(msg, Hello):
        if msg.link is None:
            fields.pop()  # the form of version 6 or older
            if msg.role is None:
                fields.pop()  # of version 4 or older
        elif msg.role is None:
            raise ValueError("a hello that names its link must say its role")
    elif isinstance(msg, ReadReply) and msg.retransmitted is None:
        fields.pop()  # the form of an older version
    return fields


def encode(msg: Message) -> bytes:
    """One complete frame for ``msg``."""
    payload = msgpack.packb([msg.KIND, *_fields(msg)], use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ValueError(f"message of {len(payload)} bytes exceeds MAX_FRAME")
    return _HEADER.pack(len(payload)) + payload


def _decode_hello(fields: list[Any]) -> Hello:
    _expect(len(fields) in (2, 3, 4), "Hello needs 2 to 4 fields")
    _expect(_is_uint(fields[0]) and isinstance(fields[1], str), "malformed Hello")
    _expect(len(fields) == 2 or (isinstance(fields[2], str) and fields[2] in Role.ALL),
            "Hello has an unknown role")
    _expect(len(fields) < 4 or _is_uint(fields[3]), "Hello has a malformed link")
    return Hello(*fields)


def _decode_meta_reply(fields: list[Any]) -> MetaReply:
    _expect(len(fields) == 3, "meta reply needs 3 fields")
    req_id, entries, done = fields
    _expect(_is_uint(req_id) and isinstance(entries, list) and isinstance(done, bool),
            "malformed meta reply")
    return MetaReply(req_id, tuple(MetaEntry.from_wire(e) for e in entries), done)


def _decode_read_reply(fields: list[Any]) -> ReadReply:
    _expect(len(fields) in (4, 5), "read reply needs 4 or 5 fields")
    req_id, first, data, checksums, *rest = fields
    _expect(_is_uint(req_id) and _is_uint(first), "malformed read reply header")
    retransmitted = rest[0] if rest else None
    _expect(not rest or _is_uint(retransmitted), "malformed retransmitted count")
    _expect(isinstance(data, _BINARY) and isinstance(checksums, bytes),
            "read reply payload not binary")
    _expect(len(checksums) % CHECKSUM_BYTES == 0, "checksum field has a partial checksum")
    return ReadReply(req_id, first, data, checksums, retransmitted)


def _decode_read_many_request(fields: list[Any]) -> ReadManyRequest:
    _expect(len(fields) == 3, "read-many request needs 3 fields")
    req_id, priority, ranges = fields
    _expect(_is_uint(req_id) and _is_priority(priority), "malformed read-many request header")
    _expect(isinstance(ranges, list) and 0 < len(ranges) <= MAX_READ_RANGES,
            f"read-many request needs 1..{MAX_READ_RANGES} ranges")
    for r in ranges:
        _expect(isinstance(r, list) and len(r) == 4 and all(map(_is_uint, r)),
                "a range must be 4 unsigned integers")
    return ReadManyRequest(req_id, priority, tuple(tuple(r) for r in ranges))


def _decode_read_many_reply(fields: list[Any]) -> ReadManyReply:
    _expect(len(fields) == 6, "read-many reply needs 6 fields")
    req_id, sizes, data, checksums, errors, retransmitted = fields
    _expect(_is_uint(req_id) and _is_uint(retransmitted), "malformed read-many reply header")
    _expect(isinstance(sizes, list) and 0 < len(sizes) <= MAX_READ_RANGES
            and all(map(_is_uint, sizes)), "malformed read-many reply sizes")
    _expect(isinstance(data, _BINARY) and isinstance(checksums, bytes),
            "read-many reply payload not binary")
    _expect(sum(sizes) == len(data), "read-many reply sizes do not add up to its data")
    _expect(len(checksums) == sum(block_count(s) for s in sizes) * CHECKSUM_BYTES,
            "read-many reply has not one checksum per block")
    _expect(isinstance(errors, list), "malformed read-many reply errors")
    seen: set[int] = set()
    for e in errors:
        _expect(isinstance(e, list) and len(e) == 3 and _is_uint(e[0]) and e[0] < len(sizes)
                and e[0] not in seen and isinstance(e[1], str) and e[1] in ErrorCode.ALL
                and isinstance(e[2], str) and sizes[e[0]] == 0, "malformed read-many error")
        seen.add(e[0])
    return ReadManyReply(req_id, tuple(sizes), data, checksums,
                         tuple(tuple(e) for e in errors), retransmitted)


# (class, field validators) for messages whose fields are all scalars.
_SIMPLE: dict[int, tuple[type, tuple[Any, ...]]] = {
    Welcome.KIND: (Welcome, (_is_uint, lambda v: isinstance(v, str))),
    MetaRequest.KIND: (MetaRequest, (_is_uint,)),
    ReadRequest.KIND: (ReadRequest, (*(_is_uint,) * 5, _is_priority)),
    PacingLimit.KIND: (PacingLimit, (_is_uint,)),
    Mirror.KIND: (Mirror, (_is_uint,)),
    ErrorReply.KIND: (ErrorReply, (_is_uint, lambda v: isinstance(v, str) and v in ErrorCode.ALL,
                                   lambda v: isinstance(v, str))),
}


def decode_payload(payload: bytes, version: int = PROTOCOL_VERSION) -> Message:
    """Parse one frame's payload; raises ProtocolError (only) on anything malformed.

    ``version`` is the protocol the peer said it speaks: a version-1 spoke's ReadRequest has
    five fields and is read as demand."""
    try:
        raw = msgpack.unpackb(payload, use_list=True, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable payload: {exc.__class__.__name__}") from None
    return _decode_raw(raw, version)


def decode_owned_payload(payload: memoryview, version: int = PROTOCOL_VERSION) -> Message:
    """``decode_payload`` of a payload in a buffer of its own, which the message may keep: the
    block data of a ReadReply or ReadManyReply is a view of ``payload``, not msgpack's copy of
    it (one copy of every byte a spoke receives). Anything this does not split cleanly, bad
    input included, goes through ``decode_payload``, so the checks and errors are the same."""
    raw = _split_block_reply(payload)
    if raw is None:
        return decode_payload(payload, version)  # type: ignore[arg-type]
    return _decode_raw(raw, version)


_BLOCK_REPLY_HEADS = frozenset({(0x95, ReadReply.KIND), (0x96, ReadReply.KIND),
                                (0x97, ReadManyReply.KIND)})
"""A block reply's first two bytes: a msgpack fixarray of 5-7 items and its kind (a fixint)."""

_FIELDS_BEFORE_DATA = 3  # [kind, req_id, first or sizes, data, ...]
_HEAD_LIMIT = 32 + 9 * MAX_READ_RANGES
"""Most bytes a block reply's fields before its data take (the sizes of MAX_READ_RANGES ranges
as msgpack uint64s, and room to spare): only these are handed to msgpack's unpacker."""

_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin 8/16/32: bytes of the length
_BINARY = (bytes, memoryview)


def _split_block_reply(payload: memoryview) -> list[Any] | None:
    """A block reply's fields, its data a view of ``payload``; None for any other payload, or
    for one that is not well-formed around its data (``decode_payload`` then says why)."""
    if len(payload) < 2 or (payload[0], payload[1]) not in _BLOCK_REPLY_HEADS:
        return None
    items = payload[0] & 0x0F
    head = msgpack.Unpacker(use_list=True, raw=False, strict_map_key=True)
    head.feed(payload[1:_HEAD_LIMIT])
    try:
        fields = [head.unpack() for _ in range(_FIELDS_BEFORE_DATA)]
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    at = 1 + head.tell()
    width = _BIN_LENGTH_BYTES.get(payload[at]) if at < len(payload) else None
    if width is None:
        return None
    start = at + 1 + width
    end = start + int.from_bytes(payload[at + 1:start], "big")
    if start > len(payload) or end > len(payload):
        return None
    tail = msgpack.Unpacker(use_list=True, raw=False, strict_map_key=True)
    tail.feed(payload[end:])
    try:
        rest = list(tail)  # stops at the end of the data, or before an item cut short
    except Exception:
        return None
    if len(rest) != items - _FIELDS_BEFORE_DATA - 1 or end + tail.tell() != len(payload):
        return None
    return [*fields, payload[start:end], *rest]


def _decode_raw(raw: Any, version: int) -> Message:
    """The message of a decoded msgpack payload, checked field by field."""
    _expect(isinstance(raw, list) and len(raw) >= 1, "payload is not a non-empty array")
    kind, fields = raw[0], raw[1:]
    _expect(_is_uint(kind), f"message kind {kind!r} is not an unsigned integer")
    if kind == Hello.KIND:
        return _decode_hello(fields)
    if kind == MetaReply.KIND:
        return _decode_meta_reply(fields)
    if kind == ReadReply.KIND:
        return _decode_read_reply(fields)
    if kind == ReadManyRequest.KIND and version >= READ_MANY_VERSION:
        return _decode_read_many_request(fields)
    if kind == ReadManyReply.KIND:
        return _decode_read_many_reply(fields)
    spec = _SIMPLE.get(kind)
    _expect(spec is not None and (kind != PacingLimit.KIND or version >= PACING_LIMIT_VERSION)
            and (kind != Mirror.KIND or version >= MIRROR_VERSION),
            f"unknown message kind {kind!r}")
    cls, checks = spec  # type: ignore[misc]
    if kind == ReadRequest.KIND and version < PRIORITY_VERSION:
        checks = checks[:5]  # no priority field: the request is demand
    _expect(len(fields) == len(checks), f"{cls.__name__} needs {len(checks)} fields")
    _expect(all(check(v) for check, v in zip(checks, fields)), f"malformed {cls.__name__}")
    return cls(*fields)


class FrameDecoder:
    """Accumulates received bytes and yields complete messages, whatever the chunking."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data``; return every message now complete. Raises ProtocolError on bad input."""
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self._max_frame:
                raise ProtocolError(f"frame of {length} bytes exceeds limit {self._max_frame}")
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            payload = bytes(self._buf[_HEADER.size:end])
            del self._buf[:end]
            out.append(decode_payload(payload))
        return out

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back; non-zero at EOF means a truncated frame."""
        return len(self._buf)
