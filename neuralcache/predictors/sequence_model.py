"""A learned sequence model over block deltas: an online n-gram (Markov) table with back-off.

Learned memory-access prefetchers treat the stream of address deltas as a language and predict
the next delta from the last few. This is the count-based version of that idea: for contexts of
the last 1-3 deltas the table counts which delta followed, shared by all streams (workers reading
one record layout teach each other) and updated on every read. Prediction walks the table from a
stream's current context, chaining the most likely delta while the product of probabilities
stays high, so a repeating irregular layout (records of sizes 3, 7, 2, 5 blocks with only the
headers read) is predicted where a stride predictor sees no stride. It only runs for streams the
stride predictor cannot explain, which keeps its per-read cost off the common sequential path.
"""

from __future__ import annotations

from collections import deque

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.predictors.base import Context
from neuralcache.streams import HISTORY, Observation, Stream

NGRAM = "ngram"

MIN_SUPPORT = 2
"""A context must have been seen this often before it predicts anything."""

MIN_CHAIN_PROBABILITY = 0.5
"""Stop chaining once the product of step probabilities falls below this."""

STEPS_PER_READ = 8
"""Chain steps computed per read: amortises a deep window over several reads."""

MAX_CONTEXTS = 65536
"""Table size that triggers pruning of contexts seen only once (random deltas)."""


class _Entry:
    __slots__ = ("total", "best", "best_count", "counts")

    def __init__(self) -> None:
        self.total = 0
        self.best = 0
        self.best_count = 0
        self.counts: dict[int, int] = {}


class NgramTable:
    """Counts of next delta per context of the last k deltas, k = 1..HISTORY."""

    def __init__(self) -> None:
        self._tables: list[dict[tuple[int, ...], _Entry]] = [{} for _ in range(HISTORY)]

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables)

    def update(self, history: tuple[int, ...], delta: int) -> None:
        """Learn that ``delta`` followed ``history`` (the deltas before it, oldest first)."""
        for k in range(1, min(len(history), HISTORY) + 1):
            ctx = history[-k:]
            table = self._tables[k - 1]
            entry = table.get(ctx)
            if entry is None:
                entry = table[ctx] = _Entry()
            entry.total += 1
            count = entry.counts.get(delta, 0) + 1
            entry.counts[delta] = count
            if count > entry.best_count:
                entry.best, entry.best_count = delta, count
        if len(self._tables[0]) + len(self._tables[-1]) > MAX_CONTEXTS:
            self._prune()

    def predict(self, history: tuple[int, ...]) -> tuple[int, float] | None:
        """Most likely next delta and its probability, from the longest supported context."""
        for k in range(min(len(history), HISTORY), 0, -1):
            entry = self._tables[k - 1].get(history[-k:])
            if entry is not None and entry.total >= MIN_SUPPORT:
                return entry.best, entry.best_count / entry.total
        return None

    def _prune(self) -> None:
        for i, table in enumerate(self._tables):
            self._tables[i] = {c: e for c, e in table.items() if e.total >= MIN_SUPPORT}


class NgramWindow:
    """A chain of predicted reads (first block, length) for one stream, consumed as they occur."""

    __slots__ = ("stream", "ctx", "chain", "issued", "history", "prob", "pos")

    stable_peek = True
    """Its peek changes only in ``SequenceModelPredictor.observe`` (which offers it or reports
    the change) and in ``take``: the planner need not re-peek it every plan (``window_queue``)."""

    def __init__(self, stream: Stream, ctx: Context) -> None:
        self.stream = stream
        self.ctx = ctx
        self.chain: deque[tuple[int, int]] = deque()
        self.issued = 0  # leading chain entries already handed out
        self.history: tuple[int, ...] = ()  # context at the chain's end
        self.prob = 1.0  # probability of the whole chain so far
        self.pos = 0  # first block of the chain's last read

    def reset(self) -> None:
        s = self.stream
        self.chain.clear()
        self.issued = 0
        self.history = s.deltas
        self.prob = 1.0
        self.pos = s.last_block

    def peek(self, now: float) -> tuple[float, str, float] | None:
        if self.issued >= len(self.chain):
            return None
        s = self.stream
        ahead = self.issued * s.last_len * BLOCK_SIZE  # reads before this one, in bytes
        return now + ahead / self.ctx.rate(s.read_rate(now)), NGRAM, self.prob

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        if self.issued >= len(self.chain):
            return None
        first, length = self.chain[self.issued]
        self.issued += 1
        return self.stream.file_id, first, first + min(length, max_blocks), NGRAM


class SequenceModelPredictor:
    """Trains the shared table on every stream's deltas; predicts for irregular streams."""

    name = NGRAM

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.table = NgramTable()

    def observe(self, now: float, obs: Observation) -> None:
        s = obs.stream
        if obs.delta is None or obs.crossed_from is not None:
            s.state.pop(NGRAM, None)
            return
        self.table.update(s.deltas[:-1], obs.delta)
        if s.seq_conf >= 1 or s.stride_conf >= 2:
            s.state.pop(NGRAM, None)  # the stride predictor explains this stream
            return
        window = s.state.get(NGRAM)
        if window is None:
            window = s.state[NGRAM] = NgramWindow(s, self.ctx)
            window.reset()
        elif window.chain and window.chain[0][0] == obs.first:
            obs.explained = True
            window.chain.popleft()
            window.issued = max(window.issued - 1, 0)
        else:
            window.reset()
        self._extend(now, window)
        if window.issued < len(window.chain):
            self.ctx.planner.offer(window)
        else:
            self.ctx.planner.changed(window)

    def _extend(self, now: float, window: NgramWindow) -> None:
        s = window.stream
        want = self.ctx.depth_bytes(s.read_rate(now)) // BLOCK_SIZE
        have = len(window.chain) * s.last_len
        blocks = self.ctx.catalog.blocks(s.file_id)
        for _ in range(STEPS_PER_READ):
            if have >= want:
                return
            guess = self.table.predict(window.history)
            if guess is None:
                return
            delta, p = guess
            if window.prob * p < MIN_CHAIN_PROBABILITY:
                return
            pos = window.pos + delta
            if not 0 <= pos < blocks:
                return
            window.prob *= p
            window.pos = pos
            window.history = (window.history + (delta,))[-HISTORY:]
            length = min(s.last_len, blocks - pos)
            window.chain.append((pos, length))
            self.ctx.register(now, NGRAM, s.file_id, pos, pos + length)
            have += length
