"""The ``neuralcache`` command: hub, kernel-cc, mount, umount, demo and the rest."""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time

import trio

from fabric.client import HubUnavailable
from fabric.export import Export
from fabric.heap import keep_freed_buffers
from fabric.metrics import serve_metrics
from fabric.transport import kernel_cc

from . import config, control_commands, sd_notify
from .daemon import (DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_RTT, MountError, SpokeConfig,
                     run_spoke)
from .namespace import NamespaceError
from .runtime import CacheBusyError, pid_alive, read_record

log = logging.getLogger("neuralcache")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

UMOUNT_WAIT = 60.0
"""Seconds ``umount`` waits for the daemon to flush its cache and exit."""

_FAILURES = (HubUnavailable, MountError, NamespaceError, CacheBusyError, OSError)


def parse_size(text: str) -> int:
    """'512M', '10GiB', '1.5g' or a byte count -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 20G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --- hub -------------------------------------------------------------------------------------

async def _run_hub(export: Export, host: str, port: int, metrics_port: int | None,
                   tcp_congestion: str) -> None:
    # Imported here so a spoke does not register hub metrics.
    from fabric.hub import HubServer
    from fabric.hub_metrics import REGISTRY
    if metrics_port is not None:
        serve_metrics(metrics_port, host, REGISTRY)
    server = HubServer(export, tcp_congestion=tcp_congestion)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(server.serve, host, port)
        bound = listeners[0].socket.getsockname()
        print(f"hub: serving {export.root} on {bound[0]}:{bound[1]}", flush=True)
        sd_notify.notify(READY=1, STATUS=f"serving {export.root} on {bound[0]}:{bound[1]}")


def cmd_hub(args: argparse.Namespace) -> int:
    host, port = args.listen
    keep_freed_buffers()
    try:
        bulk_congestion = kernel_cc.bulk_congestion(args.tcp_congestion)
    except kernel_cc.KernelCCError as exc:
        print(f"neuralcache hub: cannot load {kernel_cc.NAME}: {exc}", file=sys.stderr)
        return 1
    log.info("hub: bulk connections run TCP congestion control %s", bulk_congestion)
    export = Export(args.export)
    started = time.monotonic()
    entries = export.scan()  # reads are served by file id, so know the files before listening
    log.info("hub: scanned %d entries of %s in %.1f s", len(entries), export.root,
             time.monotonic() - started)
    trio.run(_run_hub, export, host, port, args.metrics_port, bulk_congestion)
    return 0


def cmd_kernel_cc(args: argparse.Namespace) -> int:
    try:
        kernel_cc.load()
    except kernel_cc.KernelCCError as exc:
        print(f"neuralcache kernel-cc: cannot load {kernel_cc.NAME}: {exc}", file=sys.stderr)
        return 1
    print(f"{kernel_cc.NAME} is loaded; hubs (of any user) may use it", flush=True)
    return 0


# --- mount / umount --------------------------------------------------------------------------

def _config(args: argparse.Namespace) -> SpokeConfig:
    host, port = args.hub
    return SpokeConfig(hub_host=host, hub_port=port, cache_dir=os.path.abspath(args.cache_dir),
                       cache_size=args.cache_size, mountpoint=os.path.abspath(args.mountpoint),
                       metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                       connect_timeout=args.connect_timeout, hub_timeout=args.hub_timeout,
                       allow_other=os.geteuid() == 0, prefetch=args.prefetch,
                       record_trace=os.path.abspath(args.record_trace) if args.record_trace
                       else None,
                       link_bandwidth=args.link_bandwidth * 1e6 / 8, link_rtt=args.link_rtt / 1e3,
                       loop_steps=args.loop_steps)


def _mount_foreground(args: argparse.Namespace) -> int:
    ready_fd = args.ready_fd

    def tell(line: str) -> None:
        if ready_fd is not None:
            os.write(ready_fd, (line + "\n").encode())
            os.close(ready_fd)

    def ready(message: str) -> None:
        log.info("%s", message)
        tell(f"ok {message}")

    failures: list[BaseException] = []
    keep_freed_buffers()
    try:
        trio.run(run_spoke, _config(args), ready)
    except* _FAILURES as group:
        failures.extend(group.exceptions)
    if failures:
        message = "; ".join(str(e) for e in failures)
        log.error("mount failed: %s", message)
        tell(f"error {message}")
        return 1
    return 0


def _mount_background(args: argparse.Namespace) -> int:
    """Re-run as a foreground daemon in a new session; return once it is mounted (or failed)."""
    log_file = args.log_file or os.path.join(os.path.abspath(args.cache_dir), "neuralcache.log")
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    read_end, write_end = os.pipe()
    argv = [sys.executable, "-m", "fuse_mount.cli", *sys.argv[1:], "--foreground",
            "--ready-fd", str(write_end)]
    with open(log_file, "ab") as log_out:
        started_at = os.fstat(log_out.fileno()).st_size
        # A detached daemon is not the caller's service: it must not notify the caller's manager.
        env = {k: v for k, v in os.environ.items() if k != sd_notify.NOTIFY_SOCKET}
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out,
                         pass_fds=(write_end,), start_new_session=True, env=env)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        line = answer.readline().strip()
    status, _, message = line.partition(" ")
    if status == "ok":
        print(f"neuralcache: {message}", flush=True)  # before the warnings on stderr
        for warning in _logged_warnings(log_file, started_at):
            print(f"neuralcache: {warning}", file=sys.stderr)
        return 0
    print(f"neuralcache: mount failed: {message or 'daemon exited; see ' + log_file}",
          file=sys.stderr)
    return 1


_WARNING_LINE = re.compile(r"^\S+ \S+ (WARNING|ERROR) [\w.]+: (.*)$")
"""A warning or error as ``logging.basicConfig``'s format above writes it to the daemon's log."""


def _logged_warnings(log_file: str, offset: int) -> list[str]:
    """The warnings and errors the daemon logged while it mounted (after ``offset``): a
    background mount's terminal shows them, not only its log (an old cache replaced, a cache
    too large for its disk, no BBR)."""
    with open(log_file, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    return [f"{m[1].lower()}: {m[2]}" for m in map(_WARNING_LINE.match, lines) if m]


def cmd_mount(args: argparse.Namespace) -> int:
    return _mount_foreground(args) if args.foreground else _mount_background(args)


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = os.path.realpath(args.mountpoint)
    record = read_record(mountpoint)
    result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"neuralcache: umount {mountpoint} failed: {result.stderr.strip()}", file=sys.stderr)
        return 1
    if record is not None:
        deadline = time.monotonic() + UMOUNT_WAIT
        while pid_alive(record.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(record.pid):
            print(f"neuralcache: daemon {record.pid} still running after {UMOUNT_WAIT:g} s",
                  file=sys.stderr)
            return 1
    print(f"neuralcache: unmounted {mountpoint}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args.workdir, keep=args.keep)


# --- parser ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuralcache", description=__doc__)
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file of option defaults; flags override it "
                             f"[${config.CONFIG_ENV} or {config.DEFAULT_PATH} if present]")
    sub = parser.add_subparsers(dest="command", required=True)

    hub = sub.add_parser("hub", help="export a directory to spokes")
    hub.add_argument("--export", required=True, help="directory to export (read-only)")
    hub.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 7070),
                     help="HOST:PORT to listen on (port 0 picks a free one) [127.0.0.1:7070]")
    hub.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    hub.add_argument("--tcp-congestion", default=kernel_cc.AUTO,
                     help=f"TCP congestion control of bulk connections: {kernel_cc.AUTO} "
                          f"({kernel_cc.NAME}, which only follows the spoke's pacing, loaded "
                          f"if it can be, else {kernel_cc.FALLBACK}), {kernel_cc.NAME} (fail "
                          f"if it cannot be loaded) or a kernel name [{kernel_cc.AUTO}]")
    hub.set_defaults(func=cmd_hub)

    kcc = sub.add_parser(
        "kernel-cc",
        help=f"load {kernel_cc.NAME}, the hub's kernel congestion control (as root, before a "
             "hub that is not)")
    kcc.set_defaults(func=cmd_kernel_cc)

    mount = sub.add_parser("mount", help="mount a hub's export through a local cache")
    mount.add_argument("mountpoint")
    mount.add_argument("--hub", type=parse_hostport, required=True, help="hub HOST:PORT")
    mount.add_argument("--cache-dir", required=True, help="local directory (NVMe) for the cache")
    mount.add_argument("--cache-size", type=parse_size, default=parse_size("10G"),
                       help="cache size limit, e.g. 512M or 200G [10G]")
    mount.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    mount.add_argument("--metrics-addr", default="127.0.0.1",
                       help="address for the metrics endpoint [127.0.0.1]")
    mount.add_argument("--connect-timeout", type=float, default=10.0,
                       help="give up mounting if the hub does not answer in this many s [10]")
    mount.add_argument("--hub-timeout", type=float, default=60.0,
                       help="a read that cannot reach the hub fails with EIO after this "
                            "many s [60]")
    mount.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                       help="predict reads and fetch ahead of them [on]")
    mount.add_argument("--record-trace", metavar="FILE",
                       help="record every read and hint to FILE for offline replay "
                            "(python -m bench.prefetch_eval --trace FILE)")
    mount.add_argument("--link-bandwidth", type=float, metavar="MBIT",
                       default=DEFAULT_LINK_BANDWIDTH * 8 / 1e6,
                       help="hub link bandwidth the prefetcher plans with until it is measured, "
                            "Mbit/s [%(default)g]")
    mount.add_argument("--link-rtt", type=float, metavar="MS", default=DEFAULT_LINK_RTT * 1e3,
                       help="hub link round trip the prefetcher plans with until it is measured, "
                            "ms [%(default)g]")
    mount.add_argument("--loop-steps", action="store_true",
                       help="count the event loop's steps of 1 ms or more, by task, in the "
                            "metrics (a diagnostic; costs every step a little) [off]")
    mount.add_argument("--foreground", action="store_true", help="stay in the foreground")
    mount.add_argument("--log-file",
                       help="daemon log in background mode [CACHE_DIR/neuralcache.log]")
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount.set_defaults(func=cmd_mount)

    umount = sub.add_parser("umount", help="unmount and wait for the daemon to flush its cache")
    umount.add_argument("mountpoint")
    umount.set_defaults(func=cmd_umount)

    demo = sub.add_parser("demo", help="hub + spoke on loopback over a generated dataset")
    demo.add_argument("--workdir", help="where to put the dataset and cache [a temp dir]")
    demo.add_argument("--keep", action="store_true", help="keep the work directory")
    demo.set_defaults(func=cmd_demo)

    control_commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = config.parse_args(build_parser(), argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except _FAILURES as exc:
        print(f"neuralcache: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
