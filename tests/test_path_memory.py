"""Careful resume: the path record (fabric/path_memory.py) and a hub client that keeps its
model there and starts the next client from it, over real loopback sockets."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from fabric.client import HubClient
from fabric.congestion.bbr import RESUME_SHARE, STARTUP_LOSS_RATE
from fabric.export import Export
from fabric.path_memory import MAX_AGE, RTT_SLACK, PathRecord, load_record, save_record
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import (LOCALHOST, TEST_LIMIT, Proxy, ReportLoss, metric, start_hub,
                                  trio_test, trio_test_within)

RESUMES = "neuralcache_fabric_path_resumes_total"
RECORD = PathRecord(hub="hub:7070", controller="bbr", btl_bw=12.5e6, hello_rtt=0.9,
                    saved_at=1_000_000.0)


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "path.json"
    save_record(path, RECORD)
    assert load_record(path) == RECORD
    save_record(path, dataclasses.replace(RECORD, btl_bw=1.0))  # replaced, not appended
    assert load_record(path) == dataclasses.replace(RECORD, btl_bw=1.0)
    assert [p.name for p in tmp_path.iterdir()] == ["path.json"]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"hub": "h"}', "null",
                                  json.dumps({**dataclasses.asdict(RECORD), "btl_bw": "fast"}),
                                  json.dumps({**dataclasses.asdict(RECORD), "btl_bw": -1}),
                                  json.dumps({**dataclasses.asdict(RECORD), "hello_rtt": "nan"})])
def test_a_damaged_record_is_ignored_with_a_warning(tmp_path: Path, text: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "path.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="fabric.path_memory"):
        assert load_record(path) is None
    assert "ignoring the path record" in caplog.text


def test_no_record_is_no_record(tmp_path: Path) -> None:
    assert load_record(tmp_path / "path.json") is None


@pytest.mark.parametrize(("hub", "controller", "hello_rtt", "age", "why"), [
    ("hub:7070", "bbr", 0.9, 10.0, None),
    ("hub:7070", "bbr", 0.9 * 1.45, MAX_AGE - 1, None),
    ("hub:7070", "bbr", 0.9 * 0.55, 0.0, None),
    ("hub:7071", "bbr", 0.9, 10.0, "other_path"),
    ("hub:7070", "cubic", 0.9, 10.0, "other_path"),
    ("hub:7070", "bbr", 0.9, MAX_AGE + 1, "expired"),
    ("hub:7070", "bbr", 0.9, -60.0, "expired"),  # saved "in the future": the clock moved
    ("hub:7070", "bbr", 0.9 * 1.6, 10.0, "rtt_changed"),
    ("hub:7070", "bbr", 0.9 * 0.4, 10.0, "rtt_changed"),
])
def test_a_record_is_used_only_for_the_same_recent_path(hub: str, controller: str,
                                                        hello_rtt: float, age: float,
                                                        why: str | None) -> None:
    assert RECORD.matches(hub, controller, hello_rtt, RECORD.saved_at + age) == why


def test_short_paths_match_within_the_slack() -> None:
    lan = dataclasses.replace(RECORD, hello_rtt=0.0002)
    assert lan.matches("hub:7070", "bbr", 0.0002 + RTT_SLACK * 0.9, RECORD.saved_at) is None
    assert lan.matches("hub:7070", "bbr", 0.0002 + RTT_SLACK * 1.1, RECORD.saved_at) \
        == "rtt_changed"


BLOCKS = 3000
READERS = 8
READ_BLOCKS = BLOCKS // READERS
PREFETCH_BUDGET = 10.0
"""Seconds a client may prefetch before what it waits for happens: a round trip or two once
its replies report loss (``LOSS_ENDS_STARTUP``)."""

WAITS_FOR_STARTUP = trio_test_within(2 * PREFETCH_BUDGET + TEST_LIMIT)
"""For the tests that prefetch until STARTUP has ended: room for two budgets and the rest, so
that a budget's ``TooSlowError``, not ``trio_test``'s own limit, says what was slow."""

LOSS_ENDS_STARTUP = 2 * STARTUP_LOSS_RATE
"""Share of each reply the proxy reports resent, so that BBR's STARTUP ends at its first round
(``STARTUP_LOSS_RATE``) and the record is kept. On a clean loopback path STARTUP ends when its
delivery samples stop growing, which is timing: 0.75-32 s in 24 runs of these tests on an idle
machine (4 Dec, session 40), over 60 s in both in a clean-clone CI run (session 43)."""


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    root.mkdir()
    (root / "big.bin").write_bytes(random.Random(3).randbytes(BLOCKS * BLOCK_SIZE))
    return root


async def _prefetch_until(client: HubClient, root: Path, done: Callable[[], bool]) -> None:
    """Keep ``READERS`` prefetch reads of the export's file in flight (a pipe that is not
    app-limited, so that STARTUP can find the bottleneck) until ``done()``, checking every
    byte."""
    e = next(e for e in Export(str(root)).scan() if e.path == "big.bin")
    want = (root / "big.bin").read_bytes()

    async def reader(first: int) -> None:
        while not done():
            got = await client.read(e.file_id, e.version, first, READ_BLOCKS,
                                    deadline=trio.current_time() + 10, priority="prefetch")
            assert got == want[first * BLOCK_SIZE:(first + READ_BLOCKS) * BLOCK_SIZE]

    with trio.fail_after(PREFETCH_BUDGET):
        async with trio.open_nursery() as nursery:
            for i in range(READERS):
                nursery.start_soon(reader, i * READ_BLOCKS)


@WAITS_FOR_STARTUP
async def test_a_client_keeps_its_path_model_and_the_next_one_starts_from_it(
        export_dir: Path, tmp_path: Path) -> None:
    record = tmp_path / "path.json"
    resumed = metric(RESUMES, {"outcome": "resumed"})
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, ReportLoss(share=LOSS_ENDS_STARTUP))
        await nursery.start(proxy.serve)
        first = HubClient(LOCALHOST, proxy.port, path_memory=record, remember_period=0.05)
        # As at a remount, the first client is gone before the second starts: while it ran it
        # kept the record up to date, and the second once read a newer one than ``kept``.
        async with trio.open_nursery() as first_run:
            await first_run.start(first.run)
            assert not record.exists()  # nothing to keep until STARTUP has found the bottleneck
            await _prefetch_until(first, export_dir, record.exists)
            first_run.cancel_scope.cancel()
        kept = load_record(record)
        assert kept is not None
        assert (kept.hub, kept.controller) == (f"{LOCALHOST}:{proxy.port}", "bbr")
        assert 0 < kept.btl_bw and 0 < kept.hello_rtt < 1
        assert time.time() - 60 < kept.saved_at <= time.time()

        second = HubClient(LOCALHOST, proxy.port, path_memory=record)
        await nursery.start(second.run)
        assert metric(RESUMES, {"outcome": "resumed"}) == resumed + 1
        # Before its first reply the second client's estimate is the kept model's share.
        assert second.stats().btl_bw == pytest.approx(RESUME_SHARE * kept.btl_bw)
        await _prefetch_until(second, export_dir, lambda: second.stats().delivered_bytes > 0)
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_record_of_another_hub_is_not_resumed_from(
        export_dir: Path, tmp_path: Path) -> None:
    record = tmp_path / "path.json"
    save_record(record, dataclasses.replace(RECORD, hub=f"{LOCALHOST}:1", saved_at=time.time()))
    other = metric(RESUMES, {"outcome": "other_path"})
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        client = HubClient(LOCALHOST, hub.port, path_memory=record)
        await nursery.start(client.run)
        assert metric(RESUMES, {"outcome": "other_path"}) == other + 1
        assert client.stats().btl_bw == 0  # learnt afresh
        nursery.cancel_scope.cancel()


@WAITS_FOR_STARTUP
async def test_a_record_that_cannot_be_written_is_counted_and_the_transport_goes_on(
        export_dir: Path, tmp_path: Path) -> None:
    record = tmp_path / "gone" / "path.json"  # its directory does not exist
    errors = metric("neuralcache_fabric_path_save_errors_total")
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, ReportLoss(share=LOSS_ENDS_STARTUP))
        await nursery.start(proxy.serve)
        client = HubClient(LOCALHOST, proxy.port, path_memory=record, remember_period=0.05)
        await nursery.start(client.run)
        await _prefetch_until(client, export_dir,
                              lambda: metric("neuralcache_fabric_path_save_errors_total") > errors)
        nursery.cancel_scope.cancel()
