"""The reproduction's scenarios, and the issue's targets as checks over their figures."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

from bench.repro_stats import (EARLY_BATCHES, RunRecord, hit_ratio, link_use, streaming_rate,
                               total_seconds, window_rate)

LOCAL = "hub-local"
"""Reading the hub's export directly: the reference's "hub (with the data)"."""
SPOKE = "spoke"
"""A NeuralCache mount over the emulated WAN."""
RCLONE = "rclone"
"""``rclone mount --vfs-cache-mode full`` of ``rclone serve http`` over the emulated WAN."""
MEMFS = "memfs"
"""The export's shards served from memory by ``bench.memfs``, a minimal pyfuse3 + trio
filesystem mounted on the loader's side: no WAN, no cache, no disk. A pyfuse3 mount does no
less work per read, so its ratios to hub-local are the ceiling of the warm spoke's (beyond a
run's noise, which in the GPU-step variants is as large as the gap)."""
TARGETS = (LOCAL, SPOKE, RCLONE, MEMFS)
UNCACHED = (LOCAL, MEMFS)
"""Targets that run once per variant: they have no cache to be cold or warm."""
COLD = "cold"  # empty cache
WARM = "warm"  # the mount restarted over the cache its cold run left

SEQUENTIAL = "sequential"
SHUFFLED = "shuffled"
IO_BOUND = "io-bound"
"""Sequential, no GPU step: raw samples/s through the mount."""
VARIANTS = (SEQUENTIAL, SHUFFLED, IO_BOUND)


@dataclass(frozen=True)
class Scenario:
    variant: str
    target: str
    state: str | None = None  # COLD or WARM; None for the UNCACHED targets

    @property
    def key(self) -> str:
        return f"{self.variant}|{self.label}"

    @property
    def label(self) -> str:
        return self.target if self.state is None else f"{self.target} {self.state}"

    @classmethod
    def parse(cls, key: str) -> Scenario:
        variant, label = key.split("|")
        target, _, state = label.partition(" ")
        return cls(variant, target, state or None)


def scenarios(variant: str, target: str) -> list[Scenario]:
    """The runs of ``target`` in ``variant``: one for an UNCACHED target, cold then warm for a
    caching mount."""
    if target in UNCACHED:
        return [Scenario(variant, target)]
    return [Scenario(variant, target, COLD), Scenario(variant, target, WARM)]


# --- targets ----------------------------------------------------------------------------------

Runs = dict[str, dict[int, RunRecord]]
"""Records by scenario key, then by repeat."""


def per_repeat(runs: Runs, key: str, reference: str,
               figure: Callable[[RunRecord, RunRecord], float | None]) -> list[float]:
    """``figure(run, reference_run)`` for each repeat that has both (side by side, one run)."""
    out = []
    for repeat, record in sorted(runs.get(key, {}).items()):
        ref = runs.get(reference, {}).get(repeat)
        if ref is not None:
            value = figure(record, ref)
            if value is not None:
                out.append(value)
    return out


def rate_ratio(run: RunRecord, ref: RunRecord) -> float:
    """Whole-run samples/s of ``run`` over ``ref``'s (same batches, so 1/time ratio)."""
    return total_seconds(ref.trace) / total_seconds(run.trace)


def streaming_ratio(run: RunRecord, ref: RunRecord) -> float | None:
    """Samples/s after the first batch, ``run`` over ``ref`` (the I/O-bound figure)."""
    mine, theirs = streaming_rate(run.trace), streaming_rate(ref.trace)
    return None if mine is None or theirs is None else mine / theirs


def time_ratio(run: RunRecord, ref: RunRecord) -> float:
    return total_seconds(run.trace) / total_seconds(ref.trace)


def early_rate_ratio(run: RunRecord, ref: RunRecord) -> float | None:
    """Samples/s over batches 0-150, ``run`` over ``ref``."""
    mine, theirs = window_rate(run.trace, 0, EARLY_BATCHES), window_rate(ref.trace, 0,
                                                                         EARLY_BATCHES)
    return None if mine is None or theirs is None else mine / theirs


@dataclass(frozen=True)
class Check:
    """One target: what was measured (median over repeats) against the goal."""

    name: str
    values: list[float]  # one per repeat
    goal: float
    at_least: bool  # True: value >= goal passes; False: value <= goal passes
    unit: str  # "x" for ratios, "%" for shares
    peer: list[float]  # rclone's same figure, for comparison (may be empty)
    ceiling: list[float] = field(default_factory=list)
    """memfs's same figure, for the warm targets: what a pyfuse3 mount reaches at most."""

    @property
    def value(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return bool(self.value >= self.goal if self.at_least else self.value <= self.goal)


def checks(runs: Runs, link_rate_bps: float) -> list[Check]:
    """The issue's targets, each from ratios measured side by side within a repeat."""
    def key(variant: str, target: str, state: str | None = None) -> str:
        return Scenario(variant, target, state).key

    def ratio(variant: str, target: str, state: str,
              figure: Callable[[RunRecord, RunRecord], float | None]) -> list[float]:
        return per_repeat(runs, key(variant, target, state), key(variant, LOCAL), figure)

    def ceiling(variant: str, figure: Callable[[RunRecord, RunRecord], float | None]
                ) -> list[float]:
        return per_repeat(runs, key(variant, MEMFS), key(variant, LOCAL), figure)

    def hits(variant: str) -> list[float]:
        found = (hit_ratio(r.metrics) if r.metrics else None
                 for r in runs.get(key(variant, SPOKE, WARM), {}).values())
        return [h for h in found if h is not None]

    def link(target: str) -> list[float]:
        cold_runs = runs.get(key(IO_BOUND, target, COLD), {})
        found = (link_use(r, link_rate_bps) for r in cold_runs.values())
        return [u for u in found if u is not None]

    out = [
        Check("warm spoke, sequential, GPU step: samples/s vs hub-local",
              ratio(SEQUENTIAL, SPOKE, WARM, rate_ratio), 0.99, True, "x",
              ratio(SEQUENTIAL, RCLONE, WARM, rate_ratio), ceiling(SEQUENTIAL, rate_ratio)),
        Check("warm spoke, shuffled, GPU step: samples/s vs hub-local",
              ratio(SHUFFLED, SPOKE, WARM, rate_ratio), 0.99, True, "x",
              ratio(SHUFFLED, RCLONE, WARM, rate_ratio), ceiling(SHUFFLED, rate_ratio)),
        Check("warm spoke, I/O bound: samples/s after the first batch vs hub-local",
              ratio(IO_BOUND, SPOKE, WARM, streaming_ratio), 0.90, True, "x",
              ratio(IO_BOUND, RCLONE, WARM, streaming_ratio),
              ceiling(IO_BOUND, streaming_ratio)),
        Check("cold spoke, sequential: whole-run time vs hub-local",
              ratio(SEQUENTIAL, SPOKE, COLD, time_ratio), 1.03, False, "x",
              ratio(SEQUENTIAL, RCLONE, COLD, time_ratio)),
        Check("cold spoke, sequential: samples/s over batches 0-150 vs hub-local",
              ratio(SEQUENTIAL, SPOKE, COLD, early_rate_ratio), 0.90, True, "x",
              ratio(SEQUENTIAL, RCLONE, COLD, early_rate_ratio)),
        Check("cold spoke, shuffled with hints: whole-run time vs hub-local",
              ratio(SHUFFLED, SPOKE, COLD, time_ratio), 1.05, False, "x",
              ratio(SHUFFLED, RCLONE, COLD, time_ratio)),
        Check("cold spoke, I/O bound: share of the link used (hub -> spoke wire bytes)",
              link(SPOKE), 0.90, True, "%", link(RCLONE)),
    ]
    for variant in VARIANTS:
        out.append(Check(f"warm spoke, {variant}: blocks served from the local cache",
                         hits(variant), 0.99, True, "%", []))
    return out
