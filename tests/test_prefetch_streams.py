"""Stream separation: interleaved readers on one handle, strides, crossing into the next file."""

from hypothesis import given, settings
from hypothesis import strategies as st

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.streams import StreamTable
from tests.prefetch_helpers import shards


def test_interleaved_workers_on_one_handle_become_separate_streams():
    table = StreamTable(shards())
    starts = [0, 1000, 2000, 3000]  # four workers, regions far apart, one shared descriptor
    sids = {}
    for step in range(10):
        for w, start in enumerate(starts):
            obs = table.observe(step * 0.01, 7, 1, (start + 4 * step) * BLOCK_SIZE, 4 * BLOCK_SIZE)
            sids.setdefault(w, set()).add(obs.stream.sid)
    assert all(len(s) == 1 for s in sids.values())
    assert len({next(iter(s)) for s in sids.values()}) == 4
    assert all(s.seq_conf >= 2 and s.run >= 8 for s in table.streams())


def test_strided_reader_is_one_stream_with_its_stride():
    table = StreamTable(shards())
    for k in range(6):
        obs = table.observe(k * 0.01, 3, 1, k * 32 * BLOCK_SIZE, 4 * BLOCK_SIZE)
    s = obs.stream
    assert (s.stride, s.stride_conf >= 2, s.seq_conf, len(table)) == (32, True, 0, 1)


def test_stream_follows_into_the_next_file_with_a_new_handle():
    catalog = shards(size=64 * BLOCK_SIZE)
    table = StreamTable(catalog)
    for b in range(0, 64, 8):
        first = table.observe(0.0, 11, 1, b * BLOCK_SIZE, 8 * BLOCK_SIZE)
    crossed = table.observe(0.1, 12, 2, 0, 8 * BLOCK_SIZE)  # the next shard, opened anew
    assert crossed.stream is first.stream
    assert crossed.crossed_from == 1 and crossed.delta == 8 and crossed.stream.file_id == 2


def test_random_reads_start_new_streams():
    table = StreamTable(shards())
    offsets = [500, 90, 700, 10, 300]
    results = [table.observe(0.0, 1, 1, o * BLOCK_SIZE, BLOCK_SIZE) for o in offsets]
    assert all(r.delta is None for r in results)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 1023),
                          st.integers(1, 64)), max_size=200))
def test_table_stays_bounded_and_consistent(reads):
    table = StreamTable(shards(), max_streams=8)
    for i, (hint, fid, block, n) in enumerate(reads):
        obs = table.observe(i * 0.001, hint, fid, block * BLOCK_SIZE, n * BLOCK_SIZE)
        assert obs.stream.file_id == fid and obs.stream.last_block == block
        assert len(table) <= 8
