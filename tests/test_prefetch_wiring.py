"""The mount's prefetch wiring without a mount: the LRU's protected victims, the cache's drop
reports, the control file's decoding rules and the link estimate taken from the transport."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.congestion import CongestionStats
from fabric.protocol import MetaEntry
from fuse_mount.block_cache import BlockCache
from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.control import ControlFiles
from fuse_mount.key_space import KeySpace
from fuse_mount.prefetch import MountCacheView, measured_link
from neuralcache.blocks import BLOCK_SIZE
from neuralcache.cache_policy import LruPolicy
from neuralcache.events import LinkEstimate
from neuralcache.hints import HintRecord, encode_hints
from tests.fabric_helpers import metric


@given(ops=st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=80),
       capacity=st.integers(1, 8))
def test_lru_spares_protected_keys_while_any_other_can_go(ops, capacity) -> None:
    policy = LruPolicy(capacity)
    protected: set[int] = set()
    for key, protect in ops:
        (protected.add if protect else protected.discard)(key)
        held_before = set(policy.oldest_first())
        evicted = policy.insert(key, 1, protected.__contains__)
        assert policy.used <= capacity
        assert set(policy.oldest_first()) == (held_before | {key}) - set(evicted)
        # The key being inserted is no candidate; every older unprotected one goes first.
        unprotected_left = [k for k in policy.oldest_first() if k not in protected and k != key]
        if any(k in protected for k in evicted):
            assert not unprotected_left, "evicted a protected key while another could go"


def test_lru_without_a_predicate_is_plain_lru() -> None:
    policy = LruPolicy(2)
    policy.insert("a", 1)
    policy.insert("b", 1)
    assert policy.insert("c", 1) == ["a"]
    assert policy.insert("d", 1, lambda k: k == "b") == ["c"]  # b spared, moved to the new end


def test_the_cache_reports_evictions_and_spares_protected_blocks(tmp_path: Path) -> None:
    cache = BlockCache(BlockStore(str(tmp_path / "c"), 2 * BLOCK_SIZE), 2 * BLOCK_SIZE)
    dropped: list[BlockKey] = []
    keys = [BlockKey(1, 1, b) for b in range(4)]
    cache.watch(dropped.append, lambda key: key == keys[0])
    try:
        for key in keys[:3]:
            cache.put(key, bytes(BLOCK_SIZE))
        assert dropped == [keys[1]] and cache.holds(keys[0])
        cache.put(keys[3], bytes(BLOCK_SIZE))
        assert dropped == [keys[1], keys[2]]
    finally:
        cache.close()


def _control() -> tuple[ControlFiles, list[HintRecord]]:
    records: list[HintRecord] = []
    return ControlFiles(first_inode=100, on_record=records.append), records


def test_hints_may_arrive_split_across_writes() -> None:
    control, records = _control()
    data = encode_hints([("a/b", 0, 4096), ("a/c", 8192, 100)], epoch=3, source="r2")
    control.open(control.hints_inode, os.O_WRONLY | os.O_TRUNC, fh=7)
    assert control.write(7, data[:5]) == 5
    assert records == []
    assert control.write(7, data[5:]) == len(data) - 5
    assert records == [HintRecord(3, (("a/b", 0, 4096), ("a/c", 8192, 100)), "r2")]


def test_a_malformed_record_fails_the_write_and_poisons_only_that_handle() -> None:
    control, records = _control()
    before = metric("neuralcache_prefetch_hint_errors_total")
    control.open(control.hints_inode, os.O_WRONLY, fh=1)
    control.open(control.hints_inode, os.O_WRONLY, fh=2)
    for data in (b"\x00\x00\x00\x02\x91\x01", encode_hints([("x", 0, 1)], epoch=0)):
        with pytest.raises(pyfuse3.FUSEError) as exc:
            control.write(1, data)
        assert exc.value.errno == errno.EINVAL
    control.write(2, encode_hints([("x", 0, 1)], epoch=0))
    assert len(records) == 1
    control.write(2, b"\x00\x00")  # an unfinished record at close is counted, not raised
    control.release(2)
    assert metric("neuralcache_prefetch_hint_errors_total") == before + 3


def test_the_hints_file_is_write_only_and_the_directory_holds_only_it() -> None:
    control, _ = _control()
    for flags, code in ((os.O_RDONLY, errno.EACCES), (os.O_RDWR, errno.EACCES)):
        with pytest.raises(pyfuse3.FUSEError) as exc:
            control.open(control.hints_inode, flags, fh=1)
        assert exc.value.errno == code
    assert control.lookup(pyfuse3.ROOT_INODE, ".neuralcache").st_ino == control.dir_inode
    assert control.lookup(pyfuse3.ROOT_INODE, "data") is None  # not ours: the namespace's
    with pytest.raises(pyfuse3.FUSEError):
        control.lookup(control.dir_inode, "other")
    assert control.listing(control.dir_inode) == [("hints", control.hints_inode)]


def _stats(btl_bw: float, min_rtt: float) -> CongestionStats:
    return CongestionStats("bbr", "startup", True, btl_bw, min_rtt, min_rtt, btl_bw, 0, 0, 0, 0, 0)


def test_the_link_estimate_is_the_transport_model_once_it_has_one() -> None:
    assert measured_link(_stats(0.0, math.inf)) is None
    assert measured_link(_stats(1e6, math.inf)) is None
    assert measured_link(_stats(25e6, 0.06)) == LinkEstimate(25e6, 0.06)


@given(st.sets(st.integers(0, 40)), st.sets(st.integers(0, 40)), st.integers(0, 45),
       st.integers(0, 45), st.booleans())
def test_the_mount_answers_a_stretch_as_contains_does_block_by_block(
        held: set[int], fetching: set[int], first: int, length: int, known_file: bool) -> None:
    """``present_until``/``absent_until`` walk keys in a loop of their own; they must agree
    with ``contains``. The blocks of another version of the file, held and fetched alike,
    count for neither."""
    policy, keys = LruPolicy(1 << 30), KeySpace()
    old = keys.base(7, 2)  # a version the snapshot no longer has, seen first
    for block in range(41):
        policy.insert(old + block, BLOCK_SIZE)
    base = keys.base(7, 3)
    for block in held:
        policy.insert(base + block, BLOCK_SIZE)
    in_flight = {base + block for block in fetching} | {old + block for block in range(41)}
    view = MountCacheView(
        SimpleNamespace(files=lambda: [MetaEntry("a", "f", 0o444, 1 << 20, 0, 7, 3)]),
        SimpleNamespace(policy=policy, keys=keys),
        SimpleNamespace(in_flight=in_flight.__contains__))
    assert [view.contains(7, b) for b in range(41)] == [b in held | fetching for b in range(41)]
    file_id, stop = (7 if known_file else 8), first + length

    def walk(wanted: bool) -> int:
        block = first
        while block < stop and view.contains(file_id, block) != wanted:
            block += 1
        return block

    assert view.present_until(file_id, first, stop) == walk(False)
    assert view.absent_until(file_id, first, stop) == walk(True)
