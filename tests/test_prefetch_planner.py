"""The planner's budgets and its issued/useful/late/wasted accounting."""

import heapq
import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.ensemble import MIN_SCORE, Ledger
from neuralcache.events import LinkEstimate
from neuralcache.planner import MAX_REQUEST_BLOCKS, MIN_ISSUE_BYTES, Planner
from tests.prefetch_helpers import LINK, DictCache


class ListWindow:
    """A window over a fixed list of ranges, all due ``need_in`` seconds from now."""

    def __init__(self, ranges, source="stride", need_in=0.0, conf=1.0):
        self.ranges = list(ranges)
        self.source = source
        self.need_in = need_in
        self.conf = conf

    def peek(self, now):
        return (now + self.need_in, self.source, self.conf) if self.ranges else None

    def take(self, max_blocks):
        if not self.ranges:
            return None
        fid, a, b = self.ranges.pop(0)
        if b - a > max_blocks:
            self.ranges.insert(0, (fid, a + max_blocks, b))
            b = a + max_blocks
        return fid, a, b, self.source


def _planner(cache=None, link=LINK):
    ledger = Ledger(["stride", "fill"])
    planner = Planner(cache or DictCache(), ledger, {"fill": 100.0})
    planner.link = link
    return planner


def test_requests_stay_within_the_inflight_budget_and_resume_on_completion():
    planner = _planner()
    planner.offer(ListWindow([(1, 0, 100_000)]))
    first = planner.plan(0.0, 0.5)
    budget = planner.inflight_budget()
    issued = sum(r.count for r in first) * BLOCK_SIZE
    assert budget - MAX_REQUEST_BLOCKS * BLOCK_SIZE < issued <= budget
    assert planner.plan(0.0, 0.5) == []  # nothing more until something completes
    planner.on_complete(0.1, first[0], True)
    more = planner.plan(0.1, 0.5)
    assert sum(r.count for r in more) == first[0].count


def test_budget_scales_with_bandwidth_delay_product():
    small = _planner(link=LinkEstimate(12.5e6, 0.01)).inflight_budget()
    large = _planner(link=LinkEstimate(12.5e6, 0.9)).inflight_budget()
    assert large > 5 * small  # 0.91 s vs 0.11 s of bandwidth


def test_cached_blocks_are_skipped_and_runs_split_around_them():
    cache = DictCache()
    cache.keys.add((1 << 40) | 5)
    planner = _planner(cache)
    planner.offer(ListWindow([(1, 0, 10)]))
    reqs = planner.plan(0.0, 0.5)
    assert [(r.first, r.count) for r in reqs] == [(0, 5), (6, 4)]


def test_useful_late_and_wasted_accounting():
    planner = _planner()
    planner.offer(ListWindow([(1, 0, 8), (1, 8, 16), (1, 16, 24)]))
    a, b, c = planner.plan(0.0, 0.5)
    planner.on_complete(0.1, a, True)
    planner.on_read(1, 0, 8)  # arrived, then read: useful
    planner.on_read(1, 8, 12)  # read while in flight: late
    planner.on_complete(0.2, b, True)
    planner.on_complete(0.2, c, True)
    assert planner.is_protected(1, 20) and not planner.is_protected(1, 0)
    planner.on_evicted(1, 16, 24)  # evicted unread: wasted
    s = planner.stats()
    assert (s.issued_blocks, s.useful_blocks, s.late_blocks, s.wasted_blocks) == (24, 8, 4, 8)
    assert s.unused_blocks == 4 and s.inflight_blocks == 0 and s.per_source["stride"] == [24, 8]


def test_settled_once_every_prefetch_is_read_or_written_off():
    """The mount stops showing reads to a settled prefetcher: it must not be settled while a
    read could still count a block useful or late."""
    planner = _planner()
    assert planner.settled()
    planner.offer(ListWindow([(1, 0, 8), (1, 8, 16)]))
    a, b = planner.plan(0.0, 0.5)
    assert not planner.settled()  # in flight
    planner.on_complete(0.1, a, True)
    planner.on_complete(0.1, b, True)
    assert not planner.settled()  # arrived, unread
    planner.on_read(1, 0, 8)
    assert not planner.settled()
    planner.on_evicted(1, 8, 16)  # the rest evicted unread: wasted
    assert planner.settled()
    assert planner.stats().useful_blocks == 8 and planner.stats().wasted_blocks == 8


def test_far_guesses_only_use_free_space_and_near_ones_a_share_of_the_cache():
    cache = DictCache(capacity=1 << 20)
    cache.keys.update((2 << 40) | b for b in range(200))  # 800 KiB of the 1 MiB used
    planner = _planner(cache)
    far = ListWindow([(1, 0, 1000)], source="fill", need_in=10.0)
    near = ListWindow([(1, 1000, 2000)], need_in=0.0)
    planner.offer(far)
    planner.offer(near)
    reqs = planner.plan(0.0, 0.5)
    fill = sum(r.count for r in reqs if r.source == "fill") * BLOCK_SIZE
    stride = sum(r.count for r in reqs if r.source == "stride") * BLOCK_SIZE
    assert fill <= cache.free_bytes() and stride <= (1 << 20) // 2


def test_low_scoring_windows_are_not_fetched():
    planner = _planner()
    planner.offer(ListWindow([(1, 0, 64)], conf=0.1))
    assert planner.plan(0.0, 0.5) == []


def test_guessed_neighbours_are_merged_into_one_request():
    planner = _planner()
    for b in range(0, 64, 8):  # eight strided windows tile blocks 0..63 between them
        planner.ledger.register(0.0, 10.0, "stride", 1, b, b + 8)
    planner.offer(ListWindow([(1, 0, 8)]))
    reqs = planner.plan(0.0, 0.5)
    assert [(r.first, r.count) for r in reqs] == [(0, 64)]


def test_interval_set_matches_a_reference_set():
    import random

    from neuralcache.intervals import IntervalSet

    rng = random.Random(0)
    ivs, ref = IntervalSet(), set()
    for _ in range(2000):
        a = rng.randrange(200)
        b = a + rng.randrange(1, 20)
        if rng.random() < 0.6:
            ivs.add(a, b)
            ref |= set(range(a, b))
        else:
            ivs.remove(a, b)
            ref -= set(range(a, b))
        x = rng.randrange(220)
        assert ivs.covers(x) == (x in ref)
        gaps = ivs.uncovered(a, b + 10)
        assert {v for g in gaps for v in range(*g)} == set(range(a, b + 10)) - ref
        assert ivs.next_covered(x, b + 10) == min({v for v in ref if x <= v < b + 10},
                                                  default=b + 10)
    spans = ivs.intervals()
    assert all(s1 < e1 < s2 for (s1, e1), (s2, _) in zip(spans, spans[1:]))  # merged, sorted


def test_completions_of_small_requests_do_not_cut_the_next_ones_smaller():
    """Sixteen-KiB items fill the budget; each completion frees one item, and the planner
    waits for a worthwhile budget instead of issuing what is left of it one block at a time
    (the budget follows the measured link, so it moves by amounts that are no item's size)."""
    planner = _planner()
    items = [(1, 8 * i, 8 * i + 4) for i in range(100_000)]  # 16 KiB samples, 16 KiB apart
    planner.offer(ListWindow(items))
    inflight = planner.plan(0.0, 0.5)
    sizes = []
    for step in range(2000):
        planner.link = LinkEstimate(25e6 + (step % 5) * 40_000, 0.06)  # +-6.4 KB of budget
        done = inflight.pop(0)
        planner.on_complete(0.001 * step, done, True)
        more = planner.plan(0.001 * step, 0.5)
        sizes += [r.count for r in more]
        inflight += more
    assert sizes and min(sizes) == 4  # whole items, never a cut-off block or two
    in_flight = sum(r.count for r in inflight) * BLOCK_SIZE
    assert in_flight > planner.inflight_budget() - MIN_ISSUE_BYTES - 4 * BLOCK_SIZE


def test_a_mostly_cached_file_is_walked_into_requests_for_the_gaps_only():
    """A window over a file that is mostly cached (as a working-set fill's is) asks for the
    missing blocks only, and remembers the cached stretches, so neither the next plan nor
    ``unknown_runs`` asks the cache about them again; an eviction reopens its blocks."""
    cache = DictCache()
    cache.keys.update((1 << 40) | b for b in range(0, 1000) if b not in (300, 301, 700))
    planner = _planner(cache)
    planner.offer(ListWindow([(1, 0, 1000)], source="fill", need_in=10.0))
    reqs = planner.plan(0.0, 0.5)
    assert [(r.first, r.count) for r in reqs] == [(300, 2), (700, 1)]
    assert planner._known[1].intervals() == [(0, 1000)]  # cached stretches plus the requests
    assert planner.unknown_runs(1, 0, 1000) == []
    planner.on_evicted(1, 500, 510)
    cache.keys.difference_update((1 << 40) | b for b in range(505, 510))
    assert planner.unknown_runs(1, 490, 520) == [(505, 510)]
    assert planner._known[1].intervals() == [(0, 505), (510, 1000)]


class ScanQueue:
    """The planner's window order as it was before ``WindowQueue``: every window peeked on
    every plan, ties in offer order (a dict's), windows put back after a take losing ties."""

    def __init__(self, ledger):
        self.ledger = ledger
        self.windows = {}
        self.heap = []
        self.ties = None
        self.now = self.horizon = 0.0

    def __len__(self):
        return len(self.windows)

    def offer(self, window):
        self.windows[id(window)] = window

    def changed(self, window):
        pass

    def _entry(self, window):
        peeked = window.peek(self.now)
        if peeked is None:
            return None
        score = self.ledger.score(peeked[1], peeked[2])
        if score < MIN_SCORE:
            return None
        return (peeked[0] + (1.0 - score) * self.horizon, next(self.ties), window)

    def start(self, now, horizon, near_only=False):  # heaps far windows all the same
        self.now, self.horizon, self.ties = now, horizon, itertools.count()
        self.heap = []
        for key, window in list(self.windows.items()):
            entry = self._entry(window)
            if entry is None:
                del self.windows[key]
            else:
                self.heap.append(entry)
        heapq.heapify(self.heap)

    def pop(self):
        if not self.heap:
            return None
        window = heapq.heappop(self.heap)[2]
        return window, window.peek(self.now)

    def taken(self, window):
        pass

    def put_back(self, window):
        entry = self._entry(window)
        if entry is not None:
            heapq.heappush(self.heap, entry)

    def finish(self):
        pass


class FakeWindow(ListWindow):
    """A ListWindow with a due time per range; ``stable`` ones keep WindowQueue's promise, the
    others' due times drift with the clock (as a hinted window's pace does)."""

    def __init__(self, ranges, source, conf, stable):
        super().__init__([r[:3] for r in ranges], source, 0.0, conf)
        self.due = [r[3] for r in ranges]
        self.stable_peek = stable

    def peek(self, now):
        if not self.ranges:
            return None
        drift = 0.0 if self.stable_peek else (now * 7.0) % 0.3
        return now + self.due[0] + drift, self.source, self.conf

    def take(self, max_blocks):
        taken = super().take(max_blocks)
        if taken is not None and len(self.due) > len(self.ranges):
            self.due.pop(0)
        return taken


SOURCES = ["stride", "ngram", "hinted"]


def _random_window(rng):
    """Ranges with due times and confidences from short lists, so priorities often tie."""
    ranges = [(rng.randint(1, 8), rng.randrange(100_000), rng.randint(4, 64),
               rng.choice([0.0, 0.0, 0.05, 0.5, 3.0])) for _ in range(rng.randint(0, 12))]
    ranges = [(f, a, a + n, due) for f, a, n, due in ranges]
    return ranges, rng.choice(SOURCES), rng.choice([0.5, 0.8, 1.0]), rng.random() < 0.8


def _random_ops(rng, n):
    """Offers, changes, accuracy moves, plans and completions, in a random mix."""
    ops = []
    for _ in range(n):
        kind = rng.choices(["new", "offer", "changed", "accuracy", "plan", "complete"],
                           [2, 2, 1, 2, 4, 3])[0]
        if kind == "new":
            ops.append((kind, _random_window(rng)))
        elif kind in ("offer", "changed"):
            ops.append((kind, rng.randrange(8), _random_window(rng)))  # a recent window
        elif kind == "accuracy":
            ops.append((kind, rng.choice(SOURCES), rng.choice([0.2, 0.6, 1.0])))
        elif kind == "plan":
            ops.append((kind, rng.choice([0.0, 0.001, 0.2])))
        else:
            ops.append((kind, rng.randint(1, 6)))
    return ops


def _apply(op, planner, windows, inflight, now, horizon):
    """One operation on one side; a plan's requests (as comparable tuples) or None."""
    kind = op[0]
    if kind == "new":
        windows.append(FakeWindow(*op[1]))
        planner.offer(windows[-1])
    elif kind in ("offer", "changed") and windows:
        window = windows[-1 - op[1] % len(windows)]
        ranges, source, conf, _ = op[2]
        window.ranges = [r[:3] for r in ranges]
        window.due = [r[3] for r in ranges]
        window.source, window.conf = source, conf
        getattr(planner, kind)(window)  # a stable window's owner reports its changes
    elif kind == "accuracy":
        planner.ledger.accuracy[op[1]] = op[2]
    elif kind == "complete":
        for request in inflight[:op[1]]:
            planner.on_complete(now, request, True)
        del inflight[:op[1]]
    elif kind == "plan":
        requests = planner.plan(now + op[1], horizon)
        inflight += requests
        return [(r.file_id, r.first, r.count, r.source, r.need_at) for r in requests]
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0.0, 0.5]), st.booleans())
def test_window_queue_issues_what_a_full_scan_of_the_windows_would(seed, horizon, full):
    """Windows left unpeeked between plans are never skipped when they could issue, and ties
    and drops come out as with the full scan: the same requests, in the same order."""
    ops = _random_ops(random.Random(seed), 400)
    link = LinkEstimate(2e6, 0.01)  # a 256 KiB in-flight budget: plans stop early
    sides = []
    for queue_type in (ScanQueue, None):
        cache = DictCache(capacity=1 << 20)
        if full:  # no free space: far windows cannot issue
            cache.keys.update((9 << 40) | b for b in range(256))
        planner = Planner(cache, Ledger(SOURCES), {})
        planner.link = link
        if queue_type is not None:
            planner._queue = queue_type(planner.ledger)
        sides.append((planner, [], []))  # planner, its windows, its requests in flight
    now = 0.0
    for op in ops:
        scanned, queued = (_apply(op, *side, now, horizon) for side in sides)
        assert scanned == queued
        if op[0] == "plan":
            now += op[1]


def test_a_window_dropped_for_its_score_queues_behind_windows_offered_before_its_return():
    """A waiting window whose source's accuracy fell is dropped at that plan, unpeeked, as the
    full scan drops it: offered again, it loses ties to windows offered in between."""
    orders = []
    for queue_type in (ScanQueue, None):
        planner = Planner(DictCache(), Ledger(SOURCES), {})
        planner.link = LinkEstimate(2e6, 0.01)  # 256 KiB in flight: one 64-block request
        if queue_type is not None:
            planner._queue = queue_type(planner.ledger)
        accuracy = planner.ledger.accuracy
        accuracy["hinted"] = 1.0
        dropped = FakeWindow([(2, 0, 8, 0.0)], "ngram", 1.0, True)
        other = FakeWindow([(3, 0, 8, 0.0)], "stride", 1.0, True)
        urgent = FakeWindow([(1, 0, 64, 0.0), (1, 64, 128, 0.0)], "hinted", 1.0, False)
        for window in (dropped, other, urgent):
            planner.offer(window)
        (first,) = planner.plan(0.0, 0.5)  # the urgent window takes the whole budget
        accuracy["ngram"] = 0.2
        planner.on_complete(0.1, first, True)
        (second,) = planner.plan(0.1, 0.5)  # drops the low-scoring window
        accuracy["ngram"] = 0.6
        planner.offer(dropped)
        planner.on_complete(0.2, second, True)
        orders.append([r.file_id for r in planner.plan(0.2, 0.5)])
    assert orders[0] == orders[1] == [3, 2]
