"""Combining predictors by measured accuracy.

Every predictor's guesses are recorded in a ledger whether or not the planner turns them into
fetches ("shadow" evaluation), so a predictor that is switched off for being wrong keeps being
scored and comes back when the workload changes. A guess is right if the block is read before it
expires. A predictor's accuracy is right / (right + expired) over outcomes that decay with a
half-life in time (plus a small prior), so thousands of right guesses in the last seconds are not
overturned by one window's worth of expiries at an epoch's end, while a predictor that has been
wrong for a few seconds is switched off. It scales the confidence each predictor reports.
"""

from __future__ import annotations

import heapq
from itertools import count, repeat

from neuralcache.blocks import block_key

ACCURACY_PRIOR = 0.6
"""Accuracy of a predictor with no recent outcomes: high enough that its confident guesses are
tried (and so measured)."""

PRIOR_WEIGHT = 32.0
"""The prior counts as this many block outcomes."""

HALF_LIFE_S = 10.0
"""Outcomes lose half their weight every this many seconds (about an epoch of a small set)."""

MIN_SCORE = 0.3
"""Guesses scoring below this (accuracy x confidence) are not fetched."""


class Ledger:
    """Outstanding guesses per block, with their predictors and expiry, and per-predictor accuracy.

    ``sources`` fixes the predictor names; each gets a bit in a mask so one block guessed by
    several predictors is one dict entry.
    """

    def __init__(self, sources: list[str]) -> None:
        self.sources = list(sources)
        self._bit = {name: 1 << i for i, name in enumerate(self.sources)}
        self.accuracy = {name: ACCURACY_PRIOR for name in self.sources}
        self.outcomes = {name: [0, 0] for name in self.sources}  # [right, expired], all time
        self._weights = {name: [0.0, 0.0, 0.0] for name in self.sources}  # right, wrong, at
        self._pending: dict[int, int] = {}  # block key -> mask of predictors that guessed it
        # Per source, a heap of (deadline, order, block keys) - one entry per register call,
        # not per block: a deep sequential window registers hundreds of blocks at once.
        self._expiry: dict[str, list[tuple[float, int, list[int]]]] = {
            n: [] for n in self.sources}
        self._order = count()

    def __len__(self) -> int:
        return len(self._pending)

    def guessed_by(self, key: int, source: str) -> bool:
        """True while ``source`` has an unexpired guess on this block key."""
        return bool(self._pending.get(key, 0) & self._bit[source])

    def register(self, now: float, ttl: float, source: str, file_id: int, first: int,
                 stop: int) -> None:
        """Record that ``source`` expects blocks ``[first, stop)`` to be read within ``ttl``."""
        bit = self._bit[source]
        pending = self._pending
        get = pending.get
        base = block_key(file_id, 0)
        keys = [key for key in range(base + first, base + stop) if not get(key, 0) & bit]
        if not keys:
            return
        for key in keys:
            pending[key] = get(key, 0) | bit
        heapq.heappush(self._expiry[source], (now + ttl, next(self._order), keys))

    def bit(self, source: str) -> int:
        """The mask bit of ``source`` (as in ``on_read``'s result)."""
        return self._bit[source]

    def on_read(self, now: float, file_id: int, first: int, stop: int) -> int:
        """Credit every predictor that guessed any of these blocks; returns their mask."""
        pending = self._pending
        if not pending:
            return 0
        base = block_key(file_id, 0)
        popped = list(map(pending.pop, range(base + first, base + stop), repeat(0)))
        masks = set(popped)
        masks.discard(0)
        if not masks:
            return 0
        counts = {mask: popped.count(mask) for mask in masks}
        guessed = 0
        for mask in masks:
            guessed |= mask
        for name in self.sources:
            bit = self._bit[name]
            if guessed & bit:
                self._credit(name, True, now, sum(n for mask, n in counts.items() if mask & bit))
        return guessed

    def expire(self, now: float) -> None:
        """Charge predictors for guesses whose time ran out unread (amortised: call often)."""
        pending = self._pending
        for name, queue in self._expiry.items():
            if not queue or queue[0][0] > now:
                continue
            bit = self._bit[name]
            wrong = 0
            while queue and queue[0][0] <= now:
                for key in heapq.heappop(queue)[2]:
                    mask = pending.get(key, 0)
                    if mask & bit:
                        mask &= ~bit
                        if mask:
                            pending[key] = mask
                        else:
                            del pending[key]
                        wrong += 1
            if wrong:
                self._credit(name, False, now, wrong)

    def _credit(self, name: str, right: bool, now: float, blocks: int) -> None:
        """``blocks`` outcomes at once: the same arithmetic as one ``_update`` call each."""
        w = self._weights[name]
        if now > w[2]:
            decay = 0.5 ** ((now - w[2]) / HALF_LIFE_S)
            w[0] *= decay
            w[1] *= decay
            w[2] = now
        i = 0 if right else 1
        total = w[i]
        for _ in range(blocks):
            total += 1.0  # one rounding per outcome, as a block at a time did
        w[i] = total
        self.accuracy[name] = (w[0] + PRIOR_WEIGHT * ACCURACY_PRIOR) / (w[0] + w[1] + PRIOR_WEIGHT)
        self.outcomes[name][i] += blocks

    def score(self, source: str, confidence: float) -> float:
        """How much to trust a guess: the predictor's measured accuracy times its confidence."""
        return self.accuracy[source] * confidence
