"""The control socket and its commands: wire format and progress line without I/O, the server
in-process over a real Unix socket, then ``warmup``/``status``/``cache`` against real mounts."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge

from fabric.protocol import CHECKSUM_BYTES
from fuse_mount import control_protocol as proto
from fuse_mount import runtime
from fuse_mount.block_cache import BlockCache
from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.control_socket import ControlServer
from fuse_mount.launch import CLI, Hub, Spoke
from fuse_mount.progress import ProgressMeter, render
from fuse_mount.runtime import MountRecord, find_mount
from fuse_mount.scrape import sample, scrape
from fuse_mount.status import format_status, snapshot
from fuse_mount.warmup import STATE_FILE, Chunk, save_plan
from neuralcache.blocks import BLOCK_SIZE
from tests.conftest import needs_fuse
from tests.fabric_helpers import trio_test
from tests.test_warmup import FILES, FakeFetcher, make_namespace


# --- wire format --------------------------------------------------------------------------------

@given(st.lists(st.dictionaries(st.text(max_size=5),
                                st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20),
                                max_size=4), min_size=1, max_size=5),
       st.lists(st.integers(1, 40), max_size=10))
def test_messages_survive_any_split_of_the_stream(messages: list[dict], cuts: list[int]) -> None:
    stream = b"".join(proto.encode(m) for m in messages)
    reader, bodies, at = proto.MessageReader(), [], 0
    for cut in cuts + [len(stream)]:
        bodies += reader.feed(stream[at:at + cut])
        at += cut
    bodies += reader.feed(stream[at:])
    assert [proto.decode_body(b) for b in bodies] == messages
    assert reader.pending == 0


def test_an_oversized_length_is_refused_before_its_body_arrives() -> None:
    with pytest.raises(proto.FrameTooLarge):
        proto.MessageReader().feed(struct.pack(">I", proto.MAX_MESSAGE + 1))


@pytest.mark.parametrize("body, message", [(b"\xc1", "not valid msgpack"),
                                           (b"\x93\x01\x02\x03", "not a map")])
def test_a_body_that_is_not_a_map_is_named(body: bytes, message: str) -> None:
    with pytest.raises(proto.BadMessage, match=message):
        proto.decode_body(body)


# --- progress line, status table, mount lookup --------------------------------------------------

def test_the_rate_follows_the_recent_window_not_the_instant_start() -> None:
    meter = ProgressMeter(window=10.0)
    meter.update(0.0, 0)
    meter.update(0.5, 500 << 20)  # already-cached chunks complete at once
    for t in range(1, 31):
        meter.update(float(t), (500 << 20) + t * (10 << 20))
    assert meter.rate == pytest.approx(10 << 20)
    assert meter.eta((500 << 20) + 40 * (10 << 20)) == pytest.approx(10.0)
    line = render(600 << 20, 1000 << 20, meter.rate, 42.0, bar=True)
    assert line.startswith("[" + "#" * 18 + "-" * 12 + "]")
    assert "600.0 MiB / 1000.0 MiB" in line and "10.0 MiB/s" in line and "ETA 0:42" in line
    assert not render(1, 2, None, None, bar=False).startswith("[")


def test_status_reads_its_figures_from_the_registry() -> None:
    registry = CollectorRegistry()
    Counter("neuralcache_cache_hit_blocks", "", registry=registry).inc(30)
    Counter("neuralcache_cache_miss_blocks", "", registry=registry).inc(10)
    Gauge("neuralcache_cache_used_bytes", "", registry=registry).set(1 << 30)
    Gauge("neuralcache_cache_capacity_bytes", "", registry=registry).set(4 << 30)
    state = Gauge("neuralcache_fabric_state", "", ["controller", "state"], registry=registry)
    state.labels("bbr", "startup").set(0)
    state.labels("bbr", "probe_bw").set(1)
    s = snapshot({"mountpoint": "/mnt/x", "hub": "h:1", "pid": 1, "cache_dir": "/c"},
                 {"state": "idle"}, registry)
    assert s["cache"]["hit_ratio"] == 0.75 and s["cache"]["fill_ratio"] == 0.25
    assert (s["link"]["controller"], s["link"]["state"]) == ("bbr", "probe_bw")
    assert s["prefetch"]["accuracy"] is None  # nothing issued yet
    table = format_status(s)
    assert "75.0 %" in table and "1.0 GiB of 4.0 GiB" in table and "bbr (probe_bw)" in table


def test_a_path_belongs_to_the_innermost_mount_holding_it(tmp_path: Path) -> None:
    outer = MountRecord(1, str(tmp_path / "m"), "/c1", "h:1", None)
    inner = MountRecord(2, str(tmp_path / "m" / "in"), "/c2", "h:1", None)
    (tmp_path / "m" / "in").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "m")
    records = [outer, inner]
    assert find_mount(str(tmp_path / "m" / "a" / "b"), records) == (outer, "a/b")
    assert find_mount(str(tmp_path / "m" / "in" / "x"), records) == (inner, "x")
    assert find_mount(str(tmp_path / "m"), records) == (outer, "")
    assert find_mount(str(tmp_path / "alias" / "f"), records) == (outer, "f")
    assert find_mount(str(tmp_path / "mm"), records) is None


# --- the server in-process ----------------------------------------------------------------------

class FakeClient:
    """What status asks of the hub client: refresh the link gauges."""

    def stats(self) -> None:
        return None


def _damage(cache_dir: Path, key: BlockKey) -> None:
    """Flip a byte of one stored block behind the cache's back, as disk damage would."""
    env = lmdb.open(str(cache_dir), max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        raw = bytearray(txn.get(key.pack()))
        raw[CHECKSUM_BYTES + 5] ^= 0xFF
        txn.put(key.pack(), bytes(raw))
    env.close()


async def _ask(path: str, *messages: bytes) -> list[dict[str, Any]]:
    """Send raw frames on one connection; the replies until the server stops talking."""
    stream = await trio.open_unix_socket(path)
    replies, reader = [], proto.MessageReader()
    async with stream:
        for message in messages:
            await stream.send_all(message)
        with trio.move_on_after(1):
            while len(replies) < len(messages) and (data := await stream.receive_some(65536)):
                replies += [proto.decode_body(b) for b in reader.feed(data)]
    return replies


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.fixture
def cache_with_blocks(tmp_path: Path):
    """A namespace of FILES and a cache holding every block of a/one and c, one of c damaged."""
    ns = make_namespace(FILES)
    path = tmp_path / "blocks"
    capacity = 64 * BLOCK_SIZE
    cache = BlockCache(BlockStore(str(path), capacity), capacity)
    for name in ("a/one", "c"):
        entry = ns.by_path(name).entry
        for b in range(-(-entry.size // BLOCK_SIZE)):
            cache.put(BlockKey(entry.file_id, entry.version, b), bytes([b]) * BLOCK_SIZE)
    trio.run(cache.flush)
    cache.close()
    c = ns.by_path("c").entry
    _damage(path, BlockKey(c.file_id, c.version, 2))
    cache = BlockCache(BlockStore(str(path), capacity), capacity)
    yield ns, cache
    cache.close()


@trio_test
async def test_the_server_answers_bad_requests_with_errors_and_keeps_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_with_blocks) -> None:
    monkeypatch.setattr(runtime, "RUNTIME_DIR", str(tmp_path / "run"))
    ns, cache = cache_with_blocks
    server = ControlServer(mountpoint="/mnt/test", hub="h:1", cache_dir=str(tmp_path), namespace=ns,
                           cache=cache, fetcher=FakeFetcher(), client=FakeClient())
    async with trio.open_nursery() as nursery:
        path = await nursery.start(server.serve)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        replies = await _ask(path, _frame(b"\xc1"), _frame(b"\x93\x01\x02\x03"),
                             proto.encode({"op": "reboot"}), proto.encode({"no": "op"}),
                             proto.encode({"op": "warmup", "paths": "a/one"}),
                             proto.encode({"op": "warmup", "paths": ["nope"]}),
                             proto.encode({"op": "cache_drop", "paths": ["a"]}),
                             proto.encode({"op": "warmup_progress"}))
        assert [r["ok"] for r in replies] == [False] * 7 + [True]
        errors = [r["error"] for r in replies[:7]]
        for error, expected in zip(errors, ["not valid msgpack", "not a map", "unknown request",
                                            "unknown request", "'paths' has the wrong type",
                                            "no such file", "is a directory"]):
            assert expected in error
        assert replies[7]["job"]["state"] == "idle"
        # A length past the limit: an error, then the connection closes.
        assert (await _ask(path, struct.pack(">I", proto.MAX_MESSAGE + 1)))[0]["ok"] is False
        # ... and the daemon goes on answering.
        status = (await _ask(path, proto.encode({"op": "status"})))[0]["status"]
        assert status["mountpoint"] == "/mnt/test"
        nursery.cancel_scope.cancel()
    assert not os.path.exists(path)


@trio_test
async def test_cache_verify_drops_a_damaged_block_and_drop_forgets_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_with_blocks) -> None:
    monkeypatch.setattr(runtime, "RUNTIME_DIR", str(tmp_path / "run"))
    ns, cache = cache_with_blocks
    server = ControlServer(mountpoint="/mnt/test", hub="h:1", cache_dir=str(tmp_path), namespace=ns,
                           cache=cache, fetcher=FakeFetcher(), client=FakeClient())
    one_blocks, c_blocks = 3, 5
    async with trio.open_nursery() as nursery:
        path = await nursery.start(server.serve)
        verify = proto.encode({"op": "cache_verify", "paths": [""], "recursive": True})
        first, second = await _ask(path, verify, verify)
        assert first == {"ok": True, "files": len(FILES), "checked_blocks": one_blocks + c_blocks,
                         "corrupt_blocks": 1}
        assert second["checked_blocks"] == one_blocks + c_blocks - 1
        assert second["corrupt_blocks"] == 0
        [dropped] = await _ask(path, proto.encode({"op": "cache_drop", "paths": ["a/one"]}))
        assert dropped == {"ok": True, "files": 1, "dropped_blocks": one_blocks}
        assert cache.policy.used == (c_blocks - 1) * BLOCK_SIZE
        nursery.cancel_scope.cancel()


# --- against real mounts ------------------------------------------------------------------------

def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}: {result.stderr}")
    return result


def read_all(mnt: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (mnt / rel).read_bytes() == data, rel


@needs_fuse
@pytest.mark.mount
def test_after_warmup_every_file_reads_from_cache_with_the_hub_gone(
        export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address, "--hub-timeout", "2")
    result = cli("warmup", str(spoke.mountpoint), "--recursive", "--wait")
    assert "warm-up done" in result.stderr
    assert f"{len([d for d in files.values() if d])} files" in result.stdout
    hub.stop()
    read_all(spoke.mountpoint, files)
    assert spoke.metric("neuralcache_read_bytes_total", source="hub") == 0
    verify = cli("cache", "verify", "-r", str(spoke.mountpoint))
    blocks = sum(-(-len(d) // BLOCK_SIZE) for d in files.values())
    assert f"checked {blocks} cached blocks" in verify.stdout and "none corrupt" in verify.stdout


@needs_fuse
@pytest.mark.mount
def test_a_restarted_daemon_resumes_the_unfinished_warmup(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.cache_dir.mkdir(parents=True)
    # What a daemon killed mid-job leaves behind: the plan, nothing of it cached.
    save_plan(str(spoke.cache_dir / STATE_FILE),
              [Chunk(rel, 0, -(-len(data) // BLOCK_SIZE)) for rel, data in files.items() if data])
    spoke.mount(hub.address, "--hub-timeout", "2")
    result = cli("warmup", "--wait")  # the only mount: watch the job it resumed
    assert "warm-up done" in result.stderr
    assert not (spoke.cache_dir / STATE_FILE).exists()
    hub.stop()
    read_all(spoke.mountpoint, files)
    assert spoke.metric("neuralcache_read_bytes_total", source="hub") == 0


STATUS_SAMPLES = {
    ("cache", "hit_blocks"): ("neuralcache_cache_hit_blocks_total", {}),
    ("cache", "miss_blocks"): ("neuralcache_cache_miss_blocks_total", {}),
    ("cache", "used_bytes"): ("neuralcache_cache_used_bytes", {}),
    ("cache", "capacity_bytes"): ("neuralcache_cache_capacity_bytes", {}),
    ("cache", "evicted_blocks"): ("neuralcache_cache_evictions_total", {}),
    ("reads", "cache_bytes"): ("neuralcache_read_bytes_total", {"source": "cache"}),
    ("reads", "hub_bytes"): ("neuralcache_read_bytes_total", {"source": "hub"}),
    ("prefetch", "issued_bytes"): ("neuralcache_prefetch_issued_bytes_total", {}),
    ("prefetch", "useful_bytes"): ("neuralcache_prefetch_useful_bytes_total", {}),
    ("prefetch", "inflight_bytes"): ("neuralcache_prefetch_inflight_bytes", {}),
    ("link", "btl_bw_bytes_per_second"): ("neuralcache_fabric_btl_bw_bytes_per_second", {}),
    ("link", "min_rtt_seconds"): ("neuralcache_fabric_min_rtt_seconds", {}),
    ("link", "pacing_rate_bytes_per_second"):
        ("neuralcache_fabric_pacing_rate_bytes_per_second", {}),
    ("link", "inflight_bytes"): ("neuralcache_fabric_inflight_bytes", {}),
}
"""Each figure of ``status --json`` and the endpoint sample it must equal."""


def _figures(status: dict[str, Any]) -> dict[tuple[str, str], float]:
    return {key: status[key[0]][key[1]] for key in STATUS_SAMPLES}


@needs_fuse
@pytest.mark.mount
def test_status_json_agrees_with_the_metrics_endpoint(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address)
    for rel in list(files)[:5]:
        (spoke.mountpoint / rel).read_bytes()
    (spoke.mountpoint / list(files)[4]).read_bytes()  # some hits too
    # Prefetches may still be settling: compare once two status calls around a scrape agree.
    for _ in range(20):
        before = json.loads(cli("status", "--json").stdout)
        samples = scrape(spoke.metrics_port)
        after = json.loads(cli("status", "--json", str(spoke.mountpoint)).stdout)
        if _figures(before) == _figures(after):
            break
    else:
        pytest.fail("the mount's figures never settled")
    for (section, field), (name, labels) in STATUS_SAMPLES.items():
        assert after[section][field] == sample(samples, name, **labels), (section, field)
    hits = sample(samples, "neuralcache_cache_hit_blocks_total")
    misses = sample(samples, "neuralcache_cache_miss_blocks_total")
    assert hits > 0 and misses > 0
    assert after["cache"]["hit_ratio"] == pytest.approx(hits / (hits + misses))
    assert after["link"]["up"] is (sample(samples, "neuralcache_hub_link_up") == 1)
    assert after["mountpoint"] == str(spoke.mountpoint) and after["hub"] == hub.address
    table = cli("status").stdout
    assert str(spoke.mountpoint) in table and "cache hit ratio" in table


@needs_fuse
@pytest.mark.mount
def test_the_commands_explain_what_they_cannot_do(export, hub: Hub, spoke: Spoke,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _, files = export
    monkeypatch.setattr(runtime, "RUNTIME_DIR", os.environ["NEURALCACHE_RUNTIME_DIR"])
    spoke.mount(hub.address)
    outside = cli("warmup", str(tmp_path), check=False)
    assert outside.returncode == 1 and "not inside a neuralcache mount" in outside.stderr
    no_r = cli("warmup", str(spoke.mountpoint / "d1"), check=False)
    assert no_r.returncode == 1 and "is a directory (use --recursive)" in no_r.stderr
    missing = cli("cache", "drop", str(spoke.mountpoint / "nope"), check=False)
    assert missing.returncode == 1 and "no such file" in missing.stderr
    assert "no warm-up is running" in cli("warmup", "--cancel").stdout
    # A client speaking garbage on the live daemon's socket gets an error, not a dead daemon.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(runtime.control_socket_path(str(spoke.mountpoint)))
        s.sendall(_frame(b"\xc1"))
        reply = proto.decode_body(s.recv(65536)[4:])
    assert reply["ok"] is False and "msgpack" in reply["error"]
    in_d1 = {rel: data for rel, data in files.items() if rel.startswith("d1/")}
    read_all(spoke.mountpoint, in_d1)
    drop = cli("cache", "drop", str(spoke.mountpoint / "top0.bin"), str(spoke.mountpoint / "d1"),
               "-r")
    blocks = sum(-(-len(d) // BLOCK_SIZE) for d in in_d1.values())
    assert f"dropped {blocks} cached blocks of {len(in_d1) + 1} files" in drop.stdout


@needs_fuse
@pytest.mark.mount
def test_a_recorded_profile_warms_exactly_what_the_run_read(
        export, hub: Hub, tmp_path: Path) -> None:
    _, files = export
    profile = tmp_path / "run.trace"
    recorded = {rel: data for rel, data in files.items() if rel.startswith("d")}
    first = Spoke(tmp_path / "mnt1", tmp_path / "cache1")
    try:
        first.mount(hub.address, "--record-trace", str(profile))
        read_all(first.mountpoint, recorded)
    finally:
        first.cleanup()
    second = Spoke(tmp_path / "mnt2", tmp_path / "cache2")
    try:
        second.mount(hub.address, "--hub-timeout", "2")
        result = cli("warmup", "--profile", str(profile), str(second.mountpoint), "--wait")
        assert f"{len(recorded)} files" in result.stdout and "warm-up done" in result.stderr
        assert second.metric("neuralcache_cache_used_bytes") == sum(map(len, recorded.values()))
        hub.stop()
        read_all(second.mountpoint, recorded)
    finally:
        second.cleanup()
