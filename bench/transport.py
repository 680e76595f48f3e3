"""Measure the hub->spoke data path over emulated WAN links: the table of docs/transport.md.

    .venv/bin/python -m bench.transport            # 3 links x 4 clients x 60 s + loopback, ~15 min
    .venv/bin/python -m bench.transport --quick    # 15 s transfers, for development

For each link (``bench.wan``: namespaces, TUN devices, a shaping forwarder) and each client, a
hub process runs in the hub namespace and a load process in the spoke namespace. The load keeps
the pipe full of prefetch reads (``PREFETCH_DEPTH`` reads of 4 MiB outstanding, sequential
through a synthetic export file) while a separate task issues a demand read of one random
block every ``DEMAND_INTERVAL`` and records its latency. Clients:

* ``bbr`` / ``cubic``: ``fabric.client.HubClient`` with that congestion controller (the hub's
  kernel TCP under its bulk connections is ``nc_paced``, which follows the client's pacing
  alone, or ``bbr`` where it cannot be loaded, as ``neuralcache hub`` chooses it; under its
  demand connections CUBIC);
* ``bbr-resumed``: ``bbr`` again on the same link, started from the path record the ``bbr``
  run before it kept (``fabric.path_memory``: careful resume, as a spoke remounting over its
  cache does); the ``bbr`` row itself always starts without one;
* ``naive``: one plain TCP connection fetching one 4 KiB block at a time (a demand read takes
  the next turn).

Goodput counts verified block bytes delivered to the caller, as a fraction of the link's line
rate; "after start-up" skips the first ``max(2 s, 20 RTT)``. Demand latency is measured after
start-up, while prefetch fills the pipe. The controller's bandwidth estimate (its median after
start-up), the packets the emulator's full queue dropped (hub to spoke) and how long packets
waited in that queue after start-up (p50 and p99, as the upper bounds of the emulator's
histogram buckets) show whether the pacing overfills the bottleneck, and how much of a demand
read's latency is that queue. Under each emulated row, the hub kernel's retransmission
timeouts, tail loss probes, spurious timeouts and resent segments over that run
(``HUB_TCP_COUNTERS``), how long its bulk connections' kernel BBR spent in PROBE_RTT
(``bench.kernel_probes``; none under ``nc_paced``) and which control they ran. The loopback
rows run hub and spoke on 127.0.0.1 with no emulation, after a row of plain TCP over the same
number of connections (``bench.tcp_ceiling``): what this machine moves over loopback between
two Python processes doing nothing else, the ceiling of the fabric's loopback rows; the
fabric's rows read the export from the page cache (``cache_export``). Root is needed for the
namespaces. The export file is sparse, under /var/tmp.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import operator
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from bench import proc_cpu, tcp_ceiling
from bench.kernel_probes import ProbeSampler
from bench.mount_procs import exit_on_sigterm
from bench.wan_shaper import QUEUE_WAIT_BOUNDS_MS, queue_wait_quantile
from fabric.client import (DEFAULT_CONNECTIONS, LONG_PATH_CONNECTIONS, LONG_PATH_RTT,
                           HubClient, HubUnavailable, bulk_connections)
from fabric.heap import keep_freed_buffers
from fabric.protocol import MetaEntry

EXPORT_DIR = Path("/var/tmp/neuralcache-bench/transport-export")
EXPORT_FILE = "data.bin"
EXPORT_BYTES = 4 * 1024**3
"""Synthetic file size: 60 s at 200 Mbit/s is 1.5 GB; loopback wraps around it."""
CACHE_READ_BYTES = 8 * 1024 * 1024  # one read of ``cache_export``

HUB_PORT = 7070  # inside the hub namespace, which is ours alone
PREFETCH_READ_BLOCKS = 1024  # one prefetch read: 4 MiB, the most one request carries
PREFETCH_DEPTH = 32
"""Prefetch reads outstanding (64 MiB): more than the pipe holds even in BBR's STARTUP on the
900 ms path (2.9 x 11 MB), so the load never runs dry."""
DEMAND_INTERVAL = 0.1  # seconds between demand reads
DEMAND_DEADLINE = 60.0  # a demand read gives up after this long (recorded as a miss)
STARTUP_RTTS = 20  # "after start-up" begins this many RTTs in ...
MIN_STARTUP = 2.0  # ... and at least this many seconds in
SAMPLE_PERIOD = 0.5  # seconds between snapshots of the controller's model
READY_TIMEOUT = 20.0  # seconds for the hub process to listen
RUN_SLACK = 60.0  # seconds a load process may run past its duration before it is killed
LOOPBACK_SECONDS = 15.0  # length of the loopback runs (the links run --duration)


NODE_SYSCTLS = (
    # Receive buffers start large (8 MiB) and may grow to 128 MiB: with 1 % loss a connection
    # holds about a round trip of data out of order besides its share of the BDP, and
    # autotuning grows the buffer only as the application reads, which it cannot do past a hole.
    "net.ipv4.tcp_rmem=4096 8388608 134217728",
    # Idle demand connections keep their congestion window instead of restarting from 10.
    "net.ipv4.tcp_slow_start_after_idle=0",
)
"""The node settings of docs/transport.md, applied to both namespaces of an emulated link."""

ROUTE_WINDOW = 1024
"""``initcwnd``/``initrwnd`` (packets) on each namespace's route to the other, also from
docs/transport.md: a fresh connection's first flight may be 1.5 MB instead of 14 KB. What the
hub's kernel sends is still only what the spoke's controller asked for; the window only stops
the kernel from being the limit. A controller resumed on the 900 ms path (``bbr-resumed``)
asks for half its 11 MB BDP at once, ~1.4 MB per bulk connection, which 128 packets
(185 KB) would spread over four more round trips: at 128 resuming gained nothing, at 1024 both
the first contact and the resumed run used more of that link (docs/transport.md, "Careful
resume, and a full run with it")."""


def configure_node(wan: Any) -> None:
    """Apply the node settings to both namespaces of ``wan`` (never to the host's)."""
    from bench.wan import DEVICE

    for ns, peer in ((wan.hub_ns, wan.spoke_addr), (wan.spoke_ns, wan.hub_addr)):
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *NODE_SYSCTLS],
                       check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "route", "change", f"{peer}/32", "dev", DEVICE,
                        "initcwnd", str(ROUTE_WINDOW), "initrwnd", str(ROUTE_WINDOW)],
                       check=True, capture_output=True)


@dataclass(frozen=True)
class Link:
    label: str
    rtt: float  # seconds
    rate_bps: float
    loss: float


LINKS = (
    Link("60 ms / 200 Mbit/s / 0 %", 0.060, 200e6, 0.0),
    Link("60 ms / 200 Mbit/s / 1 %", 0.060, 200e6, 0.01),
    Link("900 ms / 100 Mbit/s / 1 %", 0.900, 100e6, 0.01),
)
CLIENTS = ("bbr", "bbr-resumed", "cubic", "naive")
RESUMED = "bbr-resumed"
"""The client that starts from the path record the ``bbr`` run on the same link kept."""
PATH_RECORD = "path.json"
"""The ``bbr`` runs' path record, in a directory of each link's own."""
CEILING = "plain TCP"
"""The loopback rows' ceiling: the same connections with nothing but TCP on them
(``bench.tcp_ceiling``)."""


def make_export() -> Path:
    """The sparse export file (holes read as zeros: what is measured is the path, not a disk)."""
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = EXPORT_DIR / EXPORT_FILE
    if not path.exists() or path.stat().st_size != EXPORT_BYTES:
        with open(path, "wb") as f:
            f.truncate(EXPORT_BYTES)
    return EXPORT_DIR


def cache_export(export: Path) -> None:
    """Read the export file once, so that the loopback rows measure the fabric and not the
    kernel's first touch of the file: a page of a hole not yet in the page cache is a page of
    zeros the kernel must clear (38 % of the hub's samples under ``perf`` on loopback, when
    the file had left the cache). A hub serving a dataset its spokes read has it cached."""
    print(f"loopback: reading {EXPORT_BYTES / 2**30:.0f} GiB of the export into the page cache",
          flush=True)
    buffer = bytearray(CACHE_READ_BYTES)
    with open(export / EXPORT_FILE, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


# -- hub side (runs in the hub namespace) ------------------------------------------------------

def hub_main(export: str, host: str, port: int) -> None:
    from fabric.export import Export
    from fabric.hub import HubServer
    from fabric.transport import kernel_cc

    keep_freed_buffers()  # as `neuralcache hub` does
    congestion = kernel_cc.bulk_congestion(kernel_cc.AUTO)  # as `neuralcache hub` does

    async def main() -> None:
        server = HubServer(Export(export), tcp_congestion=congestion)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve, host, port)
            print(f"ready {listeners[0].socket.getsockname()[1]} {congestion}", flush=True)

    trio.run(main)


# -- spoke side (runs in the spoke namespace) ---------------------------------------------------

def load_main(host: str, port: int, client: str, duration: float, connections: int | None,
              depth: int = PREFETCH_DEPTH, path_memory: Path | None = None) -> None:
    if client == "naive":
        result = _naive_load(host, port, duration)
    else:
        result = _fabric_load(host, port, "bbr" if client == RESUMED else client, duration,
                              connections, depth, path_memory)
    print(json.dumps(result), flush=True)


def _fabric_load(host: str, port: int, congestion: str, duration: float,
                 connections: int | None, depth: int, path_memory: Path | None
                 ) -> dict[str, Any]:
    result: dict[str, Any] = {}
    keep_freed_buffers()  # as `neuralcache mount` does

    async def main() -> None:
        client = HubClient(host, port, congestion=congestion, connections=connections,
                           connect_timeout=30.0, attempt_timeout=60.0, path_memory=path_memory)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            entry = next(e for e in await client.metadata(timeout=60) if e.path == EXPORT_FILE)
            cpu_start = time.process_time()
            load = _FabricLoad(client, entry)
            await load.run(duration, depth)
            result.update(delivered=load.delivered, demand=load.demand, model=load.model,
                          cpu_seconds=time.process_time() - cpu_start,
                          resume=_resume_outcome(), bulk_connections=_bulk_connections())
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result


def _bulk_connections() -> int:
    """Bulk connections the client has up (``neuralcache_fabric_connections``)."""
    return int(_gauge("neuralcache_fabric_connections", {"role": "bulk"}))


def _gauge(name: str, labels: dict[str, str] | None = None) -> float:
    """A fabric gauge's value in this process (0 before it is set)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def _resume_outcome() -> str | None:
    """How the client used its path record (``neuralcache_fabric_path_resumes_total``), or
    None if it had none."""
    from fabric.metrics import FABRIC_PATH_RESUMES

    for metric in FABRIC_PATH_RESUMES.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                return str(sample.labels["outcome"])
    return None


class _FabricLoad:
    """The load over one ``HubClient``: ``depth`` prefetch readers keep the pipe full, a demand
    read of a random block goes every ``DEMAND_INTERVAL``, and the controller's model is
    sampled every ``SAMPLE_PERIOD``; times are seconds since ``run`` started."""

    def __init__(self, client: HubClient, entry: MetaEntry) -> None:
        self.client = client
        self.entry = entry
        self.blocks = entry.size // 4096
        self.next_block = 0
        self.start = 0.0
        self.delivered: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self.demand: list[tuple[float, float]] = []  # (issued at, latency; inf if it failed)
        self.model: list[dict[str, Any]] = []

    async def run(self, duration: float, depth: int) -> None:
        rng = random.Random(1)
        self.start = tick = trio.current_time()
        async with trio.open_nursery() as load:
            for _ in range(depth):
                load.start_soon(self._prefetcher)
            load.start_soon(self._sampler)
            while tick < self.start + duration:
                load.start_soon(self._one_demand, rng.randrange(self.blocks))
                tick += DEMAND_INTERVAL
                await trio.sleep_until(tick)
            load.cancel_scope.cancel()

    async def _prefetch_once(self, first: int) -> int:
        """One read made as the spoke's fetcher prefetches (``start_prefetch``: its bytes come
        in parts, not joined); its size."""
        landed = trio.Event()
        outcome: list[Any] = []

        def on_done(parts: Any) -> None:
            outcome.append(parts)
            landed.set()

        self.client.start_prefetch(self.entry.file_id, self.entry.version, first,
                                   PREFETCH_READ_BLOCKS, deadline=trio.current_time() + 3600,
                                   on_done=on_done)
        await landed.wait()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return sum(map(len, outcome[0]))

    async def _prefetcher(self) -> None:
        while True:
            first = self.next_block
            self.next_block = (self.next_block + PREFETCH_READ_BLOCKS) % self.blocks
            size = await self._prefetch_once(first)
            self.delivered.append((trio.current_time() - self.start, size))

    async def _one_demand(self, block: int) -> None:
        issued = trio.current_time()
        try:
            data = await self.client.read(self.entry.file_id, self.entry.version, block, 1,
                                          deadline=issued + DEMAND_DEADLINE)
        except HubUnavailable:
            self.demand.append((issued - self.start, math.inf))
            return
        done = trio.current_time()
        self.delivered.append((done - self.start, len(data)))
        self.demand.append((issued - self.start, done - issued))

    async def _sampler(self) -> None:
        while True:
            s = self.client.stats()
            self.model.append({"t": trio.current_time() - self.start, "state": s.state,
                               "btl_bw": s.btl_bw, "min_rtt": _finite(s.min_rtt),
                               "srtt": _finite(s.srtt), "pacing_rate": s.pacing_rate,
                               "cwnd": s.cwnd, "inflight": s.bytes_in_flight,
                               "lost_packets": s.lost_packets, "loss_rate": s.loss_rate,
                               "headroom": self.client.prefetch_headroom,
                               "resent_ratio": _gauge("neuralcache_fabric_resent_ratio"),
                               "bulk_connections": _bulk_connections()})
            await trio.sleep(SAMPLE_PERIOD)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _naive_load(host: str, port: int, duration: float) -> dict[str, Any]:
    """One blocking TCP connection, one 4 KiB block per request; a due demand read goes next."""
    from fabric.checksum import bad_blocks
    from fabric.protocol import (PROTOCOL_VERSION, FrameDecoder, Hello, MetaReply, MetaRequest,
                                 ReadReply, ReadRequest, encode)

    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = FrameDecoder()
    pending: list[Any] = []

    def call(msg: Any) -> Any:
        sock.sendall(encode(msg))
        while not pending:
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("hub closed the connection")
            pending.extend(decoder.feed(data))
        return pending.pop(0)

    call(Hello(PROTOCOL_VERSION, "naive"))
    entries = []
    reply = call(MetaRequest(1))
    while True:
        assert isinstance(reply, MetaReply)
        entries.extend(reply.entries)
        if reply.done:
            break
        reply = call(MetaRequest(1)) if not pending else pending.pop(0)
    entry = next(e for e in entries if e.path == EXPORT_FILE)
    blocks = entry.size // 4096
    rng = random.Random(1)
    delivered: list[tuple[float, int]] = []
    demand: list[tuple[float, float]] = []
    start = time.monotonic()
    next_demand = start
    seq = 0
    req_id = 1
    while True:
        now = time.monotonic()
        if now >= start + duration:
            break
        is_demand = now >= next_demand
        if is_demand:
            block, issued = rng.randrange(blocks), next_demand
            next_demand += DEMAND_INTERVAL
        else:
            block, seq = seq, (seq + 1) % blocks
        req_id += 1
        reply = call(ReadRequest(req_id, entry.file_id, entry.version, block, 1))
        assert isinstance(reply, ReadReply) and not bad_blocks(reply.data, reply.checksums)
        done = time.monotonic()
        delivered.append((done - start, len(reply.data)))
        if is_demand:
            demand.append((issued - start, done - issued))
    # Demand reads the naive client never got to are misses of the whole run.
    while next_demand < start + duration:
        demand.append((next_demand - start, math.inf))
        next_demand += DEMAND_INTERVAL
    sock.close()
    return {"delivered": delivered, "demand": demand, "model": []}


# -- the parent: links, processes, the table ----------------------------------------------------

@dataclass(frozen=True)
class Row:
    link: str
    client: str
    line_rate: float  # bytes/s
    rtt: float  # seconds (0 on loopback)
    whole: float  # goodput bytes/s over the whole run
    after: float  # goodput bytes/s after start-up
    p50: float  # demand latency seconds, after start-up
    p99: float
    demand_done: int
    demand_issued: int
    lost: int  # requests the controller counted lost
    startup: float  # seconds treated as start-up
    btl_bw: float  # the controller's bandwidth estimate, bytes/s, median after start-up
    tail_drops: int | None  # hub-to-spoke packets the emulator's full queue dropped
    queue_p50: float = math.nan  # ms, hub-to-spoke packets' wait at the bottleneck, after
    queue_p99: float = math.nan  # start-up (bucket upper bounds; nan on loopback)
    ceiling: float = math.nan  # loopback: the plain-TCP row's goodput, bytes/s, same window


def summarize(link: str, client: str, line_rate: float, rtt: float, duration: float,
              result: dict[str, Any]) -> Row:
    startup = max(MIN_STARTUP, STARTUP_RTTS * rtt)
    delivered = result["delivered"]
    whole = sum(n for t, n in delivered if t <= duration) / duration
    after = sum(n for t, n in delivered if startup < t <= duration) / (duration - startup)
    window = [lat for t, lat in result["demand"] if t >= startup]
    done = sorted(x for x in window if math.isfinite(x))
    # A demand read that never completed counts as slower than every one that did.
    ranked = done + [math.inf] * (len(window) - len(done))
    lost = result["model"][-1]["lost_packets"] if result["model"] else 0
    btl_bw = sorted(s["btl_bw"] for s in result["model"] if s["t"] >= startup)
    drops = result.get("tail_drops")  # none on loopback
    waits = result.get("queue_wait_ms")  # the same
    return Row(link, client, line_rate, rtt, whole, after, _quantile(ranked, 0.5),
               _quantile(ranked, 0.99), len(done), len(window), lost, startup,
               _quantile(btl_bw, 0.5), drops,
               *((queue_wait_quantile(waits, 0.5), queue_wait_quantile(waits, 0.99))
                 if waits else ()))


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


HUB_TCP_COUNTERS = ("TcpExt:TCPTimeouts", "TcpExt:TCPLossProbes", "TcpExt:TCPSpuriousRTOs",
                    "Tcp:RetransSegs")
"""The hub's kernel counters kept per run (its namespace's own, ``/proc/net/netstat`` and
``/proc/net/snmp``): retransmission timeouts, tail loss probes, timeouts later found spurious,
and segments resent. A timeout sets a connection's window back to one segment, which on a long
path takes many round trips to regrow; the loss probe is what the kernel tries before it."""


def parse_mib(text: str) -> dict[str, int]:
    """``/proc/net/netstat`` or ``/proc/net/snmp`` as ``{"Group:Name": value}``: each group is
    a line of names followed by a line of values, both led by ``Group:``."""
    counters: dict[str, int] = {}
    lines = text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        group, _, names = names.partition(":")
        for name, value in zip(names.split(), values.partition(":")[2].split()):
            counters[f"{group}:{name}"] = int(value)
    return counters


def _hub_tcp(hub_ns: str) -> dict[str, int]:
    out = subprocess.run(["ip", "netns", "exec", hub_ns, "cat", "/proc/net/netstat",
                          "/proc/net/snmp"], capture_output=True, text=True, check=True).stdout
    counters = parse_mib(out)
    return {name: counters.get(name, 0) for name in HUB_TCP_COUNTERS}


def _tail_drops(wire: dict[str, Any]) -> int:
    return int(wire["hub_to_spoke"]["queue_dropped_packets"])


def _queue_waits(wire: dict[str, Any]) -> list[int]:
    return list(wire["hub_to_spoke"]["queue_wait_ms"])


def _run_pair(hub_cmd: list[str], load_cmd: list[str], duration: float) -> dict[str, Any]:
    hub = subprocess.Popen(hub_cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = _read_line(hub, READY_TIMEOUT)
        if not line.startswith("ready"):
            raise RuntimeError(f"hub did not start: {line!r}")
        hub_cpu, stolen_mark = proc_cpu.cpu_seconds(hub.pid), proc_cpu.stolen_ticks()
        out = subprocess.run(load_cmd, capture_output=True, text=True,
                             timeout=duration + RUN_SLACK)
        if out.returncode != 0:
            raise RuntimeError(f"load process failed:\n{out.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        ready = line.split()  # the hub's "ready PORT CONGESTION"
        if len(ready) > 2:
            result["hub_congestion"] = ready[2]
        result["hub_cpu_seconds"] = proc_cpu.cpu_seconds(hub.pid) - hub_cpu
        result["stolen"] = proc_cpu.stolen_share_since(stolen_mark)
        return result
    finally:
        hub.terminate()
        try:
            hub.wait(timeout=10)
        except subprocess.TimeoutExpired:
            hub.kill()
            hub.wait()


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.transport", *args]


def _save(save: Path | None, name: str, result: dict[str, Any]) -> None:
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        (save / f"{name}.json").write_text(json.dumps(result))


def _connections_option(connections: int | None) -> list[str]:
    """The load's ``--connections``: none leaves the count to the client (by the path)."""
    return [] if connections is None else ["--connections", str(connections)]


def run_link(link: Link, clients: list[str], duration: float, connections: int | None,
             export: Path, save: Path | None = None) -> list[Row]:
    from bench.wan import LinkSpec, WanLink

    rows = []
    with WanLink(LinkSpec(rtt=link.rtt, rate_bps=link.rate_bps, loss=link.loss, seed=1)) as wan, \
            tempfile.TemporaryDirectory(prefix="nc-path-") as records:
        configure_node(wan)
        for client in clients:
            hub_cmd = wan.command("hub", _python("hub", "--export", str(export), "--listen",
                                                 f"{wan.hub_addr}:{HUB_PORT}"))
            record = Path(records, PATH_RECORD)
            if client == "bbr":  # first contact: learn the path afresh, keep what it learnt
                record.unlink(missing_ok=True)
            keep = ["--path-memory", str(record)] if client in ("bbr", RESUMED) else []
            load_cmd = wan.command("spoke", _python(
                "load", "--hub", f"{wan.hub_addr}:{HUB_PORT}", "--client", client,
                "--duration", str(duration), *_connections_option(connections), *keep))
            dropped = _tail_drops(wan.stats())
            hub_tcp = _hub_tcp(wan.hub_ns)
            # The queue's waits after start-up, as the demand latencies are: counters taken
            # when start-up ends, while the pair runs.
            at_startup: list[dict[str, Any]] = []
            timer = threading.Timer(max(MIN_STARTUP, STARTUP_RTTS * link.rtt),
                                    lambda: at_startup.append(wan.stats()))
            timer.start()
            probes = ProbeSampler(wan.hub_ns)
            probes.start()
            try:
                result = _run_pair(hub_cmd, load_cmd, duration)
            finally:
                timer.cancel()
                probe_summary = probes.stop()
            result["kernel_probes"] = dataclasses.asdict(probe_summary)
            result["wire"] = wan.stats()  # the link's counters so far, every client's
            result["tail_drops"] = _tail_drops(result["wire"]) - dropped
            result["hub_tcp"] = {name: value - hub_tcp[name]
                                 for name, value in _hub_tcp(wan.hub_ns).items()}
            if at_startup:
                result["queue_wait_ms"] = list(map(
                    operator.sub, _queue_waits(result["wire"]), _queue_waits(at_startup[0])))
            _save(save, f"{link.rtt * 1000:.0f}ms-{link.loss:g}-{client}", result)
            label = client
            if client == RESUMED and result.get("resume") != "resumed":
                label += f" (not resumed: {result.get('resume') or 'no record'})"
            row = summarize(link.label, label, link.rate_bps / 8, link.rtt, duration, result)
            print(format_row(row), file=sys.stderr, flush=True)
            print("  hub TCP: " + ", ".join(f"{name.partition(':')[2]} {value:,}"
                                            for name, value in result["hub_tcp"].items()),
                  file=sys.stderr, flush=True)
            print("  " + probe_summary.line(), file=sys.stderr, flush=True)
            print(f"  bulk connections: {result.get('bulk_connections', '-')}, their "
                  f"congestion control at the hub: {result.get('hub_congestion', '?')}",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def run_loopback(clients: list[str], duration: float, connections: int | None, export: Path,
                 save: Path | None = None) -> list[Row]:
    """The fabric's loopback rows, after the plain-TCP ceiling's (``bench.tcp_ceiling``) over
    as many connections as the client chooses for loopback."""
    count = connections or bulk_connections(0.0)
    load = ["--duration", str(duration), "--connections", str(count)]
    rows = [_loopback_row(CEILING, ["tcp-source"], ["tcp-sink", *load], "plain-tcp", duration,
                          save)]
    cache_export(export)
    for client in clients:
        rows.append(_loopback_row(client, ["hub", "--export", str(export)],
                                  ["load", "--client", client, *load], client, duration, save,
                                  ceiling=rows[0].after))
    return rows


def _loopback_row(client: str, server: list[str], load: list[str], name: str, duration: float,
                  save: Path | None, ceiling: float = math.nan) -> Row:
    """One loopback row: ``server`` listening on a free port of 127.0.0.1, ``load`` run against
    it; saved as ``loopback-NAME``, printed with each side's CPU per GB."""
    address = f"127.0.0.1:{_free_port()}"
    result = _run_pair(_python(*server, "--listen", address), _python(*load, "--hub", address),
                       duration)
    _save(save, f"loopback-{name}", result)
    row = dataclasses.replace(
        summarize("loopback, no emulation", client, math.nan, 0.0, duration, result),
        ceiling=ceiling)
    print(format_row(row), file=sys.stderr, flush=True)
    print(_cpu_line(result), file=sys.stderr, flush=True)
    return row


def _cpu_line(result: dict[str, Any]) -> str:
    """What each side spent per GB it moved (the load's CPU over its run, the hub's over the
    load's): on loopback the two processes share the machine's cores, and CPU is the limit;
    and the share of the CPUs the hypervisor took meanwhile (``proc_cpu.STOLEN``)."""
    gb = sum(n for _, n in result["delivered"]) / 1e9
    if gb == 0:
        return "  CPU per GB moved: - (nothing moved)"
    return (f"  CPU per GB moved: hub {result['hub_cpu_seconds'] / gb:.2f} s, "
            f"spoke {result['cpu_seconds'] / gb:.2f} s; "
            f"{100 * result['stolen']:.0f} % of the CPUs stolen by the hypervisor")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def _ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "never" if math.isinf(x) else f"{1000 * x:.0f} ms"


def _rate(x: float, line: float, ceiling: float = math.nan) -> str:
    if not math.isnan(line):
        return f"{_pct(x / line)} ({8 * x / 1e6:.0f} Mbit/s)"
    if math.isnan(ceiling):
        return f"{x / 1e9:.2f} GB/s"
    return f"{x / 1e9:.2f} GB/s ({_pct(x / ceiling)} of {CEILING})"


HEADER = ("| link | client | goodput, whole run | goodput after start-up | demand p50 | "
          "demand p99 | p99 / RTT | demand reads done | lost requests | BtlBw, median "
          "after start-up | tail drops | queue wait p50 / p99 |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: Row) -> str:
    ratio = "-" if r.rtt == 0 or math.isnan(r.p99) else (
        "inf" if math.isinf(r.p99) else f"{r.p99 / r.rtt:.2f}")
    return (f"| {r.link} | {r.client} | {_rate(r.whole, r.line_rate)} | "
            f"{_rate(r.after, r.line_rate, r.ceiling)} | {_ms(r.p50)} | {_ms(r.p99)} | {ratio} | "
            f"{r.demand_done}/{r.demand_issued} | {r.lost} | {_bw(r.btl_bw)} | "
            f"{'-' if r.tail_drops is None else f'{r.tail_drops:,}'} | "
            f"{_wait(r.queue_p50)} / {_wait(r.queue_p99)} |")


def _wait(ms: float) -> str:
    """A queue-wait bucket's upper bound: "<= 30 ms"."""
    if math.isnan(ms):
        return "-"
    return f"> {QUEUE_WAIT_BOUNDS_MS[-1]} ms" if math.isinf(ms) else f"<= {ms:g} ms"


def _bw(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 1e6:.1f} MB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    hub = sub.add_parser("hub", help="(internal) serve the export")
    hub.add_argument("--export", required=True)
    hub.add_argument("--listen", required=True)
    load = sub.add_parser("load", help="(internal) run one client's load, print JSON")
    load.add_argument("--hub", required=True)
    load.add_argument("--client", choices=CLIENTS, required=True)
    load.add_argument("--duration", type=float, required=True)
    load.add_argument("--connections", type=int, default=None,
                      help="bulk connections [the client's choice for the path]")
    load.add_argument("--depth", type=int, default=PREFETCH_DEPTH,
                      help="prefetch reads outstanding (0: demand reads only)")
    load.add_argument("--path-memory", type=Path, default=None,
                      help="the client's path record (fabric.path_memory)")
    source = sub.add_parser("tcp-source", help="(internal) the plain-TCP ceiling's sender")
    source.add_argument("--listen", required=True)
    sink = sub.add_parser("tcp-sink", help="(internal) the plain-TCP ceiling's receiver, "
                                           "print JSON")
    sink.add_argument("--hub", required=True)
    sink.add_argument("--duration", type=float, required=True)
    sink.add_argument("--connections", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="15 s transfers instead of 60 s")
    parser.add_argument("--duration", type=float, default=None, help="seconds per transfer")
    parser.add_argument("--links", type=int, nargs="+", default=None,
                        help=f"indices of links to run (0..{len(LINKS) - 1}; default all)")
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument("--connections", type=int, default=None,
                        help="bulk TCP connections [the client's choice for the path: "
                             f"{DEFAULT_CONNECTIONS}, {LONG_PATH_CONNECTIONS} from "
                             f"{LONG_PATH_RTT:g} s round trip]")
    parser.add_argument("--no-loopback", action="store_true")
    parser.add_argument("--loopback-only", action="store_true")
    parser.add_argument("--save", type=Path, default=None,
                        help="directory to keep each run's raw JSON (timelines, model samples)")
    args = parser.parse_args(argv)
    if (args.cmd is None and RESUMED in args.clients
            and "bbr" not in args.clients[:args.clients.index(RESUMED)]):
        parser.error(f"{RESUMED} resumes from the record the bbr run before it keeps: "
                     f"list bbr before it in --clients")
    if args.cmd == "hub":
        host, _, port = args.listen.rpartition(":")
        hub_main(args.export, host, int(port))
        return 0
    if args.cmd == "load":
        host, _, port = args.hub.rpartition(":")
        load_main(host, int(port), args.client, args.duration, args.connections, args.depth,
                  args.path_memory)
        return 0
    if args.cmd == "tcp-source":
        host, _, port = args.listen.rpartition(":")
        tcp_ceiling.serve(host, int(port))
        return 0
    if args.cmd == "tcp-sink":
        host, _, port = args.hub.rpartition(":")
        print(json.dumps(tcp_ceiling.receive(host, int(port), args.duration, args.connections)),
              flush=True)
        return 0
    exit_on_sigterm()  # so that a stopped run still removes its namespaces and processes
    duration = args.duration or (15.0 if args.quick else 60.0)
    export = make_export()
    rows: list[Row] = []
    if not args.loopback_only:
        if os.geteuid() != 0:
            parser.error("the emulated links need root (network namespaces)")
        for i in (args.links if args.links is not None else range(len(LINKS))):
            rows += run_link(LINKS[i], args.clients, duration, args.connections, export,
                             args.save)
    if not args.no_loopback:
        loop_clients = [c for c in args.clients if c not in ("naive", RESUMED)] or ["bbr"]
        rows += run_loopback(loop_clients, min(duration, LOOPBACK_SECONDS), args.connections,
                             export, args.save)
    print(HEADER)
    for row in rows:
        print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
