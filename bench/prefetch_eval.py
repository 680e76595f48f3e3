"""Trace-driven evaluation of prefetch policies over a modelled WAN link.

For each trace of ``bench/traces.py`` (or recorded ``.trace`` files given with ``--trace``) and
each policy - no prefetch, kernel-style readahead, stride only, NeuralCache's predictor, the same
with the job's hints, and an oracle that knows the trace - replays the reads through
``bench/prefetch_sim.py`` and reports the demand hit ratio (overall, first epoch, later epochs),
prefetch accuracy (useful / issued), coverage (useful / (useful + demand-fetched)), timeliness
(useful prefetches that arrived before their read), wasted bytes (as a share of all bytes
fetched), bytes the link carried per byte read, the run's slowdown against the trace's own
timing, and the predictor's cost per read. Writes one markdown table and a plot of hit ratio
over time per trace. ``--max-prefetch-requests``, ``--no-promote`` and ``--hedge-blocks`` add
the real mount's limits to the ideal link (``prefetch_sim.MountModel``), one at a time or
together, to see what each costs on a recorded trace.

    python -m bench.prefetch_eval                 # full: 256 MiB data sets, a few minutes
    python -m bench.prefetch_eval --quick         # 64 MiB data sets, under a minute
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from bench.prefetch_baselines import KernelReadahead, NoPrefetch, Oracle
from bench.prefetch_sim import BINS, LinkModel, MountModel, Policy, Result, SimCache, Simulation
from bench.traces import FULL_BYTES, QUICK_BYTES, TRACE_NAMES, generate
from neuralcache.catalog import Catalog
from neuralcache.prefetcher import PrefetchConfig, Prefetcher
from neuralcache.trace import Trace, read_trace

CACHE_FIT_FACTOR = 1.25
"""Cache size as a multiple of the data set, unless a trace asks for less (``cache_fraction``)."""

POLICIES = ["none", "readahead", "stride", "ours", "ours+hints", "oracle"]
COLORS = {"none": "tab:gray", "readahead": "tab:orange", "stride": "tab:green",
          "ours": "tab:red", "ours+hints": "tab:blue", "oracle": "black"}

LABELS = {
    "seq8": "(a) sequential, 8 workers", "seq64": "(a) sequential, 64 workers",
    "ddp8": "(b) 8 ranks, DistributedSampler", "shuffle": "(c) shuffled, new seed/epoch",
    "shuffle_hinted": "(d) shuffled + hints", "tar": "(e) tar shards, shuffled order",
    "smallfiles": "(f) small files, random", "fixed_shuffle": "fixed shuffle, cache 50 %",
    "records": "irregular records",
}


class _Unhinted(Prefetcher):
    """Our predictor with the job's hints withheld."""

    def on_hints(self, now, record):  # type: ignore[no-untyped-def]
        return []


def policy_factory(name: str, trace: Trace) -> Callable[[Catalog, SimCache], Policy]:
    """How to build each policy for one simulation."""
    if name == "none":
        return lambda catalog, cache: NoPrefetch()
    if name == "readahead":
        return lambda catalog, cache: KernelReadahead(catalog)
    if name == "stride":
        return lambda catalog, cache: Prefetcher(catalog, cache, PrefetchConfig.stride_only())
    if name == "ours":
        return lambda catalog, cache: _Unhinted(catalog, cache)
    if name == "ours+hints":
        return lambda catalog, cache: Prefetcher(catalog, cache)
    if name == "oracle":
        return lambda catalog, cache: Oracle(trace, cache)
    raise ValueError(name)


def cache_bytes(trace: Trace) -> int:
    fraction = float(trace.meta.get("cache_fraction", CACHE_FIT_FACTOR))  # type: ignore[arg-type]
    return int(trace.data_bytes * fraction)


def evaluate(trace: Trace, policies: list[str], link: LinkModel, elastic: bool = True,
             mount: MountModel = MountModel()) -> dict[str, Result]:
    """Run every policy over one trace."""
    out = {}
    for name in policies:
        if name == "ours+hints" and not trace.hints:
            continue
        sim = Simulation(trace, policy_factory(name, trace), link, cache_bytes(trace), elastic,
                         mount)
        out[name] = sim.run()
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(results: dict[str, dict[str, Result]]) -> str:
    """The markdown table."""
    head = ("| trace | policy | hit % | epoch 1 hit % | later epochs hit % | accuracy % | "
            "coverage % | timeliness % | wasted % of fetched | link bytes / read | "
            "time / trace time | µs per read |")
    lines = [head, "|" + "---|" * 12]
    for tname, per_policy in results.items():
        for pname, r in per_policy.items():
            later_h = sum(r.epoch_hits[1:])
            later_t = sum(r.epoch_total[1:])
            prefetches = pname not in ("none",)
            us = (f"{1e6 * r.on_access_s / max(r.accesses, 1):.0f}"
                  if pname in ("stride", "ours", "ours+hints") else "")
            lines.append(
                f"| {LABELS.get(tname, tname)} | {pname} | {_pct(r.hit_ratio)} | "
                f"{_pct(r.epoch_ratio(0))} | {_pct(later_h / max(later_t, 1))} | "
                f"{_pct(r.accuracy) if prefetches else ''} | "
                f"{_pct(r.coverage) if prefetches else ''} | "
                f"{_pct(r.timeliness) if prefetches else ''} | "
                f"{_pct(r.wasted_share) if prefetches else ''} | {r.link_per_read:.2f} | "
                f"{r.makespan / max(r.trace_span, 1e-9):.2f} | {us} |")
    return "\n".join(lines)


def targets(results: dict[str, dict[str, Result]]) -> list[str]:
    """The issue's targets, each with its measured number and whether it is met."""
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- [{'x' if ok else ' '}] {text}")

    for name in ("seq8", "seq64", "ddp8", "tar"):
        if name in results and "oracle" in results[name]:
            ours, oracle = results[name]["ours"].hit_ratio, results[name]["oracle"].hit_ratio
            line(oracle - ours <= 0.02, f"{LABELS[name]}: ours {_pct(ours)} % vs oracle "
                 f"{_pct(oracle)} % (within 2 points)")
    if "shuffle_hinted" in results and "oracle" in results["shuffle_hinted"]:
        r = results["shuffle_hinted"]
        ours, oracle = r["ours+hints"].epoch_ratio(0), r["oracle"].epoch_ratio(0)
        line(oracle - ours <= 0.02, f"{LABELS['shuffle_hinted']}, first epoch: ours+hints "
             f"{_pct(ours)} % vs oracle {_pct(oracle)} % (within 2 points)")
    if "shuffle" in results:
        r = results["shuffle"]["ours"]
        later = sum(r.epoch_hits[1:]) / max(sum(r.epoch_total[1:]), 1)
        line(later >= 0.95, f"{LABELS['shuffle']}, epochs 2+: ours {_pct(later)} % (>= 95 %)")
    for name in ("seq8", "seq64", "ddp8"):
        if name in results:
            w = results[name]["ours"].wasted_share
            line(w < 0.05, f"{LABELS[name]}: wasted {_pct(w)} % of fetched bytes (< 5 %)")
    return out


def plot(results: dict[str, dict[str, Result]], path: str) -> None:
    """Hit ratio over the trace's progress, one panel per trace, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = 3
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (tname, per_policy) in zip(axes.flat, results.items()):
        for pname, r in per_policy.items():
            xs = [100 * (i + 0.5) / BINS for i, t in enumerate(r.bins_total) if t]
            ys = [100 * h / t for h, t in zip(r.bins_hits, r.bins_total) if t]
            ax.plot(xs, ys, label=pname, linewidth=1.2, color=COLORS.get(pname))
        ax.set_title(LABELS.get(tname, tname), fontsize=10)
        ax.set_ylim(-2, 102)
        ax.set_xlabel("reads done (% of the trace: 3 epochs)")
        ax.set_ylabel("hit %")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    legend: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(legend))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB data sets (under a minute)")
    parser.add_argument("--traces", nargs="*", default=TRACE_NAMES, help="generated traces")
    parser.add_argument("--trace", action="append", default=[], help="a recorded .trace file")
    parser.add_argument("--policies", nargs="*", default=POLICIES)
    parser.add_argument("--rtt-ms", type=float, default=60.0)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--open-loop", action="store_true",
                        help="replay timestamps as recorded instead of elastically")
    parser.add_argument("--max-prefetch-requests", type=int,
                        help="mount model: prefetch requests fetching at once [no cap]")
    parser.add_argument("--no-promote", action="store_true",
                        help="mount model: a read waits for a queued prefetch, unpromoted")
    parser.add_argument("--hedge-blocks", type=int, default=0,
                        help="mount model: demand fetches up to this many blocks are sent twice")
    parser.add_argument("--plot", default=None,
                        help="write the hit-ratio plot here (docs/prefetch-hit-ratio.png for the "
                             "docs' figure; a --quick run should not overwrite it)")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    link = LinkModel(rtt=args.rtt_ms / 1000, bandwidth=args.mbit * 1e6 / 8)
    mount = MountModel(args.max_prefetch_requests, not args.no_promote, args.hedge_blocks)
    size = QUICK_BYTES if args.quick else FULL_BYTES
    results: dict[str, dict[str, Result]] = {}
    started = time.perf_counter()
    sources: list[tuple[str, Callable[[], Trace]]] = [
        (name, lambda name=name: generate(name, size)) for name in args.traces]
    sources += [(os.path.basename(p), lambda p=p: read_trace(p)) for p in args.trace]
    for name, load in sources:
        t0 = time.perf_counter()
        trace = load()
        results[name] = evaluate(trace, args.policies, link, elastic=not args.open_loop,
                                 mount=mount)
        print(f"{name}: {len(trace.reads)} reads, {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    command = "python -m bench.prefetch_eval" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    report = "\n".join([
        f"Link {args.rtt_ms:g} ms RTT, {args.mbit:g} Mbit/s; data sets "
        f"{size / 2**20:.0f} MiB; cache {CACHE_FIT_FACTOR:g}x the data unless noted; "
        f"{'open' if args.open_loop else 'elastic (closed)'}-loop replay. Command: `{command}`",
        "", table(results), "", "Targets:", *targets(results)])
    print(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report + "\n")
    if args.plot:
        plot(results, args.plot)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
