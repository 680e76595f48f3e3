"""Source trees compared by the same bench.repro runs, interleaved round by round.

    python -m bench.repro_ab --tree base=DIR --tree change=DIR [--rounds 3] [--out DIR]
                             [--workdir DIR] -- [bench.repro options]

Why: on this shared machine one tree's runs spread by more than most changes move a figure
(the hypervisor alone took up to 43 % of the CPUs in some minutes, docs/repro.md), so a change
is judged by runs of both trees interleaved, and by how often each came out ahead within a
round, not by a figure set against one measured an hour before. Each tree is a directory
holding the repository's packages (``git archive REV | tar -x -C DIR``); its runs start in it
(``python -m`` puts the current directory first on the module path, and the hub and the daemon
are started the same way) with this interpreter. One run per tree and round (``--repeats 1``),
the trees' order rotating from round to round. Every run's results JSON and log stay in
``--out``. After each run it prints the run's measured targets, the spoke daemon's CPU seconds
over each spoke run's loop, the loader's time in reads and the cache's reader thread's disk
waits in each spoke run, and the CPU time the hypervisor took during the loops; at the end,
per figure, each tree's values, their median and in how many rounds each tree did best. The
targets are ratios to hub-local's run in the same ``bench.repro`` run, so ``--targets`` must
include hub-local (the default does). Ctrl-C or SIGTERM stops the run in progress as it would
stop on its own. Wrap it in ``flock /tmp/nc-bench.lock`` as the other benches.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bench.mount_procs import exit_on_sigterm
from bench.proc_cpu import DAEMON, STOLEN
from bench.repro import DEFAULT_WORKDIR, load_results
from bench.repro_procs import stop_process
from bench.repro_scenarios import SPOKE, Scenario, checks
from bench.repro_stats import READER_DISK_WAITS, read_seconds_total

DEFAULT_ROUNDS = 3
RUN_TIMEOUT = 3600.0
"""Seconds one ``bench.repro`` run may take before it is stopped (a full-size run of every
variant and target takes ~7 min here)."""
STOP_TIMEOUT = 60.0
"""Seconds a stopped run may take to unmount and remove what it made before it is killed."""
LOADER_READS = "loader's seconds in reads"
"""The figure of ``repro_stats.read_seconds_total``: what the mount's waits cost the loader's
workers, told apart from the run's time, which the hub-local run it is a ratio to, reading its
export from a disk other tenants share, moves as much."""
READER_WAITS = "reader thread's disk waits"
"""``neuralcache_cache_reader_disk_waits_total`` over the loop: the times a warm read in the
cache's reader thread waited for the disk (and every read queued behind it), because no
read-ahead had asked for its pages in time. A figure that changes with how the daemon reads
ahead, where the loader's time in reads also moves with the disk other tenants share."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
OWN_OPTIONS = ("--repeats", "--results", "--workdir", "--report-only")
"""``bench.repro`` options this tool sets itself for every run."""


@dataclass(frozen=True)
class Figure:
    """One target's figure from one run, and which way is better."""

    value: float
    at_least: bool  # True: higher is better


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The trees' order in a round: each round starts one tree later, so that no tree always
    runs first or last in a round."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def best_counts(figures: dict[str, list[Figure | None]]) -> tuple[dict[str, int], int]:
    """In how many rounds each tree had the best figure (a tie counts for every tree in it),
    and over how many rounds: those where a tree lacks the figure are left out."""
    counts = dict.fromkeys(figures, 0)
    rounds = 0
    for row in zip(*figures.values()):
        present = [f for f in row if f is not None]
        if len(present) < len(row):
            continue
        rounds += 1
        values = [f.value for f in present]
        best = max(values) if present[0].at_least else min(values)
        for name, f in zip(figures, present):
            counts[name] += f.value == best
    return counts, rounds


def run_figures(results_path: str) -> tuple[dict[str, Figure], float]:
    """The measured targets of one results file, then for each of its spoke runs the daemon's
    CPU seconds over the loop (steadier than the times on a shared machine, and what most
    changes to the daemon move), the loader's time in reads (``LOADER_READS``) and the reader
    thread's disk waits (``READER_WAITS``, where the run's metrics have them), and the CPU
    seconds the hypervisor took over all of its runs' loops."""
    meta, runs = load_results(results_path)
    found = {c.name: Figure(c.value, c.at_least)
             for c in checks(runs, meta["link"]["rate_bps"]) if c.value is not None}
    for key, by_repeat in runs.items():
        scenario = Scenario.parse(key)
        if scenario.target != SPOKE:
            continue
        daemon = [r.cpu_seconds[DAEMON] for r in by_repeat.values()
                  if r.cpu_seconds and DAEMON in r.cpu_seconds]
        if daemon:
            found[f"{scenario.variant}, {scenario.label}: {DAEMON} CPU seconds over the loop"] = \
                Figure(statistics.median(daemon), at_least=False)
        found[f"{scenario.variant}, {scenario.label}: {LOADER_READS}"] = Figure(
            statistics.median(read_seconds_total(r.trace) for r in by_repeat.values()),
            at_least=False)
        waits = [r.metrics[READER_DISK_WAITS] for r in by_repeat.values()
                 if r.metrics and READER_DISK_WAITS in r.metrics]
        if waits:
            found[f"{scenario.variant}, {scenario.label}: {READER_WAITS}"] = Figure(
                statistics.median(waits), at_least=False)
    stolen = sum((r.cpu_seconds or {}).get(STOLEN, 0.0) for by in runs.values()
                 for r in by.values())
    return found, stolen


def parse_trees(parser: argparse.ArgumentParser, specs: list[str], package: str
                ) -> dict[str, str]:
    """The ``--tree NAME=DIR`` options as {name: absolute DIR}, each DIR holding ``package``
    (what the tool runs from it); a bad one ends the program through ``parser``."""
    trees: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not _NAME.fullmatch(name) or not os.path.isdir(os.path.join(path, package)):
            parser.error(f"--tree {spec!r}: expected NAME=DIR, NAME of letters, digits, '-', "
                         "'_' or '.' (it names the run's files), DIR holding the repository's "
                         "packages")
        if name in trees:
            parser.error(f"--tree {name!r} given twice")
        trees[name] = os.path.abspath(path)
    return trees


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str], list[str]]:
    """This tool's options, its trees by name, and the options passed on to ``bench.repro``."""
    own, repro_args = ((argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv
                       else (argv, []))
    parser = argparse.ArgumentParser(
        prog="python -m bench.repro_ab", description=__doc__.split("\n")[0],
        epilog=f"Options after -- go to every bench.repro run, but {', '.join(OWN_OPTIONS)}, "
               "which this tool sets.")
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                        help="a source tree to run bench.repro from (two or more)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--out", default=os.path.join(DEFAULT_WORKDIR, "ab"),
                        help="where each run's results and log go")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="bench.repro's --workdir")
    args = parser.parse_args(own)
    trees = parse_trees(parser, args.tree, "bench")
    if len(trees) < 2 or args.rounds < 1:
        parser.error("two or more trees and one or more rounds are needed")
    if clash := [a for a in repro_args if a.split("=")[0] in OWN_OPTIONS]:
        parser.error(f"{', '.join(clash)}: set by this tool for every run")
    return args, trees, repro_args


def _run(tree: str, stem: str, repro_args: list[str], workdir: str) -> dict[str, Figure] | None:
    """One ``bench.repro`` run from ``tree``, results and log under ``stem``; its measured
    targets (printed), or None if it failed."""
    command = [sys.executable, "-m", "bench.repro", *repro_args, "--repeats", "1",
               "--results", stem + ".json", "--workdir", workdir]
    print(f"python {' '.join(command[1:])} (in {tree}, log {stem}.log)", flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(stem + ".json")  # an earlier comparison's: never read as this run's
    with open(stem + ".log", "w") as log:
        # A session of its own: a terminal's Ctrl-C reaches this tool only, which then stops
        # the run with one SIGTERM (a second signal would cut its clean-up short).
        child = subprocess.Popen(command, cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            code = child.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            stop_process(child, STOP_TIMEOUT)  # a run cleans up on SIGTERM
            code = -1
        except BaseException:  # Ctrl-C, SIGTERM: the run cleans up before this tool exits
            stop_process(child, STOP_TIMEOUT)
            raise
    if code != 0 or not os.path.exists(stem + ".json"):
        print(f"  failed (exit {code}); see the log", flush=True)
        return None
    found, stolen = run_figures(stem + ".json")
    for target, figure in found.items():
        print(f"  {target}: {figure.value:.3f}", flush=True)
    print(f"  CPU taken by the hypervisor over the loops: {stolen:.1f} s", flush=True)
    return found


def _report(table: dict[str, dict[str, list[Figure | None]]]) -> None:
    print("\nper target: each tree's figure round by round, their median, and in how many rounds "
          "the tree did best")
    for target, row in table.items():
        counts, rounds = best_counts(row)
        print(target)
        for name, figures in row.items():
            values = " ".join(_format(f.value if f else None) for f in figures)
            median = _format(statistics.median(present) if (present := [
                f.value for f in figures if f is not None]) else None)
            print(f"  {name:<16} {values}   median {median}, best in {counts[name]} of {rounds}")


def main(argv: list[str] | None = None) -> int:
    args, trees, repro_args = _parse(sys.argv[1:] if argv is None else argv)
    out, workdir = os.path.abspath(args.out), os.path.abspath(args.workdir)
    os.makedirs(out, exist_ok=True)
    names = list(trees)
    table: dict[str, dict[str, list[Figure | None]]] = {}
    failed = 0
    for r in range(args.rounds):
        for name in rotation(names, r):
            print(f"round {r + 1}/{args.rounds}, {name}: ", end="")
            found = _run(trees[name], os.path.join(out, f"{name}-{r + 1}"), repro_args, workdir)
            failed += found is None
            for target in [*table, *(t for t in found or {} if t not in table)]:
                row = table.setdefault(target, {n: [None] * args.rounds for n in names})
                row[name][r] = (found or {}).get(target)
    _report(table)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
