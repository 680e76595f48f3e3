"""TCP socket options for the fabric's connections.

The kernel moves the bytes; what it needs from us is a congestion control that does not read
random loss as congestion (on the hub's bulk connections ``nc_paced``, which follows our pacing
alone, ``kernel_cc``; ``bbr`` where that cannot be loaded: cubic collapses to ~1 % of a lossy
long path, see docs/wan-emulator.md) and small requests sent without Nagle's delay.
Buffers are left to autotuning: setting SO_RCVBUF/SO_SNDBUF switches autotuning off and caps
the buffer at ``net.core.rmem_max``/``wmem_max``, whereas autotuning grows it to the
``tcp_rmem``/``tcp_wmem`` maximum, which is what a long path needs (docs/transport.md lists
the sysctls).
"""

from __future__ import annotations

import logging
import socket
import struct
from pathlib import Path

from ..protocol import Role
from .arrivals import TcpCounters

log = logging.getLogger(__name__)

DEMAND_CONGESTION = "cubic"
"""TCP congestion control of demand connections (``Role.DEMAND``), at both ends. They carry a
request and its small reply (4-128 KiB) at a time and are idle in between, and BBR paces
every segment at its bandwidth estimate, which on such a connection is what those replies
measure: a few KB per round trip. A 4 KiB reply's three segments then left tens of
milliseconds apart at 60 ms (docs/transport.md, "Demand connections without pacing"). CUBIC
does not pace (without the fq qdisc), is built into every kernel, and its reaction to loss
only shrinks a window that replies this small hardly use."""


def congestion_for(role: str | None, bulk: str | None) -> str | None:
    """The congestion control a connection of ``role`` runs: ``DEMAND_CONGESTION`` on demand
    connections, ``bulk`` on the rest (a hello without a role is a bulk connection's)."""
    return DEMAND_CONGESTION if role == Role.DEMAND else bulk


AVAILABLE_CC = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
"""Congestion controls the running kernel has loaded, space-separated."""

_warned: set[str] = set()

# struct tcp_info (include/uapi/linux/tcp.h): offsets of the fields arrivals.py and the hub's
# retransmission counter read.
_TCP_INFO_BYTES = 228  # up to and including tcpi_rcv_ooopack (Linux >= 5.4)
_RCV_MSS = struct.Struct("=I")  # at 20
_BYTES_RECEIVED = struct.Struct("=Q")  # at 128
_DATA_SEGS_IN = struct.Struct("=I")  # at 152
_BYTES_RETRANS = struct.Struct("=Q")  # at 208 (Linux >= 4.19)
_RCV_OOOPACK = struct.Struct("=I")  # at 224


def available_congestion_controls() -> frozenset[str]:
    """Names the kernel accepts for TCP_CONGESTION (empty if it cannot be read)."""
    try:
        return frozenset(AVAILABLE_CC.read_text().split())
    except OSError:
        return frozenset()


def configure(sock: socket.socket | object, congestion: str | None) -> str | None:
    """Turn Nagle off and set ``congestion`` if the kernel has it; returns the control in use.

    ``sock`` is a socket or a trio socket/stream (anything with ``setsockopt``/``getsockopt``);
    for a stream that is not a socket (no ``setsockopt``) nothing is done and None returned.
    """
    setsockopt = getattr(sock, "setsockopt", None)
    getsockopt = getattr(sock, "getsockopt", None)
    if setsockopt is None or getsockopt is None:
        return None
    setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion and hasattr(socket, "TCP_CONGESTION"):
        try:
            setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        except OSError as exc:
            if congestion not in _warned:  # once per process: every connection would repeat it
                _warned.add(congestion)
                log.warning("TCP congestion control %r unavailable (%s); using the kernel "
                            "default. Load it with: modprobe tcp_%s", congestion, exc, congestion)
    if not hasattr(socket, "TCP_CONGESTION"):
        return None
    name = getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return name.rstrip(b"\0").decode()


def _tcp_info(sock: socket.socket | object) -> bytes | None:
    """``sock``'s TCP_INFO up to the last field read here; None if it is not a TCP socket or
    the kernel is too old to fill it."""
    try:
        info = getattr(sock, "getsockopt")(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return None
    return info if len(info) >= _TCP_INFO_BYTES else None


def counters(sock: socket.socket | object) -> TcpCounters | None:
    """The receive-side TCP_INFO counters of ``sock``; None where the kernel lacks them."""
    info = _tcp_info(sock)
    if info is None:
        return None
    return TcpCounters(bytes_received=_BYTES_RECEIVED.unpack_from(info, 128)[0],
                       data_segs_in=_DATA_SEGS_IN.unpack_from(info, 152)[0],
                       ooo_packets=_RCV_OOOPACK.unpack_from(info, 224)[0],
                       rcv_mss=_RCV_MSS.unpack_from(info, 20)[0])


def retransmitted_bytes(sock: socket.socket | object) -> int | None:
    """Bytes ``sock`` has sent more than once since it opened; None where the kernel lacks it."""
    info = _tcp_info(sock)
    return None if info is None else _BYTES_RETRANS.unpack_from(info, 208)[0]


_CA_STATE_AT = 1  # tcpi_ca_state, a byte after tcpi_state
_TCP_CA_OPEN = 0
"""The sender's congestion-avoidance state when nothing it sent is known missing at the peer.
Disorder (the peer's SACKs say a segment is missing), Recovery and Loss mean the peer holds
what came after a hole; CWR (a slowdown for local congestion or ECN) counts as held too."""


def sends_held(sock: socket.socket | object) -> bool:
    """Whether the peer is holding what ``sock`` sent behind a missing segment (known a
    round trip after the loss, when the peer's SACKs come back); False where it cannot tell."""
    try:
        info = getattr(sock, "getsockopt")(socket.IPPROTO_TCP, socket.TCP_INFO, _CA_STATE_AT + 1)
    except (OSError, AttributeError):
        return False
    return len(info) > _CA_STATE_AT and info[_CA_STATE_AT] != _TCP_CA_OPEN


SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
"""Linux's cap on the rate (bytes/s) the kernel paces a socket's sends at; Python does not name
it. It binds whatever paces: BBR (of any state) or the fq qdisc."""

_PACING_RATE = struct.Struct("=Q")
"""The option as a u64, which Linux takes since 4.20; an older kernel reads its low 32 bits."""

UNLIMITED_PACING = 2 ** 64 - 1
"""The option's "no cap" (~0UL), the kernel's default."""


def limit_pacing(sock: socket.socket | object, rate: int) -> None:
    """Cap the kernel's pacing of ``sock``'s sends at ``rate`` bytes/s; nothing if ``sock`` is
    not a socket (no ``setsockopt``, as ``_tcp_info`` treats it). Where the kernel refuses,
    warn once: the sends then go at the congestion control's own pace."""
    setsockopt = getattr(sock, "setsockopt", None)
    if setsockopt is None:
        return
    try:
        setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE,
                   _PACING_RATE.pack(min(rate, UNLIMITED_PACING)))
    except OSError as exc:
        if "SO_MAX_PACING_RATE" not in _warned:
            _warned.add("SO_MAX_PACING_RATE")
            log.warning("cannot cap a connection's pacing rate (%s); replies go at its "
                        "congestion control's pace", exc)
