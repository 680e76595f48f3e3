"""What a spoke learned about its path to a hub, kept across restarts (careful resume).

A spoke's path to its hub is the same two regions and, most days, the same link; BBR's STARTUP
learns it again from the initial window on every connect, ten or more round trips (9-13 s at
900 ms, docs/transport.md). The client keeps its controller's model in a small JSON file (the
mount keeps it beside its cache) and a later client starts from it when the path still looks
the same: the same hub, the same controller, a recent record, and a greeting round trip close
to the one remembered. The controller then starts from half the remembered bandwidth and lets
its own samples confirm it (``fabric.congestion.bbr.RESUME_ROUNDS``), as
draft-ietf-tsvwg-careful-resume does for TCP and QUIC.

Plain functions over a file: the client runs them in a worker thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_AGE = 24 * 3600.0
"""Seconds after which a record is not used: a day covers a node's restarts and remounts
within one training run; links are re-provisioned on longer scales, and then the controller
learns the path again as it would without a record."""

RTT_MATCH = 0.5
"""A record is for the path in use only if the greeting's round trip now is within this share
of the one remembered, either way (or within ``RTT_SLACK``): a different route or a different
hub site has a different delay, and its bandwidth says nothing about this one."""

RTT_SLACK = 0.005
"""Seconds of greeting round-trip difference accepted whatever the share: on a path of a few
milliseconds (a LAN, loopback) scheduling noise alone moves it by more than half."""


@dataclass(frozen=True)
class PathRecord:
    """One path's model: where to, which controller measured it, and when."""

    hub: str  # "host:port" as the client dials it
    controller: str  # the congestion controller's name ("bbr")
    btl_bw: float  # bytes/s
    hello_rtt: float  # seconds, the greeting's round trip when the model was kept
    saved_at: float  # Unix time

    def matches(self, hub: str, controller: str, hello_rtt: float, now: float) -> str | None:
        """Why this record must not be used for ``hub`` now, or None if it may."""
        if hub != self.hub or controller != self.controller:
            return "other_path"
        if not 0 <= now - self.saved_at <= MAX_AGE:
            return "expired"
        if abs(hello_rtt - self.hello_rtt) > max(RTT_MATCH * self.hello_rtt, RTT_SLACK):
            return "rtt_changed"
        return None


def load_record(path: Path) -> PathRecord | None:
    """The record kept at ``path``; None if there is none or it cannot be read (logged: the
    client then learns the path from scratch, which is always safe)."""
    try:
        raw = json.loads(path.read_text())
        record = PathRecord(hub=str(raw["hub"]), controller=str(raw["controller"]),
                            **{k: float(raw[k]) for k in
                               ("btl_bw", "hello_rtt", "saved_at")})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring the path record %s (%s); the link's model is learnt afresh",
                    path, exc)
        return None
    if not all(math.isfinite(v) and v > 0 for v in
               (record.btl_bw, record.hello_rtt)):
        log.warning("ignoring the path record %s (values out of range)", path)
        return None
    return record


def save_record(path: Path, record: PathRecord) -> None:
    """Replace the record at ``path`` atomically (a crash leaves the old one or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)
