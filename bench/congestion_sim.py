"""Print the simulated BBR-vs-CUBIC table of docs/congestion.md.

Run from the repository root:  .venv/bin/python -m bench.congestion_sim [--seeds 5]

Every scenario runs both controllers on the same seeded link (bench/linksim.py) and measures
the same window after startup. Figures are mean [min-max] over the seeds. "Loss" is the
probability that a whole request's response is lost, except in the row that converts a
per-1500-byte-segment rate into a per-request one.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fabric.congestion import DEFAULT_MSS, create_controller
from bench.linksim import FlowSpec, LinkConfig, SimResult, per_request_loss, simulate

MBIT = 1e6 / 8  # bytes/s per Mbit/s

CONVERGED_UTILIZATION = 0.9
"""A flow has converged once goodput over every later 5-RTT window is at least this."""

CONVERGENCE_WINDOW_RTTS = 5


@dataclass(frozen=True)
class Scenario:
    label: str
    link: LinkConfig
    duration: float  # simulated seconds
    measure_from: float  # start of the steady-state window, seconds


SCENARIOS = (
    Scenario("200 Mbit/s, 60 ms, no loss", LinkConfig(200 * MBIT, 0.06), 10.0, 2.0),
    Scenario(
        "200 Mbit/s, 60 ms, no loss, 10-BDP buffer",
        LinkConfig(200 * MBIT, 0.06, queue_limit=int(10 * 200 * MBIT * 0.06)),
        10.0,
        2.0,
    ),
    Scenario(
        "200 Mbit/s, 60 ms, 1 % of requests lost", LinkConfig(200 * MBIT, 0.06, 0.01), 10.0, 2.0
    ),
    Scenario(
        "100 Mbit/s, 900 ms, 1 % of requests lost", LinkConfig(100 * MBIT, 0.9, 0.01), 60.0, 25.0
    ),
    Scenario(
        "200 Mbit/s, 60 ms, 1 % of 1500-B segments (= {:.1%} of 64 KiB requests)".format(
            per_request_loss(0.01, DEFAULT_MSS)
        ),
        LinkConfig(200 * MBIT, 0.06, per_request_loss(0.01, DEFAULT_MSS)),
        10.0,
        2.0,
    ),
)

FAIRNESS_LINK = LinkConfig(200 * MBIT, 0.06)
FAIRNESS_DURATION = 30.0
FAIRNESS_SECOND_START = 2.0


def _controller(name: str, seed: int):
    return create_controller(name, seed=seed) if name == "bbr" else create_controller(name)


def _converged_after(result: SimResult, duration: float) -> int | None:
    """Round trips until goodput stays >= CONVERGED_UTILIZATION in every later 5-RTT window
    (counted to the end of the first such window), or None if it never does."""
    rtt, width = result.link.rtt, CONVERGENCE_WINDOW_RTTS
    last = int(duration / rtt) - width
    utils = [result.utilization(k * rtt, (k + width) * rtt) for k in range(last + 1)]
    last_below = max((k for k, u in enumerate(utils) if u < CONVERGED_UTILIZATION), default=-1)
    return None if last_below == last else last_below + 1 + width


def _summary(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    present = [v for v in values if v is not None]
    if len(present) < len(values):
        return f"never in {len(values) - len(present)}/{len(values)}"
    mean = statistics.fmean(present)
    return f"{fmt(mean)} [{fmt(min(present))}-{fmt(max(present))}]"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _bdps(x: float) -> str:
    return f"{x:.2f}"


def _rtts(x: float) -> str:
    return f"{x:.0f}"


def single_flow_rows(seeds: int) -> list[str]:
    rows = [
        "| scenario | controller | goodput / line rate | queue peak (BDP) | queue mean (BDP) "
        "| RTTs to 90 % |",
        "|---|---|---|---|---|---|",
    ]
    for sc in SCENARIOS:
        for name in ("bbr", "cubic"):
            util, peak, mean, conv = [], [], [], []
            for seed in range(seeds):
                r = simulate(sc.link, [FlowSpec(_controller(name, seed))], sc.duration, seed=seed)
                util.append(r.utilization(sc.measure_from, sc.duration))
                peak.append(r.queue_peak(sc.measure_from, sc.duration) / sc.link.bdp)
                mean.append(r.queue_mean(sc.measure_from, sc.duration) / sc.link.bdp)
                conv.append(_converged_after(r, sc.duration))
            rows.append(
                f"| {sc.label} | {name} | {_summary(util, _pct)} | {_summary(peak, _bdps)} "
                f"| {_summary(mean, _bdps)} | {_summary(conv, _rtts)} |"
            )
    return rows


def fairness_rows(seeds: int) -> list[str]:
    t0 = FAIRNESS_DURATION / 2
    rows = [
        f"| two flows, 200 Mbit/s, 60 ms, 2nd starts at {FAIRNESS_SECOND_START:.0f} s "
        f"| Jain index ({t0:.0f}-{FAIRNESS_DURATION:.0f} s) | link utilization "
        "| queue mean (BDP) |",
        "|---|---|---|---|",
    ]
    for name in ("bbr", "cubic"):
        jain, util, mean = [], [], []
        for seed in range(seeds):
            flows = [
                FlowSpec(_controller(name, 2 * seed)),
                FlowSpec(_controller(name, 2 * seed + 1), start=FAIRNESS_SECOND_START),
            ]
            r = simulate(FAIRNESS_LINK, flows, FAIRNESS_DURATION, seed=seed)
            jain.append(r.jain_index(t0, FAIRNESS_DURATION))
            util.append(r.utilization(t0, FAIRNESS_DURATION))
            mean.append(r.queue_mean(t0, FAIRNESS_DURATION) / FAIRNESS_LINK.bdp)
        rows.append(
            f"| {name} + {name} | {_summary(jain, lambda x: f'{x:.3f}')} "
            f"| {_summary(util, _pct)} | {_summary(mean, _bdps)} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per scenario (default 5)")
    args = parser.parse_args(argv)
    print("\n".join(single_flow_rows(args.seeds)))
    print()
    print("\n".join(fairness_rows(args.seeds)))


if __name__ == "__main__":
    main()
