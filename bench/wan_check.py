"""Measure an emulated WAN link: RTT, TCP goodput and wire rate, asked vs measured.

    python -m bench.wan_check --rtt 60ms --rate 200mbit --loss 0.01 [--cc bbr cubic]
    python -m bench.wan_check --table     # the table in docs/wan-emulator.md

RTT is the median of UDP ping-pongs between sockets living in the two
namespaces. Rate is one TCP stream from hub to spoke (the direction data flows
in NeuralCache), ``TCP_CONGESTION`` set on the sender, buffers left to the
namespace's raised autotuning limits. Goodput counts payload bytes received;
the wire rate counts IP bytes the forwarder delivered in the same window, so it
is what the shaper actually let through. Both skip a warm-up (slow start /
BBR startup), which at 900 ms lasts several seconds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

from bench.proc_cpu import cpu_seconds, stolen_share_since, stolen_ticks
from bench.wan import HUB, SPOKE, LinkSpec, WanLink, parse_rate, parse_rtt

PING_PAYLOAD = 32  # bytes per UDP ping; small, so serialization adds ~nothing to the RTT
PING_TIMEOUT_EXTRA = 0.5  # seconds beyond 2 RTT before a ping counts as lost
BULK_CHUNK = 4 * 1024 * 1024  # bytes per sendall(): big enough to keep the socket full
RECV_CHUNK = 1024 * 1024  # bytes per recv_into()
WARMUP_RTTS = 35  # startup from 10 segments to 1 BDP at 900 ms/100 Mbit grows ~2x per RTT
# (~13 RTTs), overshoots into the queue and needs ~10 RTTs of recovery: skip all of it
MIN_WARMUP = 1.5  # seconds of warm-up at least, for short RTTs
MEASURE_RTTS = 30  # the measured window lasts this many RTTs (covers BBR's ProbeRTT every 10 s) ...
MIN_MEASURE = 3.0  # ... and at least this many seconds
ACCEPT_TIMEOUT = 10.0  # seconds for the TCP connection to come up over a lossy long path


@dataclass(frozen=True)
class Transfer:
    """One bulk TCP transfer's figures over the measured window."""

    cc: str
    goodput_bps: float  # payload bits/s received by the spoke
    wire_bps: float  # IP bits/s the forwarder delivered hub->spoke
    seconds: float  # length of the measured window
    forwarder_cores: float  # CPU the forwarder used in the window, in cores
    steal: float  # share of the machine's CPU time its hypervisor took in the window: while
    # large, every process here runs less, the sender's kernel too, whatever the link does


@dataclass(frozen=True)
class CheckResult:
    rtt_samples: list[float]
    transfers: list[Transfer]

    @property
    def rtt_median(self) -> float:
        return statistics.median(self.rtt_samples)


def measure_rtt(link: WanLink, samples: int) -> list[float]:
    """RTTs of ``samples`` UDP ping-pongs spoke -> hub -> spoke (lost ones skipped)."""
    server = link.socket(HUB, socket.AF_INET, socket.SOCK_DGRAM)
    client = link.socket(SPOKE, socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()

    def echo() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                data, peer = server.recvfrom(PING_PAYLOAD)
            except TimeoutError:
                continue
            server.sendto(data, peer)

    with server, client:
        server.bind((link.hub_addr, 0))
        echo_thread = threading.Thread(target=echo, name="udp-echo")
        echo_thread.start()
        try:
            client.connect(server.getsockname())
            client.settimeout(2 * link.spec.rtt + PING_TIMEOUT_EXTRA)
            rtts = []
            for seq in range(samples):
                payload = struct.pack("!Q", seq).ljust(PING_PAYLOAD, b"\0")
                sent = time.monotonic()
                client.send(payload)
                try:
                    while client.recv(PING_PAYLOAD) != payload:
                        pass  # a late reply to an earlier ping
                except TimeoutError:
                    continue
                rtts.append(time.monotonic() - sent)
        finally:
            stop.set()
            echo_thread.join()
    return rtts


def _forwarded_bytes(link: WanLink) -> int:
    return link.stats()["hub_to_spoke"]["forwarded_bytes"]


def measure_transfer(link: WanLink, cc: str, warmup: float, seconds: float) -> Transfer:
    """One TCP stream hub -> spoke; figures over ``seconds`` after ``warmup``."""
    listener = link.socket(HUB)
    receiver = link.socket(SPOKE)
    stop = threading.Event()
    forwarder = link.forwarder_pid
    if forwarder is None:
        raise RuntimeError("measure_transfer needs a link that is up")

    def send(conn: socket.socket) -> None:
        chunk = memoryview(bytes(BULK_CHUNK))
        with conn:
            try:
                while not stop.is_set():
                    conn.sendall(chunk)
            except OSError:
                pass  # the receiver closed: the transfer is over

    with listener, receiver:
        listener.bind((link.hub_addr, 0))
        listener.listen(1)
        listener.settimeout(ACCEPT_TIMEOUT)
        receiver.settimeout(ACCEPT_TIMEOUT)
        receiver.connect(listener.getsockname())
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        sender = threading.Thread(target=send, args=(conn,), name="bulk-sender")
        sender.start()
        try:
            buf = bytearray(RECV_CHUNK)
            start = time.monotonic()
            window_start = start + warmup
            window_end = window_start + seconds
            received = 0
            mark: tuple[float, int, int, float, tuple[int, int]] | None = None
            while True:
                received += receiver.recv_into(buf)
                now = time.monotonic()
                if mark is None and now >= window_start:
                    mark = (now, received, _forwarded_bytes(link),
                            cpu_seconds(forwarder), stolen_ticks())
                if now >= window_end:
                    break
            assert mark is not None
            elapsed = now - mark[0]
            wire = _forwarded_bytes(link) - mark[2]
            cores = (cpu_seconds(forwarder) - mark[3]) / elapsed
            steal = stolen_share_since(mark[4])
        finally:
            stop.set()
            receiver.close()
            sender.join()
    return Transfer(cc, (received - mark[1]) * 8 / elapsed, wire * 8 / elapsed, elapsed, cores,
                    steal)


def default_windows(spec: LinkSpec) -> tuple[float, float]:
    """(warm-up, measured) seconds long enough to leave startup at this RTT."""
    return max(MIN_WARMUP, WARMUP_RTTS * spec.rtt), max(MIN_MEASURE, MEASURE_RTTS * spec.rtt)


def check_link(
    link: WanLink, ccs: tuple[str, ...] = ("bbr",), ping_samples: int = 20
) -> CheckResult:
    """RTT samples, then one transfer per congestion control in ``ccs``."""
    warmup, seconds = default_windows(link.spec)
    rtts = measure_rtt(link, ping_samples)
    return CheckResult(rtts, [measure_transfer(link, cc, warmup, seconds) for cc in ccs])


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:.1f}"


def format_check(spec: LinkSpec, result: CheckResult) -> str:
    """Asked vs measured, one line per transfer."""
    median = result.rtt_median if result.rtt_samples else float("nan")
    lines = [
        f"asked: rtt {spec.rtt * 1e3:.1f} ms, rate {_mbit(spec.rate_bps)} Mbit/s, "
        f"loss {spec.loss:g}",
        f"rtt: median {median * 1e3:.1f} ms over {len(result.rtt_samples)} pings "
        f"({100 * (median / spec.rtt - 1):+.1f} %)" if spec.rtt else "",
    ]
    for t in result.transfers:
        wire_pct = 100 * t.wire_bps / spec.rate_bps
        goodput_pct = 100 * t.goodput_bps / spec.rate_bps
        lines.append(
            f"{t.cc}: wire {_mbit(t.wire_bps)} Mbit/s ({wire_pct:.1f} % of rate), "
            f"goodput {_mbit(t.goodput_bps)} Mbit/s ({goodput_pct:.1f} % of rate) "
            f"over {t.seconds:.1f} s; forwarder {t.forwarder_cores:.2f} cores; "
            f"{100 * t.steal:.0f} % of the CPUs stolen by the hypervisor"
        )
    return "\n".join(line for line in lines if line)


TABLE_CASES = (  # (rtt, rate, loss) of the table in docs/wan-emulator.md
    ("60ms", "400mbit", 0.0),  # past the 100-200 Mbit/s target: the forwarder's headroom
    ("60ms", "200mbit", 0.0),
    ("60ms", "200mbit", 0.01),
    ("900ms", "100mbit", 0.01),
)


def table(ccs: tuple[str, ...], seed: int) -> str:
    """Markdown table: asked vs measured for each of ``TABLE_CASES``."""
    rows = [
        "| asked RTT | measured RTT (median) | asked rate | loss | cc | wire rate | goodput "
        "| forwarder CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rtt, rate, loss in TABLE_CASES:
        spec = LinkSpec(rtt=parse_rtt(rtt), rate_bps=parse_rate(rate), loss=loss, seed=seed)
        with WanLink(spec) as link:
            result = check_link(link, ccs)
        for t in result.transfers:
            rows.append(
                f"| {rtt} | {result.rtt_median * 1e3:.1f} ms | {_mbit(spec.rate_bps)} Mbit/s "
                f"| {loss:.0%} | {t.cc} | {_mbit(t.wire_bps)} Mbit/s "
                f"({100 * t.wire_bps / spec.rate_bps:.1f} %) | {_mbit(t.goodput_bps)} Mbit/s "
                f"({100 * t.goodput_bps / spec.rate_bps:.1f} %) | {t.forwarder_cores:.2f} cores |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.wan_check", description=__doc__)
    parser.add_argument("--rtt", default="60ms")
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cc", nargs="+", default=["bbr"], help="congestion controls to try")
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--table", action="store_true", help="run the docs table cases")
    args = parser.parse_args(argv)
    if args.table:
        print(table(tuple(args.cc), args.seed))
        return
    spec = LinkSpec(rtt=parse_rtt(args.rtt), rate_bps=parse_rate(args.rate),
                    loss=args.loss, seed=args.seed)
    with WanLink(spec) as link:
        print(format_check(spec, check_link(link, tuple(args.cc), args.pings)))


if __name__ == "__main__":
    main()
