"""The spoke's block cache: an LRU policy over an LMDB store, with writes batched off the read path.

A block put into the cache is readable at once from memory; a background task writes the
accumulated puts, evictions and last-use stamps to LMDB in one transaction per batch, in a
child process (``cache_writer``: in a thread of the daemon the writes fought the event loop
for the GIL). Readers therefore never wait on a write transaction, and the cache survives a
restart (remounting over the same directory is warm). Reads of LMDB run in one long-lived
reader thread, so the event loop never waits for the disk, except short runs whose pages are
all in RAM (checked with ``mincore``), which the loop reads itself: for them the hand-off to
the thread was most of the cost.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np
import trio

from fabric.job_threads import JobThreads
from neuralcache.blocks import BLOCK_SIZE
from neuralcache.cache_policy import LruPolicy

from . import metrics
from .block_store import (EXTENT_BLOCKS, EXTENT_VALUE_BYTES, VALUE_BYTES, BlockKey, BlockStore,
                          RunBytes, extent_of)
from .cache_writer import CacheWriteError, CacheWriter
from .key_space import KeySpace, slot_of
from .residency import ResidencyProbe, run_stretch, value_spans, will_need, will_need_spans

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 0.05
"""Seconds the writer waits to gather a batch; bounds how long fresh blocks live only in memory."""
MAX_BATCH_OPS = 4096
"""Puts per write transaction (16 MiB of blocks): large enough to amortise, small enough to stay
quick."""
MAX_BATCH_STAMPS = 16384
"""Last-use stamps per write transaction besides those of its puts (64 MiB of blocks read):
few enough that taking them keeps the event loop's step short (their rows are made in the
thread that hands the batch to the writer), and the transaction quick."""
STAMPS_PENDING_MAX = 1 << 20
"""Last-use stamps held in memory before the writer is woken to write them on their own. They
ride along with the puts, and a warm mount puts nothing: over an epoch read from the cache they
would wait for the unmount and make its flush one transaction of them all. At this many (4 GiB
of blocks) the writer writes batch after batch, without gathering for ``FLUSH_INTERVAL``, until
fewer wait; a pass over a smaller cache never wakes it. The stamps of a run read whole wait as
one entry (``BlockCache._touch_run``), others as a dict entry each (~110 bytes)."""

INLINE_MAX_BLOCKS = 64
"""Longest run (256 KiB) served on the event loop when its pages are in RAM. A 16 KiB read
(4 blocks) is mostly the hand-off to the reader thread, which inline saves; a 1 MiB one is
mostly LMDB and hashing, part of which py-lmdb runs with the GIL released, so in the thread
it overlaps the loop's next FUSE request: served inline, sequential reads measured slower
(``bench.throughput --quick``: 739-749 MB/s inline against 1024-1096 through the thread)."""
READ_AHEAD_BLOCKS = 2048
"""Blocks after a warm run read from the disk that are asked for with it (8 MiB, a disk's usual
readahead), when the run continues a recent one (``BlockCache._read_ahead``)."""
RECENT_READS = 64
"""Runs whose ends ``read_run`` remembers, to tell a run that continues one: several workers of a
data loader read a file's consecutive batches in turns. A random reader's run starts at one of
them by chance only (64 of a file's blocks)."""
_INLINE_READS = metrics.CACHE_RUN_READS.labels(metrics.PATH_INLINE)
_THREAD_READS = metrics.CACHE_RUN_READS.labels(metrics.PATH_THREAD)

_DELETED = None  # marker in the pending-ops map: the key was evicted


class PageIn(NamedTuple):
    """What ``BlockCache.page_in`` asks the kernel to read: spans of the map, and how many
    blocks of the runs asked about they hold (for the metric)."""

    spans: list[tuple[int, int]]
    blocks: int


def whole_extents(puts: dict[int, bytes]) -> list[int]:
    """The first keys of the extents all of whose blocks ``puts`` (in key order) holds whole:
    a batch stores them as extents (``BlockStore.write_batch``)."""
    get = puts.get
    return [first for first in puts if not first % EXTENT_BLOCKS and all(
        len(get(key, b"")) == BLOCK_SIZE for key in range(first, first + EXTENT_BLOCKS))]


class BlockCache:
    """Blocks by key, bounded by ``capacity`` bytes.

    Inside, every block is keyed by its int from ``keys`` (``key_space``: the policy, the
    stamps, the addresses, the queued writes); ``BlockKey``s are what the cache takes and
    hands out at its edges (``get_many``, ``drop``, ``purge``, the watcher's callbacks).
    """

    def __init__(self, store: BlockStore, capacity: int) -> None:
        self.store = store
        self.keys = KeySpace()
        self.writer = CacheWriter(store.path, store.capacity, store.map_base, self.keys)
        self.policy = LruPolicy(capacity, group_of=slot_of)
        """Held blocks by int key (``keys``), least recently used first, counted by file
        version (``held_blocks``)."""
        self._ops: dict[int, bytes | None] = {}  # not yet handed to the writer
        self._writing: dict[int, bytes | None] = {}  # being written right now
        self._stamps: dict[int, int] = {}
        self._stamp_runs: deque[tuple[range, int]] = deque()
        """Stamps of warm runs not yet in ``_stamps``: each run's keys and its first key's
        stamp, oldest first, every one younger than the stamps in ``_stamps`` (``_touch_run``)."""
        self._run_stamps = 0  # how many stamps ``_stamp_runs`` holds
        self._packed: set[int] = set()
        """First keys of the extents LMDB holds (``block_store``), each of whose blocks is held
        and waits for no write; a read names the ones it reads (``_extents_of``)."""
        self._unpacked: dict[int, None] = {}
        """First keys of extents whose rows the next batch deletes (``_unpack``)."""
        self._stale: dict[int, None] = {}
        """Keys of a failed batch (see ``_drop_unwritten``), whose rows LMDB may hold though the
        cache no longer counts them: deleted with the next batch."""
        self._clock = 0
        self._work = trio.Event()
        self._write_lock = trio.Lock()
        self._on_dropped: Callable[[BlockKey], None] | None = None
        self._protected: Callable[[BlockKey], bool] | None = None
        self._reader = JobThreads(on_wait=metrics.CACHE_READER_WAIT.observe)
        self._reader.post(metrics.READER_THREAD.watch)  # for its disk waits, counted by the kernel
        self._pager = JobThreads(follow_loop_cpu=False, name="neuralcache-page-in")
        """Runs the advice of ``page_in``, ``_read_ahead`` and ``_read_queued``, apart from the
        reader thread: asking the kernel for a window's pages of a cache file on disk takes it
        tens of ms per 64 MiB (allocating the pages and queueing their reads), which the reads
        behind it in the reader thread would wait for too."""
        self._reads_in_thread = 0
        """``_read_queued`` reads out in the reader thread (not ``read_run_located``'s, which
        learn where blocks lie): a run found on the disk behind one of them is asked for early."""
        self._probe = ResidencyProbe()  # used on the event loop only
        self._recent_ends: dict[int, bool] = {}
        """Keys just past the last ``RECENT_READS`` runs read, oldest first (``read_run``)."""
        self._addresses: dict[int, int] = {}
        """Where each block's value lay in LMDB's map when it was last written or read in the
        reader thread, for the residency check of inline reads; forgotten at any later change
        to the key. Known at mount for blocks whose stamp row records where they lie (see
        ``BlockStore.index``); the others are learnt by their first read."""
        self.inline_max_blocks = INLINE_MAX_BLOCKS
        """Longest run ``read_run`` may serve on the event loop (0: always the reader thread)."""
        self._load_index()

    def watch(self, on_dropped: Callable[[BlockKey], None],
              protected: Callable[[BlockKey], bool]) -> None:
        """Report every block that leaves the cache, and spare ``protected`` ones from eviction.

        The prefetcher assumes a block it fetched stays cached until told otherwise, and marks
        the prefetched blocks a reader is about to reach as protected.
        """
        self._on_dropped = on_dropped
        self._protected = protected

    def _spared(self, key: int) -> bool:
        """The policy's eviction predicate: is this held key protected by the watcher?"""
        return self._protected is not None and self._protected(self.keys.block_key(key))

    def _dropped(self, key: int) -> None:
        if self._on_dropped is not None:
            self._on_dropped(self.keys.block_key(key))

    def holds(self, key: BlockKey) -> bool:
        """Whether the cache holds this block."""
        return self.policy.holds(self.keys.key(*key))

    def held_blocks(self, file_id: int, version: int) -> int:
        """How many blocks of this file version the cache holds (a dict look-up)."""
        return self.policy.held_in(self.keys.slot(file_id, version))

    def held_keys(self) -> list[BlockKey]:
        """The held blocks, least recently used first."""
        return list(map(self.keys.block_key, self.policy.oldest_first()))

    def _load_index(self) -> None:
        read_ahead = self.store.page_in_trees()
        log.info("reading the cache's index (%d pages of its tables read ahead)", read_ahead)
        key_of = self.keys.key
        for entry in self.store.index():
            key = key_of(*entry.key)
            self._clock = max(self._clock, entry.stamp)
            if entry.address is not None:
                self._addresses[key] = entry.address
            for old in self.policy.insert(key, entry.size):
                self._record(old, _DELETED)
        for file_id, version, block in self.store.extents():
            self._packed.add(key_of(file_id, version, block))
        self._check_packed(list(self._packed))
        metrics.CACHE_CAPACITY_BYTES.set(self.policy.capacity)
        self._update_gauges()

    def _update_gauges(self) -> None:
        metrics.CACHE_USED_BYTES.set(self.policy.used)

    def _record(self, key: int, data: bytes | None) -> None:
        if self._packed and (extent := extent_of(key)) in self._packed:
            self._unpack(extent)
        self._ops[key] = data
        self._addresses.pop(key, None)
        if data is _DELETED:
            self._settle_runs()
            self._stamps.pop(key, None)
        self._work.set()

    def _unpack(self, extent: int) -> None:
        """One of an extent's blocks leaves the cache or is put again: the next batch deletes
        the extent's rows, and its other blocks leave with it (they have no rows of their own;
        landed together, and read together by a reader going forward, they are about as old
        as the one that goes)."""
        self._packed.discard(extent)
        self._unpacked[extent] = None
        for key in range(extent, extent + EXTENT_BLOCKS):
            if self.policy.remove(key):
                self._record(key, _DELETED)
                self._dropped(key)

    def _check_packed(self, extents: list[int]) -> None:
        """Keep in ``_packed`` only those of these extents (just written, or found at mount)
        whose blocks are all held and wait for no write: one evicted while its batch was
        written, say, has the extent unpacked."""
        holds, ops = self.policy.holds, self._ops
        for extent in extents:
            keys = range(extent, extent + EXTENT_BLOCKS)
            if not all(map(holds, keys)) or not ops.keys().isdisjoint(keys):
                self._unpack(extent)

    def _extents_of(self, keys: range) -> list[int]:
        """The first keys of the stored extents that hold blocks of the run ``keys``."""
        return [e for e in range(extent_of(keys[0]), keys[-1] + 1, EXTENT_BLOCKS)
                if e in self._packed]

    def _span(self, keys: range, first: int) -> tuple[range, list[int]]:
        """The run ``keys`` (from block ``first``) widened to the ends of the stored extents it
        reads, and those extents' first blocks."""
        packed = self._extents_of(keys) if self._packed else []
        if not packed:
            return keys, []
        span = range(min(keys[0], packed[0]), max(keys[-1] + 1, packed[-1] + EXTENT_BLOCKS))
        base = keys[0] - first
        return span, [extent - base for extent in packed]

    def purge(self, keep: Any) -> int:
        """Drop every block for which ``keep(key)`` is false (e.g. versions no longer on the
        hub)."""
        block_key = self.keys.block_key
        stale = [k for k in self.policy.oldest_first() if not keep(block_key(k))]
        for key in stale:
            self.policy.remove(key)
            self._record(key, _DELETED)
        self._update_gauges()
        return len(stale)

    def drop(self, keys: Iterable[BlockKey]) -> int:
        """Forget the held ones among ``keys`` (``neuralcache cache drop``); returns how many.

        Unlike ``purge`` it looks only at the keys given (and the other blocks of their
        extents, which go with them), and it tells the watcher, so the prefetcher knows those
        blocks must be fetched again.
        """
        held = [key for key in dict.fromkeys(self.keys.key(*k) for k in keys)
                if self.policy.holds(key)]
        for key in held:
            if self.policy.remove(key):  # else gone with another block of its extent
                self._record(key, _DELETED)
                self._dropped(key)
        self._update_gauges()
        return len(held)

    def _stamp(self, keys: Sequence[int]) -> None:
        """Give ``keys`` the next last-use stamps, in order. They ride along with the next batch
        of puts (or the flush at unmount): waking the writer for every hit would put a write
        transaction behind each warm read."""
        self._settle_runs()
        self._stamps.update(zip(keys, itertools.count(self._clock + 1)))
        self._count_stamps(len(keys))

    def _touch_run(self, keys: range) -> None:
        """``_touch`` of a run read whole, in bulk: the LRU's moves wait until its order is
        needed (``LruPolicy.touch_later``: a warm mount that evicts nothing never makes them),
        and the run's stamps wait as one entry of ``_stamp_runs`` until a batch takes them or
        something else stamps or drops a key (``_settle_runs``). Block by block, both had cost
        the event loop a dict look-up per block, in dicts of every block held or read, on a
        warm mount (docs/throughput.md, session 49).

        The run's keys are not checked: one evicted or dropped while the run was read gets a
        stamp here, for which ``_write_batch`` writes no row (it is not held), and which a
        later put of it outdates."""
        self.policy.touch_later(keys)
        self._stamp_runs.append((keys, self._clock + 1))
        self._run_stamps += len(keys)
        self._count_stamps(len(keys))

    def _count_stamps(self, count: int) -> None:
        """Move the clock past ``count`` stamps just given, and wake the writer once
        ``STAMPS_PENDING_MAX`` wait."""
        self._clock += count
        if self._pending_stamps() >= STAMPS_PENDING_MAX:
            self._work.set()

    def _settle_runs(self, limit: int | None = None) -> None:
        """Move the stamps of ``_stamp_runs`` into ``_stamps``, oldest first, until it holds
        ``limit`` (all of them if None). Done in full before anything else stamps or drops a
        key, so that ``_stamps`` always holds what stamping each key at once would have left,
        and the runs' stamps are younger than all of it."""
        runs, stamps = self._stamp_runs, self._stamps
        while runs and (limit is None or len(stamps) < limit):
            keys, first = runs.popleft()
            stamps.update(zip(keys, itertools.count(first)))
            self._run_stamps -= len(keys)

    def _pending_stamps(self) -> int:
        return len(self._stamps) + self._run_stamps

    def _touch(self, keys: Sequence[int]) -> None:
        """Record a use of the held ones among ``keys``, in order.

        A block evicted or purged while its disk read ran is still correct to return; it gets
        no stamp here (nor a row: ``_write_batch`` writes none for a key not held).
        """
        self._stamp(self.policy.touch_many(keys))

    async def read_run(self, file_id: int, version: int, first: int, count: int
                       ) -> RunBytes | None:
        """Blocks ``[first, first + count)`` of a file version, joined, if LMDB holds them all.

        The warm read's fast path: one LMDB transaction and bookkeeping in bulk, on the event
        loop itself if the run is short and every page of it is in RAM (``read_run_resident``),
        else in one trip to the reader thread (which, for blocks whose place in the map is not
        known yet, also notes where they lie; a long run whose first and last values lie close
        is taken to be laid out together).
        None (often without leaving the loop) if the run's first or last block is not held, a
        block of it waits in memory for the writer, or any block is missing or damaged on disk:
        ``get_many`` then serves what there is, block by block, and drops what is damaged.

        The residency check and the advice to the kernel cover the stored extents the run
        reads whole (``span``: the run widened to their ends), as a read of whole extents
        touches them all. A run inside one stored extent is checked and read the short way
        first (``_read_in_extent``).
        """
        if count <= 0:
            return b""
        keys = self.keys.run(file_id, version, first, count)
        follows = self._continues(keys)
        data = self._read_in_extent(file_id, version, first, keys)
        if data is not None:
            self._touch_run(keys)
            return data
        if not self._may_be_stored(keys):
            return None
        span, extents = self._span(keys, first)
        get = self._addresses.get
        length = VALUE_BYTES
        stretch = None
        if len(span) > self.inline_max_blocks and None not in (ends := (get(span[0]),
                                                                        get(span[-1]))):
            # Bound for the reader thread, where the values' places serve only to ask the kernel
            # for pages not in RAM: if the first and last lie close enough for the values between
            # to lie side by side (a run written together), their stretch tells that with two
            # look-ups. One per block cost the daemon a tenth of a 1 MiB read's CPU time (646 ->
            # 578 us, ``python -m bench.throughput_ab``).
            stretch = run_stretch(*ends, len(span), VALUE_BYTES)
        if stretch is not None:
            located, addresses, length = True, [stretch[0]], stretch[1]
        else:
            addresses = list(map(get, span))
            located = None not in addresses
            if located and len(span) <= self.inline_max_blocks:
                data = self.store.read_run_resident(file_id, version, first, count,
                                                    addresses, self._probe, extents)
        if data is not None:
            _INLINE_READS.inc()
        elif not located:
            # Learn where the values lie (once per block and mount, ~1 us each), so that the
            # next read of them may go inline or have its pages asked for at once, and so that
            # their next stamp rows record it for the next mount.
            _THREAD_READS.inc()
            found = await self._reader.run(self.store.read_run_located, file_id, version,
                                           first, count, extents)
            if found is not None:
                data, addresses = found
                self._learn_addresses(span, addresses)
        else:
            _THREAD_READS.inc()
            if follows:
                self._read_ahead(file_id, version, first, count, addresses[0])
            data = await self._read_queued(len(span) <= self.inline_max_blocks, file_id,
                                           version, first, count, addresses, length, extents)
        if data is not None:
            # Bytes LMDB returned for a key are that key's, whatever happened to the policy
            # meanwhile: keys name one version, and every checksum was verified. Only the
            # run's blocks count as used, not the rest of its extents: stamping those too
            # gave a random 16 KiB read four times the stamps to keep and write
            # (docs/repro.md, session 51).
            self._touch_run(keys)
        return data

    async def _read_queued(self, on_disk: bool, file_id: int, version: int, first: int,
                           count: int, addresses: list[int], length: int,
                           extents: Sequence[int]) -> RunBytes | None:
        """``BlockStore.read_run`` in the reader thread. ``on_disk``: the event loop's check
        found a page of the run's values out of RAM (or the run not wholly stored, where the
        advice below is merely wasted). Such a run queued behind other reads has the page-in
        thread ask the kernel for its values at once: the reader thread asks for a run's
        pages only when it gets to the run, so a loader's workers' reads of a cache on the
        disk each waited for the disk in turn, behind the one before."""
        if on_disk and self._reads_in_thread:
            self._pager.post(will_need, addresses, length, self.store.will_need_bytes)
        self._reads_in_thread += 1
        try:
            return await self._reader.run(self.store.read_run, file_id, version, first, count,
                                          addresses, length, extents)
        finally:
            self._reads_in_thread -= 1

    def _may_be_stored(self, keys: range) -> bool:
        """Whether LMDB may hold the run as the cache has it: its first and last blocks held,
        and none of it waiting in memory for the writer."""
        holds = self.policy.holds
        if not (holds(keys[0]) and holds(keys[-1])):
            return False
        return not ((self._ops and not self._ops.keys().isdisjoint(keys))
                    or (self._writing and not self._writing.keys().isdisjoint(keys)))

    def _read_in_extent(self, file_id: int, version: int, first: int, keys: range
                        ) -> bytes | None:
        """The run ``keys`` (from block ``first``) if it lies inside one stored extent, read on
        the event loop if every page of the extent's value is in RAM; else None (``read_run``
        then goes the general way, which sorts out a damaged extent too).

        A random 16 KiB read of a cache filled in order: its extent's place in the map is
        the place of its first block, and its pages are one stretch, so this takes one look-up
        and one ``mincore`` where the general way looks up each block of the extent and
        merges their places (a sixth of ``BlockFetcher.read``'s time, docs/throughput.md,
        session 52).
        """
        extent = extent_of(keys[0])
        if (keys[-1] >= extent + EXTENT_BLOCKS or extent not in self._packed
                or self.inline_max_blocks < EXTENT_BLOCKS):
            return None
        address = self._addresses.get(extent)
        if address is None or not self._probe.stretch_resident(address, EXTENT_VALUE_BYTES):
            return None
        data = self.store.read_part(file_id, version, extent_of(first), first, len(keys))
        if data is not None:
            _INLINE_READS.inc()
        return data

    def _continues(self, keys: range) -> bool:
        """Does this run start where one of the last ``RECENT_READS`` ended (a reader going
        forward, maybe as several workers taking turns)? Remembers where it ends."""
        ends = self._recent_ends
        follows = ends.pop(keys[0], False)
        ends[keys[-1] + 1] = True
        if len(ends) > RECENT_READS:
            del ends[next(iter(ends))]
        return follows

    def _read_ahead(self, file_id: int, version: int, first: int, count: int,
                    address: int) -> None:
        """For a run that starts where a recent one ended: if the value half a read-ahead past
        its end, or the one just past it, is on the disk, not in RAM (or, if neither block's
        place is known, the run's first value, at ``address``), have the page-in thread ask
        the kernel for the run and the ``READ_AHEAD_BLOCKS`` after it at once, as the kernel's
        own readahead would for a reader going forward through a file (it does not here: LMDB
        maps the cache file for random access). Looking half a read-ahead on, not at the run
        itself, asks for the next stretch while half of the last is still unread, as the
        kernel does at its readahead marker: a reader going forward does not wait for the disk
        at each stretch's first run. The prefetcher's windows do the same once they have
        grown; this covers a reader's first reads, and readers nothing predicts.

        The value just past the run is looked at too because something else may have read
        the one half a read-ahead on (a prefetch window's ``page_in``) while the next runs'
        values were still on the disk: looking there alone, the read-ahead stood down
        (docs/repro.md, session 57). One ``mincore`` per page looked at."""
        get, key = self._addresses.get, self.keys.key
        probes = [place for place in (get(key(file_id, version, first + count)),
                                      get(key(file_id, version,
                                              first + count + READ_AHEAD_BLOCKS // 2)))
                  if place is not None]
        if self._probe.all_resident(probes or [address], 1):
            return
        # A page there is out, so the stretch is not asked about first (``mincore`` over up to
        # 8 MiB on the loop, answering what is known).
        wanted = self._placed([(file_id, version, first, first + count + READ_AHEAD_BLOCKS)])
        if wanted.spans:
            self._pager.post(will_need_spans, wanted.spans, self.store.will_need_bytes)
            metrics.CACHE_PAGE_IN_BLOCKS.inc(wanted.blocks)

    def pages_to_read(self, runs: Iterable[tuple[int, int, int, int]]) -> PageIn | None:
        """Where the values of these runs ``(file, version, first, stop)`` lie, if any of their
        pages is not in RAM: what ``page_in`` should ask for. None if all of them are resident
        (the usual answer on a warm mount, found on the event loop with ``mincore``, without a
        task or a thread), or if no block's place in the map is known."""
        wanted = self._placed(runs)
        if not wanted.spans or self._probe.spans_resident(wanted.spans):
            return None
        return wanted

    def _placed(self, runs: Iterable[tuple[int, int, int, int]]) -> PageIn:
        """Where the values of these runs lie in the map, as ``pages_to_read`` finds them,
        whether in RAM or not (no spans if no block's place is known).

        Each value by its own place: a stored extent by its first block's, a block stored on
        its own by its own. A run's values need not lie between its first and last ones': a
        cache filled by several readers at once holds each write batch's blocks together, in
        the order their fetches landed. Guessed from a run's ends, as before, a prefetch
        window's page-in left out the values outside, and a warm reader going through the
        window waited for the disk once a page (docs/repro.md, session 58)."""
        get, run, packed = self._addresses.get, self.keys.run, self._packed
        values: list[int] = []  # a stored extent by its first key, a block on its own by its own
        lengths: list[int] = []
        counts: list[int] = []  # how many of the runs' blocks each value holds
        for file_id, version, first, stop in runs:
            keys = run(file_id, version, first, stop - first)
            if not keys:
                continue
            starts = range(extent_of(keys.start), keys.stop, EXTENT_BLOCKS)
            stored = list(map(packed.__contains__, starts)) if packed else []
            if not any(stored):
                values += keys
                lengths += itertools.repeat(VALUE_BYTES, len(keys))
                counts += itertools.repeat(1, len(keys))
            elif all(stored):  # a run stored in order, the usual
                values += starts
                lengths += itertools.repeat(EXTENT_VALUE_BYTES, len(starts))
                counts += itertools.repeat(EXTENT_BLOCKS, len(starts))
                counts[-len(starts)] -= keys.start - starts[0]
                counts[-1] -= starts[-1] + EXTENT_BLOCKS - keys.stop
            else:
                for start, is_stored in zip(starts, stored):
                    part = range(max(start, keys.start), min(start + EXTENT_BLOCKS, keys.stop))
                    if is_stored:
                        values.append(start)
                        lengths.append(EXTENT_VALUE_BYTES)
                        counts.append(len(part))
                    else:
                        values += part
                        lengths += itertools.repeat(VALUE_BYTES, len(part))
                        counts += itertools.repeat(1, len(part))
        places = np.fromiter(map(get, values, itertools.repeat(-1)), dtype=np.int64,
                             count=len(values))
        known = places >= 0
        return PageIn(value_spans(places[known], np.array(lengths, dtype=np.int64)[known]),
                      int(np.array(counts, dtype=np.int64)[known].sum()))

    async def page_in(self, wanted: PageIn) -> None:
        """Have the kernel read these values (``pages_to_read``) from the disk into RAM, so
        that their reads, when they come, are served on the event loop (a warm read whose pages
        are on disk waits for them in the reader thread). Advice: the call returns once the
        reads are started (``madvise(MADV_WILLNEED)``, in a thread of its own, as starting them
        may wait for the disk's queue)."""
        await self._pager.run(will_need_spans, wanted.spans, self.store.will_need_bytes)
        metrics.CACHE_PAGE_IN_BLOCKS.inc(wanted.blocks)

    def _learn_addresses(self, keys: range, addresses: list[int]) -> None:
        """Remember where a thread read found these values, for the ones nothing has changed
        since (held, and no write of them queued or running)."""
        ops, writing, holds = self._ops, self._writing, self.policy.holds
        self._addresses.update((k, a) for k, a in zip(keys, addresses)
                               if holds(k) and k not in ops and k not in writing)

    async def get_many(self, keys: Iterable[BlockKey]) -> dict[BlockKey, bytes]:
        """The blocks among ``keys`` that the cache holds."""
        found: dict[BlockKey, bytes] = {}
        to_read: list[BlockKey] = []
        held: dict[BlockKey, int] = {}  # the int key of each held one
        for block_key in keys:
            key = self.keys.key(*block_key)
            if key not in self.policy:
                continue
            held[block_key] = key
            data = self._ops.get(key, self._writing.get(key))
            if data is not None:
                found[block_key] = data
            else:
                to_read.append(block_key)
        if to_read:
            stored, corrupt = await self._reader.run(self.store.get_many, to_read)
            found.update(stored)
            for block_key in corrupt:
                log.error("cache block %s failed its checksum; dropping it", block_key)
                metrics.CACHE_CORRUPT_BLOCKS.inc()
                key = held[block_key]
                self.policy.remove(key)
                self._record(key, _DELETED)
                self._dropped(key)
            self._update_gauges()
        self._touch([held[block_key] for block_key in found])
        return found

    def put(self, key: BlockKey, data: bytes) -> None:
        """Hold a verified block; evicts least recently used blocks past capacity."""
        file_id, version, block = key
        self.put_run(file_id, version, block, [data])

    def put_run(self, file_id: int, version: int, first: int, blocks: list[bytes]) -> None:
        """``put`` of the consecutive blocks of one file version from ``first``, the bookkeeping
        done once for the run: a fetch that lands is a run of up to a request's
        ``MAX_READ_BLOCKS``, and a ``put`` each (a gauge update, a wake-up of the writer, a
        stamp) was a sizeable part of landing it."""
        keys = self.keys.run(file_id, version, first, len(blocks))
        if self._packed and keys:  # blocks put again: rarely, but their extent goes
            for extent in self._extents_of(keys):
                self._unpack(extent)
        evicted = self.policy.insert_many(list(zip(keys, map(len, blocks))), self._spared)
        if evicted:
            metrics.CACHE_EVICTIONS.inc(len(evicted))
            for old in evicted:
                self._record(old, _DELETED)
                self._dropped(old)
        holds = self.policy.holds
        held = [(key, data) for key, data in zip(keys, blocks) if holds(key)]
        if self._stale:  # a new put replaces the row the failed batch may have left
            for key, _ in held:
                self._stale.pop(key, None)
        self._ops.update(held)
        for key, _ in held:
            self._addresses.pop(key, None)
        self._stamp([key for key, _ in held])
        self._work.set()
        self._update_gauges()

    async def run_writer(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write batches forever; start it in the daemon's nursery."""
        task_status.started()
        while True:
            await self._work.wait()
            if self._pending_stamps() < STAMPS_PENDING_MAX:
                await trio.sleep(FLUSH_INTERVAL)
            await self._write_one_batch()

    async def _write_one_batch(self) -> None:
        async with self._write_lock:
            await self._write_locked()

    async def _write_locked(self) -> None:
        batch = dict(itertools.islice(self._ops.items(), MAX_BATCH_OPS))
        for key in batch:
            del self._ops[key]
        stamps = self._take_stamps(batch)
        if not batch and not stamps and not self._stale and not self._unpacked:
            self._work = trio.Event()
            return
        self._writing = batch
        # Puts in key order: LMDB gives each head its page as it is put, so the blocks of one
        # file in a batch lie in the cache file side by side in block order, not in the order
        # their fetches landed (interleaved); a later warm read of them from the disk, or a
        # page-in, then asks for a few long stretches rather than many short ones.
        puts = {k: batch[k] for k in sorted(batch) if batch[k] is not _DELETED}
        deletes = [k for k, v in batch.items() if v is _DELETED]
        stale = [k for k in self._stale if k not in batch]
        deletes += stale
        self._stale = {}
        unpacked, self._unpacked = list(self._unpacked), {}
        metrics.CACHE_WRITE_OPS.observe(len(batch) + len(stale))
        try:
            with metrics.CACHE_WRITE_SECONDS.time():
                written, extents = await trio.to_thread.run_sync(
                    self._write_batch, puts, deletes, stamps, unpacked)
        except CacheWriteError as exc:
            self._drop_unwritten(puts, deletes, exc)
            # It may have stored extents, or not deleted those it was to.
            self._unpacked.update(dict.fromkeys([*unpacked, *whole_extents(puts)]))
        else:
            # A key changed again meanwhile (evicted, say) has its new op queued: that write
            # will move or free the value, so its address is not worth keeping. (The writer
            # put the others' addresses in their stamp rows, for the next mount.)
            self._addresses.update((k, a) for k, a in written.items()
                                   if k not in self._ops and k in self.policy)
            self._packed.update(extents)
            self._check_packed(extents)
        finally:
            self._writing = {}
        if not self._ops and self._pending_stamps() < STAMPS_PENDING_MAX:
            self._work = trio.Event()

    def _take_stamps(self, batch: dict[int, bytes | None]) -> dict[int, int]:
        """The next batch's stamps by key: those of the blocks ``batch`` puts, then the oldest
        other pending ones, up to ``MAX_BATCH_STAMPS`` more, taken in bulk (C loops) since it
        runs on the event loop.

        A stamp row goes with its block's put, never before it: ``BlockStore.index`` reads the
        stamps alone, so a block put without its row would never be counted or evicted again,
        and a row without its block would count one that is not there. The stamps of keys
        whose change waits for a later batch wait too.
        """
        pending = self._stamps
        own = {key: pending.pop(key) for key in batch.keys() & pending.keys()}
        self._settle_runs(MAX_BATCH_STAMPS)  # the runs' are younger than any in ``pending``
        taken = dict(itertools.islice(pending.items(), MAX_BATCH_STAMPS))
        deque(map(pending.__delitem__, taken), maxlen=0)
        for key in taken.keys() & self._ops.keys():
            pending[key] = taken.pop(key)
        taken.update(own)
        return taken

    def _write_batch(self, puts: dict[int, bytes], deletes: list[int], stamps: dict[int, int],
                     unpacked: Sequence[int] = ()) -> tuple[dict[int, int], list[int]]:
        """``writer.write_batch``, in a worker thread: the stamp rows ``(stamp, size, address)``
        are made here, off the event loop, by point look-ups into what the loop keeps changing.
        A key evicted meanwhile gets no row, unless this batch puts its block: then the row
        goes with it (a later batch deletes both). Returns where the puts lie and the extents
        the batch stored (``whole_extents``, found here too)."""
        sizes, located = self.policy.sizes, self._addresses
        rows = {}
        for key, stamp in stamps.items():
            size = sizes.get(key)
            if size is None:
                if key not in puts:
                    continue
                size = len(puts[key])
            rows[key] = (stamp, size, located.get(key))
        extents = whole_extents(puts)
        written = self.writer.write_batch(puts, deletes, rows, extents, unpacked)
        if extents and not written.extents:
            metrics.CACHE_EXTENTS_REFUSED.inc(len(extents))
            return written.addresses, []
        return written.addresses, extents

    def _drop_unwritten(self, puts: dict[int, bytes], deletes: list[int],
                        exc: Exception) -> None:
        """A batch failed (disk or map full, or the writer died, maybe after its commit): forget
        its blocks so they are simply re-fetched, and have the next batch delete them and the
        batch's evicted blocks from LMDB, whichever way this one ended, so the cache file never
        keeps blocks the cache does not count against its size. They ride along with the next
        batch rather than wake the writer: on a full disk that would retry without end."""
        metrics.CACHE_WRITE_ERRORS.inc()
        log.error("cache write of %d blocks failed (%s); they will be fetched again",
                  len(puts), exc)
        for key in puts:
            if key not in self._ops and self.policy.remove(key):
                self._dropped(key)
        self._stale.update((key, None) for key in itertools.chain(puts, deletes)
                           if key not in self._ops and not self.policy.holds(key))
        self._update_gauges()

    async def flush(self) -> None:
        """Wait until everything put so far is on disk (used at shutdown and by tests); rows a
        failed batch may have left get one more try."""
        while self._ops or self._stamps or self._stamp_runs:
            await self._write_one_batch()
        if self._stale or self._unpacked:
            await self._write_one_batch()

    def close(self) -> None:
        self.writer.close()
        self._reader.close()
        self._pager.close()
        self.store.close()
