"""bench/repro_ab.py: the trees' order, who did best, the figures read back from a results
file, and a whole comparison over stand-in trees whose ``bench.repro`` only hands back a
prepared results file (the real bench needs the WAN emulator, a mount and torch)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.proc_cpu import DAEMON, STOLEN
from bench.repro_ab import Figure, best_counts, main, rotation, run_figures
from bench.repro_loader import LoopTrace
from bench.repro_scenarios import COLD, LOCAL, SHUFFLED, SPOKE, Scenario
from bench.repro_stats import READER_DISK_WAITS, RunRecord

COLD_SHUFFLE = "cold spoke, shuffled with hints: whole-run time vs hub-local"
DAEMON_CPU = "shuffled, spoke cold: spoke daemon CPU seconds over the loop"
LOADER_READS = "shuffled, spoke cold: loader's seconds in reads"
READER_WAITS = "shuffled, spoke cold: reader thread's disk waits"


@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=6, unique=True))
def test_each_tree_runs_first_once_in_as_many_rounds(names: list[str]) -> None:
    orders = [rotation(names, r) for r in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert sorted(order[0] for order in orders) == sorted(names)
    assert rotation(names, len(names)) == orders[0]


def test_best_is_the_lower_time_or_the_higher_share() -> None:
    def duration(value: float) -> Figure:
        return Figure(value, at_least=False)

    def share(value: float) -> Figure:
        return Figure(value, at_least=True)

    counts, rounds = best_counts({
        "base": [duration(1.10), duration(1.05), duration(1.07), None],
        "change": [duration(1.04), duration(1.05), duration(1.09), duration(1.0)]})
    assert (counts, rounds) == ({"base": 2, "change": 2}, 3)  # a tie counts for both
    counts, rounds = best_counts({"base": [share(0.91)], "change": [share(0.94)]})
    assert (counts, rounds) == ({"base": 0, "change": 1}, 1)


def _results(path: Path, cold_seconds: float, stolen: float) -> None:
    """A results file as ``bench.repro`` writes it: one hub-local and one cold shuffle run."""
    def record(key: str, seconds: float, cpu: dict[str, float],
               metrics: dict[str, float] | None = None) -> dict:
        done = [float(t) for t in np.cumsum([seconds / 100] * 100)]
        trace = LoopTrace(24, asked=[0.0] + done[:-1], ready=[0.0] + done[:-1], done=done,
                          read_seconds=[0.001] * 2400)
        return RunRecord(key, 0, trace, seconds, metrics=metrics, cpu_seconds=cpu).to_json()

    runs = [record(Scenario(SHUFFLED, LOCAL).key, 4.0, {STOLEN: 0.5}),
            record(Scenario(SHUFFLED, SPOKE, COLD).key, cold_seconds,
                   {STOLEN: stolen, DAEMON: 3 * cold_seconds}, {READER_DISK_WAITS: 17.0})]
    path.write_text(json.dumps({"meta": {"link": {"rate_bps": 200e6}}, "runs": runs}))


def test_a_results_file_gives_its_targets_and_the_stolen_time(tmp_path: Path) -> None:
    _results(tmp_path / "r.json", cold_seconds=4.4, stolen=1.5)
    found, stolen = run_figures(str(tmp_path / "r.json"))
    assert found == {COLD_SHUFFLE: Figure(pytest.approx(1.1), at_least=False),
                     DAEMON_CPU: Figure(pytest.approx(13.2), at_least=False),
                     LOADER_READS: Figure(pytest.approx(2.4), at_least=False),
                     READER_WAITS: Figure(17.0, at_least=False)}
    assert stolen == pytest.approx(2.0)


def _stand_in(root: Path, name: str, cold_seconds: float) -> Path:
    """A tree whose ``python -m bench.repro`` copies a prepared results file to ``--results``
    and notes its arguments, or fails if its results file is missing."""
    tree = root / name
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "__init__.py").write_text("")
    if cold_seconds > 0:
        _results(tree / "prepared.json", cold_seconds, stolen=0.0)
    (tree / "bench" / "repro.py").write_text(textwrap.dedent("""\
        import shutil, sys
        from pathlib import Path
        tree = Path(__file__).parent.parent
        with open(tree / "argv.txt", "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        results = sys.argv[sys.argv.index("--results") + 1]
        shutil.copy(tree / "prepared.json", results)
        """))
    return tree


def test_trees_are_compared_round_by_round(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    base = _stand_in(tmp_path, "base", cold_seconds=4.4)
    change = _stand_in(tmp_path, "change", cold_seconds=4.2)
    code = main(["--tree", f"base={base}", "--tree", f"change={change}", "--rounds", "2",
                 "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"),
                 "--", "--variants", "shuffled"])
    assert code == 0
    for tree in (base, change):
        argv = (tree / "argv.txt").read_text().splitlines()
        assert len(argv) == 2 and all(a.startswith("--variants shuffled --repeats 1 --results")
                                      for a in argv)
    report = capsys.readouterr().out.split("per target:")[1]
    assert COLD_SHUFFLE in report
    assert "base             1.100 1.100   median 1.100, best in 0 of 2" in report
    assert "change           1.050 1.050   median 1.050, best in 2 of 2" in report
    assert DAEMON_CPU in report and "base             13.200 13.200" in report
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"{name}-{r}.{ext}" for name in ("base", "change") for r in (1, 2)
        for ext in ("json", "log")]


def test_a_failed_run_is_reported_and_fails_the_comparison(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _stand_in(tmp_path, "base", cold_seconds=4.4)
    broken = _stand_in(tmp_path, "broken", cold_seconds=0)  # no prepared file: exits 1
    code = main(["--tree", f"base={base}", "--tree", f"broken={broken}", "--rounds", "1",
                 "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert code == 1
    out = capsys.readouterr().out
    assert "failed (exit 1)" in out
    assert "broken           -   median -, best in 0 of 0" in out
    assert "FileNotFoundError" in (tmp_path / "out" / "broken-1.log").read_text()


def test_a_run_that_leaves_no_results_never_reads_an_earlier_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _stand_in(tmp_path, "base", cold_seconds=4.4)
    silent = _stand_in(tmp_path, "silent", cold_seconds=4.0)
    (silent / "bench" / "repro.py").write_text("")  # exits 0, writes nothing
    (tmp_path / "out").mkdir()
    shutil.copy(silent / "prepared.json", tmp_path / "out" / "silent-1.json")  # from before
    code = main(["--tree", f"base={base}", "--tree", f"silent={silent}", "--rounds", "1",
                 "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert code == 1
    out = capsys.readouterr().out
    assert "failed (exit 0)" in out and "silent           -   median -" in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_comparison_lets_its_run_clean_up(tmp_path: Path, signum: int) -> None:
    """SIGTERM or Ctrl-C to the tool's process group reaches the run in progress as one
    SIGTERM, which it cleans up on (a second signal would kill it mid-way here), and the tool
    waits for it."""
    base = _stand_in(tmp_path, "base", cold_seconds=4.4)
    slow = tmp_path / "slow"
    shutil.copytree(base, slow)
    (slow / "bench" / "repro.py").write_text(textwrap.dedent("""\
        import os, signal, sys, time
        from pathlib import Path
        tree = Path(__file__).parent.parent
        def cleanup(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one would cut this short
            time.sleep(0.5)  # unmounting, removing namespaces
            (tree / "cleaned").write_text("")
            sys.exit(1)
        signal.signal(signal.SIGTERM, cleanup)
        signal.signal(signal.SIGINT, cleanup)
        (tree / "started").write_text(str(os.getpid()))
        time.sleep(60)
        """))
    tool = subprocess.Popen([sys.executable, "-m", "bench.repro_ab", "--tree", f"slow={slow}",
                             "--tree", f"base={base}", "--out", str(tmp_path / "out"),
                             "--workdir", str(tmp_path / "work")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (slow / "started").exists():
            assert time.monotonic() < deadline and tool.poll() is None
            time.sleep(0.05)
        os.killpg(tool.pid, signum)  # as a terminal sends Ctrl-C: to the whole group
        assert tool.wait(timeout=30) != 0
        assert (slow / "cleaned").exists()
        assert not (base / "argv.txt").exists()  # no further run started
    finally:
        tool.kill()
        tool.wait()
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((slow / "started").read_text()), signal.SIGKILL)  # if still running


@pytest.mark.parametrize("argv, message", [
    (["--tree", "a=."], "two or more trees"),
    (["--tree", "a=.", "--tree", "a=."], "given twice"),
    (["--tree", "a=/nonexistent", "--tree", "b=."], "expected NAME=DIR"),
    (["--tree", "a/b=.", "--tree", "b=."], "expected NAME=DIR"),
    (["--tree", "a=.", "--tree", "b=.", "--", "--results=x"], "set by this tool"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
