"""The forwarder's hand-off of a frame to the link: whole while its flow has no hole, segment by
segment while it has one (a real shaper; frames built as in test_wan_gso)."""

from __future__ import annotations

import random

from bench.wan_forwarder import _offer
from bench.wan_gso import VNET_HDR, Holes
from bench.wan_shaper import LinkDirection
from tests.test_wan_gso import MSS, _fields, _frame


class _LoseSome(random.Random):
    """Loses the segments at the given positions of what the link is offered."""

    def __init__(self, lost: set[int]) -> None:
        super().__init__(0)
        self._lost, self._drawn = lost, 0

    def random(self) -> float:
        self._drawn += 1
        return 0.0 if self._drawn - 1 in self._lost else 1.0


def _link(lost: tuple[int, ...] = ()) -> LinkDirection:
    return LinkDirection(rate_bps=1e9, delay=0.01, queue_bytes=10**6, loss=0.5,
                         rng=_LoseSome(set(lost)))


def test_a_burst_admitted_whole_leaves_as_it_came() -> None:
    link = _link()
    frame = _frame(bytes(5 * MSS))
    _offer(link, Holes(), 0.0, frame)
    assert link.due(1.0) == [frame]
    assert link.counters.forwarded_packets == 5


def test_a_flow_with_a_hole_goes_segment_by_segment_until_it_is_repaired() -> None:
    link, holes = _link((1, 4)), Holes()
    payload = bytes(i % 251 for i in range(6 * MSS))
    _offer(link, holes, 0.0, _frame(payload, seq=0))
    pieces = [_fields(p) for p in link.due(1.0)]
    assert [(p["seq"], p["payload"]) for p in pieces] == [
        (i * MSS, payload[i * MSS:(i + 1) * MSS]) for i in (0, 2, 3, 5)]
    assert all(p["gso_type"] == 0 for p in pieces)
    assert (link.counters.forwarded_packets, link.counters.lost_packets) == (4, 2)

    after = _frame(bytes(3 * MSS), seq=6 * MSS)  # new data while both holes are open
    _offer(link, holes, 1.0, after)
    assert len(link.due(2.0)) == 3
    _offer(link, holes, 2.0, _frame(bytes(MSS), seq=MSS, gso=False))  # the first repair
    _offer(link, holes, 2.0, _frame(bytes(MSS), seq=4 * MSS, gso=False))  # the second
    assert len(link.due(3.0)) == 2
    _offer(link, holes, 3.0, after)  # no hole left: whole again
    assert link.due(4.0) == [after]


def test_a_frame_it_cannot_cut_goes_through_as_one_packet() -> None:
    link = _link()
    frame = VNET_HDR.pack(1, 4, 52, MSS, 20, 16) + bytes(3000)  # a TCPv6 burst: not offered here
    _offer(link, Holes(), 0.0, frame)
    assert link.due(1.0) == [frame]
    assert link.counters.forwarded_bytes == 3000


def test_without_bursts_a_lost_packet_is_simply_gone() -> None:
    link = _link((1,))
    packets = [_frame(bytes(MSS), seq=i * MSS, gso=False) for i in range(3)]
    for packet in packets:
        _offer(link, None, 0.0, packet)
    assert link.due(1.0) == [packets[0], packets[2]]
