"""Reproduce the reference validation: hub-local vs cold and warm spoke, beside rclone, with a real
PyTorch DataLoader over the emulated WAN.

    python -m bench.repro [--quick] [--repeats N] [--workdir DIR] [--markdown FILE] [--plot FILE]
    python -m bench.repro --report-only --results FILE [--markdown FILE] [--plot FILE]

The dataset is packed token shards (``bench.repro_data``: 4,096 uint32 ids = 16 KiB per sample).
Each sample is read by a real ``torch.utils.data.DataLoader`` (workers, prefetch factor, batch 24)
feeding a loop whose GPU step is a sleep (``bench.repro_loader``). Every scenario runs in the same
invocation, over one emulated link (``bench.wan``: 60 ms RTT, 200 Mbit/s by default) whose two
namespaces get the node settings of docs/transport.md (``bench.transport.configure_node``):

- hub-local: the loader reads the export directory itself;
- spoke cold / warm: ``neuralcache mount`` (daemon in the spoke namespace, hub in the hub
  namespace) over an empty cache, then the daemon restarted over the cache that run left;
- rclone cold / warm: ``rclone mount :http: --vfs-cache-mode full --vfs-read-ahead 256M`` of
  ``rclone serve http`` on the hub side, same two states;
- memfs: the shards served from memory by ``bench.memfs``, a minimal pyfuse3 + trio mount on the
  loader's side (no WAN, no cache, no disk): what a Python FUSE mount reaches here at most,
  the ceiling of the warm spoke's figures (up to the runs' noise).

in three variants: GPU step with sequential order; GPU step with a seeded shuffled order (the
same permutation for every target; the spoke's runs announce it with ``HintedSampler``); and I/O
bound (no GPU step, sequential). Before every run the pages it should not find in memory are
evicted (``posix_fadvise(DONTNEED)``): the export's before hub-local and cold runs (the hub reads
from disk), the cache directory's before warm runs; every mount is fresh, so no run finds
another's pages in the kernel. Each repeat runs every scenario, the order of targets rotating
between repeats; ratios are taken within a repeat and the tables show median [min–max]. A run
during which the hypervisor took more than ``--max-steal`` of the machine's CPU time is run
again, up to ``--attempts`` in all, and the least disturbed attempt kept; the report's header
lists the runs set aside.

Work files go under ``--workdir`` (the dataset stays for the next run; caches and mountpoints are
removed). Every mount is unmounted and every process stopped, even on Ctrl-C or SIGTERM, and the
link's namespaces are removed. Results (every run's per-batch timings) are saved as JSON after
each run, so ``--report-only`` can rebuild the tables and the plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Iterator

from bench import mount_procs, proc_cpu, repro_procs
from bench.mount_procs import drop_page_cache, exit_on_sigterm
from bench.repro_data import MANIFEST, WINDOW_BYTES, ShardLayout, make_dataset
from bench.repro_diag import Timeline, diagnose, link_model
from bench.repro_loader import (SEQUENTIAL as ORDER_SEQUENTIAL, SHUFFLED as ORDER_SHUFFLED,
                                STEP_KINDS, STEP_SLEEP, LoopConfig, run_loop)
from bench.repro_report import markdown, plot
from bench.repro_scenarios import (COLD, IO_BOUND, LOCAL, MEMFS, RCLONE, SEQUENTIAL, SHUFFLED,
                                   SPOKE, TARGETS, VARIANTS, WARM, Runs, Scenario, scenarios)
from bench.repro_stats import (HINT_RECORDS, RunRecord, least_disturbed, link_counter,
                               metric_total, metrics_delta, summarize, worst_stolen_share)
from bench.transport import configure_node
from bench.wan import (DEFAULT_MTU, SPOKE as SPOKE_SIDE, LinkSpec, WanLink, parse_rate,
                       parse_rtt)
from fuse_mount.cli import parse_size
from neuralcache.hints import HintedSampler

DEFAULT_WORKDIR = "/var/tmp/neuralcache-repro"
DEFAULT_SIZE = "512M"
DEFAULT_SHARDS = 8
DEFAULT_BATCHES = 999
"""The reference's run length (or the whole epoch, if shorter)."""
DEFAULT_REPEATS = 3
QUICK_SIZE = "64M"
"""``--quick``: 170 batches, just past the reference's early windows, in a few minutes."""
MIN_CACHE_SIZE = 256 << 20
"""Floor of the default cache size (twice the dataset): metadata and LMDB overhead need room."""
SEED = 20250923
"""Fixes the dataset's token ids and the shuffled order, so runs are comparable."""
DOWN, UP = "hub_to_spoke", "spoke_to_hub"
MAX_STEAL = 0.02
"""A loop during which the hypervisor took more than this share of the machine's CPU time is
run again: in session 58's full run the loops fell into two groups, 0-0.9 % and 2.4-12.8 %."""
ATTEMPTS = 3
"""Most attempts at one scenario (in an hour when the host takes CPUs all the time, a run
takes at most this many times as long)."""


def evict_tree(root: str) -> None:
    """Drop every regular file under ``root`` from the page cache."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with contextlib.suppress(OSError):
                    drop_page_cache(path)


class Repro:
    """Runs scenarios against one link, one hub and one rclone server; records each run."""

    def __init__(self, args: argparse.Namespace, layout: ShardLayout, export: str,
                 scratch: str, link: WanLink, results_path: str) -> None:
        self.args = args
        self.layout = layout
        self.export = export
        self.scratch = scratch
        self.link = link
        self.results_path = results_path
        self.meta: dict[str, Any] = {}  # what and where was measured; saved with the runs
        self.records: list[RunRecord] = []
        self.hub_address = ""
        self.rclone_url = ""
        self.rclone_config = os.path.join(scratch, "rclone.conf")
        self.logs = os.path.join(scratch, "logs")
        os.makedirs(self.logs, exist_ok=True)
        open(self.rclone_config, "w").close()  # rclone needs a config file; remotes are inline

    # -- configuration --------------------------------------------------------------------
    def loop_config(self, variant: str) -> LoopConfig:
        a = self.args
        base = LoopConfig(batch_size=a.batch_size, workers=a.workers,
                          prefetch_factor=a.prefetch_factor, step_seconds=a.step_ms / 1e3,
                          step_kind=a.step_kind, batches=a.batches, order=ORDER_SEQUENTIAL,
                          seed=a.seed)
        if variant == SHUFFLED:
            return replace(base, order=ORDER_SHUFFLED)
        if variant == IO_BOUND:
            return replace(base, step_seconds=0.0, step_kind=STEP_SLEEP,
                           batches=a.io_batches)
        return base

    @property
    def cache_size(self) -> int:
        return self.args.cache_size or max(MIN_CACHE_SIZE, 2 * self.layout.total_bytes)

    # -- one measured loop ------------------------------------------------------------------
    def _probe(self) -> tuple[dict[str, float], float, dict[str, Any]]:
        return proc_cpu.snapshot(), time.perf_counter(), self.link.stats()

    def measure(self, scenario: Scenario, repeat: int, root: str,
                wrap_sampler: Callable[[Iterable[int]], Iterable[int]] | None = None,
                metrics_port: int | None = None) -> RunRecord:
        before = (None if metrics_port is None
                  else repro_procs.scrape(self.link, SPOKE_SIDE, metrics_port))
        with contextlib.ExitStack() as stack:
            timeline = None
            if self.args.timeline and metrics_port is not None:
                timeline = stack.enter_context(Timeline(
                    lambda: repro_procs.scrape(self.link, SPOKE_SIDE, metrics_port)))
            trace = run_loop(root, self.layout, self.loop_config(scenario.variant),
                             wrap_sampler, probe=self._probe)
        (cpu0, t0, s0), (cpu1, t1, s1) = trace.probes
        trace.probes = []
        remote = scenario.target in (SPOKE, RCLONE)  # reads over the link
        metrics = None
        gauges = ""
        if metrics_port is not None and before is not None:
            after = repro_procs.scrape(self.link, SPOKE_SIDE, metrics_port)
            metrics = metrics_delta(before, after)
            gauges = link_model(after)
        record = RunRecord(
            scenario.key, repeat, trace, t1 - t0,
            wan_down_bytes=link_counter(s0, s1, DOWN, "forwarded_bytes") if remote else None,
            wan_up_bytes=link_counter(s0, s1, UP, "forwarded_bytes") if remote else None,
            wan_drops=link_counter(s0, s1, DOWN, "queue_dropped_packets") if remote else None,
            metrics=metrics, cpu_seconds=proc_cpu.used(cpu0, cpu1))
        self.records.append(record)
        self._report_run(record)
        if record.cpu_seconds:
            print(f"    {proc_cpu.describe(record.cpu_seconds, record.probe_seconds)}",
                  flush=True)
        if gauges:
            print(f"    {gauges}", flush=True)
        if timeline is not None:
            print(timeline.table(), flush=True)
        self.save()
        return record

    def _report_run(self, record: RunRecord) -> None:
        s = summarize(record, self.link.spec.rate_bps)
        early = s.windows[0]
        extra = ""
        if s.hit_ratio is not None:
            extra += f", hit ratio {100 * s.hit_ratio:.2f} %"
        if record.metrics is not None and Scenario.parse(record.scenario).variant == SHUFFLED:
            extra += f", hint records {metric_total(record.metrics, HINT_RECORDS):.0f}"
        if s.wan_mb is not None:
            extra += (f", WAN {s.wan_mb:.0f} MB ({100 * (s.link_use or 0):.0f} % of link, "
                      f"{s.wan_drops} packets dropped)")
        print(f"  {record.scenario:<28} {s.batches} batches in {s.seconds:7.2f} s, "
              f"{s.samples_per_s:7.1f} samples/s (0-100: "
              f"{early if early is None else round(early, 1)}), waiting "
              f"{100 * s.waiting_share:.1f} %{extra}", flush=True)
        diagnosis = diagnose(record)
        if diagnosis is not None:
            print(f"    {diagnosis.line()}", flush=True)

    def save(self) -> None:
        tmp = self.results_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": self.meta, "runs": [r.to_json() for r in self.records]}, f)
        os.replace(tmp, self.results_path)

    # -- targets ----------------------------------------------------------------------------
    def run_local(self, variant: str, repeat: int) -> None:
        evict_tree(self.export)
        self.measure(Scenario(variant, LOCAL), repeat, self.export)

    def _fresh(self, name: str) -> tuple[str, str]:
        cache, mountpoint = (os.path.join(self.scratch, f"{name}-cache"),
                             os.path.join(self.scratch, f"{name}-mnt"))
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
        os.makedirs(mountpoint, exist_ok=True)
        return cache, mountpoint

    def run_spoke(self, variant: str, repeat: int) -> None:
        cache, mountpoint = self._fresh("spoke")
        hints = variant == SHUFFLED and not self.args.no_hints
        options = ["--link-bandwidth", f"{self.link.spec.rate_bps / 1e6:g}",
                   "--link-rtt", f"{self.link.spec.rtt * 1e3:g}", *self.args.spoke_option]
        for scenario in scenarios(variant, SPOKE):
            evict_tree(self.export if scenario.state == COLD else cache)
            name = f"spoke-{repeat}-{variant}-{scenario.state}"
            log = os.path.join(self.logs, f"{name}.log")
            trace = ([f"--record-trace={os.path.join(self.args.record_traces, name)}.trace"]
                     if self.args.record_traces else [])
            with repro_procs.spoke(self.link, self.hub_address, cache, mountpoint,
                                   self.cache_size, log, options + trace) as mount:
                if scenario.state == WARM and self.args.warm_drop_manifest:
                    repro_procs.drop_cached(os.path.join(mountpoint, MANIFEST))
                self.measure(scenario, repeat, mountpoint,
                             self._hinted(mountpoint) if hints else None, mount.metrics_port)

    def _hinted(self, mountpoint: str) -> Callable[[Iterable[int]], Iterable[int]]:
        """Wraps the loader's sampler in ``HintedSampler``, announcing each epoch's reads (as
        exact: the dataset reads each sample with one ``pread`` and never maps a shard)."""
        def wrap(sampler: Iterable[int]) -> Iterable[int]:
            return HintedSampler(sampler, mountpoint, self.layout.ranges, exact_reads=True)
        return wrap

    def run_rclone(self, variant: str, repeat: int) -> None:
        cache, mountpoint = self._fresh("rclone")
        for scenario in scenarios(variant, RCLONE):
            evict_tree(self.export if scenario.state == COLD else cache)
            log = os.path.join(self.logs, f"rclone-mount-{repeat}-{variant}-{scenario.state}.log")
            with repro_procs.rclone_mount(self.link, self.rclone_url, cache, mountpoint,
                                          self.cache_size, self.rclone_config, log):
                self.measure(scenario, repeat, mountpoint)

    def run_memfs(self, variant: str, repeat: int) -> None:
        """The shards from memory through ``bench.memfs``, mounted afresh for every run."""
        shards = [os.path.join(self.export, self.layout.shard_name(shard))
                  for shard in range(self.layout.shards)]
        mountpoint = os.path.join(self.scratch, "memfs-mnt")
        with mount_procs.memfs(mountpoint, *shards):
            self.measure(Scenario(variant, MEMFS), repeat, mountpoint)

    def run_undisturbed(self, runner: Callable[[str, int], None], variant: str,
                        repeat: int) -> None:
        """``runner(variant, repeat)``, run again while the hypervisor took more than
        ``--max-steal`` of the machine's CPU time over any of its loops, up to ``--attempts``
        in all; the least disturbed attempt is kept (``least_disturbed``), the others' records
        are marked discarded and listed in the report's header.

        While the host runs others on this machine's CPUs nothing here runs, the loop's step,
        its workers' reads and the daemon's replies all wait: a loop during which the host took
        CPUs away ran slower for the host, not the code. A cold spoke loop whose machine lost
        13 % of its CPU time came to 1.070x hub-local's time where an undisturbed pair of the
        same run came to 1.027x (docs/repro.md, session 59). A spoke attempt is its cold and
        warm runs together: the warm one reads the cache the cold one filled. An attempt that
        fails is set aside if an earlier one completed, and the failure is reported as
        before."""
        cores = os.cpu_count() or 1
        attempts: list[list[RunRecord]] = []
        try:
            while True:
                first = len(self.records)
                try:
                    runner(variant, repeat)
                except BaseException:
                    if attempts:  # keep the completed attempts; this one's part goes
                        self._discard(self.records[first:], "its attempt failed")
                    raise
                attempts.append(self.records[first:])
                worst = worst_stolen_share(attempts[-1], cores)
                if worst <= self.args.max_steal or len(attempts) >= self.args.attempts:
                    break
                print(f"  the hypervisor took {100 * worst:.1f} % of the CPUs during a loop: "
                      f"running it again (attempt {len(attempts) + 1} of "
                      f"{self.args.attempts})", flush=True)
        finally:
            if len(attempts) > 1:
                kept = least_disturbed(attempts, cores)
                for number, made in enumerate(attempts, 1):
                    if number - 1 == kept:
                        continue
                    share = worst_stolen_share(made, cores)
                    self._discard(made, f"attempt {number} of {len(attempts)}, during which the "
                                        f"hypervisor took up to {100 * share:.1f} % of the CPUs "
                                        f"in a loop; attempt {kept + 1} kept")
            self.save()

    def _discard(self, records: list[RunRecord], why: str) -> None:
        for record in records:
            record.discarded = why
            self.meta.setdefault("discarded", []).append(
                f"repeat {record.repeat + 1}, {record.scenario}: {why}")

    def run(self, variants: list[str], targets: list[str], repeats: int) -> None:
        runners = {LOCAL: self.run_local, SPOKE: self.run_spoke, RCLONE: self.run_rclone,
                   MEMFS: self.run_memfs}
        with contextlib.ExitStack() as stack:
            if SPOKE in targets:
                self.hub_address = stack.enter_context(repro_procs.hub(
                    self.link, self.export, os.path.join(self.logs, "hub.log")))
            if RCLONE in targets:
                self.rclone_url = stack.enter_context(repro_procs.rclone_server(
                    self.link, self.export, self.rclone_config,
                    os.path.join(self.logs, "rclone-serve.log")))
            for repeat in range(repeats):
                turn = repeat % len(targets)  # rotate, so no target always runs first
                order = targets[turn:] + targets[:turn]
                for variant in variants:
                    print(f"repeat {repeat + 1}/{repeats}, {variant}: {', '.join(order)}",
                          flush=True)
                    for target in order:
                        try:
                            self.run_undisturbed(runners[target], variant, repeat)
                        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                            # one broken scenario must not cost the other half hour of runs
                            failure = f"repeat {repeat + 1}, {variant}, {target}: {exc}"
                            print(f"  FAILED {failure}", flush=True)
                            self.meta.setdefault("failures", []).append(failure)
                            self.save()


# --- results file and report --------------------------------------------------------------------

def load_results(path: str) -> tuple[dict[str, Any], Runs]:
    with open(path) as f:
        data = json.load(f)
    runs: Runs = {}
    for item in data["runs"]:
        record = RunRecord.from_json(item)
        if record.discarded is None:  # else run again (``Repro.run_undisturbed``)
            runs.setdefault(record.scenario, {})[record.repeat] = record
    return data["meta"], runs


def header(meta: dict[str, Any], runs: Runs) -> str:
    layout, loop, link = meta["layout"], meta["loop"], meta["link"]
    repeats = max(len(v) for v in runs.values())
    hint_counts = sorted({metric_total(r.metrics, HINT_RECORDS) for key, by in runs.items()
                          for r in by.values() if r.metrics is not None
                          and Scenario.parse(key).variant == SHUFFLED})
    hints = ("not run" if not hint_counts else
             "**not accepted by the mount (0 records)**" if max(hint_counts) == 0 else
             f"accepted ({', '.join(f'{c:.0f}' for c in hint_counts)} records per run)")
    return "\n".join([
        f"Measured {meta['date']} on {meta['host']} ({meta['cores']} cores, load average "
        f"{meta['load_start']} at the start, {meta.get('load_end', '?')} at the end), "
        f"git {meta['git']}:",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"- dataset: {layout['shards']} shards × {layout['windows']} windows of 4,096 uint32 "
        f"tokens (16 KiB per sample), {layout['total_bytes'] / 2**20:.0f} MiB",
        f"- loader: batch {loop['batch_size']}, {loop['workers']} workers, prefetch factor "
        f"{loop['prefetch_factor']}, GPU step: {loop['step_kind']} {loop['step_seconds'] * 1e3:g}"
        f" ms, {loop['batches']} batches (I/O bound: {meta['io_batches']})",
        f"- link: {link['rtt'] * 1e3:g} ms RTT, {link['rate_bps'] / 1e6:g} Mbit/s, loss "
        f"{link['loss']:g}, MTU {link.get('mtu', DEFAULT_MTU)}; "
        f"spoke cache {meta['cache_size'] / 2**20:.0f} MiB; "
        f"{meta['rclone']}; torch {meta['torch']}",
        f"- {repeats} repeat(s); cells are median [min–max] over repeats; ratios are taken "
        "within a repeat. Shuffled hints: " + hints,
        *[f"- **failed:** {failure}" for failure in meta.get("failures", [])],
        *rerun_lines(meta),
    ])


def rerun_lines(meta: dict[str, Any]) -> list[str]:
    """The header's lines on runs set aside because the host took CPUs away during them."""
    limit = meta.get("max_steal")
    if limit is None:  # a results file from before the rule
        return []
    rule = (f"- a run during which the hypervisor took more than {100 * limit:g} % of the "
            f"machine's CPU time was run again, up to {meta['attempts']} attempts in all, and "
            "the least disturbed attempt kept")
    discarded = meta.get("discarded", [])
    return [rule + (f"; set aside ({len(discarded)}):" if discarded else "; none was"),
            *[f"  - {line}" for line in discarded]]


def write_report(meta: dict[str, Any], runs: Runs, markdown_path: str | None,
                 plot_path: str | None) -> str:
    text = markdown(runs, meta["link"]["rate_bps"], header(meta, runs), meta["cores"])
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(text)
    if plot_path:
        plot(runs, plot_path, f"DataLoader samples/s over an emulated "
                              f"{meta['link']['rtt'] * 1e3:g} ms / "
                              f"{meta['link']['rate_bps'] / 1e6:g} Mbit/s WAN")
    return text


def _command_output(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _meta(args: argparse.Namespace, layout: ShardLayout, spec: LinkSpec, config: LoopConfig,
          cache_size: int, io_batches: int) -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "host": platform.node(),
        "cores": os.cpu_count(), "load_start": f"{os.getloadavg()[0]:.2f}",
        "git": _command_output(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                                "rev-parse", "--short", "HEAD"]),
        "command": "python -m bench.repro " + shlex.join(sys.argv[1:]),
        "layout": {**asdict(layout), "total_bytes": layout.total_bytes},
        "loop": asdict(config), "io_batches": io_batches,
        "link": {"rtt": spec.rtt, "rate_bps": spec.rate_bps, "loss": spec.loss, "mtu": spec.mtu},
        "cache_size": cache_size, "torch": torch.__version__,
        "max_steal": args.max_steal, "attempts": args.attempts,
        "rclone": _command_output(["rclone", "version"]).splitlines()[0],
    }


# --- command line ---------------------------------------------------------------------------

def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share from 0 to 1; got {text!r}")
    return value


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1; got {text!r}")
    return value


def _csv(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}; got {text!r}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.repro", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"development run: {QUICK_SIZE} (every batch of it), 1 repeat")
    p.add_argument("--size", type=parse_size, help=f"dataset size [{DEFAULT_SIZE}]")
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS, help="shard files [%(default)s]")
    p.add_argument("--batches", type=int, help=f"batches per GPU-step run [{DEFAULT_BATCHES}]")
    p.add_argument("--io-batches", type=int, default=0,
                   help="batches per I/O-bound run [0: the whole dataset]")
    p.add_argument("--repeats", type=int, help=f"times each scenario runs [{DEFAULT_REPEATS}]")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--prefetch-factor", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0, help="GPU step stand-in [%(default)g]")
    p.add_argument("--step-kind", choices=STEP_KINDS, default=STEP_SLEEP,
                   help="sleep, or a tiny real model on the CPU [%(default)s]")
    p.add_argument("--rtt", type=parse_rtt, default=parse_rtt("60ms"), help="[60ms]")
    p.add_argument("--rate", type=parse_rate, default=parse_rate("200mbit"), help="[200mbit]")
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                   help="packet size of the emulated link [%(default)s]; the emulator forwards "
                   "each packet in Python on the machine's own cores, so larger ones leave the "
                   "spoke more CPU (bench.wan)")
    p.add_argument("--variants", type=_csv(VARIANTS), default=list(VARIANTS),
                   help=f"[{','.join(VARIANTS)}]")
    p.add_argument("--targets", type=_csv(TARGETS), default=list(TARGETS),
                   help=f"[{','.join(TARGETS)}]")
    p.add_argument("--no-hints", action="store_true",
                   help="shuffled spoke runs without the hints sampler")
    p.add_argument("--cache-size", type=parse_size,
                   help="spoke and rclone cache size [twice the dataset]")
    p.add_argument("--spoke-option", action="append", default=[], metavar="OPT",
                   help="extra argument for every neuralcache mount, e.g. "
                        "--spoke-option=--no-prefetch (repeatable)")
    p.add_argument("--warm-drop-manifest", action="store_true",
                   help="drop the dataset's manifest, which the loader never reads, from the "
                        "cache before each warm spoke run (neuralcache cache drop): a warm cache "
                        "short of a file, whose prefetcher keeps watching the reads")
    p.add_argument("--record-traces", metavar="DIR",
                   help="record each spoke run's reads and hints to DIR/spoke-REPEAT-VARIANT-"
                        "STATE.trace (replay: python -m bench.prefetch_eval --trace FILE)")
    p.add_argument("--timeline", action="store_true",
                   help="print the spoke's prefetch and transport gauges every 0.25 s of each "
                        "spoke run (bench.repro_diag.Timeline)")
    p.add_argument("--max-steal", type=_share, default=MAX_STEAL, metavar="SHARE",
                   help="run a scenario again if the hypervisor took more than this share of "
                        "the machine's CPU time during one of its loops [%(default)g]")
    p.add_argument("--attempts", type=_at_least_one, default=ATTEMPTS,
                   help="most attempts at a scenario under --max-steal; the least disturbed "
                        "is kept [%(default)s]; 1: never run again")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR,
                   help=f"dataset, caches and mounts; never the repo [{DEFAULT_WORKDIR}]")
    p.add_argument("--results", help="results JSON [WORKDIR/results.json]")
    p.add_argument("--markdown", help="also write the report (markdown) to this file")
    p.add_argument("--plot", help="samples/s plot (PNG) [WORKDIR/repro-samples.png; with "
                                  "--report-only, beside the results file]")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from --results without running anything")
    p.add_argument("--keep", action="store_true", help="keep caches and logs of this run")
    return p


@contextlib.contextmanager
def _scratch(workdir: str, keep: bool) -> Iterator[str]:
    path = os.path.join(workdir, f"run-{os.getpid()}")
    os.makedirs(path)
    try:
        yield path
    finally:
        if keep:
            print(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workdir = os.path.abspath(args.workdir)
    results_path = args.results or os.path.join(workdir, "results.json")
    # A report rebuilt from a results file puts its plot beside it: the workdir may be gone.
    plot_dir = os.path.dirname(os.path.abspath(results_path)) if args.report_only else workdir
    plot_path = args.plot or os.path.join(plot_dir, "repro-samples.png")
    if args.report_only:
        meta, runs = load_results(results_path)
        print(write_report(meta, runs, args.markdown, plot_path))
        return 0
    size = args.size or parse_size(QUICK_SIZE if args.quick else DEFAULT_SIZE)
    args.batches = args.batches or DEFAULT_BATCHES
    repeats = args.repeats or (1 if args.quick else DEFAULT_REPEATS)
    exit_on_sigterm()
    if args.record_traces:
        args.record_traces = os.path.abspath(args.record_traces)
        os.makedirs(args.record_traces, exist_ok=True)

    layout = ShardLayout.for_size(size, args.shards)
    export = os.path.join(workdir, f"export-{layout.shards}x{layout.windows}")
    os.makedirs(workdir, exist_ok=True)
    seconds = make_dataset(export, layout, args.seed)
    if seconds:
        print(f"wrote {layout.total_bytes / 2**20:.0f} MiB of shards to {export} in "
              f"{seconds:.1f} s", flush=True)
    epoch = layout.samples // args.batch_size
    io_batches = args.io_batches = min(args.io_batches or epoch, epoch)
    spec = LinkSpec(rtt=args.rtt, rate_bps=args.rate, loss=args.loss, mtu=args.mtu)
    print(f"dataset {layout.shards} x {layout.windows} windows ({layout.total_bytes / 2**20:.0f}"
          f" MiB, {layout.samples} samples of {WINDOW_BYTES // 1024} KiB, {epoch} batches); "
          f"link {spec.rtt * 1e3:g} ms / {spec.rate_bps / 1e6:g} Mbit/s; {repeats} repeat(s)",
          flush=True)
    try:
        with _scratch(workdir, args.keep) as scratch, WanLink(spec) as link:
            configure_node(link)
            bench = Repro(args, layout, export, scratch, link, results_path)
            bench.meta = _meta(args, layout, spec, bench.loop_config(SEQUENTIAL),
                               bench.cache_size, io_batches)
            try:
                bench.run(args.variants, args.targets, repeats)
            finally:
                bench.meta["load_end"] = f"{os.getloadavg()[0]:.2f}"
                bench.save()
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    meta, runs = load_results(results_path)
    print(write_report(meta, runs, args.markdown, plot_path))
    print(f"results: {results_path}; plot: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
