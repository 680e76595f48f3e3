"""TCP segmentation offload through the emulator's TUN devices, sans-IO: what a frame the
forwarder read is made of, and the pieces of one when the link loses some of its segments.

With ``IFF_VNET_HDR`` and ``TUN_F_TSO4`` a TUN device hands the forwarder each TCP burst the
sender's kernel built as one frame (a ``virtio_net_hdr``, then one IPv4 packet of up to 64 KiB
that the header says to cut into ``gso_size`` segments), and takes such frames back, which the
receiving kernel treats as one coalesced packet, as a NIC's receive offload would. The link is
still modelled per 1500-byte segment (``LinkDirection.admit``: loss, tail drop, serialisation
of each segment with its own headers); only the reads, the writes and the two kernels' work per
packet go from one per segment to one per burst. A burst of a flow with a lost segment not yet
repaired (``Holes``) is cut here into its admitted segments, each a valid frame of its own.
"""

from __future__ import annotations

import bisect
import itertools
import struct

VNET_HDR = struct.Struct("<BBHHHH")
"""``struct virtio_net_hdr`` (flags, gso_type, hdr_len, gso_size, csum_start, csum_offset), in
the host's byte order, which the TUN device uses unless told otherwise (little-endian here)."""
GSO_NONE = 0
GSO_TCPV4 = 1
_IP_TOTAL_LENGTH = struct.Struct("!H")
_IP_ID = struct.Struct("!H")
_TCP_SEQ = struct.Struct("!I")
_SEQ_MASK = 0xFFFFFFFF  # TCP sequence numbers wrap at 2**32
_TCP_FLAGS_AT = 13  # byte of the TCP header holding CWR ... FIN
_TCP_CWR, _TCP_PSH, _TCP_FIN = 0x80, 0x08, 0x01


class FrameError(ValueError):
    """A frame the forwarder cannot make sense of (it passes it on whole instead)."""


def _headers(packet: bytes | memoryview) -> tuple[int, int]:
    """(IPv4 header length, IPv4 + TCP header length) of a TCP/IPv4 packet."""
    if len(packet) < 40 or packet[0] >> 4 != 4 or packet[9] != 6:
        raise FrameError("a segmentation-offload frame that is not TCP over IPv4")
    ip_len = (packet[0] & 0x0F) * 4
    total = ip_len + (packet[ip_len + 12] >> 4) * 4
    if ip_len < 20 or total > len(packet):
        raise FrameError("a segmentation-offload frame with a truncated header")
    return ip_len, total


def _require_tcpv4(gso_type: int, gso_size: int) -> None:
    """A burst this module can cut: TCP over IPv4, with a segment size."""
    if gso_type != GSO_TCPV4 or gso_size == 0:
        raise FrameError(f"segmentation offload of type {gso_type} (size {gso_size})")


def segment_sizes(frame: bytes) -> list[int]:
    """Bytes on the wire of each segment ``frame`` stands for: one size for a plain packet,
    one per ``gso_size`` of payload, each with its own IP and TCP headers, for a burst."""
    _, gso_type, _, gso_size, _, _ = VNET_HDR.unpack_from(frame)
    packet_len = len(frame) - VNET_HDR.size
    if gso_type == GSO_NONE:
        return [packet_len]
    _require_tcpv4(gso_type, gso_size)
    _, header = _headers(memoryview(frame)[VNET_HDR.size:])
    payload = packet_len - header
    whole, last = divmod(payload, gso_size)
    return [header + gso_size] * whole + ([header + last] if last else [])


def pieces(frame: bytes, runs: list[tuple[int, int]]) -> list[bytes]:
    """Segments ``[first, end)`` of a burst, for each ``(first, end)`` of ``runs``, as frames of
    their own.

    The IPv4 header gets the piece's length, the ID its first segment would have had and a new
    checksum; the TCP header the piece's sequence number, CWR only on the burst's first segment
    and FIN and PSH only on its last, as the sender's own segmentation would have left them. The
    TCP checksum stays the partial one the sender left for offload (the header's
    ``NEEDS_CSUM``), which the receiving kernel does not check. A single segment goes out as a
    plain packet. The frame is parsed once for all the runs: a flow with a hole has every
    burst cut into single segments (``Holes``).
    """
    flags, gso_type, _, gso_size, csum_start, csum_offset = VNET_HDR.unpack_from(frame)
    packet = memoryview(frame)[VNET_HDR.size:]
    ip_len, header = _headers(packet)
    _require_tcpv4(gso_type, gso_size)
    count = -(-(len(packet) - header) // gso_size)
    ip_id = _IP_ID.unpack_from(packet, 4)[0]
    seq = _TCP_SEQ.unpack_from(packet, ip_len + 4)[0]
    tcp_flags = packet[ip_len + _TCP_FLAGS_AT]
    head = bytearray(packet[:header])
    out = []
    for first, end in runs:
        if not 0 <= first < end <= count:
            raise ValueError(f"segments [{first}, {end}) of a burst of {count}")
        data = packet[header + first * gso_size:header + end * gso_size]
        _IP_TOTAL_LENGTH.pack_into(head, 2, header + len(data))
        _IP_ID.pack_into(head, 4, (ip_id + first) & 0xFFFF)
        head[10:12] = b"\0\0"
        _IP_ID.pack_into(head, 10, ipv4_checksum(head[:ip_len]))
        _TCP_SEQ.pack_into(head, ip_len + 4, (seq + first * gso_size) & _SEQ_MASK)
        cleared = (_TCP_CWR if first > 0 else 0) | (_TCP_PSH | _TCP_FIN if end < count else 0)
        head[ip_len + _TCP_FLAGS_AT] = tcp_flags & ~cleared & 0xFF
        single = end - first == 1
        vnet = VNET_HDR.pack(flags, GSO_NONE if single else gso_type, header,
                             0 if single else gso_size, csum_start, csum_offset)
        out.append(b"".join((vnet, head, data)))
    return out


def tcp_flow(frame: bytes) -> tuple[bytes, int, int] | None:
    """(flow, sequence number of the first segment, IPv4 + TCP header bytes) of a TCP/IPv4
    frame, or None for anything else. The flow is the addresses and ports, as bytes."""
    packet = memoryview(frame)[VNET_HDR.size:]
    try:
        ip_len, header = _headers(packet)
    except FrameError:
        return None
    flow = bytes(packet[12:20]) + bytes(packet[ip_len:ip_len + 4])
    return flow, _TCP_SEQ.unpack_from(packet, ip_len + 4)[0], header


class Holes:
    """Per TCP flow, the segments the link lost that no later segment has repaired yet.

    While a flow has one, the receiver holds what arrives after it out of order, and counts
    it segment by segment (``tcpi_data_segs_in``, ``tcpi_rcv_ooopack``; the spoke's arrival
    estimate reads them, ``fabric.transport.arrivals``). A TUN device's receiver counts a
    burst written whole as one segment where a host's receive offload counts each, so the
    forwarder writes a flow's segments one by one while it has a hole, whole otherwise.
    """

    def __init__(self) -> None:
        self._lost: dict[bytes, set[int]] = {}

    def __bool__(self) -> bool:
        """Whether any flow has a hole (else a frame with nothing lost needs no look)."""
        return bool(self._lost)

    def update(self, flow: bytes, seq: int, sizes: list[int], header: int,
               admitted: list[bool]) -> bool:
        """Note a frame's segments (payload ``size - header`` each, from ``seq``) lost or
        admitted; True if the flow has a hole once they are through. One pass over the flow's
        holes per frame, not one per segment."""
        lost = self._lost.get(flow)
        if lost is None and all(admitted):
            return False
        ends = list(itertools.accumulate(size - header for size in sizes))
        if lost:  # a hole inside this frame is repaired if its segment got through
            for hole in [h for h in lost if (h - seq) & _SEQ_MASK < ends[-1]]:
                if admitted[bisect.bisect_right(ends, (hole - seq) & _SEQ_MASK)]:
                    lost.discard(hole)
        starts = [0, *ends[:-1]]
        new = [(seq + start) & _SEQ_MASK for start, end, passed in zip(starts, ends, admitted)
               if end > start and not passed]  # a lost pure ACK leaves the receiver no hole
        if new:
            lost = self._lost.setdefault(flow, set())
            lost.update(new)
        if lost is not None and not lost:
            del self._lost[flow]
            return False
        return bool(lost)


def ipv4_checksum(header: bytes | bytearray) -> int:
    """The ones' complement checksum of an IPv4 header whose checksum field is zero."""
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
