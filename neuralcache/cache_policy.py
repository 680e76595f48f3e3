"""Which cached blocks to keep: a sans-IO least-recently-used policy over opaque keys.

The policy only does bookkeeping (keys, sizes, recency) and tells its caller what to evict;
the LMDB store does the I/O. Keeping it pure lets a later, prediction-aware policy replace it
and lets tests drive it against a reference model without a disk.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from types import MappingProxyType
from typing import Callable, Hashable, Iterable, Mapping, Sequence


TOUCHES_LATER_MAX = 1 << 20
"""Keys ``touch_later`` may hold back before it moves the oldest of them: a bound on the memory
of a long run of hits that never needs the order (one entry per run, not per key)."""


class LruPolicy:
    """Tracks cached keys and their sizes; evicts the least recently used past ``capacity``."""

    def __init__(self, capacity: int,
                 group_of: Callable[[Hashable], Hashable] | None = None) -> None:
        """``group_of(key)`` names the group a key belongs to (the spoke's: its file version),
        for ``held_in``; without it every key is in group None."""
        if capacity <= 0:
            raise ValueError("cache capacity must be positive")
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._group_of = group_of or _no_group
        self._groups: Counter[Hashable] = Counter()  # held keys per group
        self.holds: Callable[[Hashable], bool] = self._sizes.__contains__
        """``key in policy`` as a plain function, for callers that ask block by block."""
        self.sizes: Mapping[Hashable, int] = MappingProxyType(self._sizes)
        """Held keys and their sizes, read-only."""
        self._later: deque[Sequence[Hashable]] = deque()  # ``touch_later``'s, oldest first
        self._later_keys = 0

    def held_in(self, group: Hashable) -> int:
        """How many held keys are in ``group``: whether a whole file is cached, at the cost of
        a dict look-up (the spoke asks at every open)."""
        return self._groups[group]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: Hashable) -> None:
        """Mark ``key`` as just used (a no-op for keys not held)."""
        self._catch_up()
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def touch_many(self, keys: Sequence[Hashable]) -> Sequence[Hashable]:
        """Mark the held ones among ``keys`` as just used, in the given order; returns them
        (``keys`` itself if every one is held).

        The same as ``touch`` on each key, run in C: a 1 MiB read touches 256 blocks, and a
        Python-level call per block was a sizeable part of its cost. Usually every key is
        held (a warm read's), so the keys are moved at once; only if one is not are they moved
        again, the held ones alone, which leaves the same order (each held key moved last in
        turn).
        """
        self._catch_up()
        return self._move_held(keys)

    def touch_later(self, keys: Sequence[Hashable]) -> None:
        """``touch_many(keys)``, but the moves wait until the order is next needed: by an
        insert, a touch or ``oldest_first``, which make them first, oldest first, so that
        every answer is the one ``touch_many`` now would have given. Keys no longer held by
        then are skipped.

        A warm mount reading what it holds inserts nothing: its reads' moves, each a look-up
        in a dict of every held key, are then never made (past ``TOUCHES_LATER_MAX`` keys
        the oldest are)."""
        self._later.append(keys)
        self._later_keys += len(keys)
        while self._later_keys > TOUCHES_LATER_MAX:
            self._move_oldest_later()

    def _catch_up(self) -> None:
        while self._later:
            self._move_oldest_later()

    def _move_oldest_later(self) -> None:
        keys = self._later.popleft()
        self._later_keys -= len(keys)
        self._move_held(keys)

    def _move_held(self, keys: Sequence[Hashable]) -> Sequence[Hashable]:
        move = self._sizes.move_to_end
        try:
            deque(map(move, keys), maxlen=0)
        except KeyError:
            held = list(filter(self._sizes.__contains__, keys))
            deque(map(move, held), maxlen=0)
            return held
        return keys

    def insert(self, key: Hashable, size: int,
               protected: Callable[[Hashable], bool] | None = None) -> list[Hashable]:
        """Hold ``key`` as most recently used; return the keys evicted to make room.

        A key larger than the whole capacity is not held and is returned as its own eviction.
        ``protected(victim)`` true spares a victim: it moves to the most recently used end (a
        prefetched block about to be read must not be pushed out by the next prefetch), unless
        every held key is protected, in which case the least recently used goes regardless.
        """
        self._catch_up()
        self.remove(key)
        if size > self.capacity:
            return [key]
        evicted: list[Hashable] = []
        spared = 0
        while self.used + size > self.capacity:
            old = next(iter(self._sizes))
            if protected is not None and spared < len(self._sizes) and protected(old):
                self._sizes.move_to_end(old)
                spared += 1
                continue
            self.used -= self._sizes.pop(old)
            self._groups[self._group_of(old)] -= 1
            evicted.append(old)
        self._sizes[key] = size
        self.used += size
        self._groups[self._group_of(key)] += 1
        return evicted

    def insert_many(self, items: list[tuple[Hashable, int]],
                    protected: Callable[[Hashable], bool] | None = None) -> list[Hashable]:
        """``insert`` of each ``(key, size)`` in turn; the keys evicted, in order.

        A fetch lands as a run of up to a few hundred blocks: when none of them is held yet and
        they fit without evicting anything (a cache filling up), they are added in one step
        in C, which is what the inserts one by one would do, rather than a call each."""
        self._catch_up()
        sizes = self._sizes
        total = sum(size for _, size in items)
        keys = dict.fromkeys(key for key, _ in items)
        if (self.used + total <= self.capacity and len(keys) == len(items)
                and sizes.keys().isdisjoint(keys)):
            sizes.update(items)
            self.used += total
            self._groups.update(map(self._group_of, keys))
            return []
        return [old for key, size in items for old in self.insert(key, size, protected)]

    def remove(self, key: Hashable) -> bool:
        """Forget ``key``; True if it was held."""
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        self._groups[self._group_of(key)] -= 1
        return True

    def oldest_first(self) -> Iterable[Hashable]:
        """Held keys from least to most recently used."""
        self._catch_up()
        return iter(self._sizes)


def _no_group(key: Hashable) -> None:
    """The group of every key when the policy is not told how to group them."""
    return None
