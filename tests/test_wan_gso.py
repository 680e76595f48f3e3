"""The emulator's segmentation-offload frames: segment sizes, and bursts cut where the link
lost segments (no TUN device: frames are built here as the sender's kernel builds them)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.wan_gso import (GSO_NONE, GSO_TCPV4, VNET_HDR, FrameError, Holes, ipv4_checksum, pieces,
                           segment_sizes)

MSS = 1448
NEEDS_CSUM = 1
TCP_OPTIONS = b"\x01\x01\x08\x0a" + bytes(8)  # NOP NOP timestamps: a 32-byte TCP header
CWR, PSH, ACK, FIN = 0x80, 0x08, 0x10, 0x01


def _frame(payload: bytes, *, seq: int = 1000, ip_id: int = 7, flags: int = CWR | PSH | ACK | FIN,
           gso: bool = True) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 40000, 7001, seq, 1, (32 // 4) << 4, flags, 512, 0xBEEF,
                      0) + TCP_OPTIONS
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), ip_id,
                               0x4000, 64, 6, 0, bytes([198, 18, 0, 1]), bytes([198, 18, 0, 2])))
    ip[10:12] = struct.pack("!H", ipv4_checksum(ip))
    vnet = VNET_HDR.pack(NEEDS_CSUM, GSO_TCPV4 if gso else GSO_NONE, 52, MSS if gso else 0, 20,
                         16)
    return vnet + bytes(ip) + tcp + payload


def piece(frame: bytes, first: int, end: int) -> bytes:
    return pieces(frame, [(first, end)])[0]


def _fields(frame: bytes) -> dict:
    flags, gso_type, _, gso_size, csum_start, csum_offset = VNET_HDR.unpack_from(frame)
    packet = frame[VNET_HDR.size:]
    return {"gso_type": gso_type, "gso_size": gso_size, "csum": (flags, csum_start, csum_offset),
            "ip_length": struct.unpack_from("!H", packet, 2)[0],
            "ip_id": struct.unpack_from("!H", packet, 4)[0],
            "ip_checksum_ok": ipv4_checksum(packet[:20]) == 0, "length": len(packet),
            "seq": struct.unpack_from("!I", packet, 24)[0], "tcp_flags": packet[33],
            "tcp_check": packet[36:38], "payload": packet[52:]}


def test_a_plain_packet_is_one_segment_of_its_size() -> None:
    frame = _frame(b"x" * 100, gso=False)
    assert segment_sizes(frame) == [52 + 100]


def test_a_burst_is_cut_into_segments_each_with_its_headers() -> None:
    assert segment_sizes(_frame(bytes(3 * MSS + 10))) == [52 + MSS] * 3 + [52 + 10]
    assert segment_sizes(_frame(bytes(2 * MSS))) == [52 + MSS] * 2


def test_a_piece_carries_its_segments_with_headers_as_segmentation_leaves_them() -> None:
    payload = bytes(range(256)) * 24  # 6,144 bytes: four whole segments and a short fifth
    frame = _frame(payload, seq=0xFFFFFF00)  # the sequence number wraps inside the burst
    middle = _fields(piece(frame, 1, 3))
    assert middle["payload"] == payload[MSS:3 * MSS]
    assert middle["seq"] == (0xFFFFFF00 + MSS) & 0xFFFFFFFF
    assert middle["ip_length"] == middle["length"] == 52 + 2 * MSS
    assert middle["ip_id"] == 8 and middle["ip_checksum_ok"]
    assert middle["tcp_flags"] == ACK  # CWR stays with the first segment, PSH and FIN the last
    assert (middle["gso_type"], middle["gso_size"]) == (GSO_TCPV4, MSS)
    assert middle["csum"] == (NEEDS_CSUM, 20, 16) and middle["tcp_check"] == b"\xbe\xef"

    first, last = _fields(piece(frame, 0, 1)), _fields(piece(frame, 4, 5))
    assert first["tcp_flags"] == CWR | ACK and first["gso_type"] == GSO_NONE
    assert last["tcp_flags"] == PSH | ACK | FIN and last["payload"] == payload[4 * MSS:]
    assert piece(frame, 0, 5)[VNET_HDR.size:] == frame[VNET_HDR.size:]


@given(st.integers(1, 44 * MSS), st.data())
def test_pieces_of_a_burst_carry_exactly_their_bytes(size: int, data: st.DataObject) -> None:
    payload = bytes(i % 251 for i in range(size))
    frame = _frame(payload)
    count = len(segment_sizes(frame))
    first = data.draw(st.integers(0, count - 1))
    end = data.draw(st.integers(first + 1, count))
    cut = _fields(piece(frame, first, end))
    assert cut["payload"] == payload[first * MSS:end * MSS]
    assert cut["seq"] == 1000 + first * MSS
    assert cut["ip_length"] == cut["length"] and cut["ip_checksum_ok"]
    assert segment_sizes(piece(frame, first, end)) == segment_sizes(frame)[first:end]


def test_a_burst_that_is_not_tcp_over_ipv4_is_refused() -> None:
    frame = bytearray(_frame(bytes(3 * MSS)))
    frame[VNET_HDR.size + 9] = 17  # UDP
    with pytest.raises(FrameError):
        segment_sizes(bytes(frame))
    with pytest.raises(FrameError):
        segment_sizes(VNET_HDR.pack(NEEDS_CSUM, 4, 52, MSS, 20, 16) + bytes(100))  # TCPv6


def test_holes_open_on_lost_payload_and_close_when_a_segment_covers_them() -> None:
    holes, flow = Holes(), b"flow"
    assert not holes.update(flow, 100, [52] * 3, 52, [False] * 3)  # lost ACKs leave no hole
    assert holes.update(flow, 0, [52 + MSS] * 3, 52, [True, False, True])
    assert holes and holes.update(flow, 3 * MSS, [52 + MSS], 52, [True])  # new data: still
    assert not holes.update(flow, 0, [52 + 2 * MSS], 52, [True])  # a repair covering it
    assert not holes
    start = 2**32 - MSS  # sequence numbers wrap
    assert holes.update(flow, start, [52 + MSS] * 2, 52, [True, False])
    assert not holes.update(flow, 0, [52 + MSS], 52, [True])


def _reference_holes(lost: set[int], seq: int, payloads: list[int],
                     admitted: list[bool]) -> None:
    """Segment by segment: a lost one opens a hole, an admitted one closes those it covers."""
    for payload, passed in zip(payloads, admitted):
        if payload:
            if not passed:
                lost.add(seq)
            else:
                lost -= {h for h in lost if (h - seq) % 2**32 < payload}
        seq = (seq + payload) % 2**32


@given(st.lists(st.tuples(st.integers(0, 40), st.lists(st.booleans(), min_size=1, max_size=8),
                          st.integers(0, 52)), max_size=40))
def test_holes_agree_with_a_segment_by_segment_model(
        frames: list[tuple[int, list[bool], int]]) -> None:
    holes, model = Holes(), set()
    for start, admitted, short in frames:
        seq = (2**32 - 20 * MSS + start * MSS) % 2**32  # near the wrap, with retransmissions
        payloads = [MSS] * (len(admitted) - 1) + [max(MSS - short * 28, 0)]
        sizes = [52 + p for p in payloads]
        _reference_holes(model, seq, payloads, admitted)
        assert holes.update(b"flow", seq, sizes, 52, admitted) == bool(model)
