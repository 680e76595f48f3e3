"""Stream separation: split the read sequence into per-reader streams by address continuity.

Data-loader workers that inherit one descriptor interleave their reads on one file handle, and a
worker that finishes a shard moves on to the next file with a new handle. So the handle is only a
hint: a read joins the stream that expected it (the block after its last read, or its last block
plus its stride), else the nearest stream just behind it in the same file, else a stream that ran
off the end of the previous sibling file (crossing into "the next shard"), else it starts a stream.
This is the multi-stream detection of kernel readahead and of hardware stream prefetchers.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat

from neuralcache.blocks import BLOCK_SIZE, block_key, block_span
from neuralcache.catalog import Catalog

MAX_STREAMS = 128
"""Streams tracked at once; the least recently used is dropped (64 workers x 2 files fit)."""

MATCH_FORWARD_BLOCKS = 64
"""A read up to 256 KiB past a stream's expected block may still continue it (a skipped record)."""

HINT_MISMATCH_PENALTY = 16
"""Extra gap (blocks) charged when a candidate stream carries a different handle hint."""

SEQ_CONFIDENCE_MAX = 3
"""Saturating counters (sequential and stride), as in a reference prediction table."""

RATE_WINDOW_S = 0.25
"""A stream's read rate is re-measured over windows of this length."""

NEAR_BUCKET_BLOCKS = MATCH_FORWARD_BLOCKS
"""Width of the buckets that index streams by the blocks a read may continue them from, so
matching a read looks at the few streams near it, not at every stream of its file (a
shuffled sampler keeps ``MAX_STREAMS`` one-read streams in one file)."""

HISTORY = 3
"""Deltas kept per stream: the longest context of the sequence model."""


class Stream:
    """One reader's position, recent deltas and read rate.

    Positions are in blocks of the stream's current file; deltas that cross into the next file
    are measured as if the two files were concatenated.
    """

    __slots__ = (
        "sid", "hint", "file_id", "last_block", "last_len", "stride", "stride_conf", "seq_conf",
        "deltas", "t_last", "t_mark", "bytes_mark", "rate", "accesses", "expect_keys", "run",
        "state", "near_keys", "may_cross",
    )

    def __init__(self, sid: int, hint: int, file_id: int, first: int, count: int, now: float):
        self.sid = sid
        self.hint = hint
        self.file_id = file_id
        self.last_block = first
        self.last_len = count
        self.stride = 0  # last non-sequential delta, 0 if none
        self.stride_conf = 0
        self.seq_conf = 0
        self.deltas: tuple[int, ...] = ()
        self.t_last = now
        self.t_mark = now
        self.bytes_mark = count * BLOCK_SIZE
        self.rate = 0.0  # bytes/s, 0 until a window has passed
        self.accesses = 1
        self.run = 0  # consecutive reads that continued the run (sequential or the same stride)
        self.expect_keys: tuple[int, ...] = ()
        self.near_keys: tuple[tuple[int, int], ...] = ()  # its buckets in StreamTable._near
        self.may_cross = False  # in StreamTable._crossers: near enough its file's end to cross
        self.state: dict[str, object] = {}  # per-predictor scratch, keyed by predictor name

    @property
    def next_block(self) -> int:
        """The block a sequential continuation would read next."""
        return self.last_block + self.last_len

    def read_rate(self, now: float) -> float:
        """Bytes/s this stream reads at; 0 until it has been measured over a whole window."""
        if self.rate > 0:
            return self.rate
        if now - self.t_mark >= RATE_WINDOW_S:
            return self.bytes_mark / (now - self.t_mark)
        return 0.0

    def _advance(self, now: float, first: int, count: int, delta: int) -> None:
        if delta == self.last_len:
            self.run = self.run + 1 if self.seq_conf >= 1 else 1
            self.seq_conf = min(self.seq_conf + 1, SEQ_CONFIDENCE_MAX)
        else:
            self.seq_conf = max(self.seq_conf - 1, 0)
            if delta == self.stride:
                self.run = self.run + 1 if self.stride_conf >= 1 else 1
                self.stride_conf = min(self.stride_conf + 1, SEQ_CONFIDENCE_MAX)
            else:
                self.run = 0
                if self.stride_conf > 0:
                    self.stride_conf -= 1
                else:
                    self.stride = delta
        self.deltas = (self.deltas + (delta,))[-HISTORY:]
        self.last_block = first
        self.last_len = count
        self.t_last = now
        self.accesses += 1
        self.bytes_mark += count * BLOCK_SIZE
        elapsed = now - self.t_mark
        if elapsed >= RATE_WINDOW_S:
            inst = self.bytes_mark / elapsed
            self.rate = inst if self.rate == 0 else 0.5 * (self.rate + inst)
            self.t_mark = now
            self.bytes_mark = 0


class Observation:
    """What the stream table concluded about one read."""

    __slots__ = ("stream", "first", "count", "delta", "crossed_from", "explained")

    def __init__(self, stream: Stream, first: int, count: int, delta: int | None,
                 crossed_from: int | None):
        self.stream = stream
        self.first = first
        self.count = count
        self.delta = delta  # blocks since the stream's previous read; None for a new stream
        self.crossed_from = crossed_from  # previous file id when the stream moved to a new file
        self.explained = False  # set by a predictor whose guess for this stream came true


class StreamTable:
    """Assigns each read to a stream; see the module docstring for the matching rules."""

    def __init__(self, catalog: Catalog, max_streams: int = MAX_STREAMS) -> None:
        self.catalog = catalog
        self.max_streams = max_streams
        self._streams: OrderedDict[int, Stream] = OrderedDict()  # least recently used first
        self._by_file: dict[int, set[int]] = {}
        self._expect: dict[int, int] = {}  # block key -> sid of a stream expecting that block
        # (file, bucket) -> sids of streams a read in that bucket may continue (see _nearest)
        self._near: dict[tuple[int, int], set[int]] = {}
        # file -> sids of its streams that a read of the next file may continue (_crossing),
        # and the file's size in blocks they were judged by (-1 once it changed: scan them all)
        self._crossers: dict[int, set[int]] = {}
        self._crossers_blocks: dict[int, int] = {}
        self._next_sid = 0

    def __len__(self) -> int:
        return len(self._streams)

    def streams(self) -> list[Stream]:
        """Live streams, least recently used first."""
        return list(self._streams.values())

    def observe(self, now: float, hint: int, file_id: int, offset: int, length: int
                ) -> Observation:
        """Match a read to a stream (creating one if needed) and advance that stream."""
        first, stop = block_span(offset, length)
        count = max(stop - first, 1)
        stream = self._exact(file_id, first)
        crossed_from = None
        if stream is None:
            stream = self._nearest(hint, file_id, first)
        if stream is None:
            stream, crossed_from = self._crossing(file_id, first)
        if stream is None:
            return Observation(self._create(now, hint, file_id, first, count), first, count,
                               None, None)
        if crossed_from is not None:
            delta = first + self.catalog.blocks(crossed_from) - stream.last_block
            self._move(stream, file_id)
        else:
            delta = first - stream.last_block
        stream.hint = hint
        stream._advance(now, first, count, delta)
        self._streams.move_to_end(stream.sid)
        self._index(stream)
        return Observation(stream, first, count, delta, crossed_from)

    def _exact(self, file_id: int, first: int) -> Stream | None:
        sid = self._expect.get(block_key(file_id, first))
        if sid is None:
            return None
        stream = self._streams.get(sid)
        return stream if stream is not None and stream.file_id == file_id else None

    def _nearest(self, hint: int, file_id: int, first: int) -> Stream | None:
        best, best_cost = None, MATCH_FORWARD_BLOCKS + HINT_MISMATCH_PENALTY + 1
        for sid in self._near.get((file_id, first // NEAR_BUCKET_BLOCKS), ()):
            s = self._streams[sid]
            gap = first - s.next_block
            if gap < 0:
                if first < s.last_block:
                    continue
                gap = 0  # re-read or overlap of the stream's last read
            if gap > MATCH_FORWARD_BLOCKS:
                continue
            cost = gap + (0 if s.hint == hint else HINT_MISMATCH_PENALTY)
            if cost < best_cost or (cost == best_cost and best is not None and sid < best.sid):
                best, best_cost = s, cost
        return best

    def _crossing(self, file_id: int, first: int) -> tuple[Stream | None, int | None]:
        prev = self.catalog.prev_file(file_id)
        if prev is None:
            return None, None
        prev_blocks = self.catalog.blocks(prev)
        if self._crossers_blocks.get(prev) == prev_blocks and not self._crossers.get(prev):
            return None, None  # no stream of the previous file is near its end (random reads)
        return self._scan_crossing(prev, prev_blocks, first)

    def _scan_crossing(self, prev: int, prev_blocks: int, first: int
                       ) -> tuple[Stream | None, int | None]:
        """The stream of file ``prev`` (``prev_blocks`` long) that a read at ``first`` of the
        next file continues, looking at every stream of ``prev``."""
        best, best_gap = None, MATCH_FORWARD_BLOCKS + 1
        for sid in self._by_file.get(prev, ()):
            s = self._streams[sid]
            seq_next = s.next_block - prev_blocks
            if s.stride and s.stride_conf and s.last_block + s.stride - prev_blocks == first:
                return s, prev
            gap = first - max(seq_next, 0)
            if seq_next >= -MATCH_FORWARD_BLOCKS and 0 <= gap < best_gap:
                best, best_gap = s, gap
        return (best, prev) if best is not None else (None, None)

    def _create(self, now: float, hint: int, file_id: int, first: int, count: int) -> Stream:
        if len(self._streams) >= self.max_streams:
            _, old = self._streams.popitem(last=False)
            self._unindex(old)
            self._by_file[old.file_id].discard(old.sid)
        stream = Stream(self._next_sid, hint, file_id, first, count, now)
        self._next_sid += 1
        self._streams[stream.sid] = stream
        self._file_streams(file_id).add(stream.sid)
        self._index(stream)
        return stream

    def _move(self, stream: Stream, file_id: int) -> None:
        self._unindex(stream)
        self._by_file[stream.file_id].discard(stream.sid)
        stream.file_id = file_id
        self._file_streams(file_id).add(stream.sid)

    def _file_streams(self, file_id: int) -> set[int]:
        streams = self._by_file.get(file_id)
        if streams is None:
            streams = self._by_file[file_id] = set()
        return streams

    def _unindex(self, stream: Stream) -> None:
        expect, sid = self._expect, stream.sid
        for key in stream.expect_keys:
            if expect.get(key) == sid:
                del expect[key]
        stream.expect_keys = ()
        near = self._near
        for near_key in stream.near_keys:
            sids = near[near_key]
            sids.discard(sid)
            if not sids:
                del near[near_key]
        stream.near_keys = ()
        if stream.may_cross:
            self._crossers[stream.file_id].discard(sid)
            stream.may_cross = False

    def _index(self, stream: Stream) -> None:
        self._unindex(stream)
        sid, fid = stream.sid, stream.file_id
        last, stride = stream.last_block, stream.stride
        nxt = last + stream.last_len
        base = block_key(fid, 0)
        expect = self._expect
        expect[base | nxt] = sid
        if stride and stride != stream.last_len:
            expect[base | (last + stride)] = sid
            stream.expect_keys = (base | nxt, base | (last + stride))
        else:
            stream.expect_keys = (base | nxt,)
        # A read at blocks last_block .. next_block + MATCH_FORWARD_BLOCKS may continue it.
        near = self._near
        near_keys = tuple(zip(repeat(fid), range(
            last // NEAR_BUCKET_BLOCKS, (nxt + MATCH_FORWARD_BLOCKS) // NEAR_BUCKET_BLOCKS + 1)))
        for near_key in near_keys:
            sids = near.get(near_key)
            if sids is None:
                near[near_key] = {sid}
            else:
                sids.add(sid)
        stream.near_keys = near_keys
        # What _crossing accepts: a sequential continuation at most MATCH_FORWARD_BLOCKS short
        # of the file's end, or a confident stride that steps past it.
        blocks = self.catalog.blocks(fid)
        if self._crossers_blocks.setdefault(fid, blocks) != blocks:
            self._crossers_blocks[fid] = -1
        strides_past = stride and stream.stride_conf and last + stride >= blocks
        if nxt >= blocks - MATCH_FORWARD_BLOCKS or strides_past:
            self._crossers.setdefault(fid, set()).add(sid)
            stream.may_cross = True
