"""Stream separation: interleaved readers on one handle, strides, crossing into the next file."""

from hypothesis import given, settings
from hypothesis import strategies as st

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.streams import (HINT_MISMATCH_PENALTY, MATCH_FORWARD_BLOCKS,
                                 NEAR_BUCKET_BLOCKS, StreamTable)
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


class ScanningStreamTable(StreamTable):
    """The reference: ``_nearest`` by looking at every stream of the file, same costs and the
    same tie-break (the oldest stream), without the bucket index."""

    def _nearest(self, hint, file_id, first):
        best, best_cost = None, MATCH_FORWARD_BLOCKS + HINT_MISMATCH_PENALTY + 1
        for sid in sorted(self._by_file.get(file_id, ())):
            s = self._streams[sid]
            gap = first - s.next_block
            if gap < 0:
                if first < s.last_block:
                    continue
                gap = 0
            if gap > MATCH_FORWARD_BLOCKS:
                continue
            cost = gap + (0 if s.hint == hint else HINT_MISMATCH_PENALTY)
            if cost < best_cost:
                best, best_cost = s, cost
        return best

    def _crossing(self, file_id, first):
        """Every stream of the previous file, without the index of those near its end."""
        prev = self.catalog.prev_file(file_id)
        if prev is None:
            return None, None
        return self._scan_crossing(prev, self.catalog.blocks(prev), first)


reads = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(0, 400),
                           st.integers(1, 300)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(reads, st.integers(2, 12))
def test_the_nearness_index_matches_a_scan_of_every_stream(reads, max_streams):
    """Near reads (within a bucket or two of a stream), long reads, re-reads, a few files and
    a small table that evicts: every read joins the stream a full scan would pick."""
    catalog = shards(size=1024 * BLOCK_SIZE)
    indexed, scanned = StreamTable(catalog, max_streams), ScanningStreamTable(catalog, max_streams)
    for i, (hint, file_id, block, count) in enumerate(reads):
        args = (i * 0.001, hint, file_id, block * BLOCK_SIZE, count * BLOCK_SIZE)
        got, want = indexed.observe(*args), scanned.observe(*args)
        assert (got.stream.sid, got.delta, got.crossed_from) == (
            want.stream.sid, want.delta, want.crossed_from)
    # Every live stream is indexed under exactly the buckets of its current range.
    expected = {}
    for s in indexed.streams():
        for bucket in range(s.last_block // NEAR_BUCKET_BLOCKS,
                            (s.next_block + MATCH_FORWARD_BLOCKS) // NEAR_BUCKET_BLOCKS + 1):
            expected.setdefault((s.file_id, bucket), set()).add(s.sid)
    assert indexed._near == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 200),
                          st.integers(1, 40), st.booleans()), min_size=1, max_size=150),
       st.integers(2, 12))
def test_crossing_into_the_next_file_matches_a_scan_of_every_stream(reads, max_streams):
    """Short files (sequential and strided readers cross often) and files that change size:
    a read at the start of a file joins the stream a scan of the previous file would pick."""
    tables = []
    for table_type in (StreamTable, ScanningStreamTable):
        tables.append(table_type(shards(size=160 * BLOCK_SIZE), max_streams))
    for i, (hint, file_id, block, count, resize) in enumerate(reads):
        if resize and i % 7 == 0:  # the file grew (or shrank) under its readers
            for table in tables:
                info = table.catalog.get(file_id)
                table.catalog.add(file_id, info.path, (100 + block) * BLOCK_SIZE)
        args = (i * 0.001, hint, file_id, block * BLOCK_SIZE, count * BLOCK_SIZE)
        got, want = (table.observe(*args) for table in tables)
        assert (got.stream.sid, got.delta, got.crossed_from) == (
            want.stream.sid, want.delta, want.crossed_from)
