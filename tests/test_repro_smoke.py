"""Smoke test of the reproduction bench (bench/repro*.py) without a WAN or a mount: the dataset
layout, a real DataLoader loop over local shards, the hints wiring, and the report's arithmetic.
Timing goals live in the bench itself, not here."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.proc_cpu import DAEMON, DAEMON_LOOP, FORWARDER, HUB, LOADER, STOLEN
from bench.repro import Repro, build_parser, load_results, rerun_lines
from bench.repro_data import (TOKEN_DTYPE, TOKENS_PER_WINDOW, WINDOW_BYTES, ShardLayout,
                              make_dataset, read_layout)
from bench.repro_loader import SHUFFLED, LoopConfig, LoopTrace, run_loop
from bench.repro_report import markdown, rolling_rate
from bench.repro_scenarios import (COLD, LOCAL, MEMFS, SEQUENTIAL, SPOKE, WARM, Scenario,
                                   checks, scenarios)
from bench.repro_stats import (HITS, LATENCY_BUCKET, LOOP_CPU, LOOP_RUNQUEUE, MISSES,
                               PREFETCH_SECONDS, READER_WAIT_BUCKET, RunRecord, cold_start_share,
                               histogram_quantile, hit_ratio, latency_buckets, least_disturbed,
                               metrics_delta, stolen_share, summarize, waiting_share,
                               window_rate)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ShardLayout]:
    root = str(tmp_path_factory.mktemp("shards"))
    layout = ShardLayout(shards=3, windows=40)
    make_dataset(root, layout, seed=7)
    return root, layout


# --- dataset ---------------------------------------------------------------------------------

@given(st.integers(1, 16), st.integers(1, 5000))
def test_every_sample_has_its_own_window(shards: int, windows: int) -> None:
    layout = ShardLayout(shards, windows)
    indices = {i for i in (0, windows - 1, windows, layout.samples // 2, layout.samples - 1)
               if i < layout.samples}
    seen = set()
    for index in indices:
        name, offset = layout.locate(index)
        assert offset % WINDOW_BYTES == 0 and offset < windows * WINDOW_BYTES
        assert layout.ranges(index) == [(name, offset, WINDOW_BYTES)]
        seen.add((name, offset))
    assert len(seen) == len(indices)
    with pytest.raises(IndexError):
        layout.locate(layout.samples)


def test_layout_for_size_fits_in_the_size() -> None:
    layout = ShardLayout.for_size(512 << 20, 8)
    assert (layout.shards, layout.windows, layout.total_bytes) == (8, 4096, 512 << 20)


def test_dataset_is_written_once_and_reads_back(shards: tuple[str, ShardLayout]) -> None:
    root, layout = shards
    assert read_layout(root) == layout
    assert make_dataset(root, layout, seed=7) == 0.0  # already there: nothing rewritten
    name, offset = layout.locate(layout.samples - 1)
    assert os.path.getsize(os.path.join(root, name)) == layout.windows * WINDOW_BYTES
    tokens = np.fromfile(os.path.join(root, name), dtype=TOKEN_DTYPE, count=TOKENS_PER_WINDOW,
                         offset=offset)
    assert tokens.max() > 0 and len(tokens) == TOKENS_PER_WINDOW


# --- the loop ----------------------------------------------------------------------------------

def test_loader_loop_records_every_batch(shards: tuple[str, ShardLayout]) -> None:
    pytest.importorskip("torch")
    root, layout = shards
    config = LoopConfig(batch_size=8, workers=2, prefetch_factor=2, step_seconds=0.005,
                        batches=1000)
    probes = iter(["start", "end"])
    trace = run_loop(root, layout, config, probe=lambda: next(probes))
    assert trace.batches == layout.samples // 8  # capped at the epoch, last partial dropped
    assert trace.probes == ["start", "end"]
    assert len(trace.read_seconds) == trace.batches * 8
    assert all(a <= r <= d for a, r, d in zip(trace.asked, trace.ready, trace.done))
    assert np.all(np.diff(trace.done) > 0)
    # every step slept 5 ms, so at most (total - batches x 5 ms) was spent waiting
    assert waiting_share(trace) <= 1 - trace.batches * 0.005 / trace.done[-1] + 1e-9


def test_hinted_sampler_announces_the_shuffled_reads(shards: tuple[str, ShardLayout]) -> None:
    pytest.importorskip("torch")
    from neuralcache.hints import HintedSampler

    root, layout = shards
    announced: list[tuple[str, int, int]] = []

    def capture(mountpoint: str, items: list, epoch: int, source: str, exact: bool) -> int:
        announced.extend(items)
        return 0

    config = LoopConfig(batch_size=4, workers=0, step_seconds=0.0, batches=3, order=SHUFFLED)
    samplers: list[HintedSampler] = []

    def wrap(sampler: Any) -> HintedSampler:
        samplers.append(HintedSampler(sampler, root, layout.ranges, announce_fn=capture))
        return samplers[-1]

    run_loop(root, layout, config, wrap_sampler=wrap)
    assert samplers[0].wait_announced(timeout=30)  # announced in the background
    # the whole epoch's order is announced, one 16 KiB range per sample, each sample once
    assert len(announced) == layout.samples
    assert len(set(announced)) == layout.samples
    assert {length for _, _, length in announced} == {WINDOW_BYTES}
    assert [a[:2] for a in announced] != [layout.locate(i) for i in range(layout.samples)]


# --- arithmetic ----------------------------------------------------------------------------------

def _trace(step_times: list[float], batch_size: int = 24) -> LoopTrace:
    done = [float(t) for t in np.cumsum(step_times)]
    return LoopTrace(batch_size, asked=[0.0] + done[:-1], ready=[0.0] + done[:-1], done=done,
                     read_seconds=[0.001] * (len(done) * batch_size))


def test_windows_tile_the_run() -> None:
    trace = _trace([0.1] * 100 + [0.05] * 50 + [0.02] * 50)
    assert window_rate(trace, 0, 100) == pytest.approx(240)
    assert window_rate(trace, 100, 150) == pytest.approx(480)
    assert window_rate(trace, 150, None) == pytest.approx(1200)
    assert window_rate(trace, 300, None) is None


def test_histogram_quantile_matches_prometheus() -> None:
    buckets = [(0.001, 50.0), (0.01, 90.0), (0.1, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.001 + 0.009 * 0.5)
    assert histogram_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5) is None
    assert histogram_quantile([(0.1, 1.0), (math.inf, 4.0)], 0.99) == 0.1


def test_metric_deltas_give_hit_ratio_and_latency() -> None:
    def scrape(hits: float, misses: float, fast: float) -> dict:
        return {(HITS, ()): hits, (MISSES, ()): misses,
                (LATENCY_BUCKET, (("le", "0.001"), ("source", "cache"))): fast,
                (LATENCY_BUCKET, (("le", "+Inf"), ("source", "cache"))): fast + 1}

    delta = metrics_delta(scrape(10, 5, 3), scrape(109, 6, 103))
    assert hit_ratio(delta) == pytest.approx(0.99)
    assert latency_buckets(delta) == [(0.001, 100.0), (math.inf, 100.0)]


def test_extrapolated_share_shrinks_with_the_run() -> None:
    shares = [cold_start_share(10.0, 1000, 100.0, 0.1, h) for h in (10_000, 100_000)]
    assert shares[0] == pytest.approx(10 / 1010)
    assert shares[1] < shares[0] / 9


def test_report_and_targets_from_synthetic_runs(tmp_path: str) -> None:
    local = _trace([0.02] * 200)
    runs = {
        Scenario(SEQUENTIAL, LOCAL).key: {0: RunRecord(Scenario(SEQUENTIAL, LOCAL).key, 0,
                                                       local, 4.0)},
        Scenario(SEQUENTIAL, SPOKE, COLD).key: {0: RunRecord(
            Scenario(SEQUENTIAL, SPOKE, COLD).key, 0, _trace([0.03] * 100 + [0.02] * 100), 5.0,
            wan_down_bytes=10**8, wan_up_bytes=10**6,
            metrics={HITS: 50.0, MISSES: 50.0, LOOP_CPU: 3.0, LOOP_RUNQUEUE: 1.0,
                     f'{PREFETCH_SECONDS}{{stage="predict"}}': 0.5,
                     f'{PREFETCH_SECONDS}{{stage="issue"}}': 0.25},
            cpu_seconds={LOADER: 3.0, DAEMON: 4.0, DAEMON_LOOP: 3.0, HUB: 1.0, FORWARDER: 1.0})},
        Scenario(SEQUENTIAL, SPOKE, WARM).key: {0: RunRecord(
            Scenario(SEQUENTIAL, SPOKE, WARM).key, 0, local, 4.0, wan_down_bytes=0,
            wan_up_bytes=0, metrics={HITS: 100.0, MISSES: 0.0,
                                     f'{READER_WAIT_BUCKET}{{le="0.001"}}': 50.0,
                                     f'{READER_WAIT_BUCKET}{{le="0.0025"}}': 100.0,
                                     f'{READER_WAIT_BUCKET}{{le="+Inf"}}': 100.0},
            cpu_seconds={LOADER: 1.0, DAEMON: 4.0, DAEMON_LOOP: 3.8})},
    }
    found = {c.name: c for c in checks(runs, 200e6)}
    cold_time = found["cold spoke, sequential: whole-run time vs hub-local"]
    assert cold_time.value == pytest.approx(5.0 / 4.0) and cold_time.met is False
    assert found["warm spoke, sequential: blocks served from the local cache"].met is True
    assert found["warm spoke, I/O bound: samples/s after the first batch vs hub-local"].met is None
    summary = summarize(runs[Scenario(SEQUENTIAL, SPOKE, COLD).key][0], 200e6)
    assert summary.link_use == pytest.approx(10**8 * 8 / (200e6 * 5.0))
    text = markdown(runs, 200e6, "header", cores=2)
    assert "| spoke cold |" in text and "| spoke warm |" in text
    # CPU floor: the cold run's 9 CPU-seconds over 2 cores (4.5 s, more than its loop's 3 s),
    # the warm run's loop alone (3.8 s, more than 5 s over 2 cores), each over hub-local's 4 s.
    assert "| 5.0 | 1.250× | 1.125× |" in text
    assert "| 4.0 | 1.000× | 0.950× |" in text
    # Every sample's pread took 1 ms: 4,800 samples, 4.8 s in reads over the loader's workers.
    assert "| 1.000 / 1.0 | 4.80 |" in text
    # The cold run's loop ran 3 s of its 5 s and waited 1 s for a core; the warm run's daemon
    # did not report its loop.
    # ... and no read went to the reader thread in the cold run: its last cell is empty too.
    # Its prefetching took 0.75 s of the loop over two stages; the warm run did not report it.
    assert ("| sequential, spoke cold | 0.0 | 0.0 | 0.0 | 0.0 | 0 | 0.75 | 80 %: 60 % + 20 % | – "
            "| – | – | – |" in text)
    # Half the warm run's reader thread waits under 1 ms, the rest under 2.5: p99 in between.
    assert ("| sequential, spoke warm | 0.0 | 0.0 | 0.0 | 0.0 | 0 | – | – | – | – | – "
            "| 1.00 / 2.5 |" in text)
    assert "### I/O bound" not in text  # no table for a variant that was not run
    assert "pyfuse3 ceiling" not in text  # nor a column for a target that was not run
    assert rolling_rate(local.done, 24, window=20)[-1] == pytest.approx(1200)


def test_memfs_runs_once_and_stands_beside_the_warm_targets() -> None:
    assert scenarios(SEQUENTIAL, MEMFS) == [Scenario(SEQUENTIAL, MEMFS)]
    local, memfs, warm = (Scenario(SEQUENTIAL, t, s) for t, s in
                          ((LOCAL, None), (MEMFS, None), (SPOKE, WARM)))
    runs = {local.key: {0: RunRecord(local.key, 0, _trace([0.02] * 200), 4.0)},
            memfs.key: {0: RunRecord(memfs.key, 0, _trace([0.025] * 200), 5.0)},
            warm.key: {0: RunRecord(warm.key, 0, _trace([0.04] * 200), 8.0,
                                    metrics={HITS: 100.0, MISSES: 0.0})}}
    found = {c.name: c for c in checks(runs, 200e6)}
    warm_check = found["warm spoke, sequential, GPU step: samples/s vs hub-local"]
    assert warm_check.values == [pytest.approx(0.5)]
    assert warm_check.ceiling == [pytest.approx(0.8)]
    cold_check = found["cold spoke, sequential: whole-run time vs hub-local"]
    assert cold_check.ceiling == []  # a cache's cold start has no ceiling in memfs
    text = markdown(runs, 200e6, "header", cores=2)
    scenario_rows = [line.split(" | ")[0] for line in text.splitlines()
                     if line.startswith(("| hub-local", "| memfs", "| spoke"))]
    assert scenario_rows == ["| hub-local", "| memfs", "| spoke warm"]
    assert "| memfs | " in text and " | 1.250× |" in text
    targets = text.split("### Targets", 1)[1].split("###", 1)[0]
    assert "| memfs (the pyfuse3 ceiling), same figure |" in targets
    assert "rclone" not in targets  # not run
    assert ("| warm spoke, sequential, GPU step: samples/s vs hub-local | ≥ 0.99× | 0.500× | "
            "0.800× | **no** |") in targets


def test_diagnosis_accounts_for_the_wan_bytes() -> None:
    from bench.repro_diag import diagnose, link_model
    from bench.repro_stats import (DISPATCH_WAIT, HUB_REQUESTS, LONG_STEP_SECONDS,
                                   LONG_STEPS, PREDICTOR_ISSUED, PREDICTOR_USEFUL,
                                   PREFETCH_ISSUED, PREFETCH_LATE, PREFETCH_USEFUL, READ_BYTES)

    trace = _trace([0.02] * 10)
    trace.read_seconds = [0.001] * 240  # 240 samples of 16 KiB read by the loader
    loader = 240 * WINDOW_BYTES
    metrics = {f'{READ_BYTES}{{source="cache"}}': loader * 0.75,
               f'{READ_BYTES}{{source="hub"}}': loader * 0.25,
               PREFETCH_ISSUED: loader * 0.75, PREFETCH_USEFUL: loader * 0.7,
               PREFETCH_LATE: loader * 0.05, MISSES: loader * 0.3 / 4096,
               f'{HUB_REQUESTS}{{priority="demand"}}': 120.0,
               f'{HUB_REQUESTS}{{priority="prefetch"}}': 180.0,
               f'{PREDICTOR_ISSUED}{{predictor="hinted"}}': 3e6,
               f'{PREDICTOR_USEFUL}{{predictor="hinted"}}': 2e6,
               f'{PREDICTOR_ISSUED}{{predictor="stride"}}': 0.0}
    record = RunRecord("shuffled|spoke|cold", 0, trace, 1.0, wan_down_bytes=int(1.3 * loader),
                       wan_up_bytes=0, metrics=metrics)
    d = diagnose(record)
    assert d is not None
    assert d.wan_per_read == pytest.approx(1.3, abs=1e-3)
    assert d.fuse_per_read == pytest.approx(1.0)
    assert (d.demand_requests, d.prefetch_requests) == (120, 180)
    assert d.miss_bytes == pytest.approx(loader * 0.3)
    assert "WAN/read 1.30" in d.line() and "demand 120 prefetch 180" in d.line()
    assert d.line().endswith("; issued/useful MB by predictor: hinted 3/2")  # stride issued 0
    assert diagnose(RunRecord("shuffled|hub-local", 0, trace, 1.0)) is None
    metrics[f'{DISPATCH_WAIT}{{reason="pacer"}}'] = 11.08
    metrics[f'{DISPATCH_WAIT}{{reason="empty"}}'] = 2.04
    d = diagnose(record)
    assert d is not None
    assert "; dispatcher waited s: empty 2.0, pacer 11.1; issued/useful MB" in d.line()
    metrics[f'{LONG_STEPS}{{task="fuse_requests"}}'] = 40.0
    metrics[f'{LONG_STEP_SECONDS}{{task="fuse_requests"}}'] = 0.06
    metrics[f'{LONG_STEPS}{{task="PrefetchPump.run"}}'] = 300.0
    metrics[f'{LONG_STEP_SECONDS}{{task="PrefetchPump.run"}}'] = 0.5
    d = diagnose(record)
    assert d is not None
    assert d.line().endswith("; loop steps >= 1 ms: PrefetchPump.run 300 (0.50 s), "
                             "fuse_requests 40 (0.06 s)")
    scrape = {("neuralcache_fabric_btl_bw_bytes_per_second", ()): 25e6,
              ("neuralcache_fabric_min_rtt_seconds", ()): 0.061}
    assert link_model(scrape) == "link model at the end: btl_bw 200.0 Mbit/s, min_rtt 61.0 ms"


def test_timeline_scrapes_while_the_loop_runs() -> None:
    import time as clock

    from bench import repro_diag

    counter = iter(range(1, 1000))

    def scrape() -> dict:
        n = next(counter)
        return {("neuralcache_read_bytes_total", (("source", "cache"),)): n * 1e6,
                ("neuralcache_read_bytes_total", (("source", "hub"),)): n * 1e6,
                ("neuralcache_fabric_cwnd_bytes", ()): 3e6}

    period, repro_diag.TIMELINE_PERIOD = repro_diag.TIMELINE_PERIOD, 0.01
    try:
        with repro_diag.Timeline(scrape) as timeline:
            clock.sleep(0.1)
    finally:
        repro_diag.TIMELINE_PERIOD = period
    lines = timeline.table().splitlines()
    assert "read MB" in lines[0] and len(lines) >= 3
    first, second = (line.split() for line in lines[1:3])
    assert float(first[1]) == 0.0 and float(second[1]) == pytest.approx(2.0)  # both sources
    assert float(second[6]) == pytest.approx(3.0)  # a gauge as is


# --- runs the host disturbed ---------------------------------------------------------------------

def _stolen(scenario: str, seconds: float, stolen: float, repeat: int = 0) -> RunRecord:
    return RunRecord(scenario, repeat, _trace([0.01] * 10), seconds,
                     cpu_seconds={STOLEN: stolen, LOADER: 1.0})


def test_the_least_disturbed_attempt_is_the_one_whose_worst_loop_lost_least() -> None:
    cold, warm = Scenario(SEQUENTIAL, SPOKE, COLD).key, Scenario(SEQUENTIAL, SPOKE, WARM).key
    assert stolen_share(_stolen(cold, 10.0, 1.0), cores=2) == pytest.approx(0.05)
    assert stolen_share(RunRecord(cold, 0, _trace([0.01]), 10.0), cores=2) == 0.0  # unmeasured
    attempts = [[_stolen(cold, 10.0, 0.2), _stolen(warm, 10.0, 2.0)],  # worst 10 %
                [_stolen(cold, 10.0, 1.0), _stolen(warm, 10.0, 1.0)],  # worst 5 %
                [_stolen(cold, 10.0, 1.0), _stolen(warm, 10.0, 0.0)]]  # worst 5 %, later
    assert least_disturbed(attempts, cores=2) == 1


_CORES = os.cpu_count() or 1
"""What ``Repro.run_undisturbed`` takes the machine to have."""


class _Host:
    """Runner stand-in: each call records one run per scenario, losing the next share of the
    machine's CPU to the hypervisor, or raising."""

    def __init__(self, bench: Repro, shares: list[float | Exception]) -> None:
        self.bench, self.shares, self.calls = bench, shares, 0

    def __call__(self, variant: str, repeat: int) -> None:
        share = self.shares[self.calls]
        self.calls += 1
        for state in (COLD, WARM):
            self.bench.records.append(_stolen(Scenario(variant, SPOKE, state).key, 10.0,
                                              0.0 if isinstance(share, Exception)
                                              else share * 10.0 * _CORES, repeat))
            if isinstance(share, Exception):
                raise share  # after the cold run: a part of an attempt is left


def _bench(tmp_path: Any, attempts: int = 3) -> Repro:
    args = argparse.Namespace(max_steal=0.02, attempts=attempts)
    return Repro(args, ShardLayout(1, 1), str(tmp_path), str(tmp_path / "scratch"),
                 None, str(tmp_path / "results.json"))  # type: ignore[arg-type]


def _kept(bench: Repro) -> dict[str, float]:
    """The kept runs' stolen shares as ``load_results`` gives them, by scenario."""
    _, runs = load_results(bench.results_path)
    return {key: stolen_share(by[0], _CORES) for key, by in runs.items()}


def test_a_disturbed_attempt_is_run_again_and_set_aside(tmp_path: Any) -> None:
    bench = _bench(tmp_path)
    host = _Host(bench, [0.10, 0.01, 0.0])
    bench.run_undisturbed(host, SEQUENTIAL, 0)
    assert host.calls == 2  # the second was quiet enough
    assert list(_kept(bench).values()) == pytest.approx([0.01, 0.01])
    assert [r.discarded is not None for r in bench.records] == [True, True, False, False]
    assert len(bench.meta["discarded"]) == 2 and "attempt 2 kept" in bench.meta["discarded"][0]
    lines = rerun_lines({**bench.meta, "max_steal": 0.02, "attempts": 3})
    assert "more than 2 % of the machine's CPU time" in lines[0] and "(2):" in lines[0]
    assert lines[1].startswith("  - repeat 1, sequential|spoke cold: attempt 1 of 2, during "
                               "which the hypervisor took up to 10.0 % of the CPUs in a loop")
    assert rerun_lines({}) == []  # a results file from before the rule


def test_with_every_attempt_disturbed_the_least_disturbed_is_kept(tmp_path: Any) -> None:
    bench = _bench(tmp_path)
    host = _Host(bench, [0.10, 0.05, 0.08])
    bench.run_undisturbed(host, SEQUENTIAL, 0)
    assert host.calls == 3
    assert [r.discarded is None for r in bench.records] == [False, False, True, True,
                                                            False, False]


def test_a_quiet_run_and_a_single_attempt_are_never_run_again(tmp_path: Any) -> None:
    for shares, attempts in (([0.0, 0.0], 3), ([0.5, 0.0], 1)):
        bench = _bench(tmp_path, attempts)
        host = _Host(bench, list(shares))
        bench.run_undisturbed(host, SEQUENTIAL, 0)
        assert host.calls == 1 and not bench.meta.get("discarded")
        assert all(r.discarded is None for r in bench.records)


def test_a_failed_attempt_after_a_disturbed_one_leaves_the_completed_one(tmp_path: Any) -> None:
    bench = _bench(tmp_path)
    host = _Host(bench, [0.10, RuntimeError("mount failed")])
    with pytest.raises(RuntimeError):
        bench.run_undisturbed(host, SEQUENTIAL, 0)
    assert [r.discarded is None for r in bench.records] == [True, True, False]
    assert "failed" in bench.records[2].discarded  # type: ignore[operator]
    assert len(_kept(bench)) == 2  # the first attempt's cold and warm runs


@pytest.mark.parametrize("argv", [["--max-steal", "1.5"], ["--max-steal", "-0.1"],
                                  ["--attempts", "0"]])
def test_the_rerun_rule_refuses_what_it_cannot_mean(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert build_parser().parse_args([]).max_steal == pytest.approx(0.02)
