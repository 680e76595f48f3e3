"""Warm-up planning, accounting and persistence without a mount; the job runner against a fake
fetcher (the real one is driven end to end in test_control.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from fabric.protocol import MetaEntry
from fuse_mount.block_store import BlockKey
from fuse_mount.namespace import Namespace
from fuse_mount.warmup import (CANCELLED, DONE, FAILED, RUNNING, STATE_FILE, Chunk, PlanError,
                               WarmupJob, WarmupManager, load_plan, plan_paths, plan_profile,
                               resolve, save_plan)
from neuralcache.blocks import BLOCK_SIZE
from neuralcache.trace import READ_DTYPE, Trace
from tests.fabric_helpers import trio_test


def make_namespace(files: dict[str, int]) -> Namespace:
    """A snapshot holding ``files`` (path -> size) and their directories, in path order."""
    paths: dict[str, int | None] = {"": None}
    for path, size in sorted(files.items()):
        parts = path.split("/")
        for i in range(1, len(parts)):
            paths.setdefault("/".join(parts[:i]), None)
        paths[path] = size
    entries = [MetaEntry(p, "d" if size is None else "f", 0o755, size or 0, 0, file_id=i + 1,
                         version=1)
               for i, (p, size) in enumerate(sorted(paths.items()))]
    return Namespace(entries)


FILES = {"a/one": 3 * BLOCK_SIZE, "a/two": BLOCK_SIZE + 1, "a/sub/three": 10, "b": 0,
         "c": 5 * BLOCK_SIZE}


# --- planning -----------------------------------------------------------------------------------

def test_paths_plan_whole_files_in_order_given_and_chunked() -> None:
    ns = make_namespace(FILES)
    assert plan_paths(ns, ["c", "a/two"], recursive=False, chunk_blocks=2) == [
        Chunk("c", 0, 2), Chunk("c", 2, 2), Chunk("c", 4, 1), Chunk("a/two", 0, 2)]


def test_a_directory_is_walked_depth_first_in_listing_order_and_each_file_once() -> None:
    ns = make_namespace(FILES)
    chunks = plan_paths(ns, ["/a/", "a/one", ""], recursive=True)
    order = list(dict.fromkeys(c.path for c in chunks))
    assert order == ["a/one", "a/sub/three", "a/two", "c"]  # "b" is empty: nothing to fetch
    assert len(chunks) == len(order)


@pytest.mark.parametrize("paths, recursive, message", [
    (["nope"], False, "no such file"), (["a"], False, "is a directory")])
def test_paths_that_cannot_be_warmed_are_refused(paths: list[str], recursive: bool,
                                                 message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_paths(make_namespace(FILES), paths, recursive)


@given(st.lists(st.integers(0, 20 * BLOCK_SIZE), min_size=1, max_size=6), st.integers(1, 8))
def test_a_path_plan_covers_every_block_once_in_order(sizes: list[int], chunk_blocks: int) -> None:
    files = {f"d/f{i}": size for i, size in enumerate(sizes)}
    ns = make_namespace(files)
    chunks = plan_paths(ns, ["d"], recursive=True, chunk_blocks=chunk_blocks)
    blocks = [(c.path, b) for c in chunks for b in range(c.first, c.first + c.count)]
    assert blocks == [(p, b) for p, size in sorted(files.items())
                      for b in range(-(-size // BLOCK_SIZE))]
    assert all(0 < c.count <= chunk_blocks for c in chunks)
    tasks, dropped = resolve(ns, chunks)
    assert dropped == 0 and sum(t.nbytes for t in tasks) == sum(sizes)


def _trace(files: dict[int, tuple[str, int]], reads: list[tuple[int, int, int]]) -> Trace:
    rows = [(float(i), 1, 1, fid, offset, length) for i, (fid, offset, length) in enumerate(reads)]
    return Trace(files=files, reads=np.array(rows, dtype=READ_DTYPE))


def test_a_profile_replays_first_touches_in_order_matched_by_path() -> None:
    ns = make_namespace(FILES)
    # Trace file ids differ from the snapshot's: a rescanned hub may number files anew.
    trace = _trace({70: ("c", 5 * BLOCK_SIZE), 71: ("a/one", 3 * BLOCK_SIZE),
                    72: ("gone", 100)},
                   [(70, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE),  # c blocks 3, 4
                    (71, 0, 10), (72, 0, 100),             # a/one block 0; gone: skipped
                    (70, 3 * BLOCK_SIZE, 10),              # re-read: already planned
                    (70, 0, 2 * BLOCK_SIZE),               # c blocks 0, 1
                    (71, BLOCK_SIZE, 9 * BLOCK_SIZE)])     # a/one 1..2, clipped at its end
    chunks, missing = plan_profile(ns, trace, chunk_blocks=4)
    assert chunks == [Chunk("c", 3, 2), Chunk("a/one", 0, 1), Chunk("c", 0, 2),
                      Chunk("a/one", 1, 2)]
    assert missing == ["gone"]


def test_a_profile_run_is_split_at_the_chunk_size() -> None:
    ns = make_namespace(FILES)
    trace = _trace({1: ("c", 5 * BLOCK_SIZE)}, [(1, 0, 5 * BLOCK_SIZE)])
    assert plan_profile(ns, trace, chunk_blocks=2)[0] == [Chunk("c", 0, 2), Chunk("c", 2, 2),
                                                          Chunk("c", 4, 1)]


def test_resolving_drops_vanished_files_and_clips_shrunk_ones() -> None:
    ns = make_namespace(FILES)
    tasks, dropped = resolve(ns, [Chunk("gone", 0, 1), Chunk("a/two", 0, 8), Chunk("a/two", 5, 1),
                                  Chunk("a", 0, 1)])
    assert dropped == 3
    assert [(t.chunk, t.nbytes) for t in tasks] == [(Chunk("a/two", 0, 2), BLOCK_SIZE + 1)]


# --- accounting and persistence -----------------------------------------------------------------

def test_a_job_hands_out_tasks_in_order_and_counts_bytes() -> None:
    ns = make_namespace(FILES)
    tasks, _ = resolve(ns, plan_paths(ns, ["a"], recursive=True, chunk_blocks=2))
    job = WarmupJob(tasks[:2])
    job.extend(tasks[2:])
    taken = []
    while (task := job.take()) is not None:
        taken.append(task)
        job.finish(task, ok=task.chunk.path != "a/two")
    assert taken == tasks
    job.end()
    progress = job.progress()
    assert progress["state"] == FAILED
    assert progress["total_bytes"] == 3 * BLOCK_SIZE + BLOCK_SIZE + 1 + 10
    assert progress["failed_bytes"] == BLOCK_SIZE + 1
    assert progress["done_bytes"] + progress["failed_bytes"] == progress["total_bytes"]
    assert progress["files"] == 3


def test_a_plan_survives_a_round_trip_and_a_damaged_one_is_reported(tmp_path: Path) -> None:
    path = str(tmp_path / STATE_FILE)
    assert load_plan(path) is None
    plan = [Chunk("a/one", 0, 3), Chunk("c", 256, 1)]
    save_plan(path, plan)
    assert load_plan(path) == plan
    (tmp_path / STATE_FILE).write_bytes(b"\x93\x01")
    with pytest.raises(ValueError, match="damaged"):
        load_plan(path)


# --- the runner ---------------------------------------------------------------------------------

class FakeFetcher:
    """Records prefetches; fails those of ``failing`` paths; may hold them at ``gate``."""

    def __init__(self, failing: tuple[str, ...] = (), gate: trio.Event | None = None) -> None:
        self.failing = failing
        self.gate = gate
        self.fetched: list[tuple[str, int, int]] = []
        self.busy: set[BlockKey] = set()  # blocks "another fetch" is bringing in

    async def prefetch(self, entry: MetaEntry, first: int, count: int) -> bool:
        if self.gate is not None:
            await self.gate.wait()
        await trio.sleep(0)
        self.fetched.append((entry.path, first, count))
        return entry.path not in self.failing

    def fetching(self, entry: MetaEntry, first: int, count: int) -> bool:
        return any(BlockKey(entry.file_id, entry.version, b) in self.busy
                   for b in range(first, first + count))


async def _until(condition, step: float = 0.005) -> None:
    while not condition():
        await trio.sleep(step)


@trio_test
async def test_the_runner_fetches_the_plan_in_order_then_forgets_it(tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    fetcher = FakeFetcher()
    manager = WarmupManager(ns, fetcher, str(tmp_path), parallel=1)
    plan = plan_paths(ns, ["c", "a"], recursive=True, chunk_blocks=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        accepted = await manager.submit(plan)
        assert accepted["total_bytes"] == sum(
            FILES[p] for p in ("c", "a/one", "a/two", "a/sub/three"))
        await _until(lambda: manager.progress()["state"] != RUNNING)
        nursery.cancel_scope.cancel()
    assert fetcher.fetched == [tuple(c) for c in plan]
    assert manager.progress()["state"] == DONE
    assert manager.progress()["done_bytes"] == accepted["total_bytes"]
    assert not (tmp_path / STATE_FILE).exists()


@trio_test
async def test_a_failed_job_keeps_its_plan_and_the_next_daemon_resumes_it(tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    plan = plan_paths(ns, ["a"], recursive=True)
    first = WarmupManager(ns, FakeFetcher(failing=("a/two",)), str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await first.submit(plan)
        await _until(lambda: first.progress()["state"] != RUNNING)
        nursery.cancel_scope.cancel()
    assert first.progress()["state"] == FAILED
    assert first.progress()["failed_bytes"] == FILES["a/two"]
    assert load_plan(str(tmp_path / STATE_FILE)) == plan

    fetcher = FakeFetcher()
    second = WarmupManager(ns, fetcher, str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)  # resumes before it reports started
        assert second.progress()["total_bytes"] == sum(FILES[p] for p in
                                                       ("a/one", "a/two", "a/sub/three"))
        await _until(lambda: second.progress()["state"] != RUNNING)
        nursery.cancel_scope.cancel()
    assert second.progress()["state"] == DONE
    assert sorted(fetcher.fetched) == sorted(tuple(c) for c in plan)
    assert not (tmp_path / STATE_FILE).exists()


@trio_test
async def test_a_daemon_stopping_mid_job_leaves_the_plan_for_its_successor(tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    manager = WarmupManager(ns, FakeFetcher(gate=trio.Event()), str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.submit(plan_paths(ns, ["c"], recursive=False))
        nursery.cancel_scope.cancel()  # the daemon's nursery going down at unmount
    assert load_plan(str(tmp_path / STATE_FILE)) == [Chunk("c", 0, 5)]


@trio_test
async def test_cancel_stops_the_job_and_forgets_its_plan(tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    gate = trio.Event()
    fetcher = FakeFetcher(gate=gate)
    manager = WarmupManager(ns, fetcher, str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.submit(plan_paths(ns, ["a", "c"], recursive=True))
        assert (tmp_path / STATE_FILE).exists()
        assert manager.cancel()
        await _until(lambda: manager.progress()["state"] != RUNNING)
        assert not manager.cancel()
        nursery.cancel_scope.cancel()
    assert manager.progress()["state"] == CANCELLED
    assert fetcher.fetched == []
    assert not (tmp_path / STATE_FILE).exists()


@trio_test
async def test_a_chunk_is_warm_only_once_blocks_fetched_elsewhere_have_landed(
        tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    fetcher = FakeFetcher()
    entry = ns.by_path("a/one").entry
    fetcher.busy.add(BlockKey(entry.file_id, entry.version, 1))  # a reader's fetch, say
    manager = WarmupManager(ns, fetcher, str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.submit(plan_paths(ns, ["a/one"], recursive=False))
        await trio.sleep(0.1)
        assert manager.progress()["state"] == RUNNING and manager.progress()["done_bytes"] == 0
        fetcher.busy.clear()
        await _until(lambda: manager.progress()["state"] != RUNNING)
        nursery.cancel_scope.cancel()
    assert manager.progress()["state"] == DONE
    assert len(fetcher.fetched) >= 2  # asked again after the other fetch ended


@trio_test
async def test_a_second_warmup_while_one_runs_joins_it(tmp_path: Path) -> None:
    ns = make_namespace(FILES)
    gate = trio.Event()
    fetcher = FakeFetcher(gate=gate)
    manager = WarmupManager(ns, fetcher, str(tmp_path), parallel=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.submit(plan_paths(ns, ["a/two"], recursive=False))
        joined = await manager.submit(plan_paths(ns, ["c"], recursive=False))
        assert joined["files"] == 2 and joined["total_bytes"] == FILES["a/two"] + FILES["c"]
        assert load_plan(str(tmp_path / STATE_FILE)) == [Chunk("a/two", 0, 2), Chunk("c", 0, 5)]
        gate.set()
        await _until(lambda: manager.progress()["state"] != RUNNING)
        nursery.cancel_scope.cancel()
    assert fetcher.fetched == [("a/two", 0, 2), ("c", 0, 5)]
    assert manager.progress()["state"] == DONE
