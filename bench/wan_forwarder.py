"""The WAN emulator's packet forwarder: a separate process moving IP packets
between the hub's and the spoke's TUN devices through two ``LinkDirection``
shapers.

It is started by :class:`bench.wan.WanLink` with the TUN file descriptors and
one end of a control socket inherited (``pass_fds``); it is not meant to be run
by hand. It runs in its own process so the caller's event loop and GIL are not
loaded by per-packet work.

Control protocol (one byte per command on the control socket):

* ``s`` - reply with one JSON line of per-direction counters;
* ``q`` - reply with the final JSON line and exit;
* EOF  - the owner is gone: exit at once (the TUN devices vanish with our fds).

On start the forwarder writes ``ready\\n`` so the owner knows it is running.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import select
import signal
import socket
import time
from dataclasses import dataclass

from bench.wan_gso import VNET_HDR, FrameError, Holes, pieces, segment_sizes, tcp_flow
from bench.wan_shaper import LinkDirection

READ_BATCH = 256  # packets read from one TUN per wakeup: amortises select() without
# starving the other direction
READ_SIZE = 65536 + VNET_HDR.size  # bytes asked per read(); a TUN read returns one frame:
# a virtio_net_hdr and one packet, a TCP burst of up to 64 KiB (bench.wan_gso) or a plain one
CONTROL_READ = 64  # bytes of control commands read at once
EARLY_WAKE = 0.001  # seconds: a long sleep ends this much early and a short one follows,
# because waking from a long idle here is ~0.2 ms late while a short sleep is ~0.07 ms late
DELIVERY_WINDOW = 0.0005
"""Seconds: a wake-up delivers every packet due within this much of now, together. At
200 Mbit/s a 1500-byte packet is due every 60 us, and a wake-up per packet (a select, the
shapers' bookkeeping) cost more than the packet's own read and write: the forwarder took
0.64 of a core at 200 Mbit/s on this 2-core host. A packet may now arrive up to this much
before its time, against a one-way delay of tens of milliseconds."""
HUB_TO_SPOKE = "hub_to_spoke"
SPOKE_TO_HUB = "spoke_to_hub"


@dataclass
class _Path:
    """One direction: where packets come from, where they go, what shapes them."""

    name: str
    in_fd: int
    out_fd: int
    shaper: LinkDirection
    holes: Holes | None  # None where the devices hand over no bursts: nothing to cut
    write_errors: int = 0


def _stats(paths: list[_Path], started: float) -> dict:
    out: dict = {"elapsed": time.monotonic() - started}
    for path in paths:
        entry = path.shaper.counters.as_dict()
        entry["in_flight_packets"] = path.shaper.in_flight_packets
        entry["write_errors"] = path.write_errors
        out[path.name] = entry
    return out


def _deliver(path: _Path, now: float) -> None:
    for packet in path.shaper.due(now):
        try:
            os.write(path.out_fd, packet)
        except OSError:
            # The far stack refused the packet (e.g. its backlog is full): a
            # real link would lose it too; count it so tests can see it.
            path.write_errors += 1


def _read_batch(path: _Path) -> None:
    now = time.monotonic()
    for _ in range(READ_BATCH):
        try:
            frame = os.read(path.in_fd, READ_SIZE)
        except BlockingIOError:
            return
        _offer(path.shaper, path.holes, now, frame)


def _offer(shaper: LinkDirection, holes: Holes | None, now: float, frame: bytes) -> None:
    """Put ``frame``'s segments through the link. What it admits goes out whole, unless its
    flow has a hole: then each admitted segment goes out on its own (``Holes``)."""
    try:
        sizes = segment_sizes(frame)
    except FrameError:  # not ours to cut: one packet of its size, as it came
        sizes = [len(frame) - VNET_HDR.size]
    arrivals = shaper.admit(now, sizes)
    split = False
    if holes is not None and (holes or None in arrivals):
        flow = tcp_flow(frame)
        if flow is not None:
            key, seq, header = flow
            split = holes.update(key, seq, sizes, header, [a is not None for a in arrivals])
    if not split and None not in arrivals:
        shaper.schedule(arrivals[-1], frame, len(sizes), sum(sizes))
        return
    admitted = [i for i, arrival in enumerate(arrivals) if arrival is not None]
    if len(sizes) == 1:
        for i in admitted:
            shaper.schedule(arrivals[i], frame, 1, sizes[i])
        return
    for i, one in zip(admitted, pieces(frame, [(i, i + 1) for i in admitted])):
        shaper.schedule(arrivals[i], one, 1, sizes[i])


def run(paths: list[_Path], control: socket.socket) -> None:
    """Forward until the control socket says quit or closes."""
    started = time.monotonic()
    control.sendall(b"ready\n")
    by_fd = {path.in_fd: path for path in paths}
    control_fd = control.fileno()
    watched = [control_fd, *by_fd]
    while True:
        now = time.monotonic()
        wakeup = None
        for path in paths:
            _deliver(path, now + DELIVERY_WINDOW)
            due = path.shaper.next_wakeup()
            if due is not None and (wakeup is None or due < wakeup):
                wakeup = due
        # select() takes a timeval (microseconds), unlike poll/epoll (milliseconds),
        # which matters when packets leave every ~60 us at 200 Mbit/s.
        timeout = None if wakeup is None else max(0.0, wakeup - time.monotonic())
        if timeout is not None and timeout > 2 * EARLY_WAKE:
            timeout -= EARLY_WAKE
        ready, _, _ = select.select(watched, [], [], timeout)
        for fd in ready:
            if fd != control_fd:
                _read_batch(by_fd[fd])
                continue
            commands = control.recv(CONTROL_READ)
            if not commands:
                return
            for command in commands.decode("ascii", "replace"):
                if command in "sq":
                    line = json.dumps(_stats(paths, started)) + "\n"
                    control.sendall(line.encode())
                if command == "q":
                    return


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hub-fd", type=int, required=True)
    parser.add_argument("--spoke-fd", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--delay", type=float, required=True, help="one-way delay, seconds")
    parser.add_argument("--rate", type=float, required=True, help="bits per second")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--queue-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--bursts", action="store_true",
                        help="the TUN devices hand over TCP bursts (bench.wan_gso)")
    return parser.parse_args(argv)


def _rng(seed: int | None, direction: str) -> random.Random:
    # Each direction draws from its own stream so that traffic in one
    # direction does not change which packets are lost in the other.
    return random.Random(None if seed is None else f"{seed}/{direction}")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    # The owner handles Ctrl-C and asks us for final stats; dying on the
    # terminal's SIGINT first would lose them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The loop creates no reference cycles; the cyclic GC would only add pauses.
    gc.disable()
    for fd in (args.hub_fd, args.spoke_fd):
        os.set_blocking(fd, False)

    def shaper(direction: str) -> LinkDirection:
        return LinkDirection(
            rate_bps=args.rate,
            delay=args.delay,
            queue_bytes=args.queue_bytes,
            loss=args.loss,
            rng=_rng(args.seed, direction),
        )

    paths = [
        _Path(HUB_TO_SPOKE, args.hub_fd, args.spoke_fd, shaper(HUB_TO_SPOKE),
              Holes() if args.bursts else None),
        _Path(SPOKE_TO_HUB, args.spoke_fd, args.hub_fd, shaper(SPOKE_TO_HUB),
              Holes() if args.bursts else None),
    ]
    with socket.socket(fileno=args.control_fd) as control:
        try:
            run(paths, control)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the owner went away while we answered: nothing left to tell


if __name__ == "__main__":
    main()
