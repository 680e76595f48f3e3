"""Each predictor on the pattern it is for, driven through the Prefetcher facade."""

import heapq
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.catalog import Catalog
from neuralcache.events import AccessEvent, PrefetchRequest
from neuralcache.ensemble import Ledger
from neuralcache.hints import HintRecord
from neuralcache.planner import MAX_REQUEST_BLOCKS, PRESENT_RENOTE_S
from neuralcache.predictors.hinted import MAX_SKIPPED_ITEMS
from neuralcache.prefetcher import PrefetchConfig, Prefetcher
from tests.prefetch_helpers import LINK, DictCache, blocks_of, shards


def _read(p: Prefetcher, cache: DictCache, now: float, hint: int, fid: int, block: int,
          n: int = 4):
    """Serve a read (as demand would, it lands in the cache) and let prefetches land at once."""
    for b in range(block, block + n):
        cache.keys.add((fid << 40) | b)
    reqs = p.on_access(now, AccessEvent(hint, fid, block * BLOCK_SIZE, n * BLOCK_SIZE))
    cache.fill(reqs)
    for r in reqs:
        reqs += p.on_prefetch_complete(now, r)
        cache.fill(reqs)
    return reqs


def test_sequential_stream_gets_a_window_ahead_and_into_the_next_shard():
    catalog = shards(n=2, size=256 * BLOCK_SIZE)
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(), LINK)
    issued = set()
    for k in range(60):
        issued |= blocks_of(_read(p, cache, k * 0.001, 1, 1, 4 * k))
    assert {(1, b) for b in range(240, 256)} <= issued  # ran ahead to the end of the file
    assert (2, 0) in issued  # and on into the next shard
    assert all(b >= 4 for f, b in issued if f == 1)  # never behind the reader


def test_window_depth_follows_the_link():
    def depth(link_rtt: float) -> int:
        catalog = shards(n=1, size=64 << 20)
        cache = DictCache()
        p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(),
                       LINK.__class__(LINK.bandwidth, link_rtt))
        for k in range(40):
            _read(p, cache, k * 0.002, 1, 1, 4 * k)  # 16 KiB every 2 ms: 8 MB/s
        return max(b for f, b in ((k >> 40, k & ((1 << 40) - 1)) for k in cache.keys))

    assert depth(0.3) > 2 * depth(0.02)


def test_inflight_budget_is_respected():
    catalog = shards(n=1, size=64 << 20)
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(), LINK)
    out = []
    for k in range(400):  # 16 KiB per 2 ms; prefetches never complete: the budget must cap them
        for b in range(4 * k, 4 * k + 4):
            cache.keys.add((1 << 40) | b)
        out += p.on_access(k * 0.002, AccessEvent(1, 1, 4 * k * BLOCK_SIZE, 4 * BLOCK_SIZE))
    budget = p.planner.inflight_budget()
    assert sum(r.count for r in out) * BLOCK_SIZE <= budget
    assert sum(r.count for r in out) * BLOCK_SIZE > budget - MAX_REQUEST_BLOCKS * BLOCK_SIZE
    assert all(r.count <= MAX_REQUEST_BLOCKS for r in out)


def _record_layout_reads(n: int) -> list[int]:
    pattern = [3, 7, 2, 5, 9, 4]
    pos, out = 0, []
    for k in range(n):
        out.append(pos)
        pos += pattern[k % len(pattern)]
    return out


def _predicted_share(config: PrefetchConfig) -> float:
    catalog = shards(n=1, size=64 << 20)
    cache = DictCache()
    p = Prefetcher(catalog, cache, config, LINK)
    hits = 0
    starts = _record_layout_reads(400)
    for k, block in enumerate(starts):
        hits += cache.contains(1, block)
        _read(p, cache, k * 0.001, 1, 1, block, 1)
    return hits / len(starts)


def test_sequence_model_beats_stride_on_an_irregular_record_layout():
    stride = _predicted_share(PrefetchConfig.stride_only())
    learned = _predicted_share(PrefetchConfig(epoch_replay=False, working_set=False))
    assert stride < 0.2 and learned > 0.9


def _evict_all(p: Prefetcher, cache: DictCache) -> None:
    for key in cache.keys:
        p.on_evicted(key >> 40, key & ((1 << 40) - 1))
    cache.keys.clear()


def _pass(p: Prefetcher, cache: DictCache, order: list[tuple[int, int]], t0: float) -> float:
    hits = 0
    for k, (fid, block) in enumerate(order):
        hits += cache.contains(fid, block)
        _read(p, cache, t0 + k * 0.001, 1, fid, block)
    return hits / len(order)


def test_epoch_replay_replays_the_first_pass_order_only_when_it_repeats():
    catalog = shards(n=4, size=16 << 20)
    samples = [(f, b) for f in range(1, 5) for b in range(0, 4096, 4)]
    order = random.Random(1).sample(samples, 400)  # a pass over 400 of them, in random order
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig(working_set=False), LINK)
    assert _pass(p, cache, order, 0.0) < 0.1, p.stats().per_source
    _evict_all(p, cache)  # as if the cache had evicted everything between epochs
    assert _pass(p, cache, order, 10.0) > 0.9
    assert p.replay is not None and p.replay.active
    _evict_all(p, cache)
    new_order = random.Random(2).sample(order, len(order))
    assert _pass(p, cache, new_order, 20.0) < 0.2


def _shuffled_samples(seed: int) -> tuple[Catalog, list[tuple[int, int]], DictCache, Prefetcher]:
    """Four shards of 16 KiB samples in a seeded shuffled order, a prefetcher with hints on."""
    catalog = shards(n=4, size=1 << 20)
    samples = [(f, b) for f in range(1, 5) for b in range(0, 256, 4)]
    order = random.Random(seed).sample(samples, len(samples))
    cache = DictCache()
    return catalog, order, cache, Prefetcher(catalog, cache, PrefetchConfig(working_set=False),
                                             LINK)


def _announce(p: Prefetcher, catalog: Catalog, order: list[tuple[int, int]]
              ) -> list[PrefetchRequest]:
    items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
    return p.on_hints(0.0, HintRecord(0, items, "rank0"))


def test_hints_make_a_shuffled_epoch_predictable_before_the_first_read():
    catalog, order, cache, p = _shuffled_samples(3)
    first = _announce(p, catalog, order)
    assert (order[0][0], order[0][1]) in blocks_of(first)
    cache.fill(first)
    for r in first:
        cache.fill(p.on_prefetch_complete(0.0, r))
    assert _pass(p, cache, order, 0.01) > 0.95


def test_announced_reads_make_no_streams_and_the_others_still_do():
    catalog, order, cache, p = _shuffled_samples(5)
    cache.fill(_announce(p, catalog, order[:32]))
    for k, (fid, block) in enumerate(order[:32]):
        _read(p, cache, 0.01 + k * 0.001, 1, fid, block)
    assert len(p.streams) == 0  # the hints hold every read: no stream to follow
    for k, (fid, block) in enumerate(order[32:40]):
        _read(p, cache, 0.1 + k * 0.001, 1, fid, block)
    assert len(p.streams) > 0  # reads beyond the announcement are followed as before


def test_working_set_fill_for_random_reads_that_fit_and_not_otherwise():
    def fill_blocks(capacity: int) -> int:
        catalog = shards(n=2, size=16 << 20)
        cache = DictCache(capacity)
        p = Prefetcher(catalog, cache, PrefetchConfig(hints=False), LINK)
        rng = random.Random(4)
        for k in range(300):
            _read(p, cache, k * 0.01, 1, rng.randint(1, 2), rng.randrange(0, 4096, 4))
        return p.stats().per_source.get("fill", [0])[0]

    assert fill_blocks(64 << 20) > 1000  # 32 MiB of data in a 64 MiB cache: filled
    assert fill_blocks(16 << 20) == 0  # does not fit: no fill


def test_unread_siblings_heads_come_first_for_whole_files_in_shuffled_order():
    catalog = Catalog([(i + 1, f"imgs/{i:04d}.jpg", 100_000) for i in range(40)])
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig(hints=False), LINK)
    order = random.Random(5).sample(range(1, 41), 40)
    for k, fid in enumerate(order[:10]):
        _read(p, cache, k * 0.05, 100 + k, fid, 0, 25)
    per_source = p.stats().per_source
    assert per_source.get("heads", [0])[0] > 0
    assert all(cache.contains(f, 0) for f in order[10:])  # every unread file's head is here


def test_a_predictor_measured_as_wrong_stops_being_fetched():
    catalog = shards(n=1, size=64 << 20)
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(), LINK)
    rng = random.Random(6)
    t = 0.0
    for _ in range(30):  # short sequential bursts at random places: each run's window is wasted
        start = rng.randrange(0, 16000)
        for k in range(3):
            t += 0.01
            _read(p, cache, t, 1, 1, start + 4 * k)
        t += 3.0
    assert p.accuracy()["stride"] < 0.3
    before = p.stats().issued_blocks
    for k in range(3):
        _read(p, cache, t + k * 0.01, 1, 1, 20000 + 4 * k)
    assert p.stats().issued_blocks == before


def _hinted_shuffle(n_files: int = 4, size: int = 1 << 20, exact: bool = False):
    """A prefetcher told a shuffled epoch of 16 KiB samples before any read, the prefetches the
    announcement started (none arrived yet), and the order."""
    catalog = shards(n=n_files, size=size)
    samples = [(f, b) for f in range(1, n_files + 1) for b in range(0, size // BLOCK_SIZE, 4)]
    order = random.Random(5).sample(samples, len(samples))
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig(working_set=False, epoch_replay=False), LINK)
    items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
    first = p.on_hints(0.0, HintRecord(0, items, "rank0", exact))
    return p, cache, first, order


def test_readahead_far_into_the_epoch_does_not_move_the_hinted_window_past_the_job():
    """The kernel's readahead reads a sample's neighbours in the file, which sit anywhere in a
    shuffled epoch: the window must stay at the first sample the job has not read."""
    p, cache, first, order = _hinted_shuffle(n_files=16, size=4 << 20)  # 4,096 samples
    fetched: set[tuple[int, int]] = set()

    def land(requests):  # every prefetch arrives at once
        while requests:
            fetched.update(blocks_of(requests))
            cache.fill(requests)
            requests = [m for r in requests for m in p.on_prefetch_complete(0.0, r)]

    land(first)
    for k in range(80):  # the job reads its first samples, each with its file neighbour
        f, b = order[k]
        cache.keys.update((f << 40) | x for x in range(b, b + 8))
        land(p.on_access(0.01 * k, AccessEvent(1, f, b * BLOCK_SIZE, 8 * BLOCK_SIZE)))
    epoch = p.hinted.sequences["rank0"].epochs[0]
    assert epoch.low == 80  # the low-water mark: every sample before it read
    neighbours = [order.index((f, b + 4)) for f, b in order[:80] if (f, b + 4) in order]
    assert all(epoch.read[i] for i in neighbours)  # read ahead: never fetched or waited for
    assert max(neighbours) > 1000  # far ahead of the job, as in a shuffled epoch
    assert {(f, b) for f, b in order[80:96]} <= fetched  # the job's next samples are fetched


def test_reads_before_the_announcement_count_for_its_epoch():
    """A sampler announces from a thread while the loader reads its first batches: those reads
    are the epoch's own, so the low-water mark follows the job instead of waiting at the first
    of them (it moves past an item never read only every 2,048 reads)."""
    catalog = shards(n=16, size=4 << 20)
    samples = [(f, b) for f in range(1, 17) for b in range(0, 1024, 4)]
    order = random.Random(5).sample(samples, len(samples))
    cache = DictCache()
    p = Prefetcher(catalog, cache, PrefetchConfig(working_set=False, epoch_replay=False), LINK)
    early = [k for k in range(64) if k % 8 == 0]  # each worker's first sample, read unannounced
    for k in early:
        _read(p, cache, 0.001 * k, 1, *order[k])
    items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
    cache.fill(p.on_hints(0.1, HintRecord(0, items, "rank0")))
    for k in range(64):
        if k not in early:
            _read(p, cache, 0.1 + 0.001 * k, 1, *order[k])
    epoch = p.hinted.sequences["rank0"].epochs[0]
    assert epoch.low == 64


def test_hinted_guesses_survive_a_job_slower_than_its_pace():
    """A cold job starved by the link reads its announced order late; that is not a wrong
    announcement, so the hints stay trusted (and fetched) rather than scored off."""
    p, cache, first, order = _hinted_shuffle(n_files=16, size=4 << 20)
    cache.fill(first)
    for r in first:
        cache.fill(p.on_prefetch_complete(0.0, r))
    t = 0.0
    for k, (f, b) in enumerate(order[:400]):  # a fast start, then 500 times slower
        t += 0.001 if k < 360 else 0.5
        _read(p, cache, t, 1, f, b)
    assert p.accuracy()["hinted"] > 0.9
    assert p.stats().per_source["hinted"][0] > 0


def test_announced_reads_stand_the_working_set_fill_down():
    """Random reads over data that fits the cache start the fill; once the job announces its
    order, the fill stops taking link and budget from the announced reads."""
    catalog = shards(n=2, size=16 << 20)
    samples = [(f, b) for f in (1, 2) for b in range(0, 4096, 4)]
    order = random.Random(6).sample(samples, len(samples))

    def fill_issued(hinted: bool) -> int:
        cache = DictCache(64 << 20)
        p = Prefetcher(catalog, cache, PrefetchConfig(epoch_replay=False), LINK)
        if hinted:
            items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
            cache.fill(p.on_hints(0.0, HintRecord(0, items, "rank0")))
        for k, (f, b) in enumerate(order[:300]):
            _read(p, cache, k * 0.01, 1, f, b)
        per_source = p.stats().per_source
        return per_source.get("fill", [0])[0] + per_source.get("heads", [0])[0]

    assert fill_issued(hinted=False) > 1000
    assert fill_issued(hinted=True) == 0


def test_hinted_window_reaches_far_enough_for_the_kernels_readahead_tails():
    """The kernel adds a sample's file neighbour to its FUSE read, a sample anywhere in the rest
    of a shuffled epoch. Once the job's pace is known the hinted window reaches far ahead
    (HINT_REACH_S, within the cache share), so those tails are cached rather than demand misses.
    Past the guessed part of the window a request takes the samples that follow in the file
    too, so the far part does not cost a request per 16 KiB sample."""
    p, cache, first, order = _hinted_shuffle(n_files=16, size=4 << 20)  # 64 MiB, 4,096 samples
    requests: list = []
    reqs = first
    while reqs:
        requests += reqs
        cache.fill(reqs)
        reqs = [m for r in reqs for m in p.on_prefetch_complete(0.0, r)]
    tails = missed = 0
    for k, (f, b) in enumerate(order[:300]):
        tail = range(b + 4, min(b + 8, 1024))  # the neighbour, unless at the file's end
        if k >= 100:  # the pace is measured: count the neighbours the read finds missing
            tails += len(tail)
            missed += sum(1 for x in tail if not cache.contains(f, x))
        cache.keys.update((f << 40) | x for x in range(b, tail.stop))  # demand fills the rest
        reqs = p.on_access(0.01 * k, AccessEvent(1, f, b * BLOCK_SIZE, 8 * BLOCK_SIZE))
        while reqs:  # every prefetch arrives at once
            requests += reqs
            cache.fill(reqs)
            reqs = [m for r in reqs for m in p.on_prefetch_complete(0.01 * k, r)]
    assert tails > 500
    assert missed <= 0.05 * tails
    fetched = sum(r.count for r in requests) // 4
    assert fetched > 0.9 * len(order)  # the rest of the epoch, not a few horizons of it
    assert len(requests) < fetched / 2  # without widening, about one request per sample


def test_an_exact_epoch_is_fetched_a_few_horizons_ahead_of_the_job():
    """Read without readahead, an epoch has no tails to reach for: its window stays a few
    horizons deep, and every sample is still fetched before the job reads it."""
    p, cache, first, order = _hinted_shuffle(n_files=16, size=4 << 20, exact=True)
    fetched: set[tuple[int, int]] = set()
    reqs = first
    missed = 0
    for k, (f, b) in enumerate(order[:300]):
        while reqs:  # every prefetch arrives at once
            fetched.update(blocks_of(reqs))
            cache.fill(reqs)
            reqs = [m for r in reqs for m in p.on_prefetch_complete(0.01 * k, r)]
        missed += not cache.contains(f, b)
        reqs = _read(p, cache, 0.01 * k, 1, f, b)
    assert missed == 0
    assert 300 < len(fetched) // 4 < 0.25 * len(order)  # ahead of the job, not the whole epoch


def test_an_epoch_read_in_the_pumps_batches_is_fetched_ahead_of_the_job():
    """The mount hands reads over with ``observe`` and plans once per batch of them: every
    sample is still fetched before the job reads it, far past the announcement's first window,
    and the guessed part of the window follows the job (extended at each plan; without that
    the guesses stay where the announcement put them)."""
    p, cache, first, order = _hinted_shuffle(n_files=16, size=4 << 20, exact=True)
    fetched: set[tuple[int, int]] = set(blocks_of(first))
    landing = first
    missed = 0
    for start in range(0, 600, 8):
        cache.fill(landing)  # the last plan's prefetches arrive before the next batch
        for r in landing:
            p.complete(0.01 * start, r)
        for k, (f, b) in enumerate(order[start:start + 8], start):
            missed += not cache.contains(f, b)
            cache.keys.update((f << 40) | x for x in range(b, b + 4))  # a demand read lands
            p.observe(0.01 * k, AccessEvent(1, f, b * BLOCK_SIZE, 4 * BLOCK_SIZE))
        landing = p.plan(0.01 * (start + 8))
        fetched.update(blocks_of(landing))
    assert missed == 0
    assert len(fetched) // 4 > 600 + len(blocks_of(first)) // 4  # the window moved on
    f, b = order[600]  # and so did its guesses: the job's next sample is one of them
    assert p.ledger.guessed_by((f << 40) | b, "hinted")


SRC = ["stride", "ngram", "hinted"]


class BlockLedger(Ledger):
    """The reference: the ledger as it was, one heap entry and one accuracy update per block."""

    def __init__(self, sources):
        super().__init__(sources)
        self._heaps = {name: [] for name in sources}

    def register(self, now, ttl, source, file_id, first, stop):
        bit = self._bit[source]
        for block in range(first, stop):
            key = (file_id << 40) | block
            mask = self._pending.get(key, 0)
            if not mask & bit:
                self._pending[key] = mask | bit
                heapq.heappush(self._heaps[source], (now + ttl, key))

    def on_read(self, now, file_id, first, stop):
        guessed = 0
        for block in range(first, stop):
            mask = self._pending.pop((file_id << 40) | block, 0)
            guessed |= mask
            for name in self.sources:
                if mask & self._bit[name]:
                    self._credit(name, True, now, 1)
        return guessed

    def expire(self, now):
        for name, queue in self._heaps.items():
            bit = self._bit[name]
            while queue and queue[0][0] <= now:
                _, key = heapq.heappop(queue)
                mask = self._pending.get(key, 0)
                if mask & bit:
                    if mask & ~bit:
                        self._pending[key] = mask & ~bit
                    else:
                        del self._pending[key]
                    self._credit(name, False, now, 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["register", "read", "expire"]), st.sampled_from(SRC),
                          st.integers(1, 2), st.integers(0, 300), st.integers(1, 80),
                          st.sampled_from([0.5, 2.0, 7.0])), max_size=80))
def test_ledger_scores_whole_ranges_exactly_as_block_by_block(ops):
    """Whole ranges at once, the same accuracies to the last bit: a one-ulp difference would
    reorder windows whose priorities tie."""
    ledgers = [Ledger(SRC), BlockLedger(SRC)]
    now = 0.0
    for kind, source, file_id, first, count, ttl in ops:
        now += 0.37
        results = []
        for ledger in ledgers:
            if kind == "register":
                ledger.register(now, ttl, source, file_id, first, first + count)
            elif kind == "read":
                results.append(ledger.on_read(now, file_id, first, first + count))
            else:
                ledger.expire(now)
        assert len(set(results)) <= 1
    fast, slow = ledgers
    assert fast.accuracy == slow.accuracy and fast.outcomes == slow.outcomes
    assert fast._pending == slow._pending


def test_a_warm_epoch_is_walked_a_bounded_stretch_per_plan_and_nothing_is_fetched():
    """Over a cache that holds the whole epoch the hinted window has nothing to fetch; walking
    past cached items costs each plan at most MAX_SKIPPED_ITEMS of them (all at once it held
    the event loop for a second), and the walk still gets through the window."""
    catalog = shards(n=16, size=4 << 20)  # 4,096 samples of 16 KiB
    samples = [(f, b) for f in range(1, 17) for b in range(0, 1024, 4)]
    order = random.Random(7).sample(samples, len(samples))
    cache = DictCache()
    cache.keys.update((f << 40) | x for f in range(1, 17) for x in range(1024))
    p = Prefetcher(catalog, cache, PrefetchConfig(working_set=False, epoch_replay=False), LINK)
    items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
    assert p.on_hints(0.0, HintRecord(0, items, "rank0")) == []
    epoch = p.hinted.sequences["rank0"].epochs[0]
    walked = []
    for k, (f, b) in enumerate(order[:400]):
        before = epoch.issued
        assert p.on_access(0.001 * k, AccessEvent(1, f, b * BLOCK_SIZE, 4 * BLOCK_SIZE)) == []
        walked.append(epoch.issued - before)
    assert max(walked) <= MAX_SKIPPED_ITEMS + 1  # the item the read itself marked, at most
    assert epoch.issued >= epoch.reach > 1000  # the walk reached the far end of the window


def _present_blocks(p: Prefetcher) -> list[tuple[int, int]]:
    return [(f, b) for f, first, stop in p.take_present() for b in range(first, stop)]


def test_near_windows_over_cached_blocks_report_them_once():
    """A reader over a warm cache: nothing is fetched, and the cached blocks its window reaches
    ahead are reported (once each) so the mount can have them read from its disk."""
    catalog = shards(n=1, size=1024 * BLOCK_SIZE)
    cache = DictCache()
    cache.keys.update((1 << 40) | b for b in range(1024))
    p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(), LINK)
    present: list[tuple[int, int]] = []
    for k in range(100):  # 16 KiB every 10 ms: the pace is measured after a quarter second
        assert _read(p, cache, k * 0.01, 1, 1, 4 * k) == []
        present += _present_blocks(p)
    assert len(present) == len(set(present))  # each block once
    assert {b for _, b in present} >= set(range(400, 440))  # ahead of the reader at block 396
    assert all(f == 1 for f, _ in present)


def test_hinted_items_held_already_are_reported_present():
    catalog = shards(n=4, size=1 << 20)
    samples = [(f, b) for f in range(1, 5) for b in range(0, 256, 4)]
    order = random.Random(5).sample(samples, len(samples))
    cache = DictCache()
    cache.keys.update((f << 40) | b for f, b0 in order[:100] for b in range(b0, b0 + 4))
    p = Prefetcher(catalog, cache, PrefetchConfig(working_set=False, epoch_replay=False), LINK)
    items = tuple((catalog.get(f).path, b * BLOCK_SIZE, 4 * BLOCK_SIZE) for f, b in order)
    fetched = blocks_of(p.on_hints(0.0, HintRecord(0, items, "rank0")))
    present = set(_present_blocks(p))
    held = {(f, b) for f, b0 in order[:100] for b in range(b0, b0 + 4)}
    assert held <= present and not held & fetched  # held: reported, not fetched
    assert (order[100][0], order[100][1]) in fetched


def test_present_stretches_are_reported_again_after_a_while():
    """The kernel may drop pages from RAM, so a later pass over the same blocks (the next
    epoch) has them reported again, not only the first."""
    catalog = shards(n=1, size=1024 * BLOCK_SIZE)
    cache = DictCache()
    cache.keys.update((1 << 40) | b for b in range(1024))
    p = Prefetcher(catalog, cache, PrefetchConfig.stride_only(), LINK)

    def one_pass(start: float, handle: int) -> set[tuple[int, int]]:
        present: set[tuple[int, int]] = set()
        for k in range(60):
            _read(p, cache, start + k * 0.01, handle, 1, 4 * k)
            present |= set(_present_blocks(p))
        return present

    first = one_pass(0.0, 1)
    assert first and one_pass(1.0, 2) == set()  # soon after: all noted already
    assert first & one_pass(1.0 + PRESENT_RENOTE_S, 3)  # later: reported afresh
