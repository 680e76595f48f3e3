"""bench/throughput_ab.py: its arguments, and a whole comparison of two trees over a small file
(real memfs and spoke mounts, every pass's bytes checked against memfs's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.throughput_ab import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, message", [
    (["--tree", "a=."], "two or more trees"),
    (["--tree", "a=.", "--tree", "a=."], "given twice"),
    (["--tree", "a=/nonexistent", "--tree", "b=."], "expected NAME=DIR"),
    (["--tree", "a/b=.", "--tree", "b=."], "expected NAME=DIR"),
    (["--tree", "a=.", "--tree", "b=.", "--rounds", "0"], "one or more rounds"),
    (["--tree", "a=.", "--tree", "b=.", "--size", "1000"], "multiple of 16 KiB"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_two_trees_are_read_beside_memfs_round_by_round(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.throughput_ab", "--tree", f"one={REPO}",
         "--tree", f"two={REPO}", "--rounds", "2", "--size", "1M", "--random-reads", "16",
         "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for round_number in (1, 2):
        for pattern in ("sequential", "random"):
            assert f"round {round_number} {pattern}" in out
    summary = out.split("best in", 1)[1].splitlines()[1:]
    assert [line.split()[:2] for line in summary] == [
        ["one", "sequential"], ["two", "sequential"], ["one", "random"], ["two", "random"]]
    assert all(line.rstrip().endswith("of 2") for line in summary)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ab-")] == []  # cleaned up
