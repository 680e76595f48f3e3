"""A small discrete-event model of one bottleneck link, for testing congestion controllers.

Topology (the fabric's request/response shape): a spoke sends a request; it reaches the hub
after rtt/2; the response joins the hub's egress FIFO (the bottleneck: `rate` bytes/s, a
tail-drop buffer of `queue_limit` bytes), is serialised whole, and reaches the spoke rtt/2
later - that arrival is the controller's ack. Every flow shares the one FIFO.

Loss: `loss` is the probability that a response is lost on the wire after it has used the
bottleneck, i.e. per request of whatever size, not per 1500-byte segment (see
`per_request_loss` to convert). The sender hears of a loss when the response would have
arrived plus a quarter of the base RTT, as RACK-style detection would tell it; tail drops
are reported the same way.

Deterministic: all randomness comes from one seeded random.Random.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fabric.congestion import DEFAULT_MSS, CongestionController, CongestionStats, Pacer

LOSS_DETECTION_RTT_FRACTION = 0.25
"""Loss is reported this fraction of the base RTT after the response would have arrived."""

APP_SLACK_BYTES = 1.0
"""An app-limited sender may go this many bytes early, so float rounding cannot stall it."""

DEFAULT_QUEUE_BDPS = 2.0
"""Default bottleneck buffer, in bandwidth-delay products."""


def per_request_loss(segment_loss: float, nbytes: int, segment: int = 1500) -> float:
    """Chance that a response of `nbytes` loses at least one `segment`-byte piece when each
    piece is lost independently with probability `segment_loss`."""
    return 1.0 - (1.0 - segment_loss) ** (nbytes / segment)


@dataclass(frozen=True)
class LinkConfig:
    rate: float  # bottleneck rate, bytes/s
    rtt: float  # base round-trip propagation delay, seconds (split evenly both ways)
    loss: float = 0.0  # per-request loss probability on the wire
    queue_limit: int | None = None  # bottleneck buffer in bytes; None: DEFAULT_QUEUE_BDPS BDPs
    rtt_change: tuple[float, float] | None = None  # (time, new rtt): a route change at `time`

    def rtt_at(self, t: float) -> float:
        """Base RTT in force at time `t`; each leg takes half of it as of when the leg starts."""
        if self.rtt_change is not None and t >= self.rtt_change[0]:
            return self.rtt_change[1]
        return self.rtt

    @property
    def bdp(self) -> float:
        return self.rate * self.rtt

    @property
    def buffer(self) -> int:
        if self.queue_limit is not None:
            return self.queue_limit
        return int(DEFAULT_QUEUE_BDPS * self.bdp)


@dataclass(frozen=True)
class AppLimit:
    """Between `start` and `end` the application offers only `rate` bytes/s."""

    start: float
    end: float
    rate: float


@dataclass
class FlowSpec:
    controller: CongestionController
    start: float = 0.0
    request_sizes: Sequence[int] = (DEFAULT_MSS,)
    app_limit: AppLimit | None = None


@dataclass
class FlowResult:
    name: str
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (ack time, bytes)
    loss_times: list[float] = field(default_factory=list)
    states: list[tuple[float, str]] = field(default_factory=list)  # state changes
    snapshots: list[tuple[float, CongestionStats]] = field(default_factory=list)

    def delivered_between(self, t0: float, t1: float) -> int:
        times = [t for t, _ in self.deliveries]
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_left(times, t1)
        return sum(n for _, n in self.deliveries[lo:hi])

    def goodput(self, t0: float, t1: float) -> float:
        """Acked bytes per second over [t0, t1)."""
        return self.delivered_between(t0, t1) / (t1 - t0)

    def first_time_in(self, state: str, after: float = 0.0) -> float | None:
        return next((t for t, s in self.states if s == state and t >= after), None)

    def snapshot_at(self, t: float) -> CongestionStats:
        """The last snapshot taken at or before `t`."""
        times = [ts for ts, _ in self.snapshots]
        return self.snapshots[max(bisect.bisect_right(times, t) - 1, 0)][1]


@dataclass
class SimResult:
    link: LinkConfig
    flows: list[FlowResult]
    queue_trace: list[tuple[float, int]]  # (time, waiting bytes) at every change
    tail_drops: int

    def utilization(self, t0: float, t1: float) -> float:
        """All flows' goodput over [t0, t1) as a fraction of the bottleneck rate."""
        return sum(f.goodput(t0, t1) for f in self.flows) / self.link.rate

    def _queue_segments(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        segments, level, prev = [], 0, t0
        for t, q in self.queue_trace:
            if t > t0:
                segments.append((prev, min(t, t1), level))
                prev = min(t, t1)
            if t >= t1:
                break
            level = q
        if prev < t1:
            segments.append((prev, t1, level))
        return [(a, b, q) for a, b, q in segments if b > a]

    def queue_peak(self, t0: float, t1: float) -> int:
        return max(q for _, _, q in self._queue_segments(t0, t1))

    def queue_mean(self, t0: float, t1: float) -> float:
        return sum((b - a) * q for a, b, q in self._queue_segments(t0, t1)) / (t1 - t0)

    def jain_index(self, t0: float, t1: float) -> float:
        """Jain's fairness index of the flows' goodputs over [t0, t1): 1 is perfectly fair."""
        x = [f.goodput(t0, t1) for f in self.flows]
        return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else 0.0


class _Sender:
    """One spoke connection: sends whenever the controller's cwnd and the pacer allow."""

    def __init__(self, sim: Simulation, spec: FlowSpec, result: FlowResult) -> None:
        self.sim = sim
        self.spec = spec
        self.cc = spec.controller
        self.pacer = Pacer(self.cc.pacing_rate)
        self.result = result
        self._ids = itertools.count()
        self._next_size = self._draw_size()
        self._wake_at: float | None = None
        self._app_budget = 0.0
        self._app_stamp = spec.app_limit.start if spec.app_limit else 0.0
        self._state = ""
        self._note_state(spec.start)

    def _draw_size(self) -> int:
        sizes = self.spec.request_sizes
        return sizes[0] if len(sizes) == 1 else self.sim.rng.choice(sizes)

    def _note_state(self, now: float) -> None:
        state = self.cc.stats().state
        if state != self._state:
            self._state = state
            self.result.states.append((now, state))

    def _app_limited_at(self, now: float) -> bool:
        limit = self.spec.app_limit
        return limit is not None and limit.start <= now < limit.end

    def _app_wait(self, now: float, size: int) -> float | None:
        """When the application will have `size` bytes to offer, or None if it has them now."""
        limit = self.spec.app_limit
        if limit is None or not self._app_limited_at(now):
            return None
        self._app_budget += (now - max(self._app_stamp, limit.start)) * limit.rate
        self._app_stamp = now
        if self._app_budget >= size - APP_SLACK_BYTES:
            return None
        return min(now + (size - self._app_budget) / limit.rate, limit.end)

    def wake(self, now: float) -> None:
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
        self.try_send(now)

    def _schedule_wake(self, t: float) -> None:
        if self._wake_at is None or t < self._wake_at:
            self._wake_at = t
            self.sim.schedule(t, self.wake)

    def try_send(self, now: float) -> None:
        if now < self.spec.start:
            return
        while True:
            size = self._next_size
            app_ready = self._app_wait(now, size)
            if app_ready is not None:
                if self.cc.can_send(size):
                    self.cc.on_app_limited(now)
                self._schedule_wake(app_ready)
                return
            if not self.cc.can_send(size):
                return  # an ack or a loss will call again
            self.pacer.update_rate(self.cc.pacing_rate, now)
            ready = self.pacer.next_send_time(now, size)
            if ready > now:
                self._schedule_wake(ready)
                return
            packet_id = next(self._ids)
            self.cc.on_packet_sent(now, packet_id, size)
            self.pacer.on_sent(now, size)
            if self._app_limited_at(now):
                self._app_budget -= size
            self._next_size = self._draw_size()
            one_way = self.sim.link.rtt_at(now) / 2
            self.sim.schedule(now + one_way, self.sim.hub_receive, self, packet_id, size)

    def on_ack(self, now: float, packet_id: int, size: int) -> None:
        self.cc.on_packet_acked(now, packet_id)
        self.result.deliveries.append((now, size))
        self._note_state(now)
        self.try_send(now)

    def on_loss(self, now: float, packet_id: int) -> None:
        self.cc.on_packet_lost(now, packet_id)
        self.result.loss_times.append(now)
        self._note_state(now)
        self.try_send(now)


class Simulation:
    """Event loop over a shared bottleneck; build it, then `run(duration)` once."""

    def __init__(
        self,
        link: LinkConfig,
        flows: Sequence[FlowSpec],
        *,
        seed: int = 0,
        snapshot_interval: float | None = None,
    ) -> None:
        self.link = link
        self.rng = random.Random(seed)
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._tail_finish = 0.0  # when the last accepted response finishes serialising
        self._waiting = 0  # bytes queued behind the one in service
        self._tail_drops = 0
        self.queue_trace: list[tuple[float, int]] = [(0.0, 0)]
        self.results = [FlowResult(name=spec.controller.name) for spec in flows]
        self.senders = [_Sender(self, s, r) for s, r in zip(flows, self.results)]
        self._snapshot_interval = snapshot_interval or link.rtt
        for sender in self.senders:
            self.schedule(sender.spec.start, sender.wake)
        self.schedule(0.0, self._snapshot)

    def schedule(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, duration: float) -> SimResult:
        while self._events and self._events[0][0] <= duration:
            t, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)
        return SimResult(self.link, self.results, self.queue_trace, self._tail_drops)

    def _snapshot(self, now: float) -> None:
        for sender in self.senders:
            sender.result.snapshots.append((now, sender.cc.stats()))
        self.schedule(now + self._snapshot_interval, self._snapshot)

    def _set_waiting(self, now: float, delta: int) -> None:
        self._waiting += delta
        self.queue_trace.append((now, self._waiting))

    def hub_receive(self, now: float, sender: _Sender, packet_id: int, size: int) -> None:
        """A request reached the hub: its response joins the bottleneck FIFO (or is dropped)."""
        link = self.link
        start = max(now, self._tail_finish)
        finish = start + size / link.rate
        one_way = link.rtt_at(finish) / 2
        detect = link.rtt_at(finish) * LOSS_DETECTION_RTT_FRACTION
        if start > now:
            if self._waiting + size > link.buffer:
                self._tail_drops += 1
                self.schedule(finish + one_way + detect, sender.on_loss, packet_id)
                return
            self._set_waiting(now, size)
            self.schedule(start, self._start_service, size)
        self._tail_finish = finish
        if self.rng.random() < link.loss:
            self.schedule(finish + one_way + detect, sender.on_loss, packet_id)
        else:
            self.schedule(finish + one_way, sender.on_ack, packet_id, size)

    def _start_service(self, now: float, size: int) -> None:
        self._set_waiting(now, -size)


def simulate(
    link: LinkConfig,
    flows: Sequence[FlowSpec],
    duration: float,
    *,
    seed: int = 0,
    snapshot_interval: float | None = None,
) -> SimResult:
    """Run `flows` over `link` for `duration` simulated seconds."""
    return Simulation(link, flows, seed=seed, snapshot_interval=snapshot_interval).run(duration)
