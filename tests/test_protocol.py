"""The sans-IO wire protocol: round trips, chunking independence, and hostile input.

The hub and the spoke both trust ``FrameDecoder`` to turn *any* byte stream into either messages
or a ``ProtocolError``; these properties are what lets the shells close a bad connection cleanly
instead of crashing on an unexpected exception.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fabric.protocol import (CHECKSUM_BYTES, MAX_FRAME, MAX_READ_BLOCKS, MAX_READ_RANGES,
                             MIRROR_VERSION, PACING_LIMIT_VERSION, READ_MANY_VERSION, ErrorCode,
                             ErrorReply, FrameDecoder, Hello, Message, MetaEntry, MetaReply,
                             MetaRequest, Mirror, PacingLimit, Priority, ProtocolError,
                             ReadManyReply, ReadManyRequest, ReadReply, ReadRequest, Role,
                             Welcome, decode_owned_payload, decode_payload, encode)
from fabric.transport.framing import read_many_reply_frame, read_many_reply_size
from neuralcache.blocks import BLOCK_SIZE, block_count

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
# msgpack carries text as UTF-8, which cannot hold lone surrogates.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)

meta_entries = st.builds(
    MetaEntry, path=TEXT, kind=st.sampled_from(sorted(MetaEntry.KINDS)),
    mode=st.integers(0, 0o7777), size=U64, mtime_ns=I64, file_id=U64, version=U64, target=TEXT)

checksum_fields = st.integers(0, 4).flatmap(
    lambda n: st.binary(min_size=n * CHECKSUM_BYTES, max_size=n * CHECKSUM_BYTES))
PRIORITIES = st.sampled_from(sorted(Priority.ALL))


def read_many_requests(max_ranges: int = MAX_READ_RANGES) -> st.SearchStrategy[ReadManyRequest]:
    return st.builds(ReadManyRequest, U64, PRIORITIES, st.lists(
        st.tuples(U64, U64, U64, U64), min_size=1, max_size=max_ranges).map(tuple))


@st.composite
def range_replies(draw: st.DrawFn, index: int) -> tuple[bytes, bytes, tuple[Any, ...] | None]:
    """One range of a ReadManyReply: its data (the last block often short) and checksums, or
    no data and its error."""
    if draw(st.booleans(), label="failed"):
        return b"", b"", (index, draw(st.sampled_from(sorted(ErrorCode.ALL))), draw(TEXT))
    size = draw(st.integers(0, 300) | st.integers(BLOCK_SIZE - 1, 2 * BLOCK_SIZE + 1))
    data = draw(st.randoms(use_true_random=False)).randbytes(size)
    sums = draw(st.binary(min_size=block_count(size) * CHECKSUM_BYTES,
                          max_size=block_count(size) * CHECKSUM_BYTES))
    return data, sums, None


@st.composite
def read_many_replies(draw: st.DrawFn, max_ranges: int = 4) -> ReadManyReply:
    n = draw(st.integers(1, max_ranges))
    ranges = [draw(range_replies(i)) for i in range(n)]
    return ReadManyReply(draw(U64), tuple(len(data) for data, _, _ in ranges),
                         b"".join(data for data, _, _ in ranges),
                         b"".join(sums for _, sums, _ in ranges),
                         tuple(e for _, _, e in ranges if e is not None), draw(U64))


MESSAGE_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Hello: st.one_of(st.builds(Hello, U64, TEXT, st.none() | st.sampled_from(sorted(Role.ALL))),
                     st.builds(Hello, U64, TEXT, st.sampled_from(sorted(Role.ALL)), U64)),
    Welcome: st.builds(Welcome, U64, TEXT),
    MetaRequest: st.builds(MetaRequest, U64),
    MetaReply: st.builds(MetaReply, U64, st.lists(meta_entries, max_size=4).map(tuple),
                         st.booleans()),
    ReadRequest: st.builds(ReadRequest, U64, U64, U64, U64, U64, PRIORITIES),
    ReadReply: st.builds(ReadReply, U64, U64, st.binary(max_size=9000), checksum_fields,
                         st.none() | U64),
    ReadManyRequest: read_many_requests(max_ranges=4),
    ReadManyReply: read_many_replies(),
    PacingLimit: st.builds(PacingLimit, U64),
    Mirror: st.builds(Mirror, U64),
    ErrorReply: st.builds(ErrorReply, U64, st.sampled_from(sorted(ErrorCode.ALL)), TEXT),
}
messages = st.one_of(*MESSAGE_STRATEGIES.values())

# Any value msgpack can carry, to stand in for a field of the wrong type.
msgpack_values = st.recursive(
    st.none() | st.booleans() | I64 | U64 | st.floats(allow_nan=False) | TEXT
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8)

HEADER = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def decode_or_protocol_error(payload: bytes) -> Message | None:
    """Decode ``payload``; None if it was refused with a ProtocolError (anything else escapes)."""
    try:
        return decode_payload(payload)
    except ProtocolError:
        return None


def assert_canonical(msg: Message, payload: bytes) -> None:
    """An accepted payload must be exactly what ``encode`` makes of the decoded message, so no
    value of a wrong type (a float kind, a bool id) slips through as if it were valid."""
    assert encode(msg)[HEADER.size:] == payload


@pytest.mark.parametrize("kind", list(MESSAGE_STRATEGIES), ids=lambda k: k.__name__)
@given(data=st.data())
def test_every_message_type_round_trips(kind: type, data: st.DataObject) -> None:
    msg = data.draw(MESSAGE_STRATEGIES[kind])
    wire = encode(msg)
    assert HEADER.unpack_from(wire)[0] == len(wire) - HEADER.size
    decoder = FrameDecoder()
    assert decoder.feed(wire) == [msg]
    assert decoder.buffered == 0
    assert decode_payload(wire[HEADER.size:]) == msg


def test_message_kinds_are_distinct() -> None:
    kinds = [cls.KIND for cls in MESSAGE_STRATEGIES]
    assert len(set(kinds)) == len(kinds)


@given(msgs=st.lists(messages, min_size=1, max_size=8), cuts=st.lists(st.floats(0, 1), max_size=12))
def test_any_split_of_a_frame_sequence_decodes_to_the_same_messages(
        msgs: list[Message], cuts: list[float]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    points = sorted({int(c * len(stream)) for c in cuts} | {0, len(stream)})
    decoder = FrameDecoder()
    out: list[Message] = []
    for start, end in zip(points, points[1:]):
        out += decoder.feed(stream[start:end])
    assert out == msgs
    assert decoder.buffered == 0


@settings(max_examples=25)
@given(msgs=st.lists(messages, min_size=1, max_size=2))
def test_byte_at_a_time_feeding_decodes_the_same_messages(msgs: list[Message]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    decoder = FrameDecoder()
    out: list[Message] = []
    for i in range(len(stream)):
        out += decoder.feed(stream[i:i + 1])
    assert out == msgs


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.binary(max_size=64), max_size=8))
def test_garbage_bytes_raise_only_protocol_error(chunks: list[bytes]) -> None:
    decoder = FrameDecoder(max_frame=1024)
    out: list[Message] = []
    try:
        for chunk in chunks:
            out += decoder.feed(chunk)
    except ProtocolError:
        pass
    assert all(isinstance(m, tuple(MESSAGE_STRATEGIES)) for m in out)


@given(payload=st.binary(max_size=200))
def test_garbage_payload_in_a_well_formed_frame_raises_only_protocol_error(payload: bytes) -> None:
    msg = decode_or_protocol_error(payload)
    try:
        FrameDecoder().feed(frame(payload))
    except ProtocolError:
        assert msg is None
    else:
        assert msg is not None


@given(msg=messages, position=st.integers(min_value=0), xor=st.integers(1, 255))
def test_a_flipped_payload_byte_is_refused_or_decodes_to_a_valid_message(
        msg: Message, position: int, xor: int) -> None:
    payload = bytearray(encode(msg)[HEADER.size:])
    payload[position % len(payload)] ^= xor
    decoded = decode_or_protocol_error(bytes(payload))
    if decoded is not None:
        # A flip may yield a valid but non-minimal msgpack form (uint8 0 for fixint 0), so the
        # check is that what was accepted is a well-typed message, not the same bytes.
        assert decode_payload(encode(decoded)[HEADER.size:]) == decoded


@given(msg=messages, data=st.data())
def test_a_field_of_any_other_value_is_refused_or_decodes_canonically(
        msg: Message, data: st.DataObject) -> None:
    raw = msgpack.unpackb(encode(msg)[HEADER.size:], raw=False)
    path = [data.draw(st.integers(1, len(raw) - 1), label="field")]
    if isinstance(msg, MetaReply) and msg.entries and data.draw(st.booleans(), label="in entry"):
        path = [2, data.draw(st.integers(0, len(msg.entries) - 1)), data.draw(st.integers(0, 7))]
    target = raw
    for index in path[:-1]:
        target = target[index]
    target[path[-1]] = data.draw(msgpack_values, label="replacement")
    payload = msgpack.packb(raw, use_bin_type=True)
    decoded = decode_or_protocol_error(payload)
    if decoded is not None:
        assert_canonical(decoded, payload)


@given(msg=messages, extra=msgpack_values, drop=st.booleans())
def test_a_missing_or_extra_field_is_refused(msg: Message, extra: Any, drop: bool) -> None:
    # A read reply without the retransmitted count (version 2) plus an unsigned integer is the
    # version-3 form, and one with it less the count is the version-2 form: both are valid.
    # So are a hello less its role (version 4) or its link (version 6), one of version 4 plus
    # a role and one of version 6 plus a link.
    uint = type(extra) is int and extra >= 0
    assume(not (isinstance(msg, ReadReply) and (
        drop and msg.retransmitted is not None
        or not drop and msg.retransmitted is None and uint)))
    assume(not (isinstance(msg, Hello) and (
        drop and msg.role is not None
        or not drop and msg.role is None and isinstance(extra, str) and extra in Role.ALL
        or not drop and msg.role is not None and msg.link is None and uint)))
    raw = msgpack.unpackb(encode(msg)[HEADER.size:], raw=False)
    raw = raw[:-1] if drop else raw + [extra]
    with pytest.raises(ProtocolError):
        decode_payload(msgpack.packb(raw, use_bin_type=True))


def test_a_hello_says_its_role_from_version_5_and_an_older_one_has_none() -> None:
    assert decode_payload(msgpack.packb([Hello.KIND, 4, "old"])) == Hello(4, "old", None)
    assert decode_payload(msgpack.packb([Hello.KIND, 5, "s", Role.DEMAND])).role == Role.DEMAND
    for role in ("", "prefetch", 1, ["bulk"]):
        with pytest.raises(ProtocolError):
            decode_payload(msgpack.packb([Hello.KIND, 5, "s", role]))


@given(kind=msgpack_values, fields=st.lists(msgpack_values, max_size=6))
def test_an_unknown_kind_is_refused(kind: Any, fields: list[Any]) -> None:
    assume(not (type(kind) is int and kind in {cls.KIND for cls in MESSAGE_STRATEGIES}))
    with pytest.raises(ProtocolError):
        decode_payload(msgpack.packb([kind, *fields], use_bin_type=True))


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgpack.packb({"kind": 1}), msgpack.packb([]), msgpack.packb(1),
    msgpack.packb([1, 1, "a"]) + b"\x00",  # trailing bytes after the array
    b"\x91" * 100_000 + b"\xc0",  # nesting deep enough to exhaust the unpacker's stack
    msgpack.packb([1, 1, b"\xed\xa0\x80"], use_bin_type=False),  # a string that is not UTF-8
    msgpack.packb([1, 1, b"\xff"], use_bin_type=True),  # bytes where text belongs
    msgpack.packb([5, 1, 2, 3, 4, True]),  # a bool where an integer belongs
    msgpack.packb([5.0, 1, 2, 3, 4, 5]),  # a float kind
    msgpack.packb([4.0, 1, [], True]),
    msgpack.packb([6.0, 1, 0, b"", b""]),
    msgpack.packb([7, 1, ["not", "hashable"], "x"]),
    msgpack.packb([4, 1, [["p", ["f"], 0, 0, 0, 0, 0, ""]], True]),
    msgpack.packb([4, 1, [["p", "f", 0, -1, 0, 0, 0, ""]], True]),
    msgpack.packb([6, 1, 0, b"x", b"1234567"], use_bin_type=True),  # a partial checksum
    msgpack.packb([6, 1, 0, "text", b""], use_bin_type=True),
], ids=lambda p: p[:12].hex())
def test_specific_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_payload(payload)
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(frame(payload))


def test_oversized_header_is_refused_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame=1000)
    with pytest.raises(ProtocolError):
        decoder.feed(HEADER.pack(1001))  # nothing of the body was sent yet
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(HEADER.pack(MAX_FRAME + 1))


def test_a_frame_at_the_limit_is_accepted() -> None:
    msg = ReadReply(1, 0, b"x" * 100, b"")
    wire = encode(msg)
    assert FrameDecoder(max_frame=len(wire) - HEADER.size).feed(wire) == [msg]


def test_encode_refuses_a_message_larger_than_max_frame() -> None:
    with pytest.raises(ValueError):
        encode(ReadReply(1, 0, bytes(MAX_FRAME), b""))


@given(msg=messages, data=st.data())
def test_buffered_reports_a_truncated_frame(msg: Message, data: st.DataObject) -> None:
    wire = encode(msg)
    keep = data.draw(st.integers(1, len(wire) - 1))
    decoder = FrameDecoder()
    assert decoder.feed(wire + wire[:keep]) == [msg]
    assert decoder.buffered == keep
    assert decoder.feed(wire[keep:]) == [msg]
    assert decoder.buffered == 0


@given(msg=read_many_requests())
def test_a_read_many_request_of_up_to_the_most_ranges_round_trips(msg: ReadManyRequest) -> None:
    assert FrameDecoder().feed(encode(msg)) == [msg]


@given(msg=read_many_replies(max_ranges=MAX_READ_RANGES))
def test_a_read_many_reply_round_trips_and_splits_into_its_ranges(msg: ReadManyReply) -> None:
    (decoded,) = FrameDecoder().feed(encode(msg))
    assert decoded == msg
    parts = decoded.parts()
    assert [len(data) for data, _ in parts] == list(msg.sizes)
    assert b"".join(data for data, _ in parts) == msg.data
    assert b"".join(sums for _, sums in parts) == msg.checksums
    assert all(len(sums) == block_count(len(data)) * CHECKSUM_BYTES for data, sums in parts)
    assert all(parts[index] == (b"", b"") for index, _, _ in msg.errors)


@given(msg=read_many_replies(max_ranges=8), views=st.booleans())
def test_read_many_reply_frame_is_the_encoded_reply(msg: ReadManyReply, views: bool) -> None:
    # The hub's data is bytes or a bytearray (a cached read); either must frame the same.
    parts = [(bytearray(data) if views else data, sums) for data, sums in msg.parts()]
    frame = read_many_reply_frame(msg.req_id, parts, msg.errors, msg.retransmitted)
    assert b"".join(frame) == encode(msg)


def decoded_either_way(payload: bytes) -> Message | str:
    """``decode_payload``'s message or error, after checking that ``decode_owned_payload``, over
    the payload in a buffer of its own, says the same."""
    try:
        expected: Message | str = decode_payload(payload)
    except ProtocolError as exc:
        expected = str(exc)
    try:
        got: Message | str = decode_owned_payload(memoryview(bytearray(payload)))
    except ProtocolError as exc:
        got = str(exc)
    assert got == expected
    return got


BLOCK_REPLIES = st.one_of(MESSAGE_STRATEGIES[ReadReply], read_many_replies(max_ranges=8))


@given(msg=BLOCK_REPLIES, data=st.data())
def test_a_block_reply_decoded_in_place_keeps_its_data_as_a_view_and_equals_a_copy(
        msg: ReadReply | ReadManyReply, data: st.DataObject) -> None:
    payload = encode(msg)[HEADER.size:]
    buffer = bytearray(payload)
    decoded = decode_owned_payload(memoryview(buffer))
    assert decoded == msg == decoded_either_way(payload)
    assert isinstance(decoded.data, memoryview) and decoded.data.obj is buffer


@given(msg=messages, cut=st.integers(min_value=0), position=st.integers(min_value=0),
       xor=st.integers(0, 255), extra=st.binary(max_size=3))
def test_decoding_in_place_accepts_and_refuses_exactly_what_decode_payload_does(
        msg: Message, cut: int, position: int, xor: int, extra: bytes) -> None:
    payload = bytearray(encode(msg)[HEADER.size:])
    payload[position % len(payload)] ^= xor
    decoded_either_way(bytes(payload[:len(payload) - cut % (len(payload) + 1)]) + extra)


@given(req_id=U64, counts=st.lists(st.integers(1, 16), min_size=1, max_size=MAX_READ_RANGES),
       retransmitted=st.integers(2**32, 2**64 - 1), smaller=st.integers(0, 2**32 - 1))
def test_read_many_reply_size_is_the_frame_length_of_whole_blocks(
        req_id: int, counts: list[int], retransmitted: int, smaller: int) -> None:
    assert sum(counts) <= MAX_READ_BLOCKS
    parts = [(bytes(c * BLOCK_SIZE), bytes(c * CHECKSUM_BYTES)) for c in counts]
    size = read_many_reply_size(req_id, counts)
    assert sum(map(len, read_many_reply_frame(req_id, parts, [], retransmitted))) == size
    # A smaller count takes fewer bytes: the size is a bound the spoke may budget for.
    assert sum(map(len, read_many_reply_frame(req_id, parts, [], smaller))) <= size


GOOD_RANGE = [1, 2, 0, 1]
SUM = b"\0" * CHECKSUM_BYTES


@pytest.mark.parametrize("fields", [
    pytest.param([1, 0, []], id="no-ranges"),
    pytest.param([1, 0, [GOOD_RANGE] * (MAX_READ_RANGES + 1)], id="too-many-ranges"),
    pytest.param([1, 0, [[1, 2, 0]]], id="range-of-3-ints"),
    pytest.param([1, 0, [[1, 2, 0, 1, 5]]], id="range-of-5-ints"),
    pytest.param([1, 0, [GOOD_RANGE, [1, -2, 0, 1]]], id="negative-version"),
    pytest.param([1, 0, [[1, 2, 0, -1]]], id="negative-count"),
    pytest.param([1, 0, [[1, 2, 0, True]]], id="bool-count"),
    pytest.param([-1, 0, [GOOD_RANGE]], id="negative-req-id"),
    pytest.param([1, 7, [GOOD_RANGE]], id="unknown-priority"),
    pytest.param([1, 0, GOOD_RANGE], id="ranges-not-nested"),
    pytest.param([1, 0, [GOOD_RANGE], 0], id="extra-field"),
])
def test_malformed_read_many_requests_are_refused(fields: list[Any]) -> None:
    _assert_refused(ReadManyRequest.KIND, fields)


@pytest.mark.parametrize("fields", [
    pytest.param([1, [], b"", b"", [], 0], id="no-ranges"),
    pytest.param([1, [0] * (MAX_READ_RANGES + 1), b"", b"", [], 0], id="too-many-ranges"),
    pytest.param([1, [3], b"ab", SUM, [], 0], id="sizes-above-data"),
    pytest.param([1, [1, 0], b"ab", SUM, [], 0], id="sizes-below-data"),
    pytest.param([1, [-2], b"ab", SUM, [], 0], id="negative-size"),
    pytest.param([1, [2], b"ab", b"", [], 0], id="no-checksum"),
    pytest.param([1, [2], b"ab", SUM * 2, [], 0], id="checksum-too-many"),
    pytest.param([1, [2], b"ab", SUM[:-1], [], 0], id="partial-checksum"),
    pytest.param([1, [BLOCK_SIZE + 1], bytes(BLOCK_SIZE + 1), SUM, [], 0],
                 id="short-last-block-without-checksum"),
    pytest.param([1, [0], b"", b"", [[1, ErrorCode.STALE, "x"]], 0], id="error-index-past-end"),
    pytest.param([1, [0], b"", b"", [[-1, ErrorCode.STALE, "x"]], 0], id="negative-error-index"),
    pytest.param([1, [0, 0], b"", b"", [[0, ErrorCode.STALE, "x"], [0, ErrorCode.IO_ERROR, "y"]],
                  0], id="duplicate-error-index"),
    pytest.param([1, [0], b"", b"", [[0, "no_such_code", "x"]], 0], id="unknown-error-code"),
    pytest.param([1, [0], b"", b"", [[0, ErrorCode.STALE]], 0], id="error-of-2-items"),
    pytest.param([1, [0], b"", b"", [[0, ErrorCode.STALE, b"x"]], 0], id="binary-message"),
    pytest.param([1, [2], b"ab", SUM, [[0, ErrorCode.STALE, "x"]], 0], id="error-with-data"),
    pytest.param([1, [2], b"ab", SUM, [], -1], id="negative-retransmitted"),
    pytest.param([1, [2], "ab", SUM, [], 0], id="text-data"),
    pytest.param([1, [2], b"ab", SUM, []], id="missing-retransmitted"),
])
def test_malformed_read_many_replies_are_refused(fields: list[Any]) -> None:
    _assert_refused(ReadManyReply.KIND, fields)


def _assert_refused(kind: int, fields: list[Any]) -> None:
    """A message of ``kind`` with ``fields`` is refused, alone and inside a frame."""
    payload = msgpack.packb([kind, *fields], use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_payload(payload)
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(frame(payload))


def test_a_read_many_request_is_unknown_below_its_protocol_version() -> None:
    payload = encode(ReadManyRequest(1, Priority.PREFETCH, ((1, 2, 0, 4), (3, 4, 8, 1))))
    payload = payload[HEADER.size:]
    assert decode_payload(payload, READ_MANY_VERSION) == ReadManyRequest(
        1, Priority.PREFETCH, ((1, 2, 0, 4), (3, 4, 8, 1)))
    for version in range(1, READ_MANY_VERSION):
        with pytest.raises(ProtocolError, match="unknown message kind"):
            decode_payload(payload, version)


def test_a_hello_may_name_its_link_but_only_with_its_role() -> None:
    hello = Hello(MIRROR_VERSION, "s", Role.BULK, 3)
    assert decode_payload(encode(hello)[HEADER.size:]) == hello
    assert decode_payload(msgpack.packb([Hello.KIND, 6, "s", Role.BULK])).link is None
    for link in (-1, "1", None, 1.0):
        with pytest.raises(ProtocolError):
            decode_payload(msgpack.packb([Hello.KIND, 7, "s", Role.BULK, link]))
    with pytest.raises(ValueError):
        encode(Hello(MIRROR_VERSION, "s", None, 3))


@pytest.mark.parametrize("msg, first_version", [(PacingLimit(31_250_000), PACING_LIMIT_VERSION),
                                                (Mirror(2), MIRROR_VERSION)])
def test_a_spoke_message_is_unknown_below_its_protocol_version(msg: Message,
                                                               first_version: int) -> None:
    payload = encode(msg)[HEADER.size:]
    assert decode_payload(payload, first_version) == msg
    for version in range(1, first_version):
        with pytest.raises(ProtocolError, match="unknown message kind"):
            decode_payload(payload, version)
