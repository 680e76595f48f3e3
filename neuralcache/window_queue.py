"""The planner's windows in priority order, re-peeking only the ones that may have changed.

A plan takes the windows in order of ``need_at + (1 - score) x horizon`` (score = the source's
measured accuracy x the window's confidence) and stops when a budget runs out, usually after one
or two windows. Peeking every window to build that order made a plan cost O(windows): with a
hinted shuffle ~100 stream windows wait behind the hinted one, each re-peeked on every read and
completion. Most of them have not changed since the last plan, so this queue keeps them aside:

* A *stable* window (``stable_peek``) promises that its peek is pure, returns a ``need_at`` not
  before ``now``, and changes in anything else (None or not, source, confidence) only when its
  owner calls ``offer``/``changed`` or when the planner takes from it. After a plan has peeked
  one and not taken from it, it waits in a list per source, sorted by confidence.
* Its priority cannot be below ``now + (1 - accuracy x confidence) x horizon`` (need_at is not
  before now; the same float operations round monotonically), so ``pop`` peeks a waiting window
  only once the next window in the heap is not more urgent than that bound.
* Its score changes only with its source's accuracy, so the waiting windows a lower accuracy
  makes ineligible are the low-confidence end of their list: they are dropped at the start of
  the plan, as the full scan did.

The order of windows with equal priority (the order they were offered in, as a dict kept it)
and the plan that drops an ineligible window are the same as peeking every window every time,
so the planner issues exactly the same requests (tests/test_prefetch_planner.py replays random
operations against that simple scan; ``bench.prefetch_cpu`` compares digests of real runs).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Protocol

from neuralcache.ensemble import MIN_SCORE, Ledger

Peeked = tuple[float, str, float]

REPUSH_TIE = 1 << 62
"""Tie-break base of windows put back after a take: they lose ties against every window that
entered the plan's heap at its start (whose tie is its offer stamp, far below this), as they
did when the heap was rebuilt from the whole dict."""


class Window(Protocol):
    """A predictor's current guess for one stream: an ordered run of block ranges."""

    def peek(self, now: float) -> Peeked | None:
        """(need_at, source, confidence) of the next range not yet handed out, or None."""
        ...

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        """Hand out the next range as (file_id, first, stop, source) and move past it."""
        ...


def is_stable(window: Window) -> bool:
    """True if the window keeps the promise in the module docstring (``stable_peek = True``)."""
    return bool(getattr(window, "stable_peek", False))


class WindowQueue:
    """Offered windows; a plan calls ``start``, ``pop``/``taken``/``put_back``, ``finish``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._windows: dict[int, Window] = {}  # id -> window, every offered, not dropped one
        self._stamp: dict[int, int] = {}  # id -> offer order (ties go to the earlier offer)
        self._stamps = itertools.count()
        self._stable: set[int] = set()
        self._fresh: dict[int, Window] = {}  # to peek at the next start (not known unchanged)
        self._waiting: dict[str, list[tuple[float, int, int]]] = {}  # source -> (conf, stamp, id)
        self._waiting_key: dict[int, tuple[str, float, int]] = {}
        # per plan
        self._heap: list[tuple[float, int, int, Window, Peeked]] = []
        self._next: dict[str, int] = {}  # source -> index of the next waiting window to admit
        self._peeked: list[tuple[int, str, float]] = []  # fresh stable windows peeked by start
        self._touched: set[int] = set()  # ids taken from in this plan
        self._repushes = itertools.count(REPUSH_TIE)
        self._now = 0.0
        self._horizon = 0.0
        self._near_only = False

    def __len__(self) -> int:
        return len(self._windows)

    def offer(self, window: Window) -> None:
        """Make a window eligible (idempotent: a window offered again keeps its place in ties);
        its state may have changed, so the next plan peeks it."""
        wid = id(window)
        if wid not in self._windows:
            self._windows[wid] = window
            self._stamp[wid] = next(self._stamps)
            if is_stable(window):
                self._stable.add(wid)
        else:
            self._unwait(wid)
        self._fresh[wid] = window

    def changed(self, window: Window) -> None:
        """A stable window's state changed without an offer (it may have nothing left): the
        next plan peeks it, and drops it if so, as the full scan would."""
        wid = id(window)
        if wid in self._windows:
            self._unwait(wid)
            self._fresh[wid] = window

    # one plan ------------------------------------------------------------------------------
    def start(self, now: float, horizon: float, near_only: bool = False) -> None:
        """Drop what became ineligible, peek the fresh windows and heap the eligible ones.

        ``near_only``: the plan cannot issue a far window (need_at past ``now + horizon``: no
        free cache space), so those are not heaped; the plan would pop and skip each one."""
        self._now, self._horizon, self._near_only = now, horizon, near_only
        far_after = now + horizon
        accuracy = self.ledger.accuracy
        for source, waiting in self._waiting.items():
            acc = accuracy[source]
            k = 0
            while k < len(waiting) and acc * waiting[k][0] < MIN_SCORE:
                k += 1
            for _, _, wid in waiting[:k]:
                del self._waiting_key[wid]
                self._drop(wid)
            del waiting[:k]
            self._next[source] = len(waiting) - 1
        heap = self._heap
        heap.clear()
        peeked_stable = self._peeked
        peeked_stable.clear()
        stable = self._stable
        for wid, window in list(self._fresh.items()):
            peeked = window.peek(now)
            if peeked is None:
                self._drop(wid)
                continue
            need_at, source, confidence = peeked
            score = accuracy[source] * confidence
            if score < MIN_SCORE:
                self._drop(wid)
                continue
            if not (near_only and need_at > far_after):
                heap.append((need_at + (1.0 - score) * horizon, self._stamp[wid], wid, window,
                             peeked))
            if wid in stable:
                peeked_stable.append((wid, source, confidence))
        heapq.heapify(heap)
        self._touched.clear()

    def pop(self) -> tuple[Window, Peeked] | None:
        """The most urgent window and its peek, or None when every window was handed out."""
        heap = self._heap
        self._admit(heap[0][0] if heap else float("inf"))
        if not heap:
            return None
        _, _, _, window, peeked = heapq.heappop(heap)
        return window, peeked

    def taken(self, window: Window) -> None:
        """The planner took from (or tried to take from) the window: its state moved."""
        self._touched.add(id(window))

    def put_back(self, window: Window) -> None:
        """Re-queue a window after a take, at its new priority, if it is still eligible."""
        peeked = window.peek(self._now)
        if peeked is None:
            return
        need_at, source, confidence = peeked
        score = self.ledger.accuracy[source] * confidence
        if score < MIN_SCORE or (self._near_only and need_at > self._now + self._horizon):
            return
        heapq.heappush(self._heap, (need_at + (1.0 - score) * self._horizon,
                                    next(self._repushes), id(window), window, peeked))

    def finish(self) -> None:
        """After a plan: stable windows peeked and not taken from wait until they change."""
        touched = self._touched
        for wid in touched:
            if wid in self._windows:
                self._unwait(wid)
                self._fresh[wid] = self._windows[wid]
        for wid, source, confidence in self._peeked:
            if wid not in touched and wid in self._fresh:
                del self._fresh[wid]
                key = (confidence, self._stamp[wid], wid)
                bisect.insort(self._waiting.setdefault(source, []), key)
                self._waiting_key[wid] = (source, confidence, self._stamp[wid])
        self._heap.clear()
        self._peeked.clear()

    # internals -----------------------------------------------------------------------------
    def _admit(self, top: float) -> None:
        """Peek and heap every waiting window whose priority bound is not above ``top``."""
        now, horizon = self._now, self._horizon
        far_after = now + horizon if self._near_only else float("inf")
        accuracy = self.ledger.accuracy
        heap = self._heap
        for source, waiting in self._waiting.items():
            i = self._next.get(source, -1)
            if i < 0:
                continue
            acc = accuracy[source]
            while i >= 0 and now + (1.0 - acc * waiting[i][0]) * horizon <= top:
                _, stamp, wid = waiting[i]
                window = self._windows[wid]
                peeked = window.peek(now)
                score = 0.0 if peeked is None else accuracy[peeked[1]] * peeked[2]
                if score < MIN_SCORE:  # a window that broke its promise: dropped, as by a scan
                    del waiting[i], self._waiting_key[wid]
                    self._drop(wid)
                elif peeked[0] <= far_after:  # type: ignore[index]
                    priority = peeked[0] + (1.0 - score) * horizon  # type: ignore[index]
                    heapq.heappush(heap, (priority, stamp, wid, window, peeked))
                    top = min(top, priority)
                i -= 1
            self._next[source] = i

    def _unwait(self, wid: int) -> None:
        key = self._waiting_key.pop(wid, None)
        if key is None:
            return
        source, confidence, stamp = key
        waiting = self._waiting[source]
        i = bisect.bisect_left(waiting, (confidence, stamp, wid))
        del waiting[i]

    def _drop(self, wid: int) -> None:
        del self._windows[wid]
        del self._stamp[wid]
        self._stable.discard(wid)
        self._fresh.pop(wid, None)
