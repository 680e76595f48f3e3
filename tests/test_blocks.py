"""Block geometry, cache key order and block checksums, each against a brute-force reference."""

from __future__ import annotations

import itertools

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from fabric.checksum import bad_blocks, block_checksum, intact, range_checksums
from fabric.protocol import CHECKSUM_BYTES
from fuse_mount.block_store import BlockKey
from fuse_mount.key_space import KeySpace
from neuralcache.blocks import (BLOCK_SIZE, KEY_SHIFT, BlockRange, block_count, block_key,
                                block_length, block_span, blocks_for_read, contiguous_runs)

SMALL_BLOCKS = 12
"""Offsets and sizes span this many blocks: enough for every edge, few enough to enumerate."""

byte_positions = st.integers(0, SMALL_BLOCKS * BLOCK_SIZE)
U64 = st.integers(0, 2**64 - 1)


def touched_blocks(offset: int, length: int, size: int) -> list[int]:
    """Reference: each block whose bytes meet the part of [offset, offset+length) in the file."""
    end = min(offset + length, size)
    return [b for b in range(SMALL_BLOCKS + 2)
            if max(offset, b * BLOCK_SIZE) < min(end, (b + 1) * BLOCK_SIZE)]


@given(offset=byte_positions, length=byte_positions, size=byte_positions)
def test_blocks_for_read_covers_exactly_the_blocks_touched(
        offset: int, length: int, size: int) -> None:
    got = blocks_for_read(offset, length, size)
    expected = touched_blocks(offset, length, size)
    assert list(range(got.first, got.end)) == expected
    if not expected:
        assert got == BlockRange(offset // BLOCK_SIZE, 0)


@pytest.mark.parametrize("offset,length", [(-1, 10), (0, -1)])
def test_blocks_for_read_refuses_negative_arguments(offset: int, length: int) -> None:
    with pytest.raises(ValueError):
        blocks_for_read(offset, length, 100)


@given(size=byte_positions)
def test_block_count_is_the_number_of_chunks(size: int) -> None:
    assert block_count(size) == len(range(0, size, BLOCK_SIZE))


@given(block=st.integers(0, SMALL_BLOCKS + 2), size=byte_positions)
def test_block_length_is_the_length_of_the_slice(block: int, size: int) -> None:
    chunk = range(size)[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE]
    assert block_length(block, size) == len(chunk)


@given(size=byte_positions)
def test_block_lengths_sum_to_the_file_size(size: int) -> None:
    lengths = [block_length(b, size) for b in range(block_count(size))]
    assert sum(lengths) == size
    assert all(n > 0 for n in lengths)


@given(blocks=st.sets(st.integers(0, 200)).map(sorted))
def test_contiguous_runs_match_a_groupby_reference(blocks: list[int]) -> None:
    # Consecutive numbers share the same (value - position) difference.
    expected = []
    for _, group in itertools.groupby(enumerate(blocks), key=lambda t: t[1] - t[0]):
        members = [b for _, b in group]
        expected.append(BlockRange(members[0], len(members)))
    assert contiguous_runs(blocks) == expected


@given(offset=byte_positions, length=byte_positions)
def test_block_span_agrees_with_blocks_for_read_on_an_unbounded_file(
        offset: int, length: int) -> None:
    r = blocks_for_read(offset, length, 2**62)
    assert block_span(offset, length) == (r.first, r.end)


@given(file_id=st.integers(0, 2**23), block=st.integers(0, 2**KEY_SHIFT - 1))
def test_block_key_is_injective(file_id: int, block: int) -> None:
    key = block_key(file_id, block)
    assert (key >> KEY_SHIFT, key & (2**KEY_SHIFT - 1)) == (file_id, block)


block_keys = st.builds(BlockKey, U64, U64, U64)


@given(keys=st.lists(block_keys, max_size=30))
def test_packed_keys_sort_like_the_tuples(keys: list[BlockKey]) -> None:
    assert sorted(keys, key=BlockKey.pack) == sorted(keys)
    assert all(BlockKey.unpack(k.pack()) == k for k in keys)


@given(file_id=st.integers(1, 2**64 - 2), version=st.integers(1, 2**64 - 2),
       blocks=st.sets(U64, min_size=1, max_size=10), data=st.data())
def test_one_file_versions_keys_are_contiguous_in_block_order(
        file_id: int, version: int, blocks: set[int], data: st.DataObject) -> None:
    """LMDB iterates in packed-key order, so a file version's blocks must form one sorted run,
    even among keys of the same file's other versions and of the neighbouring file ids."""
    near = st.builds(BlockKey, st.sampled_from([file_id - 1, file_id, file_id + 1]),
                     st.sampled_from([version - 1, version, version + 1]), U64)
    others = data.draw(st.lists(near, max_size=20))
    ordered = sorted({BlockKey(file_id, version, b) for b in blocks} | set(others),
                     key=BlockKey.pack)
    positions = [i for i, k in enumerate(ordered) if (k.file_id, k.version) == (file_id, version)]
    assert positions == list(range(positions[0], positions[0] + len(positions)))
    run = [ordered[i].block for i in positions]
    assert run == sorted(run)


@given(data=st.binary(max_size=4 * BLOCK_SIZE + 10))
def test_range_checksums_are_the_per_block_xxh3(data: bytes) -> None:
    sums = range_checksums(data)
    blocks = [data[i:i + BLOCK_SIZE] for i in range(0, len(data), BLOCK_SIZE)]
    assert sums == b"".join(
        xxhash.xxh3_64_intdigest(b).to_bytes(CHECKSUM_BYTES, "big") for b in blocks)
    assert all(block_checksum(b) == sums[i * CHECKSUM_BYTES:(i + 1) * CHECKSUM_BYTES]
               for i, b in enumerate(blocks))
    assert bad_blocks(data, sums) == [] and intact(data, sums)


@given(data=st.binary(min_size=1, max_size=4 * BLOCK_SIZE + 10), position=st.integers(min_value=0),
       xor=st.integers(1, 255))
def test_bad_blocks_flags_exactly_the_flipped_block(data: bytes, position: int, xor: int) -> None:
    sums = range_checksums(data)
    flipped = bytearray(data)
    position %= len(data)
    flipped[position] ^= xor
    assert bad_blocks(bytes(flipped), sums) == [position // BLOCK_SIZE]
    assert not intact(bytes(flipped), sums)


@given(data=st.binary(min_size=1, max_size=3 * BLOCK_SIZE))
def test_bad_blocks_flags_everything_when_a_checksum_is_missing(data: bytes) -> None:
    sums = range_checksums(data)[:-CHECKSUM_BYTES]
    assert bad_blocks(data, sums) == list(range(block_count(len(data))))


@given(data=st.binary(max_size=3 * BLOCK_SIZE))
def test_bad_blocks_flags_everything_when_a_checksum_is_extra(data: bytes) -> None:
    sums = range_checksums(data) + bytes(CHECKSUM_BYTES)
    assert bad_blocks(data, sums) == list(range(block_count(len(data)) + 1))


MAX_BLOCK = (2**63 - 1) // BLOCK_SIZE
"""The last block of the largest file a stat can describe (``st_size`` is a signed 64-bit int)."""


@given(blocks=st.lists(st.tuples(st.sampled_from([(1, 1), (1, 2), (2, 1), (2**64 - 1, 2**64 - 1)]),
                                 st.integers(0, MAX_BLOCK)), min_size=1, max_size=20),
       first=st.integers(0, MAX_BLOCK - 300), count=st.integers(0, 300))
def test_int_keys_name_each_block_of_each_version_once(
        blocks: list[tuple[tuple[int, int], int]], first: int, count: int) -> None:
    keys = KeySpace()
    triples = [(file_id, version, block) for (file_id, version), block in blocks]
    ints = [keys.key(*t) for t in triples]
    assert len(set(ints)) == len(set(triples))  # equal keys exactly for equal blocks
    assert [keys.triple(k) for k in ints] == triples
    assert [keys.block_key(k) for k in ints] == [BlockKey(*t) for t in triples]
    file_id, version, _ = triples[0]
    assert list(keys.run(file_id, version, first, count)) == [
        keys.key(file_id, version, b) for b in range(first, first + count)]
