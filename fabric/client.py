"""The spoke's link to the hub: a pool of TCP connections paced by one congestion controller.

The kernel moves the bytes (several TCP connections; on bulk ones the hub runs ``nc_paced``,
which only follows the pacing cap below, where it could load it, else ``bbr``:
``transport.kernel_cc``; ``cubic`` on demand ones: ``transport.tcp.DEMAND_CONGESTION``);
our controller (``fabric.congestion``, ``bbr`` or ``cubic``) decides how many reply bytes may be
outstanding and when the next prefetch request may leave (``transport.request_pipe``). The
connections have two roles:

* **bulk** (``connections``; by default ``bulk_connections``: four, sixteen on a long path;
  dialled over ``BULK_STAGGER`` unless the path is very short or very long,
  ``stagger_step``; grown to ``LOSSY_PATH_CONNECTIONS`` once the path loses segments after
  its start-up, ``SteadyLoss``): prefetch requests, cut into
  chunks as the controller's window and pacer allow, each sent on the bulk connection with
  the fewest bytes outstanding. A chunk counts as delivered when its bytes reach the spoke's
  kernel, not when TCP releases them in order (``transport.arrivals``): otherwise a lost
  segment's stall and release would read to the controller as a burst of bandwidth. The
  hub's kernel paces their replies at most at a cap the spoke sends with the requests, each
  connection a share of it (``PacingLimit``, ``transport.reply_pacing``), so its own TCP does
  not burst them. While a path shorter than ``MIRROR_MAX_RTT`` loses segments, each request
  also goes on a second bulk connection (``Mirror``): a lost request segment no longer holds
  the requests behind it for a round trip and then releases their replies in a burst.
* **demand** (``demand_connections``, grown on need up to ``MAX_DEMAND_CONNECTIONS``): demand
  reads skip the prefetch queue and the pacer and go out at once on a connection that carries
  no prefetch, so a demand reply never waits behind megabytes of prefetch replies in one TCP
  stream; the hub serves them before any queued prefetch. TCP delivers in order, so one lost
  segment stalls everything behind it on that connection for a round trip or more: a demand
  read therefore prefers a connection with nothing outstanding, and while the path is losing
  segments (the hub reports its TCP's resends, ``transport.resend_rate``) a small one goes out
  on two such connections at once (the first verified reply wins), so a single random loss
  does not cost it a retransmission round trip.

Given a ``path_memory`` file, the client keeps its controller's model of the path there and
starts from it on the next run if the path still looks the same (careful resume,
``fabric.path_memory``).

Every connection redials with exponential backoff when it breaks; requests on a lost
connection are sent again. Blocks are checked against the hub's checksums before they are
returned. Callers see ``HubUnavailable``, ``ChecksumError`` or ``RemoteError`` - nothing else.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from neuralcache.blocks import BLOCK_SIZE

from . import metrics
from .checksum import bad_blocks, intact
from .congestion import CongestionStats, create_controller
from .path_memory import PathRecord, load_record, save_record
from .protocol import (MAX_READ_BLOCKS, PROTOCOL_VERSION, ErrorReply, Hello, Message,
                       MetaEntry, MetaReply, MetaRequest, Mirror, PacingLimit, Priority,
                       ProtocolError, ReadManyReply, ReadManyRequest, ReadReply, ReadRequest, Role,
                       Welcome, encode)
from .transport import tcp
from .transport.arrivals import ArrivalCount, ArrivalTracker, TcpCounters
from .transport.framing import FrameReader, read_many_reply_size, read_reply_size
from .transport.limits import MAX_REQUESTS_PER_CONNECTION
from .transport.reply_pacing import SHARE_MIN_RTT, ReplyPacing
from .transport.request_pipe import RequestPipe
from .transport.resend_rate import ResendRate, SteadyLoss

log = logging.getLogger(__name__)

BACKOFF_INITIAL = 0.1
"""First redial delay after the hub is lost (seconds); doubles up to ``BACKOFF_MAX``."""
BACKOFF_MAX = 5.0

ReadData = bytes | memoryview
"""A read's verified blocks: its own bytes, or a view of the reply that carried them (which it
keeps alive), shared with other reads' ranges (``ReadManyReply.parts``)."""

CHECKSUM_ATTEMPTS = 3
"""Replies for the same range that may fail verification before the read fails."""

DEFAULT_CONNECTIONS = 4
"""Bulk (prefetch) connections. Several, so one connection's loss recovery or its kernel
BBR's PROBE_RTT (cwnd of 4 packets for a round trip every 10 s) idles only part of the pipe."""

LONG_PATH_CONNECTIONS = 16
"""Bulk connections on a long path (``LONG_PATH_RTT``). At 900 ms / 1 % a 60 s run moved 83-84
% of the line rate with sixteen, 74-82 % with four (docs/transport.md, "More bulk connections
on long paths, under nc_paced"); likely because a retransmission timeout idles its connection
for round trips of 0.9 s, and then idles a sixteenth of the pipe rather than a quarter."""

LONG_PATH_RTT = 0.5
"""First greeting's round trip (s) from which a path is long: where the bulk connections are
dialled at once (``STAGGER_MIN_ROUNDS`` x 0.5 s is the whole ``BULK_STAGGER``)."""

LOSSY_PATH_CONNECTIONS = 16
"""Bulk connections once a shorter path is seen to lose segments after its start-up
(``SteadyLoss``): the extra ones are dialled then, at once. At 60 ms / 1 % sixteen from the
start kept the demand p99 at 1.23-1.28 RTT against 1.59-1.67 with four, the same goodput
(docs/transport.md, "More bulk connections on long paths, under nc_paced"); on the clean path
they cost the mount's cold shuffle a little, so a path that does not lose segments keeps
``DEFAULT_CONNECTIONS``."""

BULK_STAGGER = 10.0
"""Seconds over which the bulk connections are dialled, evenly spaced. The kernel's BBR enters
PROBE_RTT (cwnd of 4 packets for 200 ms and a round trip) 10 s after its connection's last
min-RTT sample, the first one taken at the handshake: connections dialled together probe
together, stalling the whole pipe, and the backlog they release afterwards queues at the
bottleneck for a second or two, in front of demand replies (measured at 60 ms). Spread out,
one connection probes at a time and the dispatcher sends around it. Not on short paths (the
first greeting took under ``STAGGER_MIN_RTT``): there a probe costs 200 ms at most and a
staggered pool only delays full speed (on loopback by most of a 10 s run); nor on long ones
(``STAGGER_MIN_ROUNDS``)."""

STAGGER_MIN_RTT = 0.005
"""Round trip below which the bulk connections are all dialled at once."""

STAGGER_MIN_ROUNDS = 20
"""Round trips the whole stagger must span for it to be used; on longer paths the bulk
connections are dialled at once. BBR's start-up takes about ten rounds, and at 1 % loss a
round takes about two round trips (replies wait behind TCP's repairs): where ``BULK_STAGGER``
spans fewer than these twenty round trips (900 ms: 11), start-up runs while the pool is still
being dialled, and the first connection carries it alone through its own slow start and loss
recovery (docs/transport.md, "Bulk connections at once on long paths")."""

DEFAULT_DEMAND_CONNECTIONS = 2
"""Demand connections dialled at start: one per copy of a hedged read."""

MAX_DEMAND_CONNECTIONS = 32
"""Demand connections the pool may grow to: on a 900 ms path ten misses a second keep ~18
requests (two copies each) outstanding, and each wants a connection of its own."""

MAX_PARALLEL_DIALS = 4
"""Demand connections dialled at once while the pool grows."""

HEDGE_COPIES = 2
"""Copies of a small demand read sent at once, each on its own idle demand connection."""

MIRROR_MAX_RTT = SHARE_MIN_RTT
"""Round trip (s) from which bulk requests are not sent twice (``HubClient._twin``): there each
bulk connection's replies are capped at its share of the path (``reply_pacing``), which
bounds the burst a stalled connection releases, and the copies were not measured to help
(docs/transport.md, "Requests on two connections")."""

HEDGE_MAX_BLOCKS = 32
"""Demand reads up to this many blocks (128 KiB, one FUSE read) go out on two connections;
doubling a larger read would cost more bandwidth than a loss costs it in time."""

PUBLISH_PERIOD = 0.05
"""Seconds between exports of the controller's model to Prometheus (acks come ~1000/s)."""

ARRIVAL_POLL_PERIOD = 0.002
"""Seconds between looks at the bulk connections' kernel counters while the path loses
segments (they are also read after every reply): a reply held back behind a lost segment is
counted as delivered within this long of its arrival, not a round trip later
(transport.arrivals)."""

PREFETCH_EXPIRY_PERIOD = 1.0
"""Seconds between checks for ``start_prefetch`` reads past their deadline: a prefetch's
deadline is the mount's hub timeout (tens of seconds), so a second late is nothing."""

WATCHDOG_PERIOD = 1.0
"""Longest interval between checks for requests older than ``attempt_timeout``."""

REMEMBER_PERIOD = 10.0
"""Seconds between writes of the controller's model to ``path_memory``: a client that stops
(or is killed) loses at most this much of what it learnt, and a tiny file written this
rarely costs nothing."""

PRIORITIES = {"demand": Priority.DEMAND, "prefetch": Priority.PREFETCH}
"""The ``priority`` names ``HubClient.read`` accepts."""

DEMAND, BULK = Role.DEMAND, Role.BULK  # connection roles

_WAIT_PACER, _WAIT_PACER_LATE, _WAIT_WINDOW, _WAIT_EMPTY, _WAIT_CONNECTIONS = (
    metrics.FABRIC_DISPATCH_WAIT.labels(reason)
    for reason in ("pacer", "pacer_late", "window", "empty", "connections"))


class HubUnavailable(Exception):
    """The hub could not be reached (or answered nothing) before the deadline."""


class ChecksumError(Exception):
    """The hub kept sending blocks that fail their checksums."""


class RemoteError(Exception):
    """The hub refused the request; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class _Signal:
    """A level-free wake-up: ``wait`` returns at the next ``fire`` (or the deadline)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, deadline: float = math.inf) -> None:
        with trio.move_on_at(deadline):
            await self._event.wait()


class _Read:
    """One ``read`` call: its range, what has arrived, and how it ended."""

    def __init__(self, file_id: int, version: int, first: int, count: int, priority: int,
                 deadline: float) -> None:
        self.file_id = file_id
        self.version = version
        self.first = first
        self.count = count
        self.priority = priority
        self.deadline = deadline
        self.parts: dict[int, ReadData] = {}  # verified data by first block
        self.blocks_done = 0
        self.failures: dict[int, int] = {}  # bad replies by first block of the range
        self.copies = 0  # demand: copies of the request outstanding
        self.resend = True  # demand: no copy outstanding, send (again)
        self.finished = False
        self.error: BaseException | None = None
        self.changed = _Signal()
        self.on_finish: Callable[[], None] | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if not self.finished:
            self.finished = True
            self.error = error
            self.changed.fire()
            if self.on_finish is not None:
                # It refers to this read: left in place, the cycle would hold the read's reply
                # buffers until the garbage collector's next pass, not free them at once.
                on_finish, self.on_finish = self.on_finish, None
                on_finish()

    def add_part(self, first: int, count: int, data: ReadData) -> None:
        """Verified blocks ``first .. first + count - 1`` are in; finish once all of them are."""
        self.parts[first] = data
        self.blocks_done += count
        if self.blocks_done >= self.count:
            self.finish()

    def data(self) -> ReadData:
        """The read's blocks in one piece: its one part as it came, or its parts joined (a
        copy, which ``in_order`` spares a caller that takes them apart again)."""
        if len(self.parts) == 1:
            return next(iter(self.parts.values()))
        return b"".join(self.in_order())

    def in_order(self) -> list[ReadData]:
        """The read's parts by block number, as they came: each but the last is whole blocks."""
        return [self.parts[k] for k in sorted(self.parts)]


_Piece = tuple[_Read, int, int]
"""``(read, first block, count)``: a range of one read that a request asks for."""


def adjacent_runs(pieces: list[_Piece]) -> list[list[_Piece]]:
    """``pieces`` grouped into runs of consecutive blocks, in block order, each run at most
    what one request may ask for (``MAX_READ_BLOCKS``)."""
    runs: list[list[_Piece]] = []
    run_blocks = 0
    for piece in sorted(pieces, key=lambda p: p[1]):
        last = runs[-1][-1] if runs else None
        if (last is not None and last[1] + last[2] == piece[1]
                and run_blocks + piece[2] <= MAX_READ_BLOCKS):
            runs[-1].append(piece)
            run_blocks += piece[2]
        else:
            runs.append([piece])
            run_blocks = piece[2]
    return runs


@dataclass(eq=False)
class _Sent:
    """A request on the wire and what to do with its reply."""

    req_id: int
    packet_id: int | None  # the controller's id (prefetch chunks only)
    nbytes: int
    sent_at: float
    pieces: tuple[_Piece, ...] = ()  # the ranges asked for, in order (none: metadata)
    copy: bool = False  # one of a demand read's copies (counted in ``_Read.copies``)
    acked: bool = False  # the controller has been told it was delivered
    meta: list[MetaEntry] = field(default_factory=list)
    reply: Message | None = None
    done: trio.Event = field(default_factory=trio.Event)


class _Connection:
    """One live, greeted stream to the hub and the requests outstanding on it."""

    def __init__(self, stream: trio.SocketStream, reader: FrameReader, role: str,
                 hello_rtt: float, link: int | None = None) -> None:
        self.stream = stream
        self.reader = reader
        self.role = role
        self.link = link  # the number it said hello with (bulk connections): Mirror names it
        self.hello_rtt = hello_rtt  # no reply can come back faster than the greeting did
        self.pending: dict[int, _Sent] = {}
        self.pending_bytes = 0
        self.unarrived = 0  # pending requests whose reply has not reached the kernel
        self.last_sent = -math.inf
        self.send_lock = trio.Lock()
        self.closed = False
        self.retransmitted = 0  # the hub's last count of bytes its TCP resent on this stream
        # Bulk connections: which replies reached the kernel, holes or not (transport.arrivals).
        self.arrivals = ArrivalTracker() if role == BULK else None
        self.arrival_count = ArrivalCount()  # what reached the kernel, for the arrival cap
        self.settled = True  # looked at since its last reply: nothing more can arrive
        self.pacing_limit: int | None = None  # the cap last sent to the hub (bulk connections)

    def count_arrivals(self, counters: TcpCounters) -> int:
        """Bytes that reached the kernel on this stream since the last look, in any order
        (``ArrivalCount``: a slight over-count, never under)."""
        return self.arrival_count.update(counters)

    @property
    def has_room(self) -> bool:
        """Whether another request may go: fewer than the hub's limit are still on their way
        (a reply that has reached the kernel, held back or not, no longer counts)."""
        return not self.closed and self.unarrived < MAX_REQUESTS_PER_CONNECTION

    def oldest(self) -> float:
        return min((s.sent_at for s in self.pending.values()), default=math.inf)


def stagger_step(span: float, connections: int, rtt: float) -> float:
    """Seconds between one bulk connection's dial and the next, for a stagger of ``span``
    seconds over ``connections`` on a path whose greeting took ``rtt``: 0 on paths too short
    for the kernel's probes to matter and on paths too long for the stagger to end before
    start-up does."""
    if rtt < STAGGER_MIN_RTT or rtt * STAGGER_MIN_ROUNDS > span:
        return 0.0
    return span / connections


def bulk_connections(rtt: float) -> int:
    """Bulk connections for a path whose first greeting took ``rtt`` seconds."""
    return LONG_PATH_CONNECTIONS if rtt >= LONG_PATH_RTT else DEFAULT_CONNECTIONS


def demand_copies(count: int, lossy: bool) -> int:
    """Copies of a demand read of ``count`` blocks to send at once: two of a small one while
    the path is ``lossy`` (``ResendRate.lossy``), else one."""
    if 0 < count <= HEDGE_MAX_BLOCKS and lossy:
        return HEDGE_COPIES
    return 1


_Answer = tuple[int, ReadData, bytes] | RemoteError | None
"""What a reply says about one range: ``(first, data, checksums)``, the hub's error for it, or
None if the reply does not answer it."""


def _answers(sent: _Sent, msg: Message) -> list[_Answer]:
    """The reply's answer for each of ``sent``'s ranges, in order."""
    if isinstance(msg, ErrorReply):
        return [RemoteError(msg.code, msg.message)] * len(sent.pieces)
    if isinstance(msg, ReadReply) and len(sent.pieces) == 1:
        return [(msg.first, msg.data, msg.checksums)]
    if isinstance(msg, ReadManyReply) and len(msg.sizes) == len(sent.pieces):
        errors = {i: RemoteError(code, message) for i, code, message in msg.errors}
        return [errors.get(i) or (first, data, sums) for i, ((_, first, _), (data, sums))
                in enumerate(zip(sent.pieces, msg.parts()))]
    return [None] * len(sent.pieces)


def _corrupt_blocks(first: int, count: int, answer: tuple[int, ReadData, bytes] | None
                    ) -> list[int]:
    """Indices of the blocks of ``answer`` that fail their checksum (all ``count`` of them if
    it is not an answer for the range of ``count`` blocks from ``first``)."""
    if answer is None or answer[0] != first or len(answer[1]) > count * BLOCK_SIZE:
        return list(range(count))
    _, data, checksums = answer
    if intact(data, checksums):
        return []
    return bad_blocks(data, checksums)


class HubClient:
    """A spoke's link to one hub."""

    def __init__(self, host: str, port: int, *, name: str = "spoke",
                 connect_timeout: float = 10.0, attempt_timeout: float = 30.0,
                 congestion: str = "bbr", connections: int | None = None,
                 demand_connections: int = DEFAULT_DEMAND_CONNECTIONS,
                 tcp_congestion: str | None = "bbr", stagger: float = BULK_STAGGER,
                 path_memory: Path | None = None,
                 remember_period: float = REMEMBER_PERIOD) -> None:
        if (connections is not None and connections < 1) or demand_connections < 1:
            raise ValueError("need at least one bulk and one demand connection")
        self.host = host
        self.port = port
        self.name = name
        self.connect_timeout = connect_timeout
        self.attempt_timeout = attempt_timeout
        self.tcp_congestion = tcp_congestion
        self._bulk_fixed = connections  # None: by the path's round trip (bulk_connections)
        self._demand_slots = demand_connections
        self._stagger = stagger  # over which the bulk connections are dialled (stagger_step)
        # One spoke, many connections: the hub groups them by this name for its fair share.
        self._hello_name = f"{name}#{secrets.token_hex(4)}"
        self._pipe = RequestPipe(create_controller(congestion))
        self._conns: list[_Connection] = []
        self._ids = itertools.count(1)
        self._link_ids = itertools.count(1)  # Hello.link of each bulk connection, for Mirror
        self._link_changed = _Signal()
        self._wake = _Signal()  # the dispatcher's: work queued, window opened, link changed
        self._nursery: trio.Nursery | None = None
        self._expiring: dict[_Read, None] = {}  # start_prefetch reads not finished yet
        self._loss_reported = trio.Event()  # the hub reported loss: poll arrivals while it lasts
        self._dialing = 0  # demand connections being dialled beyond the initial pool
        self._state_label: tuple[str, str] | None = None
        self._next_publish = -math.inf
        self._resends = ResendRate()  # what the hub's TCP lately sent twice: hedge or not
        self._steady_loss = SteadyLoss()  # the same after start-up: more bulk connections or not
        self._lossy_path = trio.Event()  # set once SteadyLoss said so: the pool grows
        self._reply_pacing = ReplyPacing()  # the cap the hub's kernel paces bulk replies at
        self._path_memory = path_memory  # the path's kept model (fabric.path_memory), if any
        self._remember_period = remember_period
        self._kept: PathRecord | None = None  # read from path_memory; used up by the first link

    # -- public ----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return bool(self._conns)

    def stats(self) -> CongestionStats:
        """The congestion controller's model of the path. The Prometheus gauges follow it
        (refreshed every ``PUBLISH_PERIOD`` while requests complete, and by this call)."""
        self._publish()
        return self._pipe.stats()

    @property
    def prefetch_headroom(self) -> float:
        """Fraction of the controller's pacing rate prefetch currently leaves unused."""
        return self._pipe.headroom

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Connect (raising HubUnavailable if that fails within connect_timeout), then keep the
        pool up forever, redialling with backoff."""
        unreachable = False
        if self._path_memory is not None:
            self._kept = await trio.to_thread.run_sync(load_record, self._path_memory)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._path_memory is not None:
                nursery.start_soon(self._remember_path, self._path_memory)
            # All connections are dialled at once: on a 900 ms path each dial and hello takes
            # two round trips, which the bulk connections should not add after the first's.
            for i in range(self._demand_slots):
                nursery.start_soon(self._keep_up, DEMAND, i > 0)
            most = self._bulk_fixed or max(DEFAULT_CONNECTIONS, LONG_PATH_CONNECTIONS,
                                           LOSSY_PATH_CONNECTIONS)
            for i in range(most):  # those the path does not want end at their turn
                nursery.start_soon(self._keep_up, BULK, True, False, i)
            nursery.start_soon(self._dispatch)
            nursery.start_soon(self._arrival_poller)
            nursery.start_soon(self._expire_prefetches)
            with trio.move_on_after(self.connect_timeout):
                while not self._conns:
                    await self._link_changed.wait()
            if self._conns:
                task_status.started()
            else:
                unreachable = True
                nursery.cancel_scope.cancel()
        if unreachable:
            raise HubUnavailable(f"cannot reach the hub at {self.host}:{self.port} "
                                 f"within {self.connect_timeout:g} s")

    async def metadata(self, timeout: float = math.inf) -> list[MetaEntry]:
        """The export's namespace snapshot."""
        deadline = trio.current_time() + timeout
        while True:
            conn = self._pick_demand(1)
            if not conn:
                await self._wait_for_link(deadline)
                continue
            sent = _Sent(next(self._ids), None, 0, trio.current_time())
            await self._send(conn[0], sent, encode(MetaRequest(sent.req_id)))
            with trio.move_on_at(deadline):
                await sent.done.wait()
            if isinstance(sent.reply, MetaReply):
                return sent.meta
            if isinstance(sent.reply, ErrorReply):
                raise RemoteError(sent.reply.code, sent.reply.message)
            if trio.current_time() >= deadline:
                raise self._no_answer()
            metrics.HUB_FETCH_RETRIES.inc()

    async def read(self, file_id: int, version: int, first: int, count: int, *,
                   deadline: float, priority: str = "demand") -> ReadData:
        """Blocks ``first`` .. ``first + count - 1``, verified against their checksums.

        ``priority`` is ``"demand"`` (a reader waits: sent at once, served first) or
        ``"prefetch"`` (queued, paced, served with what demand leaves)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}")
        job = _Read(file_id, version, first, count, PRIORITIES[priority], deadline)
        try:
            if job.priority == Priority.PREFETCH and count > 0:
                self._pipe.submit(job, first, count)
                self._wake.fire()
                await job.changed.wait(deadline)
            else:
                await self._drive_demand(job, deadline)
            if not job.finished:
                raise self._no_answer()
            if job.error is not None:
                raise job.error
            return job.data()
        finally:
            job.finished = True  # late replies (a hedge's twin) are dropped
            if job.priority == Priority.PREFETCH:
                self._pipe.cancel(job)

    def _no_answer(self) -> HubUnavailable:
        """The error of a read the hub did not answer by its deadline."""
        return HubUnavailable(f"no answer from hub {self.host}:{self.port} in time")

    def start_prefetch(self, file_id: int, version: int, first: int, count: int, *,
                       deadline: float,
                       on_done: Callable[[list[ReadData] | BaseException], None]) -> None:
        """``read`` at prefetch priority, with no task waiting for it: ``on_done`` gets the
        verified bytes or the error, later, from the task that finished the read. The bytes
        come in the parts they arrived in (``_Read.in_order``): a 4 MiB read often comes in
        several replies, and joining them was the spoke's largest copy. A read still unfinished
        at ``deadline`` fails with HubUnavailable (checked every ``PREFETCH_EXPIRY_PERIOD``). A
        hinted shuffle prefetches one sample per read, and a task each was a sizeable part of
        the event loop's work. ``count`` must be positive."""
        job = _Read(file_id, version, first, count, Priority.PREFETCH, deadline)
        job.on_finish = functools.partial(self._prefetched, job, on_done)
        self._expiring[job] = None
        self._pipe.submit(job, first, count)
        self._wake.fire()

    def _prefetched(self, job: _Read,
                    on_done: Callable[[list[ReadData] | BaseException], None]) -> None:
        del self._expiring[job]
        self._pipe.cancel(job)
        try:
            on_done(job.in_order() if job.error is None else job.error)
        except Exception:  # the caller's bug: it must not take down the connection that
            log.exception("a prefetch's completion callback failed")  # finished the read

    async def _expire_prefetches(self) -> None:
        """Fail the ``start_prefetch`` reads whose deadline passed."""
        while True:
            await trio.sleep(PREFETCH_EXPIRY_PERIOD)
            now = trio.current_time()
            expired = [job for job in self._expiring if job.deadline <= now]
            for job in expired:
                job.finish(self._no_answer())

    def expedite(self, file_id: int, version: int, first: int, count: int) -> int:
        """A reader now waits for blocks ``first .. first + count - 1``: those of them that
        prefetch reads still hold in the queue leave at once, as demand requests, instead of
        waiting behind the rest of the queue for the window and the pacer (in STARTUP that is
        round trips). Blocks already requested are left to arrive. Returns how many blocks
        were expedited; their prefetch reads return as before, once every block is in."""
        if self._nursery is None:
            return 0
        pieces = self._pipe.take(
            lambda job: job.file_id == file_id and job.version == version, first, first + count)
        for run in adjacent_runs(pieces):
            self._nursery.start_soon(self._expedite_run, run)
        expedited = sum(piece_count for _, _, piece_count in pieces)
        metrics.FABRIC_EXPEDITED_BLOCKS.inc(expedited)
        return expedited

    async def _expedite_run(self, pieces: list[_Piece]) -> None:
        """Fetch adjacent pieces of prefetch reads as one demand read, and hand each its blocks.

        One request (and one task) for the run, not one per piece: the planner's reads are
        often smaller than a FUSE read, and where the pacer holds them back (a cold read on a
        fast link, docs/throughput.md) each FUSE read took its blocks from several of them."""
        job, first, _ = pieces[0]
        count = sum(piece_count for _, _, piece_count in pieces)
        deadline = max(piece_job.deadline for piece_job, _, _ in pieces)
        demand = _Read(job.file_id, job.version, first, count, Priority.DEMAND, deadline)
        await self._drive_demand(demand, deadline)
        if not demand.finished:
            return  # each prefetch read times out by its own deadline
        data = None if demand.error is not None else memoryview(demand.data())
        for piece_job, piece_first, piece_count in pieces:
            if piece_job.finished:
                continue  # the prefetch read gave up
            if data is None:
                piece_job.finish(demand.error)
                continue
            start = (piece_first - first) * BLOCK_SIZE
            piece_job.add_part(piece_first, piece_count,
                               data[start:start + piece_count * BLOCK_SIZE])

    # -- demand ----------------------------------------------------------------------------

    async def _drive_demand(self, job: _Read, deadline: float) -> None:
        """Send the demand read (and again after a loss or a bad reply) until it finishes."""
        while not job.finished:
            if job.resend:
                copies = demand_copies(job.count, self._resends.lossy(trio.current_time()))
                conns = self._pick_demand(copies)
                if not conns:
                    if trio.current_time() >= deadline:
                        return
                    await self._wake.wait(deadline)  # no link, or every connection full
                    continue
                job.resend = False
                for conn in conns:
                    await self._send_read(conn, ((job, job.first, job.count),), None)
                continue  # a reply (or a loss) may have come in while sending
            await job.changed.wait(deadline)
            if trio.current_time() >= deadline:
                return

    def _pick_demand(self, copies: int) -> list[_Connection]:
        """Up to ``copies`` distinct connections for a demand request: first those with nothing
        outstanding (no lost segment can be holding them up), least recently used first, then,
        if too few are idle, busy ones, those whose oldest request is youngest (least likely
        held up) first: a copy behind one outstanding reply is delayed only if that reply lost
        a segment, and one copy alone, whenever it lost one (at 900 ms / 1 % 15-22 % of the
        demand reads after start-up found one idle connection or none, and those made the
        tail: docs/transport.md, "A second copy on a busy connection"). Falls back to a bulk
        connection if no demand connection has room."""
        demand = [c for c in self._conns if c.role == DEMAND and c.has_room]
        chosen = sorted((c for c in demand if not c.pending), key=lambda c: c.last_sent)
        if len(chosen) < copies:
            self._grow_demand(copies - len(chosen))
            busy = sorted((c for c in demand if c.pending),
                          key=lambda c: (c.oldest(), -len(c.pending)), reverse=True)
            chosen += busy[:copies - len(chosen)]
        if chosen:
            return chosen[:copies]
        bulk = [c for c in self._conns if c.has_room]
        return [min(bulk, key=lambda c: c.pending_bytes)] if bulk else []

    def _grow_demand(self, wanted: int) -> None:
        """Dial more demand connections (in the background) when too few are idle."""
        if self._nursery is None:
            return
        room = min(wanted - self._dialing, MAX_DEMAND_CONNECTIONS - self._demand_slots,
                   MAX_PARALLEL_DIALS - self._dialing)
        for _ in range(max(0, room)):
            self._dialing += 1
            self._demand_slots += 1
            self._nursery.start_soon(self._keep_up, DEMAND, True, True)

    # -- prefetch --------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Release queued prefetch chunks as the controller's window and pacer allow. The
        time it waits, by what for, is counted (``FABRIC_DISPATCH_WAIT``): on a path the
        prefetch does not fill, it says whether the pacer, the window, the event loop or the
        prefetcher held the requests back."""
        while True:
            now = trio.current_time()
            bulk = [c for c in self._conns if c.role == BULK and c.has_room]
            if not bulk:
                await self._wake.wait()
                _WAIT_CONNECTIONS.inc(trio.current_time() - now)
                continue
            queued = self._pipe.queued_bytes > 0
            out = self._pipe.poll(now, self._resends.ratio(now))
            if out is None:
                await self._wake.wait()
                (_WAIT_WINDOW if queued else _WAIT_EMPTY).inc(trio.current_time() - now)
            elif isinstance(out, float):
                await self._wake.wait(out)
                woke = trio.current_time()
                _WAIT_PACER.inc(min(woke, out) - now)
                if woke > out:
                    _WAIT_PACER_LATE.inc(woke - out)
            else:
                conn = min(bulk, key=lambda c: c.pending_bytes)
                await self._send_read(conn, out.pieces, out.packet_id)

    # -- sending and receiving -------------------------------------------------------------

    async def _send_read(self, conn: _Connection, pieces: tuple[_Piece, ...],
                         packet_id: int | None) -> None:
        """Send one read request for ``pieces`` (several ranges go as one ReadManyRequest);
        ``packet_id`` is the pipe's for a prefetch chunk, None for a copy of a demand request
        (one range, charged to the pacer here)."""
        now = trio.current_time()
        nbytes = sum(max(count, 0) for _, _, count in pieces) * BLOCK_SIZE
        job, first, count = pieces[0]
        copy = packet_id is None
        if copy:
            self._pipe.send_demand(now, nbytes)
            job.copies += 1
        sent = _Sent(next(self._ids), packet_id, nbytes, now, pieces, copy=copy)
        name = "demand" if job.priority == Priority.DEMAND else "prefetch"
        metrics.FABRIC_REQUESTS.labels(name).inc()
        if len(pieces) == 1:
            expected = read_reply_size(sent.req_id, first, max(count, 0), loss_report=True)
            frame = encode(ReadRequest(sent.req_id, job.file_id, job.version, first, count,
                                       job.priority))
        else:
            expected = read_many_reply_size(sent.req_id, [c for _, _, c in pieces])
            frame = encode(ReadManyRequest(sent.req_id, job.priority, tuple(
                (j.file_id, j.version, f, c) for j, f, c in pieces)))
        if conn.arrivals is not None and not conn.closed:
            conn.arrivals.expect(sent.req_id, expected)
        twin, head = None, b""
        if conn.role == BULK:
            stats = self._pipe.stats()
            twin = self._twin(conn, now, stats.min_rtt)
            if twin is not None:
                frame = encode(Mirror(conn.link)) + frame  # type: ignore[arg-type]
                metrics.FABRIC_MIRRORED_REQUESTS.inc()
            bulk = sum(c.role == BULK for c in self._conns)  # live ones: closing removes
            limit = self._reply_pacing.limit(now, stats.pacing_rate, stats.min_rtt, bulk)
            if limit != conn.pacing_limit:
                conn.pacing_limit = limit
                head = encode(PacingLimit(limit))  # this connection's alone, not the copy's
        await self._send(conn, sent, head + frame)
        if twin is not None:
            await self._write(twin, frame)  # nothing is pending on the twin for it

    def _twin(self, conn: _Connection, now: float, min_rtt: float) -> _Connection | None:
        """Another bulk connection to send a copy of a request on, while a path shorter than
        ``MIRROR_MAX_RTT`` loses segments; None on a clean or long path, or with no other
        connection. A lost request segment holds the requests behind it on its connection
        for a round trip, and the replies to them then leave together, a burst on top of the
        other connections' that queued at the bottleneck in front of the demand replies. With
        a copy on a second connection the hub serves whichever comes first, on ``conn``
        (docs/transport.md, "Requests on two connections"). The twin: one whose requests the
        hub is not known to hold behind a lost segment, and of those the one with the fewest
        bytes outstanding."""
        if conn.link is None or min_rtt >= MIRROR_MAX_RTT or not self._resends.lossy(now):
            return None
        others = [c for c in self._conns
                  if c.role == BULK and c is not conn and c.link is not None and not c.closed]
        return min(others, key=lambda c: (tcp.sends_held(c.stream.socket), c.pending_bytes),
                   default=None)

    async def _send(self, conn: _Connection, sent: _Sent, frame: bytes) -> None:
        if conn.closed:
            self._lost(sent)
            return
        conn.pending[sent.req_id] = sent
        conn.pending_bytes += sent.nbytes
        conn.unarrived += 1
        conn.settled = False
        conn.last_sent = sent.sent_at
        await self._write(conn, frame)

    async def _write(self, conn: _Connection, frame: bytes) -> None:
        """Send ``frame`` on ``conn``, closing it if that fails: its receive loop then sees the
        close and fails everything outstanding on it (a Mirror copy's request stands on its
        own connection)."""
        try:
            async with conn.send_lock:
                await conn.stream.send_all(frame)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(conn.stream)

    def _on_message(self, conn: _Connection, msg: Message) -> None:
        if not isinstance(msg, (ReadReply, ReadManyReply, MetaReply, ErrorReply)):
            raise ProtocolError(f"unexpected {type(msg).__name__} from the hub")
        sent = conn.pending.get(msg.req_id)
        if sent is None:
            return  # not ours (a hub error about the connection itself)
        if isinstance(msg, MetaReply):
            sent.meta.extend(msg.entries)
            if not msg.done:
                return
        del conn.pending[msg.req_id]
        conn.pending_bytes -= sent.nbytes
        if isinstance(msg, (ReadReply, ReadManyReply)):
            now = trio.current_time()
            self._resends.on_delivered(now, sent.nbytes)
            self._steady_loss.on_delivered(now, sent.nbytes)
            if msg.retransmitted is not None:
                self._report_loss(conn, msg.retransmitted)
        if conn.arrivals is not None:
            conn.arrivals.completed(msg.req_id, conn.reader.consumed)
        self._poll_arrivals()  # first, so that the ack's rate sample counts this reply's bytes
        self._arrived(conn, sent)
        sent.reply = msg
        sent.done.set()
        if sent.pieces:
            self._read_reply(sent, msg)
        self._wake.fire()

    def _report_loss(self, conn: _Connection, retransmitted: int) -> None:
        """Pass on what the hub's TCP resent on ``conn`` since its previous reply said."""
        if retransmitted > conn.retransmitted:
            self._loss_reported.set()
            now, resent = trio.current_time(), retransmitted - conn.retransmitted
            self._pipe.on_path_loss(now, resent)
            self._resends.on_resent(now, resent)
            self._steady_loss.on_resent(now, resent)
            conn.retransmitted = retransmitted
            if not self._lossy_path.is_set() and self._steady_loss.lossy(now):
                log.info("the path to the hub %s:%s loses segments after start-up (%.2f %% of "
                         "the bytes resent lately)", self.host, self.port,
                         100 * self._resends.ratio(now))
                self._lossy_path.set()

    def _arrived(self, conn: _Connection, sent: _Sent) -> None:
        """``sent``'s reply has reached the spoke (its kernel, or the application): tell the
        controller it was delivered, once."""
        if sent.acked:
            return
        sent.acked = True
        conn.unarrived -= 1
        now = trio.current_time()
        if sent.packet_id is not None:
            self._pipe.on_acked(now, sent.packet_id)
        elif sent.copy:  # a demand reply (either copy of a hedged one): it used the path too
            self._pipe.on_demand_delivered(now, sent.nbytes)
        # Demand replies refresh the gauges too: a mount without prefetch would otherwise
        # never show its transport's state.
        if now >= self._next_publish:
            self._publish()
            self._next_publish = now + PUBLISH_PERIOD

    def _poll_arrivals(self) -> None:
        """Tell the controller what has reached the spoke's kernel on every connection (it
        bounds the bandwidth samples), then ack the prefetch replies that have
        arrived, though TCP holds them back."""
        now = trio.current_time()
        arrived = 0
        looked = False
        trackers: list[tuple[_Connection, TcpCounters]] = []
        for conn in self._conns:
            if conn.settled:
                continue
            counters = tcp.counters(conn.stream)
            if counters is None:
                continue
            looked = True
            arrived += conn.count_arrivals(counters)
            conn.settled = not conn.pending  # a last look after the last reply, for its tail
            if conn.arrivals is not None and conn.pending:
                trackers.append((conn, counters))
        if looked:  # even with nothing new: the count is current as of now
            self._pipe.on_path_arrivals(now, arrived)
        for conn, counters in trackers:
            assert conn.arrivals is not None
            for req_id in conn.arrivals.observe(counters):
                sent = conn.pending.get(req_id)
                # A reply "arrived" sooner than a round trip is the estimate overshooting
                # (duplicate segments): leave that one to be acked when it is complete.
                if sent is not None and now - sent.sent_at >= conn.hello_rtt:
                    self._arrived(conn, sent)

    async def _arrival_poller(self) -> None:
        """Poll the arrivals while the hub's TCP has lately resent bytes (``ResendRate``, over
        its window). Without loss TCP holds no reply back: each is read as it arrives, and its
        arrival seen then, so on a clean path, or on a mount gone idle after a lossy spell,
        500 wake-ups a second would find nothing. The next loss report starts it again."""
        while True:
            await self._loss_reported.wait()
            while self._resends.ratio(trio.current_time()) > 0:
                await trio.sleep(ARRIVAL_POLL_PERIOD)
                self._poll_arrivals()
            self._loss_reported = trio.Event()

    def _read_reply(self, sent: _Sent, msg: Message) -> None:
        if sent.copy:
            sent.pieces[0][0].copies -= 1
        for (job, first, count), answer in zip(sent.pieces, _answers(sent, msg)):
            if isinstance(answer, RemoteError):
                job.finish(answer)
                continue
            bad = _corrupt_blocks(first, count, answer)
            if bad:
                # Counted even when the other copy of a hedged read has already won: the path
                # delivered bad bytes either way, and which copy came first is chance.
                metrics.CHECKSUM_FAILURES.inc(len(bad))
                log.error("%d block(s) of file %d from block %d failed their checksum",
                          len(bad), job.file_id, first)
            if job.finished:
                continue  # the other copy of a hedged read won, or the reader gave up
            if not bad:
                assert answer is not None
                job.add_part(first, count, answer[1])
                continue
            failures = job.failures[first] = job.failures.get(first, 0) + 1
            if failures >= CHECKSUM_ATTEMPTS:
                job.finish(ChecksumError(f"file {job.file_id} blocks {first}+{count}: "
                                         f"checksum mismatch {failures} times"))
                continue
            self._retry(sent, job, first, count)

    def _lost(self, sent: _Sent) -> None:
        """``sent`` will get no reply (its connection died or timed out)."""
        sent.done.set()
        if sent.packet_id is not None and not sent.acked:
            sent.acked = True
            self._pipe.on_lost(trio.current_time(), sent.packet_id)
            metrics.FABRIC_LOST_REQUESTS.inc()
        if sent.copy:
            sent.pieces[0][0].copies -= 1
        for job, first, count in sent.pieces:
            if not job.finished:
                self._retry(sent, job, first, count)

    def _retry(self, sent: _Sent, job: _Read, first: int, count: int) -> None:
        """Ask again for ``job``'s range that ``sent`` did not bring: a prefetch range goes
        back to the head of the queue, a demand read is sent again once no copy of it is
        outstanding (a hedge's twin may still bring it)."""
        if not sent.copy:
            metrics.HUB_FETCH_RETRIES.inc()
            self._pipe.requeue(job, first, count)
            self._wake.fire()
        elif job.copies == 0:
            metrics.HUB_FETCH_RETRIES.inc()
            job.resend = True
            job.changed.fire()

    # -- connections -----------------------------------------------------------------------

    async def _keep_up(self, role: str, quiet: bool, grown: bool = False,
                       index: int = 0) -> None:
        """Keep one connection of ``role`` up; ``quiet`` logs its failed dials at debug level
        (one slot reports for all), ``grown`` marks a demand slot added by ``_grow_demand``,
        ``index`` is a bulk slot's place in the stagger (BULK_STAGGER)."""
        try:
            while await self._wait_turn(index):
                conn = await self._dial_until_up(role, quiet=quiet)
                if grown:
                    self._dialing -= 1
                    grown = False
                await self._serve(conn)
        finally:
            if grown:
                self._dialing -= 1

    async def _wait_turn(self, index: int) -> bool:
        """Wait before dialling bulk slot ``index``: once some connection is up, and then
        ``index`` stagger steps (``stagger_step``). A slot past what the path wants at first
        (``bulk_connections``) waits until the path is seen to lose segments after start-up
        (``SteadyLoss``), if it is one of ``LOSSY_PATH_CONNECTIONS``; else, or with a fixed
        count, False at once."""
        if index == 0:
            return True
        while not self._conns:
            await self._link_changed.wait()
        rtt = min(c.hello_rtt for c in self._conns)
        slots = self._bulk_fixed or bulk_connections(rtt)
        if index < slots:
            await trio.sleep(index * stagger_step(self._stagger, slots, rtt))
            return True
        if self._bulk_fixed or index >= LOSSY_PATH_CONNECTIONS:
            return False
        await self._lossy_path.wait()
        return True

    async def _dial_until_up(self, role: str, *, quiet: bool) -> _Connection:
        backoff = BACKOFF_INITIAL
        while True:
            try:
                with trio.fail_after(self.connect_timeout):
                    return await self._dial(role)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError,
                    trio.TooSlowError) as exc:
                (log.debug if quiet else log.warning)(
                    "hub %s:%s unreachable (%s); retrying in %.1f s",
                    self.host, self.port, str(exc) or type(exc).__name__, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _dial(self, role: str) -> _Connection:
        stream = await trio.open_tcp_stream(self.host, self.port)
        try:
            tcp.configure(stream, tcp.congestion_for(role, self.tcp_congestion))
            reader = FrameReader(stream)
            greeted = trio.current_time()
            link = next(self._link_ids) if role == BULK else None
            await stream.send_all(encode(Hello(PROTOCOL_VERSION, self._hello_name, role, link)))
            msg = await reader.receive()
            hello_rtt = trio.current_time() - greeted
            if msg is None:
                raise trio.BrokenResourceError("hub closed the connection during hello")
            if isinstance(msg, ErrorReply):
                raise ProtocolError(f"hub refused the hello: {msg.message}")
            if not isinstance(msg, Welcome):
                raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return _Connection(stream, reader, role, hello_rtt, link)

    async def _serve(self, conn: _Connection) -> None:
        self._resume(conn.hello_rtt)  # only the first connection finds a record left
        self._conns.append(conn)
        self._links_changed()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watchdog, conn)
                await self._receive_loop(conn)
                nursery.cancel_scope.cancel()
        except* ProtocolError as group:
            metrics.PROTOCOL_ERRORS.labels("spoke").inc()
            log.error("hub sent a malformed frame (%s); reconnecting", group.exceptions[0])
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as group:
            last = self._conns == [conn]  # the link is down only when the last one goes
            (log.warning if last else log.info)("lost a hub connection: %s", group.exceptions[0])
        finally:
            conn.closed = True
            self._conns.remove(conn)
            pending = list(conn.pending.values())
            conn.pending.clear()
            conn.pending_bytes = 0
            conn.unarrived = 0
            for sent in pending:
                self._lost(sent)
            self._links_changed()
            await trio.aclose_forcefully(conn.stream)

    async def _receive_loop(self, conn: _Connection) -> None:
        while True:
            msg = await conn.reader.receive()
            if msg is None:
                raise trio.BrokenResourceError("hub closed the connection")
            self._on_message(conn, msg)

    async def _watchdog(self, conn: _Connection) -> None:
        """Drop a connection on which a request has waited ``attempt_timeout`` for its reply."""
        period = min(WATCHDOG_PERIOD, self.attempt_timeout / 4)
        while True:
            await trio.sleep(period)
            if trio.current_time() - conn.oldest() > self.attempt_timeout:
                log.warning("hub did not answer a request in %g s; redialling",
                            self.attempt_timeout)
                await trio.aclose_forcefully(conn.stream)
                return

    @property
    def _hub_name(self) -> str:
        return f"{self.host}:{self.port}"

    def _resume(self, hello_rtt: float) -> None:
        """Start the controller from the path's kept model if it is this path's (the first
        connection's greeting gives the round trip to compare), before any request leaves."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        outcome = kept.matches(self._hub_name, self._pipe.controller.name, hello_rtt,
                               time.time())
        if outcome is None:
            resumed = self._pipe.resume(trio.current_time(), kept.btl_bw, hello_rtt)
            outcome = "resumed" if resumed else "not_resumable"
        metrics.FABRIC_PATH_RESUMES.labels(outcome).inc()
        if outcome == "resumed":
            log.info("resuming the path's model from %s: %.1f MB/s kept, round trip %.3f s",
                     self._path_memory, kept.btl_bw / 1e6, hello_rtt)
        else:
            log.info("not resuming the path's model from %s (%s); learning it afresh",
                     self._path_memory, outcome)

    async def _remember_path(self, path: Path) -> None:
        """Keep the controller's model of the path at ``path`` every ``remember_period`` once
        it has one worth keeping (``RequestPipe.path_bandwidth``)."""
        failing = False
        while True:
            await trio.sleep(self._remember_period)
            btl_bw = self._pipe.path_bandwidth()
            if btl_bw is None or not self._conns:
                continue
            record = PathRecord(hub=self._hub_name, controller=self._pipe.controller.name,
                                btl_bw=btl_bw, hello_rtt=min(c.hello_rtt for c in self._conns),
                                saved_at=time.time())
            try:
                await trio.to_thread.run_sync(save_record, path, record)
                failing = False
            except OSError as exc:
                metrics.FABRIC_PATH_SAVE_ERRORS.inc()
                if not failing:  # once per run of failures, not every period
                    log.warning("cannot keep the path's model in %s: %s", path, exc)
                failing = True

    def _links_changed(self) -> None:
        metrics.HUB_LINK_UP.set(1 if self._conns else 0)
        for role in (DEMAND, BULK):
            metrics.FABRIC_CONNECTIONS.labels(role).set(
                sum(c.role == role for c in self._conns))
        self._link_changed.fire()
        self._wake.fire()

    async def _wait_for_link(self, deadline: float) -> None:
        if trio.current_time() >= deadline:
            raise HubUnavailable(f"hub {self.host}:{self.port} unreachable")
        await self._link_changed.wait(deadline)

    def _publish(self) -> None:
        """Export the controller's model to Prometheus."""
        s = self._pipe.stats()
        metrics.FABRIC_BTL_BW.set(s.btl_bw)
        metrics.FABRIC_MIN_RTT.set(s.min_rtt if math.isfinite(s.min_rtt) else 0.0)
        metrics.FABRIC_SRTT.set(s.srtt if math.isfinite(s.srtt) else 0.0)
        metrics.FABRIC_PACING_RATE.set(s.pacing_rate)
        metrics.FABRIC_CWND.set(s.cwnd)
        metrics.FABRIC_INFLIGHT.set(s.bytes_in_flight)
        metrics.FABRIC_QUEUED.set(self._pipe.queued_bytes)
        metrics.FABRIC_LOSS_RATIO.set(s.loss_rate)
        now = trio.current_time()
        metrics.FABRIC_RESENT_RATIO.set(self._resends.ratio(now))
        self._steady_loss.on_model(now, s.starting, s.min_rtt)
        metrics.FABRIC_HEADROOM.set(self._pipe.headroom)
        label = (s.name, s.state)
        if label != self._state_label:
            if self._state_label is not None:
                metrics.FABRIC_STATE.labels(*self._state_label).set(0)
            metrics.FABRIC_STATE.labels(*label).set(1)
            self._state_label = label
