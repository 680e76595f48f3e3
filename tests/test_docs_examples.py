"""The documents' shell examples, run for real so they stay true.

A document under ``docs/`` opts in with the line ``MARKER``. Every ```` ```console ```` block in
it is then run, in document order, in one bash session per document, against a real hub and
spoke on loopback. In a block, ``$ `` starts a command (a trailing ``\\`` or a following ``> ``
line continues it); the lines after it, up to the next ``$ ``, are what it prints (stdout and
stderr together), matched line by line: ``...`` inside a line matches any text, a line that is
only ``...`` matches any number of lines, and no lines means the command prints nothing. A
last line ``[exit N]`` says the command exits with status N; otherwise it must exit 0. The
session's variables (``SESSION_VARIABLES``) are expanded in the expected lines, so a document
may show ``$MNT`` where the console shows the test's temporary path.

Everything the examples start is stopped afterwards, also when one fails: mounts under the
work directory are unmounted, the session's process group and any daemon whose lock file lies
there are killed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuse_mount.launch import free_port
from tests.conftest import needs_fuse

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARKER = "<!-- examples: run by tests/test_docs_examples.py -->"
"""The line a document carries when its console blocks are to be run."""
FENCE_OPEN = re.compile(r"^```console\s*$")
FENCE_CLOSE = re.compile(r"^```\s*$")
PROMPT, CONTINUATION = "$ ", "> "
EXIT_LINE = re.compile(r"^\[exit (\d+)\]$")
WILDCARD = "..."
COMMAND_TIMEOUT = 45.0
"""Seconds one example may run: a mount waits at most its connect timeout (10 s by default),
an unmount its daemon's flush; anything longer is a hang, not a slow machine."""
SESSION_VARIABLES = ("WORK", "EXPORT", "MNT", "CACHE", "HUB", "HUB_METRICS_PORT", "METRICS_PORT")
"""What a document may rely on; ``commands.md`` explains each one."""
STOP_GRACE = 10.0
"""Seconds the session's jobs get after SIGTERM before SIGKILL in teardown (a ``--foreground``
daemon writes out its cache before it exits)."""


# --- parsing and matching (pure) -----------------------------------------------------------

@dataclass
class Example:
    command: str
    expected: list[str]
    status: int
    line: int  # where the command starts in the document (1-based), for failure messages


def parse_examples(markdown: str) -> list[Example]:
    """The commands of every console block, in order, with the output each one shows."""
    examples: list[Example] = []
    in_block = continued = False
    for number, line in enumerate(markdown.splitlines(), start=1):
        if not in_block:
            in_block = bool(FENCE_OPEN.match(line))
            continue
        if FENCE_CLOSE.match(line):
            in_block = continued = False
            continue
        if continued or (line.startswith(CONTINUATION) and examples and not examples[-1].expected):
            text = line if continued else line[len(CONTINUATION):]
            examples[-1].command += "\n" + text
            continued = line.endswith("\\")
        elif line.startswith(PROMPT):
            examples.append(Example(line[len(PROMPT):], [], 0, number))
            continued = line.endswith("\\")
        elif examples:
            examples[-1].expected.append(line)
        else:
            raise ValueError(f"line {number}: output before any command in a console block")
    for example in examples:
        if example.expected and (m := EXIT_LINE.match(example.expected[-1])):
            example.status = int(m.group(1))
            example.expected.pop()
    return examples


def expand(line: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` of the session's variables replaced by their values."""
    return re.sub(r"\$\{?([A-Z_]+)\}?",
                  lambda m: variables.get(m.group(1), m.group(0)), line)


def _line_pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split(WILDCARD)))


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines fit ``expected`` (with ``...`` wildcards, see the module doc)."""
    patterns = [None if line == WILDCARD else _line_pattern(line) for line in expected]
    # reachable[j]: the patterns so far can consume exactly the first j actual lines.
    reachable = [True] + [False] * len(actual)
    for pattern in patterns:
        if pattern is None:
            for j in range(1, len(actual) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            reachable = [False] + [reachable[j] and bool(pattern.fullmatch(actual[j]))
                                   for j in range(len(actual))]
    return reachable[-1]


def documents() -> list[Path]:
    """The documents that opt in."""
    return sorted(p for p in DOCS.rglob("*.md") if MARKER in p.read_text().splitlines())


# --- the bash session ----------------------------------------------------------------------

class BashSession:
    """One bash process; each example is sourced from a file, so ``cd``, variables and
    background jobs carry over from one example to the next, and nothing reads our stdin."""

    def __init__(self, cwd: Path, env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._count = 0

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def run(self, command: str, timeout: float) -> tuple[int, list[str]]:
        """Exit status and output lines of ``command``."""
        self._count += 1
        script = self.scratch / f"example-{self._count}.sh"
        output = self.scratch / f"example-{self._count}.out"
        script.write_text(command + "\n")
        sentinel = f"__example_{self._count}_status__"
        try:
            self.proc.stdin.write(f". '{script}' </dev/null >'{output}' 2>&1; echo {sentinel} $?\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EOFError("the bash session ended (did an example call exit?)") from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"still running after {timeout:g} s") from None
            if line is None:
                raise EOFError("the bash session ended (did an example call exit?)")
            if line.startswith(sentinel):
                status = int(line.split()[1])
                return status, output.read_text(errors="replace").splitlines()

    def kill(self) -> None:
        """Stop bash and every job it started in the background (its process group)."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while _signal_group(self.proc.pid, 0) and time.monotonic() < deadline:
            self.proc.poll()  # reap bash itself, so that only its jobs keep the group alive
            time.sleep(0.05)
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(STOP_GRACE)


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to the group; False once no process is left in it."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + os.sep
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def _daemons_under(root: Path) -> list[int]:
    """Live spoke daemons whose cache directory lies under ``root`` (from their lock files)."""
    pids = []
    for lock in root.rglob("daemon.lock"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(lock.read_text().strip())
            if "fuse_mount" in Path(f"/proc/{pid}/cmdline").read_text():
                pids.append(pid)
    return pids


def teardown(session: BashSession, work: Path) -> None:
    """Leave no mount and no process behind, whatever state the examples left.

    The session goes first: its jobs (hubs, ``--foreground`` daemons, which unmount on
    SIGTERM) stop, and its working directory no longer holds a mount busy."""
    session.kill()
    for mountpoint in _mounts_under(work):
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, "-m", "fuse_mount.cli", "umount", mountpoint],
                           capture_output=True, timeout=90)
    for pid in _daemons_under(work):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for mountpoint in _mounts_under(work):
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)


def _logs(work: Path) -> str:
    """The tail of every log the examples left, for a failure message."""
    return "".join(f"\n--- {log} ---\n{log.read_text(errors='replace')[-2000:]}"
                   for log in sorted(work.rglob("*.log")))


def session_variables(work: Path) -> dict[str, str]:
    return {"WORK": str(work), "EXPORT": str(work / "export"), "MNT": str(work / "mnt"),
            "CACHE": str(work / "cache"), "HUB": f"127.0.0.1:{free_port()}",
            "HUB_METRICS_PORT": str(free_port()), "METRICS_PORT": str(free_port())}


# --- tests ---------------------------------------------------------------------------------

def test_console_blocks_parse_into_commands_outputs_and_exit_statuses() -> None:
    markdown = "\n".join([
        "text", "```sh", "$ not run", "```", "```console",
        "$ echo one \\", "  two", "one two",
        "$ for i in 1 2; do", "> echo $i; done", "1", "...",
        "$ false", "[exit 1]", "```"])
    examples = parse_examples(markdown)
    assert [(e.command, e.expected, e.status) for e in examples] == [
        ("echo one \\\n  two", ["one two"], 0),
        ("for i in 1 2; do\necho $i; done", ["1", "..."], 0),
        ("false", [], 1)]
    assert [e.line for e in examples] == [6, 9, 13]


def test_wildcards_match_within_a_line_and_across_lines() -> None:
    assert output_matches(["mounted ... (7 entries)"], ["mounted /tmp/x (7 entries)"])
    assert not output_matches(["mounted ... (7 entries)"], ["mounted /tmp/x (8 entries)"])
    assert output_matches(["a", "...", "z"], ["a", "b", "c", "z"])
    assert output_matches(["a", "...", "z"], ["a", "z"])
    assert not output_matches(["a", "z"], ["a", "b", "z"])
    assert output_matches([], [])
    assert not output_matches([], ["unexpected"])
    assert output_matches(["..."], [])


def test_variables_expand_in_expected_output() -> None:
    values = {"MNT": "/tmp/w/mnt", "METRICS_PORT": "9100"}
    assert expand("cat: $MNT/x: ${METRICS_PORT} $OTHER", values) == "cat: /tmp/w/mnt/x: 9100 $OTHER"


def test_some_documents_opt_in() -> None:
    assert DOCS / "commands.md" in documents()


@pytest.mark.mount
@needs_fuse
@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(DOCS)))
def test_document_examples_run_as_shown(document: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "export").mkdir(parents=True)
    scratch = tmp_path / "runner"
    scratch.mkdir()
    variables = session_variables(work)
    env = {**os.environ, **variables, "LC_ALL": "C",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    examples = parse_examples(document.read_text())
    assert examples, f"{document} opts in but has no console examples"
    session = BashSession(work, env, scratch)
    try:
        for example in examples:
            where = f"{document.name}:{example.line}: $ {example.command}"
            try:
                status, lines = session.run(example.command, COMMAND_TIMEOUT)
            except (TimeoutError, EOFError) as exc:
                pytest.fail(f"{where}\n{exc}{_logs(work)}")
            expected = [expand(line, variables) for line in example.expected]
            if status != example.status or not output_matches(expected, lines):
                pytest.fail(f"{where}\nexit status {status} (expected {example.status})\n"
                            f"--- expected ---\n" + "\n".join(expected) +
                            "\n--- actual ---\n" + "\n".join(lines) + _logs(work))
    finally:
        teardown(session, work)
    assert not _mounts_under(work)
