"""Figures of the reproduction, computed from loop traces, metric scrapes and link counters.

Pure functions over plain data (no torch, no processes), so the table can be rebuilt from a saved
results file and the arithmetic is unit-tested.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from bench.proc_cpu import DAEMON_LOOP, STOLEN
from bench.repro_loader import LoopTrace

RATE_WINDOWS: tuple[tuple[int, int | None], ...] = ((0, 100), (100, 150), (150, None))
"""The reference's batch ranges: samples/s over batches 0-100, 100-150 and 150 to the end."""
EARLY_BATCHES = 150
"""The reference's "early batches": cold starts run slower over batches 0-150."""
EXTRAPOLATION_HORIZONS = (10_000, 100_000, 1_000_000)
"""Run lengths (batches) the reference extrapolates its one-time cold-start penalty to."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A Prometheus scrape, keyed (name, sorted label pairs), as ``fuse_mount.scrape`` returns."""

HITS = "neuralcache_cache_hit_blocks_total"
MISSES = "neuralcache_cache_miss_blocks_total"
LATENCY_BUCKET = "neuralcache_read_latency_seconds_bucket"
READ_BYTES = "neuralcache_read_bytes_total"
PREFETCH_ISSUED = "neuralcache_prefetch_issued_bytes_total"
PREFETCH_USEFUL = "neuralcache_prefetch_useful_bytes_total"
HINT_RECORDS = "neuralcache_prefetch_hints_records_total"
PREFETCH_LATE = "neuralcache_prefetch_late_bytes_total"
PREFETCH_WASTED = "neuralcache_prefetch_wasted_bytes_total"
PREFETCH_FAILED = "neuralcache_prefetch_failed_bytes_total"
EVENTS_DROPPED = "neuralcache_prefetch_events_dropped_total"
EVICTIONS = "neuralcache_cache_evictions_total"
READS = "neuralcache_reads_total"
HUB_REQUESTS = "neuralcache_fabric_requests_total"
PREDICTOR_ISSUED = "neuralcache_prefetch_predictor_issued_bytes_total"
PREDICTOR_USEFUL = "neuralcache_prefetch_predictor_useful_bytes_total"
DISPATCH_WAIT = "neuralcache_fabric_prefetch_dispatch_wait_seconds_total"
PREFETCH_SECONDS = "neuralcache_prefetch_cpu_seconds_total"
"""The event loop's time on prefetching, by stage: handing reads over, the prefetcher's own
work, starting what it plans (fetches and the page-in of cached blocks)."""
LONG_STEPS = "neuralcache_loop_long_steps_total"  # only with mount --loop-steps
LONG_STEP_SECONDS = "neuralcache_loop_long_step_seconds_total"
WRITE_BATCHES = ("neuralcache_cache_write_batch_seconds_bucket",
                 "neuralcache_cache_write_batch_seconds_count",
                 "neuralcache_cache_write_batch_seconds_sum",
                 "neuralcache_cache_write_batch_ops_sum")
"""The cache writer's batches: how long they took (histogram) and how many blocks they held."""
LOOP_CPU = "neuralcache_loop_cpu_seconds_total"
LOOP_RUNQUEUE = "neuralcache_loop_runqueue_seconds_total"
LOOP_DISK_WAITS = "neuralcache_loop_disk_waits_total"
READER_DISK_WAITS = "neuralcache_cache_reader_disk_waits_total"
GC_SECONDS = "neuralcache_gc_seconds_total"
RUN_READS = "neuralcache_cache_run_reads_total"
"""Reads of whole cached runs by where they ran: on the event loop (inline) or in the reader
thread."""
OPENS = "neuralcache_opens_total"
"""Opens of data files by the readahead they got: warm (wholly cached) or cold."""
READER_WAIT_BUCKET = "neuralcache_cache_reader_wait_seconds_bucket"
"""How long reads handed to the cache's reader thread waited for it and back (histogram)."""
KEPT_METRICS = (HITS, MISSES, LATENCY_BUCKET, READ_BYTES, PREFETCH_ISSUED, PREFETCH_USEFUL,
                HINT_RECORDS, PREFETCH_SECONDS, PREFETCH_LATE, PREFETCH_WASTED, PREFETCH_FAILED,
                EVENTS_DROPPED, EVICTIONS, READS, HUB_REQUESTS, PREDICTOR_ISSUED, PREDICTOR_USEFUL,
                DISPATCH_WAIT, *WRITE_BATCHES, LOOP_CPU, LOOP_RUNQUEUE, LOOP_DISK_WAITS,
                READER_DISK_WAITS, GC_SECONDS, RUN_READS, LONG_STEPS, LONG_STEP_SECONDS, OPENS,
                READER_WAIT_BUCKET)
"""The spoke metrics a run keeps (as differences over the run)."""


# --- loop figures ------------------------------------------------------------------------------

def total_seconds(trace: LoopTrace) -> float:
    """Loop start to the end of the last step: the reference's "time to N batches"."""
    return trace.done[-1]


def window_rate(trace: LoopTrace, first: int, end: int | None) -> float | None:
    """Samples/s over batches ``first`` (inclusive) to ``end`` (exclusive; None: the last).

    The window starts when the step before ``first`` ended (the loop start for batch 0), so the
    windows tile the run. None if the run did not reach ``first``.
    """
    stop = trace.batches if end is None else min(end, trace.batches)
    if first >= stop:
        return None
    begin = trace.done[first - 1] if first > 0 else 0.0
    return (stop - first) * trace.batch_size / (trace.done[stop - 1] - begin)


def samples_per_second(trace: LoopTrace) -> float:
    """Over the whole run, the loader's start-up (forking its workers) included."""
    return trace.batches * trace.batch_size / total_seconds(trace)


def streaming_rate(trace: LoopTrace) -> float | None:
    """Samples/s after the first batch: what the storage sustains, without the loader's
    start-up (the same fork of workers for every target, which would pull ratios towards 1)."""
    return window_rate(trace, 1, None)


def wait_seconds(trace: LoopTrace) -> np.ndarray:
    """Seconds each step waited for its batch."""
    return np.asarray(trace.ready) - np.asarray(trace.asked)


def waiting_share(trace: LoopTrace, end: int | None = None) -> float:
    """Share of the loop's time (up to batch ``end``) spent waiting for data; one minus it is
    the stand-in for the reference's GPU utilisation."""
    stop = trace.batches if end is None else min(end, trace.batches)
    return float(wait_seconds(trace)[:stop].sum() / trace.done[stop - 1])


def read_percentiles(trace: LoopTrace) -> tuple[float, float]:
    """p50 and p99 of the samples' ``pread`` latency in the loader's workers, seconds."""
    p50, p99 = np.percentile(np.asarray(trace.read_seconds), [50, 99])
    return float(p50), float(p99)


def read_seconds_total(trace: LoopTrace) -> float:
    """Seconds the loader's workers spent in their samples' ``pread``s, summed over the workers.
    The percentiles hide the few reads that wait for the storage (under 1 % of a warm run's), and
    those waits, not the pages already read ahead, are what the workers lose to it."""
    return float(np.sum(trace.read_seconds))


# --- spoke metrics ----------------------------------------------------------------------------

def metrics_delta(before: Samples, after: Samples) -> dict[str, float]:
    """The kept metrics' increase over a run, keyed ``name{label="v",...}`` (JSON-friendly)."""
    out: dict[str, float] = {}
    for key, value in after.items():
        name, labels = key
        if name in KEPT_METRICS:
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            out[f"{name}{{{text}}}" if text else name] = value - before.get(key, 0.0)
    return out


def _labels(key: str) -> dict[str, str]:
    if "{" not in key:
        return {}
    body = key[key.index("{") + 1:-1]
    return dict((part.split("=", 1)[0], part.split("=", 1)[1].strip('"'))
                for part in body.split(",") if part)


def _name(key: str) -> str:
    return key.split("{", 1)[0]


def metric_total(delta: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for k, v in delta.items()
               if _name(k) == name and labels.items() <= _labels(k).items())


def label_values(delta: dict[str, float], name: str, label: str) -> list[str]:
    """The values ``label`` takes among ``name``'s samples, sorted."""
    return sorted({_labels(k)[label] for k in delta if _name(k) == name and label in _labels(k)})


def hit_ratio(delta: dict[str, float]) -> float | None:
    """Share of the blocks reads needed that were in the local cache (None: no reads)."""
    hits, misses = metric_total(delta, HITS), metric_total(delta, MISSES)
    return hits / (hits + misses) if hits + misses else None


def loop_load(record: RunRecord) -> tuple[float, float] | None:
    """Shares of the run the daemon's event loop spent on a CPU and waiting for one (its thread's
    times between the scrapes just before and after the loop, over the loop's own time; None:
    not our mount, or no such times)."""
    if record.metrics is None or LOOP_CPU not in record.metrics:
        return None
    return (record.metrics[LOOP_CPU] / record.probe_seconds,
            record.metrics.get(LOOP_RUNQUEUE, 0.0) / record.probe_seconds)


def cpu_floor(record: RunRecord, cores: int) -> float | None:
    """The shortest loop the CPU this run used allows, in seconds: every role's CPU (loader,
    daemon, hub, WAN forwarder, rclone, and what the hypervisor stole from the machine) spread
    evenly over the machine's ``cores``, or the spoke daemon's event loop alone (one thread:
    one core at most), whichever is longer. A run whose time is near it was bound by CPU, not
    by the link or the cache; None without CPU figures."""
    cpu = record.cpu_seconds
    if not cpu:
        return None
    total = sum(seconds for role, seconds in cpu.items() if role != DAEMON_LOOP)
    return max(total / cores, cpu.get(DAEMON_LOOP, 0.0))


def latency_buckets(delta: dict[str, float], name: str = LATENCY_BUCKET
                    ) -> list[tuple[float, float]]:
    """The histogram ``name`` (its ``_bucket`` series; by default the read latency) over every
    label but ``le``: sorted (upper bound, cumulative count)."""
    counts: dict[float, float] = {}
    for key, value in delta.items():
        if _name(key) == name:
            le = float(_labels(key)["le"])
            counts[le] = counts.get(le, 0.0) + value
    return sorted(counts.items())


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket holding the q-th
    observation; an observation past the last finite bound reports that bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            inside = cumulative - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, cumulative
    return lower


# --- link --------------------------------------------------------------------------------------

def link_counter(before: dict[str, Any], after: dict[str, Any], direction: str,
                 counter: str) -> int:
    """Increase of one of the emulated link's counters (``forwarded_bytes``,
    ``queue_dropped_packets``, ...) in ``direction`` between two ``WanLink.stats()``."""
    return int(after[direction][counter] - before[direction][counter])


# --- a run and its summary ----------------------------------------------------------------------

@dataclass
class RunRecord:
    """Everything one scenario run measured (serialised to the results file)."""

    scenario: str
    repeat: int
    trace: LoopTrace
    probe_seconds: float  # wall time between the loop's two probes (link-use denominator)
    wan_down_bytes: int | None = None  # hub -> spoke over the loop, None for local
    wan_up_bytes: int | None = None
    metrics: dict[str, float] | None = None  # spoke metric increases; None if not our mount
    wan_drops: int | None = None  # hub -> spoke packets tail-dropped by the link's queue
    cpu_seconds: dict[str, float] | None = None  # CPU per role over the loop (bench.proc_cpu)
    discarded: str | None = None  # why the run was set aside and run again; None if kept

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "repeat": self.repeat, "trace": self.trace.to_json(),
                "probe_seconds": self.probe_seconds, "wan_down_bytes": self.wan_down_bytes,
                "wan_up_bytes": self.wan_up_bytes, "metrics": self.metrics,
                "wan_drops": self.wan_drops, "cpu_seconds": self.cpu_seconds,
                "discarded": self.discarded}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        return cls(data["scenario"], data["repeat"], LoopTrace.from_json(data["trace"]),
                   data["probe_seconds"], data["wan_down_bytes"], data["wan_up_bytes"],
                   data["metrics"], data.get("wan_drops"), data.get("cpu_seconds"),
                   data.get("discarded"))


def stolen_share(record: RunRecord, cores: int) -> float:
    """The share of the machine's CPU time (all ``cores``) its hypervisor gave to others over
    the run's loop; 0 if the run did not measure it."""
    stolen = (record.cpu_seconds or {}).get(STOLEN, 0.0)
    return stolen / (record.probe_seconds * cores) if record.probe_seconds > 0 else 0.0


def worst_stolen_share(records: Iterable[RunRecord], cores: int) -> float:
    """``stolen_share`` of the most disturbed of these runs (one attempt at a scenario); 0 if
    there are none."""
    return max((stolen_share(r, cores) for r in records), default=0.0)


def least_disturbed(attempts: Sequence[Sequence[RunRecord]], cores: int) -> int:
    """Index of the attempt to keep among runs of the same scenarios: the one whose most
    disturbed loop lost the least CPU to the hypervisor (``worst_stolen_share``), the earliest
    of equals. Chosen by the host's interference alone, never by the figures measured."""
    return min(range(len(attempts)), key=lambda i: worst_stolen_share(attempts[i], cores))


def link_use(record: RunRecord, link_rate_bps: float) -> float | None:
    """Share of the link's hub -> spoke capacity the run's loop used (None: no link)."""
    if record.wan_down_bytes is None:
        return None
    return record.wan_down_bytes * 8 / (link_rate_bps * record.probe_seconds)


@dataclass(frozen=True)
class RunSummary:
    """The reference table's figures for one run."""

    windows: tuple[float | None, ...]  # samples/s over RATE_WINDOWS
    samples_per_s: float
    streaming_rate: float | None  # samples/s after the first batch
    seconds: float  # time to the run's last batch
    batches: int
    waiting_share: float
    early_waiting_share: float  # over the first EARLY_BATCHES
    read_p50: float  # loader pread latency, s
    read_p99: float
    read_total: float  # seconds in preads, summed over the workers
    mount_p50: float | None  # the mount's read-latency histogram, s
    mount_p99: float | None
    hit_ratio: float | None
    wan_mb: float | None  # hub -> spoke, 10**6 bytes
    wan_drops: int | None  # hub -> spoke packets the link's queue dropped
    link_use: float | None  # hub -> spoke wire bytes / (rate x loop time)


def summarize(record: RunRecord, link_rate_bps: float) -> RunSummary:
    trace = record.trace
    p50, p99 = read_percentiles(trace)
    mount_p50 = mount_p99 = ratio = None
    if record.metrics is not None:
        buckets = latency_buckets(record.metrics)
        mount_p50, mount_p99 = histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)
        ratio = hit_ratio(record.metrics)
    wan_mb = None if record.wan_down_bytes is None else record.wan_down_bytes / 1e6
    return RunSummary(
        windows=tuple(window_rate(trace, a, b) for a, b in RATE_WINDOWS),
        samples_per_s=samples_per_second(trace), streaming_rate=streaming_rate(trace),
        seconds=total_seconds(trace),
        batches=trace.batches, waiting_share=waiting_share(trace),
        early_waiting_share=waiting_share(trace, EARLY_BATCHES), read_p50=p50, read_p99=p99,
        read_total=read_seconds_total(trace),
        mount_p50=mount_p50, mount_p99=mount_p99, hit_ratio=ratio, wan_mb=wan_mb,
        wan_drops=record.wan_drops,
        link_use=link_use(record, link_rate_bps))


# --- repeats and extrapolation ----------------------------------------------------------------

@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over the repeats."""

    median: float
    low: float
    high: float
    n: int


def spread(values: Iterable[float | None]) -> Spread | None:
    """None if no repeat had the figure."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Spread(statistics.median(present), min(present), max(present), len(present))


def cold_start_share(penalty_seconds: float, measured_batches: int, measured_seconds: float,
                     steady_batch_seconds: float, horizon_batches: int) -> float:
    """Share of a ``horizon_batches`` run's wall time that a one-time ``penalty_seconds`` costs,
    *extrapolated*: the reference run is assumed to go on at ``steady_batch_seconds`` per batch
    after the ``measured_batches`` that took ``measured_seconds``, and the cold run to have
    caught up for good by the end of its measured part."""
    reference = measured_seconds + (horizon_batches - measured_batches) * steady_batch_seconds
    return penalty_seconds / (reference + penalty_seconds)
