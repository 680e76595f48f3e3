"""Where a spoke run's WAN bytes went: one line per run, from the figures a run already keeps.

A cold run should move each byte it reads over the link about once. When it moves more, the
parts below say where the rest came from: FUSE reads larger than the loader's (kernel
readahead), prefetches never read (wasted), demand requests (each small one is sent twice, see
``fabric.client.HEDGE_COPIES``), or fetches issued twice for the same block. Pure arithmetic over
a ``RunRecord`` (unit-tested in tests/test_repro_smoke.py), printed by ``bench.repro`` after
every spoke run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from bench.repro_data import WINDOW_BYTES
from bench.repro_stats import (DISPATCH_WAIT, EVENTS_DROPPED, EVICTIONS, HUB_REQUESTS,
                               LONG_STEP_SECONDS, LONG_STEPS, MISSES,
                               PREDICTOR_ISSUED, PREDICTOR_USEFUL, PREFETCH_FAILED,
                               PREFETCH_ISSUED, PREFETCH_LATE, PREFETCH_USEFUL, PREFETCH_WASTED,
                               READ_BYTES, READS, RunRecord, Samples, label_values, metric_total)

MB = 1e6


@dataclass(frozen=True)
class Diagnosis:
    """Byte accounting of one spoke run (bytes unless named otherwise)."""

    loader_bytes: int  # what the DataLoader's workers asked for (samples x 16 KiB)
    fuse_bytes: float  # what the kernel asked the mount for (readahead makes it more)
    fuse_reads: float
    wan_bytes: int  # IP bytes hub -> spoke over the loop
    issued: float  # prefetch bytes requested
    useful: float  # prefetched, read after arrival
    late: float  # prefetched, read while in flight (the reader waited for it)
    wasted: float  # prefetched, evicted or expired unread
    failed: float
    miss_bytes: float  # blocks reads found neither cached (includes late)
    demand_requests: float  # demand requests sent to the hub (hedged copies included)
    prefetch_requests: float  # prefetch chunks sent to the hub
    evictions: float  # blocks
    dropped_events: float  # reads the prefetcher never saw
    by_predictor: tuple[tuple[str, float, float], ...] = ()  # (predictor, issued, useful)
    dispatch_wait: tuple[tuple[str, float], ...] = ()  # (reason, seconds) the dispatcher waited
    long_steps: tuple[tuple[str, float, float], ...] = ()  # (task, steps, seconds) >= 1 ms

    @property
    def wan_per_read(self) -> float:
        """WAN bytes per byte the loader read: about 1.05 (headers) if each byte moves once."""
        return self.wan_bytes / self.loader_bytes if self.loader_bytes else float("nan")

    @property
    def fuse_per_read(self) -> float:
        """FUSE bytes per loader byte: above 1 is kernel readahead past the samples."""
        return self.fuse_bytes / self.loader_bytes if self.loader_bytes else float("nan")

    def line(self) -> str:
        return (f"WAN/read {self.wan_per_read:.2f} (WAN {self.wan_bytes / MB:.0f} MB, loader "
                f"{self.loader_bytes / MB:.0f} MB, FUSE {self.fuse_bytes / MB:.0f} MB in "
                f"{self.fuse_reads:.0f} reads = {self.fuse_per_read:.2f}x); prefetch issued "
                f"{self.issued / MB:.0f} useful {self.useful / MB:.0f} late "
                f"{self.late / MB:.0f} wasted {self.wasted / MB:.0f} failed "
                f"{self.failed / MB:.0f} MB; missed {self.miss_bytes / MB:.0f} MB; hub requests "
                f"demand {self.demand_requests:.0f} prefetch {self.prefetch_requests:.0f}; "
                f"evicted {self.evictions:.0f} blocks; prefetcher dropped "
                f"{self.dropped_events:.0f} reads" + self._dispatch() + self._predictors()
                + self._long_steps())

    def _dispatch(self) -> str:
        """Seconds the hub client's prefetch dispatcher waited, by what for: which of the pacer,
        the event loop, the window or the prefetcher held the requests back."""
        parts = [f"{reason} {seconds:.1f}" for reason, seconds in self.dispatch_wait]
        return "; dispatcher waited s: " + ", ".join(parts) if parts else ""

    def _long_steps(self) -> str:
        """Event-loop steps of 1 ms or more by task, most time first (mounts with
        ``--spoke-option=--loop-steps`` only): what held the FUSE requests up."""
        parts = [f"{task} {steps:.0f} ({seconds:.2f} s)" for task, steps, seconds
                 in sorted(self.long_steps, key=lambda item: -item[2]) if steps]
        return "; loop steps >= 1 ms: " + ", ".join(parts) if parts else ""

    def _predictors(self) -> str:
        """Issued / useful MB per predictor that issued anything."""
        parts = [f"{name} {issued / MB:.0f}/{useful / MB:.0f}"
                 for name, issued, useful in self.by_predictor if issued]
        return "; issued/useful MB by predictor: " + ", ".join(parts) if parts else ""


def diagnose(record: RunRecord) -> Diagnosis | None:
    """The run's byte accounting, or None for a run without spoke metrics or link counters."""
    m = record.metrics
    if m is None or record.wan_down_bytes is None:
        return None
    return Diagnosis(
        loader_bytes=len(record.trace.read_seconds) * WINDOW_BYTES,
        fuse_bytes=metric_total(m, READ_BYTES), fuse_reads=metric_total(m, READS),
        wan_bytes=record.wan_down_bytes,
        issued=metric_total(m, PREFETCH_ISSUED), useful=metric_total(m, PREFETCH_USEFUL),
        late=metric_total(m, PREFETCH_LATE), wasted=metric_total(m, PREFETCH_WASTED),
        failed=metric_total(m, PREFETCH_FAILED), miss_bytes=metric_total(m, MISSES) * 4096,
        demand_requests=metric_total(m, HUB_REQUESTS, priority="demand"),
        prefetch_requests=metric_total(m, HUB_REQUESTS, priority="prefetch"),
        evictions=metric_total(m, EVICTIONS), dropped_events=metric_total(m, EVENTS_DROPPED),
        by_predictor=tuple((name, metric_total(m, PREDICTOR_ISSUED, predictor=name),
                            metric_total(m, PREDICTOR_USEFUL, predictor=name))
                           for name in label_values(m, PREDICTOR_ISSUED, "predictor")),
        dispatch_wait=tuple((reason, metric_total(m, DISPATCH_WAIT, reason=reason))
                            for reason in label_values(m, DISPATCH_WAIT, "reason")),
        long_steps=tuple((task, metric_total(m, LONG_STEPS, task=task),
                          metric_total(m, LONG_STEP_SECONDS, task=task))
                         for task in label_values(m, LONG_STEPS, "task")))


LINK_GAUGES = (("neuralcache_fabric_btl_bw_bytes_per_second", "btl_bw", 8e-6, "Mbit/s"),
               ("neuralcache_fabric_min_rtt_seconds", "min_rtt", 1e3, "ms"),
               ("neuralcache_fabric_cwnd_bytes", "cwnd", 1e-6, "MB"),
               ("neuralcache_fabric_pacing_rate_bytes_per_second", "pacing", 8e-6, "Mbit/s"))
"""The hub client's congestion model at the end of a run (the planner's link estimate)."""


def link_model(scrape: Samples) -> str:
    """The congestion controller's gauges in one line, from a spoke's ``/metrics`` scrape."""
    values = {name: v for (name, _), v in scrape.items()}
    parts = [f"{label} {values[name] * scale:.1f} {unit}"
             for name, label, scale, unit in LINK_GAUGES if name in values]
    return "link model at the end: " + ", ".join(parts) if parts else ""


TIMELINE_PERIOD = 0.25
"""Seconds between scrapes of the spoke's metrics while a ``--timeline`` run's loop runs."""

TIMELINE = (("neuralcache_read_bytes_total", "read MB", 1e-6),
            ("neuralcache_prefetch_issued_bytes_total", "issued MB", 1e-6),
            ("neuralcache_prefetch_inflight_bytes", "pf inflight MB", 1e-6),
            ("neuralcache_fabric_prefetch_queued_bytes", "pipe queue MB", 1e-6),
            ("neuralcache_fabric_inflight_bytes", "wire inflight MB", 1e-6),
            ("neuralcache_fabric_cwnd_bytes", "cwnd MB", 1e-6),
            ("neuralcache_fabric_btl_bw_bytes_per_second", "btl_bw Mbit/s", 8e-6),
            ("neuralcache_cache_miss_blocks_total", "miss MB", 4096e-6),
            ("neuralcache_fabric_requests_total", "hub requests", 1.0),
            ("neuralcache_fabric_resent_ratio", "resent %", 100.0))
"""What ``--timeline`` prints per scrape: (metric, column, scale); counters summed over labels."""


class Timeline:
    """Scrapes ``scrape()`` every ``TIMELINE_PERIOD`` in a thread while the loop runs, so the
    run can be read as a time series: is the prefetch budget full, the pipe queued, the
    controller's estimate low, the reads missing?"""

    def __init__(self, scrape: Callable[[], Samples]) -> None:
        self._scrape = scrape
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self.rows: list[tuple[float, dict[str, float]]] = []

    def _run(self) -> None:
        started = time.perf_counter()
        while not self._stop.wait(TIMELINE_PERIOD):
            try:
                sample = self._scrape()
            except OSError:
                continue
            totals: dict[str, float] = {}
            for (name, _), value in sample.items():
                totals[name] = totals.get(name, 0.0) + value
            self.rows.append((time.perf_counter() - started, totals))

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def table(self) -> str:
        """One line per scrape (counters as increases since the first scrape)."""
        if not self.rows:
            return ""
        first = self.rows[0][1]
        head = "    t s  " + " ".join(f"{label:>15}" for _, label, _ in TIMELINE)
        lines = [head]
        for t, row in self.rows:
            cells = []
            for name, _, scale in TIMELINE:
                value = row.get(name, 0.0)
                if name.endswith("_total"):
                    value -= first.get(name, 0.0)
                cells.append(f"{value * scale:15.2f}")
            lines.append(f"  {t:5.2f}  " + " ".join(cells))
        return "\n".join(lines)
