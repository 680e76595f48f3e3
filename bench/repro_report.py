"""The reproduction's report: markdown tables (the reference's figures per scenario, the targets,
the extrapolated cold-start penalty) and a plot of samples/s over batches."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from bench.repro_scenarios import (COLD, IO_BOUND, LOCAL, MEMFS, SHUFFLED, SEQUENTIAL, VARIANTS,
                                   Check, Runs, Scenario, checks, per_repeat)
from bench.repro_stats import (EXTRAPOLATION_HORIZONS, GC_SECONDS, HINT_RECORDS, LOOP_DISK_WAITS,
                               PREFETCH_ISSUED, PREFETCH_SECONDS, PREFETCH_USEFUL, RATE_WINDOWS,
                               READ_BYTES, READER_DISK_WAITS, READER_WAIT_BUCKET, RunRecord,
                               RunSummary, Spread, cold_start_share, cpu_floor, histogram_quantile,
                               latency_buckets, loop_load, metric_total, spread, summarize,
                               total_seconds, window_rate)

PLOT_WINDOW = 20
"""Batches per point of the plotted samples/s (a rolling window smooths the step jitter)."""
MS = 1e3


def _fmt(s: Spread | None, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    if s is None:
        return "–"
    text = f"{s.median * scale:.{digits}f}{unit}"
    if s.n > 1:
        text += f" [{s.low * scale:.{digits}f}–{s.high * scale:.{digits}f}]"
    return text


def _summaries(runs: Runs, link_rate_bps: float) -> dict[str, list[RunSummary]]:
    return {key: [summarize(r, link_rate_bps) for _, r in sorted(by_repeat.items())]
            for key, by_repeat in runs.items()}


def _ordered_keys(runs: Runs, variant: str) -> list[str]:
    order = {LOCAL: 0, MEMFS: 1, "spoke cold": 2, "spoke warm": 3, "rclone cold": 4,
             "rclone warm": 5}
    keys = [k for k in runs if Scenario.parse(k).variant == variant]
    return sorted(keys, key=lambda k: order.get(Scenario.parse(k).label, 9))


def scenario_table(runs: Runs, variant: str, link_rate_bps: float, cores: int) -> str:
    """The reference's figures for each scenario of ``variant``, median [min–max] of repeats."""
    summaries = _summaries(runs, link_rate_bps)
    windows = [f"samples/s {a}–{b if b is not None else 'end'}" for a, b in RATE_WINDOWS]
    head = ["scenario", *windows, "samples/s 1–end", "batches", "time (s)", "time vs hub-local",
            "CPU floor vs hub-local", "waiting on data (1 − GPU util.)",
            "loader read p50 / p99 (ms)", "loader's time in reads (s)",
            "mount read p50 / p99 (ms)", "local hit ratio",
            "WAN MB", "link use", "link drops (packets)"]
    body: list[list[str]] = []
    reference = Scenario(variant, LOCAL).key
    for key in _ordered_keys(runs, variant):
        rows = summaries[key]

        def col(get: Callable[[RunSummary], float | None], **kw: Any) -> str:
            return _fmt(spread(get(s) for s in rows), **kw)

        vs_local = spread(per_repeat(runs, key, reference,
                                     lambda run, ref: total_seconds(run.trace)
                                     / total_seconds(ref.trace)))
        floor = spread(per_repeat(runs, key, reference,
                                  lambda run, ref: None if (f := cpu_floor(run, cores)) is None
                                  else f / total_seconds(ref.trace)))
        cells = [Scenario.parse(key).label]
        cells += [col(lambda s, i=i: s.windows[i]) for i in range(len(RATE_WINDOWS))]
        cells += [col(lambda s: s.streaming_rate), str(rows[0].batches), col(lambda s: s.seconds),
                  _fmt(vs_local, digits=3) + "×",
                  _fmt(floor, digits=3) + "×" if floor is not None else "–",
                  col(lambda s: s.waiting_share, scale=100, unit=" %"),
                  f"{col(lambda s: s.read_p50, scale=MS, digits=3)} / "
                  f"{col(lambda s: s.read_p99, scale=MS, digits=1)}",
                  col(lambda s: s.read_total, digits=2),
                  f"{col(lambda s: s.mount_p50, scale=MS, digits=2)} / "
                  f"{col(lambda s: s.mount_p99, scale=MS, digits=1)}"
                  if rows[0].mount_p50 is not None else "–",
                  col(lambda s: s.hit_ratio, scale=100, digits=2, unit=" %"),
                  col(lambda s: s.wan_mb, digits=0),
                  col(lambda s: s.link_use, scale=100, unit=" %"),
                  col(lambda s: s.wan_drops, digits=0)]
        body.append(cells)
    return _table(head, body)


def _table(head: list[str], body: list[list[str]]) -> str:
    """A markdown table without the columns no row has a figure for (a results file written
    before a column existed)."""
    keep = [i for i in range(len(head)) if any(row[i] != "–" for row in body)]
    lines = ["| " + " | ".join(head[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in body]
    return "\n".join(lines)


def spoke_table(runs: Runs) -> str:
    """Where the spoke's bytes came from, what its prefetcher did and what that took of the
    event loop, how busy the loop was (how often it waited for the disk, how long the
    collector ran) and how long reads waited for the cache's reader thread ("–" for runs
    from before those were counted), per spoke scenario."""
    head = ["scenario", "read from cache (MB)", "served from hub fetches (MB)",
            "prefetch issued (MB)", "prefetch useful (MB)", "hint records",
            "prefetching on the event loop (s)",
            "daemon's event loop: on a CPU + waiting for one", "its waits for the disk",
            "reader thread's waits for the disk",
            "garbage collection (s)", "reads' wait for the reader thread p50 / p99 (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in VARIANTS:
        for key in _ordered_keys(runs, variant):
            records = [r for _, r in sorted(runs[key].items()) if r.metrics is not None]
            if not records:
                continue
            deltas = [r.metrics for r in records if r.metrics is not None]

            def col(name: str, scale: float = 1e-6, digits: int = 1, **labels: str) -> str:
                return _fmt(spread(metric_total(d, name, **labels) for d in deltas), scale,
                            digits)
            lines.append("| " + " | ".join([
                f"{variant}, {Scenario.parse(key).label}",
                col(READ_BYTES, source="cache"), col(READ_BYTES, source="hub"),
                col(PREFETCH_ISSUED), col(PREFETCH_USEFUL),
                col(HINT_RECORDS, scale=1, digits=0),
                _fmt(spread(_kept_total(d, PREFETCH_SECONDS) for d in deltas), 1, 2),
                _loop_load_cell(records),
                _fmt(spread(d.get(LOOP_DISK_WAITS) for d in deltas), 1, 0),
                _fmt(spread(d.get(READER_DISK_WAITS) for d in deltas), 1, 0),
                _fmt(spread(_kept_total(d, GC_SECONDS) for d in deltas), 1, 2),
                _reader_wait_cell(deltas)]) + " |")
    return "\n".join(lines)


def _reader_wait_cell(deltas: list[dict[str, float]]) -> str:
    """"p50 / p99" of ``neuralcache_cache_reader_wait_seconds``, each a spread over the runs
    ("–" if no read went to the reader thread, or the run is from before it was counted)."""
    buckets = [latency_buckets(d, READER_WAIT_BUCKET) for d in deltas]
    p50 = spread(histogram_quantile(b, 0.5) for b in buckets)
    if p50 is None:
        return "–"
    p99 = spread(histogram_quantile(b, 0.99) for b in buckets)
    return f"{_fmt(p50, MS, 2)} / {_fmt(p99, MS, 1)}"


def _kept_total(delta: dict[str, float], name: str) -> float | None:
    """A metric's increase over the run, every label summed (None: not kept then)."""
    if not any(key.startswith(name) for key in delta):
        return None
    return metric_total(delta, name)


def _loop_load_cell(records: list[RunRecord]) -> str:
    """"busy: on a CPU + waiting for one", each a spread over the repeats."""
    loads = [load for load in map(loop_load, records) if load is not None]
    if not loads:
        return "–"
    return (f"{_fmt(spread(c + w for c, w in loads), 100, 0, ' %')}: "
            f"{_fmt(spread(c for c, _ in loads), 100, 0, ' %')} + "
            f"{_fmt(spread(w for _, w in loads), 100, 0, ' %')}")


def checks_table(found: list[Check]) -> str:
    """The targets, rclone's same figure beside each, and memfs's for the warm ones (the column
    left out of a run without memfs)."""
    head = ["target", "goal", "measured: median [min–max]", "rclone, same figure",
            "memfs (the pyfuse3 ceiling), same figure", "met"]
    body = []
    for c in found:
        scale, digits, unit = (100, 1, " %") if c.unit == "%" else (1, 3, "×")
        goal = f"{'≥' if c.at_least else '≤'} {c.goal * scale:g}{unit}"
        met = {True: "**yes**", False: "**no**", None: "not measured"}[c.met]
        body.append([c.name, goal, _fmt(spread(c.values), scale, digits, unit),
                     _fmt(spread(c.peer), scale, digits, unit),
                     _fmt(spread(c.ceiling), scale, digits, unit), met])
    return _table(head, body)


def extrapolation_table(runs: Runs) -> str:
    """The one-time cold-start penalty (cold time minus hub-local time, same repeat) as a share
    of longer runs - extrapolated, as the reference's own figures are."""
    head = ["cold scenario", "measured penalty (s)"] + [
        f"share of {h:,} batches" for h in EXTRAPOLATION_HORIZONS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in (SEQUENTIAL, SHUFFLED):
        reference = Scenario(variant, LOCAL).key
        for target in ("spoke", "rclone"):
            key = Scenario(variant, target, COLD).key
            if key not in runs:
                continue
            penalties = per_repeat(runs, key, reference, _penalty)
            shares = {h: per_repeat(runs, key, reference,
                                    lambda run, ref, h=h: _share(run, ref, h))
                      for h in EXTRAPOLATION_HORIZONS}
            cells = [f"{target}, {variant}", _fmt(spread(penalties))]
            cells += [_fmt(spread(shares[h]), scale=100, digits=3, unit=" %")
                      for h in EXTRAPOLATION_HORIZONS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _penalty(run: RunRecord, ref: RunRecord) -> float:
    return total_seconds(run.trace) - total_seconds(ref.trace)


def _share(run: RunRecord, ref: RunRecord, horizon: int) -> float | None:
    steady = window_rate(ref.trace, *RATE_WINDOWS[-1])
    if steady is None:
        return None
    return cold_start_share(_penalty(run, ref), ref.trace.batches, total_seconds(ref.trace),
                            ref.trace.batch_size / steady, horizon)


def markdown(runs: Runs, link_rate_bps: float, header: str, cores: int) -> str:
    """The whole generated report: header, one table per variant, targets, extrapolation.
    ``cores``: the measuring machine's, for the CPU floor."""
    parts = [header]
    titles = {SEQUENTIAL: "GPU step, sequential order",
              SHUFFLED: "GPU step, shuffled order (the spoke announces it with the hints "
                        "sampler)",
              IO_BOUND: "I/O bound (no GPU step), sequential order"}
    for variant in VARIANTS:
        if any(Scenario.parse(k).variant == variant for k in runs):
            parts += [f"### {titles[variant]}", scenario_table(runs, variant, link_rate_bps, cores)]
    parts += ["### Targets", checks_table(checks(runs, link_rate_bps))]
    parts += ["### Inside the spoke (its own metrics, per run)", spoke_table(runs)]
    parts += ["### Cold-start penalty, extrapolated",
              "Extrapolated, not measured: the penalty is the cold run's time minus hub-local's "
              "over the measured batches, and the longer run is assumed to continue at "
              "hub-local's rate of batches 150–end with no further penalty.",
              extrapolation_table(runs)]
    return "\n\n".join(parts) + "\n"


def rolling_rate(done: list[float], batch_size: int, window: int = PLOT_WINDOW) -> np.ndarray:
    """Samples/s over the ``window`` batches ending at each batch (from the loop start for the
    first ones)."""
    t = np.concatenate([[0.0], np.asarray(done)])
    ends = np.arange(1, len(t))
    starts = np.maximum(ends - window, 0)
    return (ends - starts) * batch_size / (t[ends] - t[starts])


def plot(runs: Runs, path: str, title: str) -> None:
    """Samples/s over batches, one panel per variant, one line per scenario (its median run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in VARIANTS if any(Scenario.parse(k).variant == v for k in runs)]
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 3.6 * len(variants)), squeeze=False)
    for ax, variant in zip(axes[:, 0], variants):
        keys = _ordered_keys(runs, variant)
        for key in keys:
            records = sorted(runs[key].values(), key=lambda r: total_seconds(r.trace))
            median = records[len(records) // 2]
            rate = rolling_rate(median.trace.done, median.trace.batch_size)
            ax.plot(np.arange(len(rate)), rate, label=Scenario.parse(key).label, linewidth=1.2)
        repeats = max(len(runs[key]) for key in keys)
        ax.set_title(f"{variant}: each scenario's median run of {repeats}, samples/s over a "
                     f"{PLOT_WINDOW}-batch rolling window")
        ax.set_xlabel("batch")
        ax.set_ylabel("samples/s")
        if variant == IO_BOUND:  # cold and warm differ by an order of magnitude here
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
