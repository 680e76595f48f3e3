"""The hint wire format, the incremental decoder, announce() and HintedSampler."""

import copy
import os
import threading

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuralcache.hints import (CONTROL_FILE, HintDecoder, HintedSampler, HintFormatError,
                               HintRecord, announce, decode_hints, encode_hints)

items_st = st.lists(st.tuples(st.text(min_size=1, max_size=20), st.integers(0, 2**40),
                              st.integers(1, 2**20)), max_size=50)


@settings(max_examples=50, deadline=None)
@given(items_st, st.integers(0, 10**6), st.text(max_size=8), st.integers(1, 7), st.booleans())
def test_encode_decode_round_trip(items, epoch, source, per_record, exact):
    records = decode_hints(encode_hints(items, epoch, source, items_per_record=per_record,
                                        exact=exact))
    assert [i for r in records for i in r.items] == items
    assert all(r.epoch == epoch and r.source == source and r.exact == exact for r in records)
    assert len(records) == max(1, -(-len(items) // per_record))


@settings(max_examples=50, deadline=None)
@given(items_st, st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_decoder_handles_any_write_boundaries(items, cuts):
    data = encode_hints(items, 3, "r", items_per_record=4)
    decoder = HintDecoder()
    records, pos, k = [], 0, 0
    while pos < len(data):
        size = cuts[k % len(cuts)]
        records += decoder.feed(data[pos:pos + size])
        pos += size
        k += 1
    assert decoder.pending == 0
    assert [i for r in records for i in r.items] == items


def _frame(msg) -> bytes:
    body = msgpack.packb(msg)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("msg", [
    {"v": 2, "epoch": 0, "items": []},
    {"v": 1, "epoch": "x", "items": []},
    {"v": 1, "epoch": 0, "items": [["a", -1, 5]]},
    {"v": 1, "epoch": 0, "items": [["a", 0, 0]]},
    {"v": 1, "epoch": 0, "items": [[1, 0, 5]]},
    [1, 2, 3],
])
def test_malformed_records_are_rejected(msg):
    with pytest.raises(HintFormatError):
        decode_hints(_frame(msg))


def test_truncated_and_oversized_records_are_rejected():
    data = encode_hints([("a", 0, 1)], 0)
    with pytest.raises(HintFormatError):
        decode_hints(data[:-1])
    with pytest.raises(HintFormatError):
        HintDecoder().feed((1 << 30).to_bytes(4, "big"))


def test_unknown_keys_are_ignored_for_forward_compatibility():
    (record,) = decode_hints(_frame({"v": 1, "epoch": 2, "items": [["a", 0, 9]], "new": 1}))
    assert record == HintRecord(2, (("a", 0, 9),), "") and not record.exact


def test_exact_must_be_a_bool():
    with pytest.raises(HintFormatError, match="exact"):
        decode_hints(_frame({"v": 1, "epoch": 2, "items": [["a", 0, 9]], "exact": 1}))


def test_announce_writes_relative_paths_to_the_control_file(tmp_path):
    os.makedirs(tmp_path / ".neuralcache")
    (tmp_path / CONTROL_FILE).write_bytes(b"")
    items = [(str(tmp_path / "d" / "x.bin"), 0, 4096), ("d/y.bin", 8192, 100)]
    written = announce(str(tmp_path), items, epoch=5, source="rank3")
    data = (tmp_path / CONTROL_FILE).read_bytes()
    assert written == len(data)
    (record,) = decode_hints(data)
    assert record == HintRecord(5, (("d/x.bin", 0, 4096), ("d/y.bin", 8192, 100)), "rank3")
    with pytest.raises(ValueError):
        announce(str(tmp_path), [("/elsewhere/z", 0, 1)])


class _Sampler:
    def __init__(self, order, rank=None):
        self.order = order
        self.epoch = None
        if rank is not None:
            self.rank = rank

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)

    def set_epoch(self, epoch):
        self.epoch = epoch


def test_hinted_sampler_announces_each_epoch_then_yields_the_indices():
    """Epochs no longer than the head go out whole, before the first index."""
    calls = []
    sampler = HintedSampler(_Sampler([3, 1, 2], rank=4), "/mnt",
                            lambda i: [(f"s/{i}", i * 10, 10)],
                            announce_fn=lambda m, items, epoch, source, exact: calls.append(
                                (m, items, epoch, source)))
    assert list(sampler) == [3, 1, 2] and len(sampler) == 3
    assert list(sampler) == [3, 1, 2]
    sampler.set_epoch(7)
    list(sampler)
    assert sampler.wait_announced(timeout=10)
    assert [c[2] for c in calls] == [0, 1, 7]
    assert calls[0] == ("/mnt", [("s/3", 30, 10), ("s/1", 10, 10), ("s/2", 20, 10)], 0, "4")
    assert sampler.sampler.epoch == 7


def test_hinted_sampler_keeps_training_when_the_mount_is_not_neuralcache(tmp_path):
    sampler = HintedSampler(_Sampler([0, 1]), str(tmp_path), lambda i: [("f", 0, 1)])
    with pytest.warns(UserWarning, match="could not announce"):
        assert list(sampler) == [0, 1]
        assert sampler.wait_announced(timeout=10)


def test_hinted_sampler_yields_before_its_announcement_is_written():
    """Only the epoch's head is announced before the first index; the rest goes out in a
    thread, so the first batch never waits for a long announcement."""
    release = threading.Event()
    calls = []

    def slow_announce(mountpoint, items, epoch, source, exact):
        if calls:  # the first epoch's head is written at once; everything after it blocks
            assert release.wait(timeout=10)
        calls.append((epoch, [offset for _, offset, _ in items], exact))

    sampler = HintedSampler(_Sampler([5, 6, 7]), "/mnt", lambda i: [("f", i, 1)],
                            announce_fn=slow_announce, exact_reads=True, head_items=1)
    assert next(iter(sampler)) == 5  # while the rest of the announcement is still blocked
    assert calls == [(0, [5], True)]  # the head went out before the first index
    assert list(sampler) == [5, 6, 7]  # the next epoch's (head too) waits for the first one's
    assert not sampler.wait_announced(timeout=0.05) and len(calls) == 1
    clone = copy.deepcopy(sampler)  # while its thread runs (a checkpoint may copy a sampler)
    assert clone.epoch == sampler.epoch and clone.wait_announced()
    release.set()
    assert sampler.wait_announced(timeout=10)
    assert calls == [(0, [5], True), (0, [6, 7], True), (1, [5, 6, 7], True)]  # in order


def test_hinted_sampler_with_a_torch_dataloader(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, RandomSampler

    os.makedirs(tmp_path / ".neuralcache")
    (tmp_path / CONTROL_FILE).write_bytes(b"")
    dataset = list(range(10))
    sampler = HintedSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
                            str(tmp_path), lambda i: [("data.bin", i * 16, 16)])
    loader = DataLoader(dataset, batch_size=5, sampler=sampler)
    seen = [int(x) for batch in loader for x in batch]
    assert sampler.wait_announced(timeout=10)
    (record,) = decode_hints((tmp_path / CONTROL_FILE).read_bytes())
    assert [o // 16 for _, o, _ in record.items] == seen
