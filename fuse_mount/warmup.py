"""Warm-up jobs: fetch chosen files, or a recorded run's reads, into the cache before training.

Planning is sans I/O: paths (or a trace's first touches) become an ordered list of chunks, each a
block range of one file, in the order the job will read them. ``WarmupJob`` keeps the progress
counters. ``WarmupManager`` is the daemon's shell: it runs one job at a time with a few chunks in
flight, at prefetch priority so training reads still go first, and keeps the unfinished plan in
the cache directory, so a daemon restarted over the same cache takes the job up again. A resumed
job walks its whole plan again: chunks already cached complete at once (an in-memory check), and
blocks a crash lost before they reached the disk are fetched again rather than trusted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import msgpack
import trio

from fabric.protocol import MetaEntry
from neuralcache.blocks import BLOCK_SIZE, block_count, blocks_for_read
from neuralcache.trace import Trace

from .fetcher import BlockFetcher
from .namespace import Namespace, Node

log = logging.getLogger(__name__)

CHUNK_BLOCKS = 256
"""Blocks per chunk (1 MiB): the unit of progress and of resumption, and large enough that the
hub client sends few requests per MiB."""
PARALLEL_CHUNKS = 32
"""Chunks in flight at once. Many small files need many requests in flight to fill a WAN's
bandwidth x RTT (200 Mbit/s x 60 ms = 1.5 MB); the hub client paces what is actually sent."""
IN_FLIGHT_POLL = 0.02
"""Seconds between looks at blocks another fetch (a reader's, the prefetcher's) is bringing in:
a chunk counts as warm only once they have landed."""
STATE_FILE = "warmup.state"
"""The unfinished job's plan, in the cache directory (msgpack)."""
STATE_VERSION = 1

RUNNING, DONE, FAILED, CANCELLED, IDLE = "running", "done", "failed", "cancelled", "idle"


class PlanError(Exception):
    """A path that cannot be warmed (missing, or a directory without ``recursive``)."""


class Chunk(NamedTuple):
    """Blocks ``first`` .. ``first + count - 1`` of the file at ``path`` (mount-relative)."""

    path: str
    first: int
    count: int


# --- planning (sans I/O) ------------------------------------------------------------------------

def _walk(namespace: Namespace, node: Node) -> Iterable[MetaEntry]:
    """Files under ``node`` depth first, in the hub's listing order (iterative: deep trees)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.entry.kind == "f":
            yield current.entry
        elif current.is_dir:
            stack.extend(namespace.nodes[i] for i in reversed(list(current.children.values())))


def select_files(namespace: Namespace, paths: list[str], recursive: bool) -> list[MetaEntry]:
    """The regular files ``paths`` name (mount-relative), each once, in the order given.

    Symlinks are skipped: the mount serves them as links, and their targets are warmed when
    named themselves.
    """
    files: dict[str, MetaEntry] = {}
    for path in paths:
        node = namespace.by_path(path)
        if node is None:
            raise PlanError(f"no such file or directory in the mount: /{path.strip('/')}")
        if node.is_dir and not recursive:
            raise PlanError(f"/{path.strip('/')} is a directory (use --recursive)")
        for entry in _walk(namespace, node):
            files.setdefault(entry.path, entry)
    return list(files.values())


def file_chunks(entry: MetaEntry, chunk_blocks: int = CHUNK_BLOCKS) -> list[Chunk]:
    """The whole file, in order."""
    blocks = block_count(entry.size)
    return [Chunk(entry.path, first, min(chunk_blocks, blocks - first))
            for first in range(0, blocks, chunk_blocks)]


def plan_paths(namespace: Namespace, paths: list[str], recursive: bool,
               chunk_blocks: int = CHUNK_BLOCKS) -> list[Chunk]:
    """Every block of the named files, file by file."""
    return [c for e in select_files(namespace, paths, recursive)
            for c in file_chunks(e, chunk_blocks)]


def plan_profile(namespace: Namespace, trace: Trace,
                 chunk_blocks: int = CHUNK_BLOCKS) -> tuple[list[Chunk], list[str]]:
    """The blocks a recorded run read, in the order it first touched them, and the trace's
    paths that this mount does not have (skipped).

    Files are matched by path, not by the hub's file id, which a rescanned export may change;
    reads past a file's current size are clipped to it.
    """
    entries: dict[int, MetaEntry | None] = {}
    missing: list[str] = []
    for file_id, (path, _size) in trace.files.items():
        node = namespace.by_path(path)
        entries[file_id] = node.entry if node is not None and node.entry.kind == "f" else None
        if entries[file_id] is None:
            missing.append(path)
    seen: set[tuple[int, int]] = set()
    chunks: list[Chunk] = []
    for file_id, offset, length in zip(trace.reads["file_id"].tolist(),
                                       trace.reads["offset"].tolist(),
                                       trace.reads["length"].tolist()):
        entry = entries.get(file_id)
        if entry is None:
            continue
        span = blocks_for_read(offset, length, entry.size)
        for block in range(span.first, span.end):
            if (file_id, block) in seen:
                continue
            seen.add((file_id, block))
            last = chunks[-1] if chunks else None
            if (last is not None and last.path == entry.path and last.first + last.count == block
                    and last.count < chunk_blocks):
                chunks[-1] = Chunk(last.path, last.first, last.count + 1)
            else:
                chunks.append(Chunk(entry.path, block, 1))
    return chunks, missing


# --- the job's accounting (sans I/O) ------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """A chunk resolved against the mount's snapshot."""

    chunk: Chunk
    entry: MetaEntry

    @property
    def nbytes(self) -> int:
        return max(0, min(self.chunk.count * BLOCK_SIZE,
                          self.entry.size - self.chunk.first * BLOCK_SIZE))


def resolve(namespace: Namespace, chunks: Iterable[Chunk]) -> tuple[list[Task], int]:
    """Tasks for the chunks whose file the snapshot still has (clipped to its size), and how
    many chunks were dropped because it does not."""
    tasks, dropped = [], 0
    for chunk in chunks:
        node = namespace.by_path(chunk.path)
        if node is None or node.entry.kind != "f":
            dropped += 1
            continue
        blocks = block_count(node.entry.size)
        count = min(chunk.count, blocks - chunk.first)
        if count <= 0:
            dropped += 1
            continue
        tasks.append(Task(Chunk(chunk.path, chunk.first, count), node.entry))
    return tasks, dropped


class WarmupJob:
    """One warm-up: its tasks in order, a cursor, and what has been done so far."""

    def __init__(self, tasks: list[Task]) -> None:
        self.tasks: list[Task] = []
        self.started = time.time()  # wall clock, for humans
        self.finished_at: float | None = None
        self.state = RUNNING
        self.done_bytes = self.failed_bytes = self.failed_chunks = 0
        self._next = 0
        self._files: set[str] = set()
        self._total = 0
        self.extend(tasks)

    def extend(self, tasks: list[Task]) -> None:
        """More work for a running job (a second ``warmup`` while the first runs)."""
        self.tasks.extend(tasks)
        self._files.update(t.chunk.path for t in tasks)
        self._total += sum(t.nbytes for t in tasks)

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def pending(self) -> bool:
        """Tasks not yet handed out."""
        return self._next < len(self.tasks)

    def take(self) -> Task | None:
        """The next task in plan order, or None when all are handed out."""
        if not self.pending:
            return None
        task = self.tasks[self._next]
        self._next += 1
        return task

    def finish(self, task: Task, ok: bool) -> None:
        if ok:
            self.done_bytes += task.nbytes
        else:
            self.failed_bytes += task.nbytes
            self.failed_chunks += 1

    def end(self, cancelled: bool = False) -> None:
        self.state = CANCELLED if cancelled else FAILED if self.failed_chunks else DONE
        self.finished_at = time.time()

    def progress(self) -> dict[str, Any]:
        """The job as the control socket reports it."""
        return {"state": self.state, "files": len(self._files), "chunks": len(self.tasks),
                "total_bytes": self.total_bytes, "done_bytes": self.done_bytes,
                "failed_bytes": self.failed_bytes, "failed_chunks": self.failed_chunks,
                "started": self.started, "finished": self.finished_at}


def idle_progress() -> dict[str, Any]:
    return {"state": IDLE, "files": 0, "chunks": 0, "total_bytes": 0, "done_bytes": 0,
            "failed_bytes": 0, "failed_chunks": 0, "started": None, "finished": None}


# --- persistence --------------------------------------------------------------------------------

def save_plan(path: str, chunks: Iterable[Chunk]) -> None:
    """Write the plan atomically (a crash leaves the old plan or the new, never half of one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb({"v": STATE_VERSION, "chunks": [list(c) for c in chunks]}))
    os.replace(tmp, path)


def load_plan(path: str) -> list[Chunk] | None:
    """The saved plan, or None if there is none (raises ValueError for a damaged file)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        state = msgpack.unpackb(data, raw=False)
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"unknown warm-up state format in {path}")
        return [Chunk(str(p), int(first), int(count)) for p, first, count in state["chunks"]]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"damaged warm-up state {path}: {exc}") from None


def remove_plan(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --- the daemon's shell -------------------------------------------------------------------------

class WarmupManager:
    """Runs warm-up jobs in the daemon, one at a time; start ``run`` in its nursery."""

    def __init__(self, namespace: Namespace, fetcher: BlockFetcher, cache_dir: str,
                 parallel: int = PARALLEL_CHUNKS) -> None:
        self.namespace = namespace
        self.fetcher = fetcher
        self.state_path = os.path.join(cache_dir, STATE_FILE)
        self.parallel = parallel
        self.job: WarmupJob | None = None
        self._wake = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._cancelled = False
        self._plan_lock = trio.Lock()  # the plan file's writes and removal, in order

    def progress(self) -> dict[str, Any]:
        return self.job.progress() if self.job is not None else idle_progress()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Resume a saved job, then run jobs as they are submitted."""
        await self._resume()
        task_status.started()
        while True:
            if self.job is None or self.job.state != RUNNING:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            await self._run_job(self.job)

    async def submit(self, chunks: list[Chunk]) -> dict[str, Any]:
        """Warm ``chunks``: appended to the running job, else a new one. Returns its progress."""
        tasks, _ = await trio.to_thread.run_sync(resolve, self.namespace, chunks)
        if self.job is not None and self.job.state == RUNNING and not self._cancelled:
            self.job.extend(tasks)
        else:
            self.job = WarmupJob(tasks)
            self._cancelled = False
        self._wake.set()
        progress = self.progress()
        async with self._plan_lock:
            if self.job.state == RUNNING:
                plan = [t.chunk for t in self.job.tasks]
                await trio.to_thread.run_sync(save_plan, self.state_path, plan)
        return progress

    def cancel(self) -> bool:
        """Stop the running job; True if there was one."""
        if self.job is None or self.job.state != RUNNING:
            return False
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()
        return True

    async def _resume(self) -> None:
        try:
            chunks = await trio.to_thread.run_sync(load_plan, self.state_path)
        except (OSError, ValueError) as exc:
            log.warning("ignoring the saved warm-up: %s", exc)
            await trio.to_thread.run_sync(remove_plan, self.state_path)
            return
        if not chunks:
            return
        tasks, dropped = await trio.to_thread.run_sync(resolve, self.namespace, chunks)
        if dropped:
            log.info("%d chunks of the saved warm-up name files the hub no longer has", dropped)
        self.job = WarmupJob(tasks)
        log.info("resuming the unfinished warm-up: %d chunks, %d bytes", len(tasks),
                 self.job.total_bytes)

    async def _run_job(self, job: WarmupJob) -> None:
        while True:
            with trio.CancelScope() as scope:
                self._scope = scope
                if self._cancelled:
                    scope.cancel()
                while job.pending:
                    async with trio.open_nursery() as nursery:
                        for _ in range(self.parallel):
                            nursery.start_soon(self._worker, job)
            self._scope = None
            cancelled = scope.cancelled_caught or self._cancelled
            async with self._plan_lock:
                # A failed job keeps its plan, so the next daemon over this cache retries it.
                # (Its plan file is a newer job's once a submit has replaced it.)
                if (cancelled or not job.failed_chunks) and self.job is job:
                    await trio.to_thread.run_sync(remove_plan, self.state_path)
                if cancelled or not job.pending:
                    job.end(cancelled)
                    log.info("warm-up %s: %d of %d bytes warm, %d failed", job.state,
                             job.done_bytes, job.total_bytes, job.failed_bytes)
                    return
            # Extended while settling up: run the new tasks (submit saves the plan again).

    async def _worker(self, job: WarmupJob) -> None:
        while (task := job.take()) is not None:
            ok = await self._warm(task)
            if not ok and not job.failed_chunks:
                log.warning("warm-up: blocks %d-%d of %s could not be fetched from the hub "
                            "(further failures are counted, not logged)", task.chunk.first,
                            task.chunk.first + task.chunk.count - 1, task.chunk.path)
            job.finish(task, ok)

    async def _warm(self, task: Task) -> bool:
        """Fetch the chunk; True once every block of it has landed in the cache.

        ``prefetch`` skips blocks another fetch is already bringing in; wait for those, and
        fetch them ourselves if that fetch failed. A block missing and not in flight after a
        successful fetch was evicted (a job larger than the cache), which is not a failure.
        """
        while True:
            try:
                if not await self.fetcher.prefetch(task.entry, task.chunk.first, task.chunk.count):
                    return False
            except Exception as exc:  # noqa: BLE001 - a failed chunk must not end the job
                log.warning("warm-up of %s failed: %s", task.chunk.path, exc)
                return False
            if not self.fetcher.fetching(task.entry, task.chunk.first, task.chunk.count):
                return True
            await trio.sleep(IN_FLIGHT_POLL)
