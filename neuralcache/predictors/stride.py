"""Sequential and strided runs, followed into the next file, with a link-adapted depth.

A stream that reads contiguously gets a window from its next block forward; one that reads
``length`` blocks every ``stride`` blocks (a rank of a distributed sampler over fixed-size samples)
gets the next positions of that stride. The window reaches ``rate x horizon`` bytes of the stream's
own reads ahead, at least a bandwidth-delay product, so a faster reader or a longer path gets a
deeper window. Past the end of the file the window continues into the next file in name order
(the next shard), scored separately as ``nextfile`` so a shuffled shard order switches it off.
"""

from __future__ import annotations

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.ensemble import MIN_SCORE
from neuralcache.predictors.base import Context
from neuralcache.streams import Observation, Stream

STRIDE = "stride"
NEXTFILE = "nextfile"

FILE_START_CONFIDENCE = 0.6
"""Confidence of the first read at a file's start (kernel-style initial readahead)."""

SETTLED_CONFIDENCE = 1.0
"""Confidence once two steps in a row matched."""

FIRST_MATCH_CONFIDENCE = 0.8
"""Confidence after one matching step."""

_NONE, _SEQ, _STRIDE = 0, 1, 2


class StrideWindow:
    """The positions a stream's run says come next: contiguous, or every ``step`` blocks."""

    __slots__ = ("stream", "ctx", "mode", "issued", "registered", "end", "step", "length", "conf",
                 "_geometry")

    stable_peek = True
    """Its peek changes only in ``StridePredictor.observe`` (which offers it or reports the
    change) and in ``take``: the planner need not re-peek it every plan (``window_queue``)."""

    def __init__(self, stream: Stream, ctx: Context) -> None:
        self.stream = stream
        self.ctx = ctx
        self.mode = _NONE
        self.issued = 0  # next position to hand out
        self.registered = 0  # positions before this are in the ledger
        self.end = 0  # positions from here on are beyond the window
        self.step = 1
        self.length = 1
        self.conf = 0.0
        self._geometry: tuple[int, int, int | None, int] = (-1, 0, None, 0)

    def _file_blocks(self) -> tuple[int, int | None, int]:
        """(blocks of the stream's file, the next file, its blocks), cached per file."""
        fid = self.stream.file_id
        g = self._geometry
        if g[0] != fid:
            catalog = self.ctx.catalog
            nxt = catalog.next_file(fid)
            g = self._geometry = (fid, catalog.blocks(fid), nxt,
                                  catalog.blocks(nxt) if nxt is not None else 0)
        return g[1], g[2], g[3]

    def _locate(self, first: int, stop: int) -> tuple[int, int, int, str] | None:
        """Map a position range onto (file, first, stop, source), clipping at a file's end."""
        fb, nxt, nb = self._file_blocks()
        if first < fb:
            return self.stream.file_id, first, min(stop, fb), STRIDE
        if nxt is None or first - fb >= nb:
            return None
        return nxt, first - fb, min(stop - fb, nb), NEXTFILE

    def peek(self, now: float) -> tuple[float, str, float] | None:
        if self.mode == _NONE or self.issued >= self.end:
            return None
        located = self._locate(self.issued, self.issued + self.length)
        if located is None:
            return None
        s = self.stream
        ahead = max(self.issued - s.next_block, 0) * BLOCK_SIZE
        if self.mode == _STRIDE:
            ahead = ahead * self.length // self.step
        return now + ahead / self.ctx.rate(s.read_rate(now)), located[3], self.conf

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        if self.mode == _NONE or self.issued >= self.end:
            return None
        if self.mode == _SEQ:
            located = self._locate(self.issued, min(self.end, self.issued + max_blocks))
        else:
            located = self._locate(self.issued, self.issued + min(self.length, max_blocks))
        if located is None:
            self.issued = self.end
            return None
        fb = self._file_blocks()[0]
        consumed_to = located[2] + (0 if located[0] == self.stream.file_id else fb)
        if self.mode == _SEQ:
            self.issued = consumed_to
        else:
            self.issued += self.step
        return located

    def shift(self, blocks: int) -> None:
        """The stream moved into the next file: positions become relative to it."""
        self.issued -= blocks
        self.registered -= blocks
        self.end -= blocks


class StridePredictor:
    """Keeps one ``StrideWindow`` per stream up to date; see the module docstring."""

    name = STRIDE

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def observe(self, now: float, obs: Observation) -> None:
        s = obs.stream
        window = s.state.get(STRIDE)
        sequential = s.seq_conf >= 1 or (obs.delta is None and obs.first == 0)
        if not sequential and not (s.stride_conf >= 1 and s.stride > 0):
            if window is not None:  # a one-off read (most random ones) gets no window at all
                window.mode = _NONE
                self.ctx.planner.changed(window)
            return
        if window is None:
            window = s.state[STRIDE] = StrideWindow(s, self.ctx)
        elif obs.crossed_from is not None:
            window.shift(self.ctx.catalog.blocks(obs.crossed_from))
        depth_blocks = -(-self.ctx.depth_bytes(s.read_rate(now), s.run) // BLOCK_SIZE)
        if sequential:
            conf = (FILE_START_CONFIDENCE if obs.delta is None else
                    SETTLED_CONFIDENCE if s.seq_conf >= 2 else FIRST_MATCH_CONFIDENCE)
            start = s.next_block
            self._retarget(window, _SEQ, 1, 1, start, start + depth_blocks, conf)
        else:
            conf = SETTLED_CONFIDENCE if s.stride_conf >= 2 else FIRST_MATCH_CONFIDENCE
            steps = max(1, depth_blocks // max(s.last_len, 1))
            start = s.last_block + s.stride
            self._retarget(window, _STRIDE, s.stride, s.last_len, start,
                           s.last_block + s.stride * steps + 1, conf)
        self._clip_and_register(now, window)
        if window.issued < window.end:
            self.ctx.planner.offer(window)
        else:
            self.ctx.planner.changed(window)

    @staticmethod
    def _retarget(window: StrideWindow, mode: int, step: int, length: int, start: int, end: int,
                  conf: float) -> None:
        if window.mode != mode or window.step != step or window.length != length:
            window.mode, window.step, window.length = mode, step, length
            window.issued = window.registered = start
        elif window.issued < start:
            window.issued = start
        window.registered = max(window.registered, start)
        window.end = max(end, window.issued)
        window.conf = conf

    def _clip_and_register(self, now: float, window: StrideWindow) -> None:
        fb, nxt, nb = window._file_blocks()
        follow = nxt is not None and self.ctx.ledger.score(NEXTFILE, 1.0) >= MIN_SCORE
        window.end = min(window.end, fb + nb if follow else fb)
        ctx = self.ctx
        s = window.stream
        fid = s.file_id
        seconds_per_block = BLOCK_SIZE / ctx.rate(s.read_rate(now))
        if window.mode == _SEQ:
            a, b = window.registered, window.end
            if a < b:
                ahead = (a - s.next_block) * seconds_per_block
                ctx.register(now, STRIDE, fid, a, min(b, fb), ahead)
                if b > fb and nxt is not None:
                    ctx.register(now, NEXTFILE, nxt, max(a, fb) - fb, b - fb, ahead)
                window.registered = b
            return
        p = window.registered
        while p < window.end:
            ahead = (p - s.next_block) * window.length / window.step * seconds_per_block
            if p < fb:
                ctx.register(now, STRIDE, fid, p, min(p + window.length, fb), ahead)
            elif nxt is not None:
                ctx.register(now, NEXTFILE, nxt, p - fb, min(p - fb + window.length, nb), ahead)
            p += window.step
        window.registered = p
