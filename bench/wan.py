"""User-space WAN emulator: two network namespaces joined by a shaped link.

The kernel here has no ``netem``, so the link is ours: a *hub* namespace and a
*spoke* namespace each get a point-to-point TUN device (``wan0``), and a
forwarder process (``bench.wan_forwarder``) moves IP packets between the two
devices applying, per direction, random loss, a bounded tail-drop queue,
serialization at a rate limit, and a one-way delay of rtt/2.

Addresses come from the RFC 2544 benchmarking range and exist only inside the
namespaces this module creates: the hub is ``198.18.0.1``, the spoke
``198.18.0.2``. Namespace names are ``ncw-<pid>-<n>-hub`` / ``ncw-<pid>-<n>-spoke``
so parallel emulators never clash; they are always removed on exit, and
:func:`cleanup_stale` removes those left by a process that was killed.

Python use::

    with WanLink(LinkSpec(rtt=0.060, rate_bps=200e6, loss=0.01)) as link:
        subprocess.run(link.command("hub", ["my-server"]))      # hub's network, host's mounts
        sock = link.socket("spoke")                             # a socket living in the spoke
        print(link.stats())

Command line::

    python -m bench.wan --rtt 60ms --rate 200mbit --loss 0.01 -- COMMAND [ARG...]

brings the link up, runs COMMAND in the *host* namespaces with these variables
set, prints the link counters on stderr at the end and exits with COMMAND's
status:

    NEURALCACHE_WAN_HUB_NS      name of the hub namespace (use: nsenter --net=/var/run/netns/$NAME)
    NEURALCACHE_WAN_SPOKE_NS    name of the spoke namespace
    NEURALCACHE_WAN_HUB_ADDR    the hub's address (198.18.0.1)
    NEURALCACHE_WAN_SPOKE_ADDR  the spoke's address (198.18.0.2)

COMMAND gets its own process group; SIGINT/SIGTERM/SIGHUP to the emulator
stops that group (SIGTERM, SIGKILL after 5 s) and then tears the link down.
``--check`` instead of a command measures RTT and rate over the link (see
``bench.wan_check``).

Socket buffers: ``tcp_rmem``/``tcp_wmem`` are raised in both namespaces so
that autotuned TCP reaches line rate at 900 ms. ``net.core.rmem_max`` cannot be
changed inside a namespace on this kernel, and we do not change the host's, so
a socket that sets ``SO_RCVBUF``/``SO_SNDBUF`` explicitly is capped there (4 MiB
here); use :func:`force_socket_buffers` (``SO_*BUFFORCE``, root) instead.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from fcntl import ioctl
from pathlib import Path
from types import FrameType, TracebackType

HUB = "hub"
SPOKE = "spoke"
SIDES = (HUB, SPOKE)
HUB_ADDR = "198.18.0.1"  # RFC 2544 benchmarking range: never routed anywhere real
SPOKE_ADDR = "198.18.0.2"
DEVICE = "wan0"  # name of the TUN device inside each namespace
NETNS_DIR = Path("/var/run/netns")  # where `ip netns` keeps its namespace handles
NS_PREFIX = "ncw"
NS_NAME_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-(\d+)-({HUB}|{SPOKE})$")
TUN_NAME_TEMPLATE = b"ncw%d"  # the kernel picks a free number under its own lock
TUN_TXQUEUELEN = 5000  # packets the kernel holds per TUN while the forwarder is busy; kept
# well above TCP's small-queue limit (~700 MTU packets) so the only tail drop is our queue
MIN_QUEUE_PACKETS = 32  # floor of the default queue, so a tiny-BDP link still absorbs bursts
TCP_BUFFER_MAX = 128 * 1024 * 1024  # autotuning ceiling: 2x BDP of 900 ms at 500 Mbit/s
FORWARDER_TIMEOUT = 10.0  # seconds to wait for the forwarder to start or answer
CHILD_STOP_TIMEOUT = 5.0  # seconds COMMAND gets to exit after SIGTERM before SIGKILL
ENV_HUB_NS = "NEURALCACHE_WAN_HUB_NS"
ENV_SPOKE_NS = "NEURALCACHE_WAN_SPOKE_NS"
ENV_HUB_ADDR = "NEURALCACHE_WAN_HUB_ADDR"
ENV_SPOKE_ADDR = "NEURALCACHE_WAN_SPOKE_ADDR"

DEFAULT_MTU = 1500
"""The link's packet size: an Ethernet path's, as on a real WAN."""
_TUNSETIFF = 0x400454CA  # _IOW('T', 202, int) from <linux/if_tun.h>
_IFF_TUN = 0x0001  # layer-3 device: reads/writes are bare IP packets
_IFF_NO_PI = 0x1000  # no 4-byte packet-info header in front of each packet
_IFF_VNET_HDR = 0x4000  # a virtio_net_hdr in front of each packet instead (bench.wan_gso)
_TUNSETOFFLOAD = 0x400454D0  # _IOW('T', 208, unsigned int)
_TUN_OFFLOADS = 0x01 | 0x02  # TUN_F_CSUM | TUN_F_TSO4: TCP bursts cross as one frame each
_CLONE_NEWNET = 0x40000000  # setns(2) nstype for network namespaces
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # <asm-generic/socket.h>; Python
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # does not export these two
_instance_counter = itertools.count()

_RTT_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_QUANTITY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]+)\s*$")


def _parse_quantity(text: str, units: dict[str, float], what: str) -> float:
    match = _QUANTITY_RE.match(text)
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"bad {what} {text!r}: expected a number and one of {sorted(units)}")
    return float(match.group(1)) * units[match.group(2).lower()]


def parse_rtt(text: str) -> float:
    """``"60ms"`` -> 0.06 seconds; units us, ms, s (a unit is required)."""
    return _parse_quantity(text, _RTT_UNITS, "time")


def parse_rate(text: str) -> float:
    """``"200mbit"`` -> 2e8 bits/s; units bit, kbit, mbit, gbit (decimal, like tc)."""
    return _parse_quantity(text, _RATE_UNITS, "rate")


@dataclass(frozen=True)
class LinkSpec:
    """What the link looks like; every figure applies to each direction."""

    rtt: float  # seconds, round trip (each direction gets rtt/2)
    rate_bps: float  # bits per second, each direction
    loss: float = 0.0  # random loss probability per packet, each direction
    queue_bytes: int | None = None  # tail-drop queue bound per direction; default derived from BDP
    mtu: int = DEFAULT_MTU
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.rtt < 0 or self.rate_bps <= 0 or not 0.0 <= self.loss < 1.0:
            raise ValueError(f"invalid link {self}")
        if not 576 <= self.mtu <= 65535:  # 576: the IPv4 minimum every host must accept
            raise ValueError(f"MTU {self.mtu} outside 576..65535")
        if self.queue_bytes is not None and self.queue_bytes < self.mtu:
            raise ValueError(
                f"queue of {self.queue_bytes} bytes cannot hold one {self.mtu}-byte packet"
            )

    @property
    def bdp_bytes(self) -> int:
        """Bandwidth-delay product: bytes in flight to fill the pipe."""
        return int(self.rate_bps * self.rtt / 8)

    @property
    def bursts(self) -> bool:
        """Whether TCP bursts cross the link as one frame each (``bench.wan_gso``): only on a
        link without random loss. With loss every flow has an unrepaired lost segment most of
        the time, so its segments are written one by one anyway, and handling the frames cost
        the forwarder more than it saved (docs/wan-emulator.md, "Measured")."""
        return self.loss == 0

    @property
    def effective_queue_bytes(self) -> int:
        """The queue bound used: as given, else one BDP (at least a few packets)."""
        if self.queue_bytes is not None:
            return self.queue_bytes
        return max(self.bdp_bytes, MIN_QUEUE_PACKETS * self.mtu)


def _run(argv: list[str], stdin: str | None = None) -> None:
    subprocess.run(argv, input=stdin, text=True, check=True, capture_output=True)


def _namespace_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove ``ncw-*`` namespaces whose creating process is dead; return their names.

    A process killed with SIGKILL cannot clean up after itself; this is the
    safety net. Namespaces of live processes (including other emulators) are
    left alone.
    """
    removed = []
    for name in _namespace_names():
        match = NS_NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


def _create_tun(bursts: bool) -> tuple[int, str]:
    """Open a new TUN device in the current namespace; return (fd, kernel-chosen name). With
    ``bursts``, TCP bursts cross it as one frame each (``bench.wan_gso``)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        request = struct.pack("16sH22x", TUN_NAME_TEMPLATE, _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR)
        reply = ioctl(fd, _TUNSETIFF, request)
        ioctl(fd, _TUNSETOFFLOAD, _TUN_OFFLOADS if bursts else 0)
    except OSError:
        os.close(fd)
        raise
    return fd, reply[:16].rstrip(b"\0").decode()


def _setns_net(ns_path: str) -> None:
    with open(ns_path, "rb") as handle:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(handle.fileno(), os.CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), ns_path)


def socket_in_netns(
    ns_path: str,
    family: int = socket.AF_INET,
    type: int = socket.SOCK_STREAM,  # noqa: A002 - same name as socket.socket's parameter
    proto: int = 0,
) -> socket.socket:
    """Create a socket that lives in the network namespace at ``ns_path``.

    A socket belongs to the namespace of the thread that created it, forever;
    so a throw-away thread joins the namespace, creates it and exits, and the
    caller's threads never leave the host namespace.
    """
    result: list[socket.socket | BaseException] = []

    def create() -> None:
        try:
            _setns_net(ns_path)
            result.append(socket.socket(family, type, proto))
        except BaseException as exc:  # re-raised in the caller's thread
            result.append(exc)

    thread = threading.Thread(target=create, name="socket-in-netns")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def force_socket_buffers(sock: socket.socket, nbytes: int) -> None:
    """Set send and receive buffers to ``nbytes``, past ``rmem_max`` (needs root)."""
    sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, nbytes)
    sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, nbytes)


class WanLink:
    """Context manager: namespaces, TUN devices and forwarder for one link."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        base = f"{NS_PREFIX}-{os.getpid()}-{next(_instance_counter)}"
        self.hub_ns = f"{base}-{HUB}"
        self.spoke_ns = f"{base}-{SPOKE}"
        self.hub_addr = HUB_ADDR
        self.spoke_addr = SPOKE_ADDR
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._final_stats: dict | None = None
        self._control_lock = threading.Lock()  # one request/answer on the control socket at a time

    @property
    def forwarder_pid(self) -> int | None:
        """Pid of the forwarder process while the link is up (to watch its CPU use)."""
        return None if self._forwarder is None else self._forwarder.pid

    # -- naming helpers ------------------------------------------------
    def _ns(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        return self.hub_ns if side == HUB else self.spoke_ns

    def netns_path(self, side: str) -> str:
        """``/var/run/netns/NAME`` of ``side``, for ``nsenter --net=`` or setns(2)."""
        return str(NETNS_DIR / self._ns(side))

    def command(self, side: str, argv: list[str], *, own_mounts: bool = False) -> list[str]:
        """``argv`` wrapped to run in ``side``'s network namespace.

        By default only the network namespace changes (``nsenter --net``), so
        the process sees the host's mounts, FUSE mounts included. With
        ``own_mounts`` it goes through ``ip netns exec``, which also gives it a
        private mount namespace with /sys and /etc/netns/NAME remounted.
        """
        if own_mounts:
            return ["ip", "netns", "exec", self._ns(side), *argv]
        return ["nsenter", f"--net={self.netns_path(side)}", "--", *argv]

    def socket(
        self,
        side: str,
        family: int = socket.AF_INET,
        type: int = socket.SOCK_STREAM,  # noqa: A002 - mirrors socket.socket
    ) -> socket.socket:
        """A socket living in ``side``'s namespace (see :func:`socket_in_netns`)."""
        return socket_in_netns(self.netns_path(side), family, type)

    def env(self) -> dict[str, str]:
        """The ``NEURALCACHE_WAN_*`` variables describing this link."""
        return {
            ENV_HUB_NS: self.hub_ns,
            ENV_SPOKE_NS: self.spoke_ns,
            ENV_HUB_ADDR: self.hub_addr,
            ENV_SPOKE_ADDR: self.spoke_addr,
        }

    # -- lifecycle -----------------------------------------------------
    def __enter__(self) -> WanLink:
        cleanup_stale()
        try:
            self._bring_up()
        except BaseException:
            self._tear_down()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._tear_down()

    def _configure_namespace(self, side: str, tun_name: str) -> None:
        ns = self._ns(side)
        local, peer = (HUB_ADDR, SPOKE_ADDR) if side == HUB else (SPOKE_ADDR, HUB_ADDR)
        tcp_max = max(TCP_BUFFER_MAX, 4 * self.spec.bdp_bytes)
        _run([
            "ip", "netns", "exec", ns, "sysctl", "-q", "-w",
            # Autotuning may grow TCP buffers to >= 2 BDP, so one stream fills the pipe.
            f"net.ipv4.tcp_rmem=4096 131072 {tcp_max}",
            f"net.ipv4.tcp_wmem=4096 16384 {tcp_max}",
            # Each connection starts fresh instead of inheriting a lossy run's ssthresh.
            "net.ipv4.tcp_no_metrics_save=1",
            # No IPv6 router/neighbour chatter on the link, so counters show only our traffic.
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ])
        _run(["ip", "link", "set", tun_name, "netns", ns])
        _run(["ip", "-n", ns, "-batch", "-"], stdin="\n".join([
            "link set lo up",
            f"link set {tun_name} name {DEVICE}",
            f"link set {DEVICE} mtu {self.spec.mtu} txqueuelen {TUN_TXQUEUELEN} up",
            f"addr add {local} peer {peer}/32 dev {DEVICE}",
        ]) + "\n")

    def _bring_up(self) -> None:
        for side in SIDES:
            _run(["ip", "netns", "add", self._ns(side)])
        tun_fds: list[int] = []
        try:
            for side in SIDES:
                fd, name = _create_tun(self.spec.bursts)
                tun_fds.append(fd)
                self._configure_namespace(side, name)
            self._start_forwarder(*tun_fds)
        finally:
            for fd in tun_fds:  # the forwarder holds its own copies now
                os.close(fd)

    def _start_forwarder(self, hub_fd: int, spoke_fd: int) -> None:
        ours, theirs = socket.socketpair()
        self._control = ours
        spec = self.spec
        argv = [
            sys.executable, "-m", "bench.wan_forwarder",
            "--hub-fd", str(hub_fd), "--spoke-fd", str(spoke_fd),
            "--control-fd", str(theirs.fileno()),
            "--delay", repr(spec.rtt / 2), "--rate", repr(spec.rate_bps),
            "--loss", repr(spec.loss), "--queue-bytes", str(spec.effective_queue_bytes),
            *(["--bursts"] if spec.bursts else []),
        ]
        if spec.seed is not None:
            argv += ["--seed", str(spec.seed)]
        # The forwarder imports bench.* from this checkout whatever the caller's cwd.
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        try:
            self._forwarder = subprocess.Popen(
                argv, pass_fds=(hub_fd, spoke_fd, theirs.fileno()), env=env
            )
        finally:
            theirs.close()
        ours.settimeout(FORWARDER_TIMEOUT)
        if self._read_line() != "ready":
            raise RuntimeError("WAN forwarder did not start")

    def _read_line(self) -> str:
        assert self._control is not None
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._control.recv(65536)
            if not chunk:
                raise RuntimeError("WAN forwarder exited unexpectedly")
            data += chunk
        return data.decode().strip()

    def _tear_down(self) -> None:
        """Stop the forwarder (keeping its last counters), remove both namespaces."""
        try:
            if self._control is not None:
                try:
                    with self._control_lock:
                        self._control.sendall(b"q")
                        self._final_stats = json.loads(self._read_line())
                except (OSError, RuntimeError, ValueError):
                    pass  # forwarder already dead: no counters to keep
                self._control.close()
                self._control = None
            if self._forwarder is not None:
                try:
                    self._forwarder.wait(timeout=FORWARDER_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self._forwarder.kill()
                    self._forwarder.wait()
                self._forwarder = None
        finally:
            for side in SIDES:
                _delete_namespace(self._ns(side))

    def stats(self) -> dict:
        """Per-direction counters (``hub_to_spoke``, ``spoke_to_hub``).

        Each direction has ``forwarded_``, ``lost_`` and ``queue_dropped_``
        ``packets``/``bytes``, ``in_flight_packets`` and ``write_errors``; plus
        ``elapsed`` seconds since the forwarder started. After exit, the final
        counters.
        """
        if self._control is None:
            if self._final_stats is None:
                raise RuntimeError("link is not up and has no final counters")
            return self._final_stats
        with self._control_lock:
            self._control.sendall(b"s")
            return json.loads(self._read_line())


def format_stats(stats: dict) -> str:
    """Counters as a small human-readable table."""
    lines = [f"link up {stats['elapsed']:.2f} s"]
    for direction in ("hub_to_spoke", "spoke_to_hub"):
        d = stats[direction]
        offered = d["forwarded_packets"] + d["lost_packets"] + d["queue_dropped_packets"]
        lost_pct = 100.0 * d["lost_packets"] / offered if offered else 0.0
        lines.append(
            f"{direction:>12}: forwarded {d['forwarded_packets']} pkts / {d['forwarded_bytes']} B, "
            f"lost {d['lost_packets']} ({lost_pct:.2f} %), "
            f"queue-dropped {d['queue_dropped_packets']}, in flight {d['in_flight_packets']}, "
            f"write errors {d['write_errors']}"
        )
    return "\n".join(lines)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Terminated(Exception):
    """Raised from the signal handler so ``with`` blocks unwind and clean up."""


_held_signals: list[int] | None = None
"""While COMMAND is being started, the stop signals received (see :func:`_run_command`)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats: a second Ctrl-C must not interrupt the cleanup it started.
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    if _held_signals is not None:
        _held_signals.append(signum)
        return
    raise _Terminated(signum)


def _spec_from_args(args: argparse.Namespace) -> LinkSpec:
    rtt = parse_rtt(args.rtt)
    rate = parse_rate(args.rate)
    queue = None if args.queue_ms is None else int(rate * args.queue_ms / 1000 / 8)
    return LinkSpec(rtt=rtt, rate_bps=rate, loss=args.loss, queue_bytes=queue,
                    mtu=args.mtu, seed=args.seed)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.wan",
        description="Run COMMAND with an emulated WAN link between two network namespaces.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "COMMAND runs in the host namespaces with:\n"
            f"  {ENV_HUB_NS}, {ENV_SPOKE_NS}  namespace names\n"
            "      (run a program there: nsenter --net=/var/run/netns/$NAME PROGRAM)\n"
            f"  {ENV_HUB_ADDR}={HUB_ADDR}, {ENV_SPOKE_ADDR}={SPOKE_ADDR}\n"
            "COMMAND runs in its own process group; on SIGINT/SIGTERM/SIGHUP the group gets\n"
            "SIGTERM (then SIGKILL after 5 s) and the link is torn down.\n"
            "Link counters are printed on stderr at the end; the exit status is COMMAND's."
        ),
    )
    parser.add_argument("--rtt", required=True, help="round-trip time, e.g. 60ms (us, ms, s)")
    parser.add_argument("--rate", required=True, help="rate per direction, e.g. 200mbit")
    parser.add_argument("--loss", type=float, default=0.0, help="loss probability per packet")
    parser.add_argument("--queue-ms", type=float, default=None,
                        help="tail-drop queue bound in ms at the rate (default: 1 BDP)")
    parser.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    parser.add_argument("--seed", type=int, default=None, help="seed of the loss RNG")
    parser.add_argument("--check", action="store_true",
                        help="instead of COMMAND, measure RTT and rate and print asked vs measured")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    return parser


def _run_command(link: WanLink, command: list[str]) -> int:
    """Run COMMAND with the link's variables; on a stop signal, end its whole group.

    COMMAND gets its own process group (like timeout(1)) so that a shell's
    grandchildren are stopped with it and do not outlive the link. A stop signal
    while it is being started is held until it can be stopped: raised inside
    ``Popen`` (while it waits for the exec, long on a loaded machine), it would leave a
    running COMMAND that no one stops, holding the caller's pipes open.
    """
    global _held_signals
    _held_signals = []
    try:
        child = subprocess.Popen(command, env={**os.environ, **link.env()}, process_group=0)
    except BaseException:
        _held_signals = None
        raise
    try:
        held, _held_signals = _held_signals, None
        if held:
            raise _Terminated(held[0])
        return child.wait()
    except _Terminated:
        _stop_group(child)
        raise


def _stop_group(child: subprocess.Popen[bytes]) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=CHILD_STOP_TIMEOUT)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.check and not command:
        parser.error("give -- COMMAND, or --check")
    try:
        spec = _spec_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_terminated)
    link = WanLink(spec)
    try:
        with link:
            if args.check:
                from bench.wan_check import check_link, format_check

                print(format_check(spec, check_link(link)))
                rc = 0
            else:
                rc = _run_command(link, command)
    except _Terminated as exc:
        rc = 128 + exc.args[0]
    try:
        print(format_stats(link.stats()), file=sys.stderr)
    except RuntimeError:
        pass  # the link never came up: the exception above says why
    return rc


if __name__ == "__main__":
    sys.exit(main())
