"""The on-disk half of the block cache: LMDB on local NVMe, written by the cache's writer process.

Keys are ``(file id, version, block)`` packed big-endian, so one file version's blocks sit
together in key order; a new version of a file has new keys, so its old blocks can never be
served for it. Each block is stored with its checksum, checked again on every read, so a
damaged cache file costs a re-fetch, never wrong bytes.

A block is kept in two tables under its key: the ``blocks`` table holds its checksum and its
first ``HEAD_BYTES``, the ``tails`` table its last few bytes. LMDB stores a value larger than
about half a page on overflow pages of its own behind a 16-byte header, so a whole 4 KiB block
with its checksum took two 4 KiB pages, the second holding 24 bytes: the cache file was twice
the data, and every block written or read from disk moved 8 KiB. The head fills exactly one
page; the tails, 24 bytes each, share leaf pages like the stamp rows do.

An extent, ``EXTENT_BLOCKS`` whole blocks from an aligned block number put in one batch (a
fetch or a prefetch window landing), is kept the same way as one value: in the ``extents``
table its checksum and first bytes, 16 pages exactly, in ``extent_tails`` the rest and its
blocks' own checksums, both under the key of its first block; its blocks have no rows of their
own in ``blocks`` and ``tails``. A warm read of whole extents then steps LMDB's cursors, makes
objects and checks a checksum once per 64 KiB, not once per 4 KiB, which was most of the
daemon's CPU time per 1 MiB read (docs/throughput.md, session 51); a read of part of one (a
random 16 KiB read) checks and copies only its blocks. Which extents are stored so is the
cache's to say (``BlockCache``): it asks for them in ``write_batch`` and names them in each
read.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import os
import struct
from typing import Any, Iterable, NamedTuple, Sequence

import lmdb
import xxhash

from fabric.checksum import block_checksum, range_checksums
from fabric.protocol import CHECKSUM_BYTES
from neuralcache.blocks import BLOCK_SIZE, block_count

from .lmdb_pages import DATA_FILE, page_in_tables
from .residency import ResidencyProbe, buffer_address, will_need, will_need_limit

log = logging.getLogger(__name__)

_KEY = struct.Struct(">QQQ")
_STAMP = struct.Struct(">Q")
"""A last-use row as older caches wrote it: the stamp alone (the block's size not kept)."""
_STAMP_ROW = struct.Struct(">QIQ")
"""A last-use row: the stamp, the block's size and where its value starts in the cache file (0:
not known yet), so that the index is read from this table alone (see ``index``)."""
_CHECKSUM = struct.Struct(">Q")
"""A stored checksum as an int: ``block_checksum`` is xxh3-64 packed this way, and comparing
ints saves a bytes object per block on the range read."""

_BLOCK_PART = operator.itemgetter(slice(CHECKSUM_BYTES, None))  # a head's block bytes
_FIRST = operator.itemgetter(0)

OVERFLOW_PAGE = 4096
"""The LMDB page (x86-64's) a head is cut to fill. A constant of the format, so that a block
splits the same way on every node."""
OVERFLOW_HEADER = 16
"""Bytes LMDB puts before an overflow value in its first page (``PAGEHDRSZ``)."""
VALUE_BYTES = OVERFLOW_PAGE - OVERFLOW_HEADER
"""A stored head: the checksum, then the block's first ``HEAD_BYTES``; what the map holds of a
block where its address points (one page, for ``mincore`` and ``madvise``)."""
HEAD_BYTES = VALUE_BYTES - CHECKSUM_BYTES
"""Bytes of a block in its head; the rest (24 bytes of a whole block, none of a last block this
short) is its tail."""
TABLE_BYTES_PER_BLOCK = 512
"""Map room per block beyond its head page: its key in the blocks table's leaves, its tail and
its stamp row (~50 bytes each on leaf pages at least half full), with room to spare."""
MAP_SLACK = 64 * 1024 * 1024
"""Room beyond that for LMDB's branch pages and free-page bookkeeping."""
LMDB_FILES = (DATA_FILE, "lock.mdb")
"""What LMDB keeps in the cache's directory."""


class BlockKey(NamedTuple):
    file_id: int
    version: int
    block: int

    def pack(self) -> bytes:
        return _KEY.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> "BlockKey":
        return cls(*_KEY.unpack(raw))


RunBytes = bytes | memoryview
"""A run's bytes as a read returns them: a view into the joined extents when the run starts or
ends inside one (a data loader's 1 MiB reads start at its samples' offsets, and slicing the
run out of the join copied it a second time, docs/throughput.md, session 56), else the joined
bytes themselves. Either way one contiguous buffer, which pyfuse3 replies with as is."""

KeyTuple = tuple[int, int, int]
"""A block key as a plain tuple, equal to the ``BlockKey`` it names (cheaper to make)."""


class Written(NamedTuple):
    """What ``write_batch`` did: where each put block now lies in the map (by key), and
    whether the batch's extents were stored as such (else every block on its own)."""

    addresses: dict[Any, int]
    extents: bool


class IndexEntry(NamedTuple):
    key: KeyTuple
    size: int
    stamp: int
    address: int | None  # of the value in this process's map, if its row says where it lies


EXTENT_BLOCKS = 16
"""Blocks of an extent (64 KiB): a 1 MiB read steps 16 values, not 256; few enough that a
cache file that has been evicting still has 16 free pages side by side for a new one, and
that a block evicted takes little else with it."""
EXTENT_BYTES = EXTENT_BLOCKS * BLOCK_SIZE
EXTENT_VALUE_BYTES = EXTENT_BLOCKS * OVERFLOW_PAGE - OVERFLOW_HEADER
"""A stored extent's value, checksum first: its 16 pages exactly."""
EXTENT_HEAD_BYTES = EXTENT_VALUE_BYTES - CHECKSUM_BYTES
"""Bytes of an extent in its value; the last 24 are its tail."""
EXTENT_TAIL_BYTES = EXTENT_BYTES - EXTENT_HEAD_BYTES
_EXTENT_SUMS = struct.Struct(f">{EXTENT_BLOCKS}Q")
"""Its blocks' checksums, kept after its tail (``extent_tails``), so that a read of part of an
extent (a random 16 KiB read) checks and copies only the blocks it reads."""
EXTENT_TAIL_ROW_BYTES = EXTENT_TAIL_BYTES + _EXTENT_SUMS.size

BLOCKS_TABLE, TAILS_TABLE, STAMPS_TABLE = b"blocks", b"tails", b"stamps"
EXTENTS_TABLE, EXTENT_TAILS_TABLE = b"extents", b"extent_tails"
TREE_RAM_SHARE = 16
"""At mount, the trees of the tables (``page_in_trees``) are read ahead up to this share of the
machine's RAM: 1/16, so a cache of about 20x the RAM has them all (they take ~4 % of the file)."""


def map_size_for(capacity: int) -> int:
    """LMDB map size that holds ``capacity`` bytes of blocks."""
    page = max(os.sysconf("SC_PAGE_SIZE"), OVERFLOW_PAGE)  # LMDB's page is the machine's
    return block_count(capacity) * (page + TABLE_BYTES_PER_BLOCK) + MAP_SLACK


DISK_OVERHEAD = 0.05
"""What a full cache file takes on disk beyond its blocks' bytes, as a share of them: 281 MB of
file for 268 MB of blocks (``python -m bench.mount_index``)."""


def disk_shortfall(capacity: int, file_bytes: int, free_bytes: int) -> int:
    """Bytes a full cache of ``capacity`` would lack on disk, given its file's size now and the
    free space beside it (0 if it fits)."""
    return max(0, int(capacity * (1 + DISK_OVERHEAD)) - file_bytes - free_bytes)


def _map_base(data_file: str) -> int | None:
    """Start of this process's one mapping of ``data_file`` at offset 0 (``/proc/self/maps``),
    or None if there is not exactly one."""
    path, inode = os.path.realpath(data_file), os.stat(data_file).st_ino
    starts = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if (len(fields) == 6 and int(fields[2], 16) == 0 and int(fields[4]) == inode
                        and fields[5].rstrip("\n") == path):
                    starts.append(int(fields[0].split("-")[0], 16))
    except OSError:  # no /proc: places are learnt by reads within each mount
        return None
    return starts[0] if len(starts) == 1 else None


def extent_of(block: int) -> int:
    """The first block of the extent that holds ``block`` (also of an int key of
    ``key_space``, whose file versions start at multiples of ``EXTENT_BLOCKS``)."""
    return block - block % EXTENT_BLOCKS


def _extent_block_addresses(address: int) -> range:
    """Where each block of the extent whose value lies at ``address`` is placed (see
    ``_head_addresses``)."""
    return range(address, address + EXTENT_BYTES, BLOCK_SIZE)


def _walk_run(txn: lmdb.Transaction, db: lmdb._Database, file_id: int, version: int,
              first: int, count: int, step: int = 1) -> list[memoryview] | None:
    """Views of the ``count`` values in ``db`` (heads or tails) keyed ``first``, ``first +
    step``, ..., or None unless all of them are stored. Valid only inside ``txn``."""
    cursor = txn.cursor(db)
    if not cursor.set_key(_KEY.pack(file_id, version, first)):
        return None
    values = list(itertools.islice(cursor.iternext(keys=False), count))
    # Keys are unique and sorted, and a table holds keys at multiples of `step` only: `count`
    # values from the first key to the expected last one are exactly the run, none missing.
    last = first + step * (count - 1)
    if len(values) != count or cursor.key() != _KEY.pack(file_id, version, last):
        return None
    return values


class _DamagedExtent(Exception):
    """A stored extent's value or row is not the length of one, or a block read of it fails
    its own checksum."""


class _Segment(NamedTuple):
    """Part of a run that one cursor walk per table reads: ``values`` extents from block
    ``first`` if ``packed``, else ``values`` blocks."""

    first: int
    values: int
    packed: bool


def _segments(first: int, end: int, extents: Sequence[int]) -> list[_Segment]:
    """Blocks ``[first, end)`` as walks: the stored extents among them (their first blocks,
    sorted, each holding a block of the run), consecutive ones in one walk, and the blocks
    between them."""
    segments: list[_Segment] = []
    at = first
    for extent in extents:
        if extent > at:
            segments.append(_Segment(at, extent - at, False))
        last = segments[-1] if segments else None
        if last is not None and last.packed and last.first + last.values * EXTENT_BLOCKS == extent:
            segments[-1] = last._replace(values=last.values + 1)
        else:
            segments.append(_Segment(extent, 1, True))
        at = extent + EXTENT_BLOCKS
    if at < end:
        segments.append(_Segment(at, end - at, False))
    return segments


def _head_addresses(heads: list[memoryview], segments: list[_Segment]) -> list[int]:
    """Where each block of walked ``segments`` lies in the map (for ``read_run_resident``): a
    block on its own at its value; one of an extent a page further into the extent's value for
    each block before it, so that ``VALUE_BYTES`` from each of the extent's blocks cover its
    pages, no others: a read that reads part of an extent has all of them checked."""
    addresses = list(map(buffer_address, heads))
    if not any(segment.packed for segment in segments):
        return addresses
    spread: list[int] = []
    at = 0
    for segment in segments:
        values = addresses[at:at + segment.values]
        at += segment.values
        if not segment.packed:
            spread += values
            continue
        for address in values:
            spread += _extent_block_addresses(address)
    return spread


def _join_verified(heads: list[memoryview], tails: list[memoryview]) -> bytes | None:
    """The blocks of stored ``heads`` and ``tails`` joined, or None if any fails its checksum.

    Slices, hashes and stored checksums are produced by ``map`` over the run, in C: per block
    a Python-level loop cost about as much as hashing the block itself. The run is joined
    first, with each head's bytes followed by its tail's, and each block hashed where it lies
    in the joined bytes: a run of whole blocks at every ``BLOCK_SIZE`` (if a damaged head or
    tail shifted the bytes of one, they fail its checksum), else where the lengths say.
    """
    try:
        stored = list(map(_FIRST, map(_CHECKSUM.unpack_from, heads)))
    except struct.error:  # a damaged head shorter than its checksum
        return None
    parts = list(map(_BLOCK_PART, heads))
    joined = b"".join(itertools.chain.from_iterable(zip(parts, tails)))
    if len(joined) == len(heads) * BLOCK_SIZE:
        slices = _whole_block_slices(len(heads))
    else:
        ends = list(itertools.accumulate(map(operator.add, map(len, parts), map(len, tails))))
        slices = list(map(slice, [0, *ends[:-1]], ends))
    with memoryview(joined) as view:
        if list(map(xxhash.xxh3_64_intdigest, map(view.__getitem__, slices))) != stored:
            return None
    return joined


@functools.lru_cache(maxsize=512)
def _whole_block_slices(count: int) -> list[slice]:
    """Where each of ``count`` whole blocks lies in their joined bytes (a read's run is at most
    a few hundred blocks long: one list per length, made once)."""
    return [slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(count)]


def _trimmed(data: bytes, skip: int, count: int) -> RunBytes:
    """``count`` blocks of ``data`` after its first ``skip`` (a run read with the whole of the
    extents at its ends): a view, not a copy."""
    start = skip * BLOCK_SIZE
    if start == 0 and len(data) <= count * BLOCK_SIZE:
        return data
    return memoryview(data)[start:start + count * BLOCK_SIZE]


class BlockStore:
    """Blocks and their last-use stamps in one LMDB environment."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        os.makedirs(path, exist_ok=True)
        self._open(path, capacity)
        old = self._old_format_blocks()
        if old:
            # Emptying it in place would walk every page and keep the file's size; a new file
            # costs nothing and gives the disk back.
            self.env.close()
            for name in LMDB_FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(path, name))
            self._open(path, capacity)
            log.warning("the cache in %s was written by an older NeuralCache (two pages per "
                        "block); removed it (%d blocks), they will be fetched again", path, old)
        self._thread_probe = ResidencyProbe()
        data_file = os.path.join(path, DATA_FILE)
        self.will_need_bytes = will_need_limit(data_file)
        """The most one ``will_need`` call reads of the cache file (``will_need_limit``)."""
        self.map_base = _map_base(data_file)
        """Where LMDB mapped the cache file in this process, to turn a value's address into
        its offset in the file (which holds across mounts) and back; None if not found."""

    def _open(self, path: str, capacity: int) -> None:
        # sync=False: a cache may lose its last batches on power loss; checksums catch damage.
        self.env = lmdb.open(path, map_size=map_size_for(capacity), max_dbs=5, sync=False,
                             metasync=False, readahead=False, max_readers=256)
        self._blocks = self.env.open_db(BLOCKS_TABLE)
        self._stamps = self.env.open_db(STAMPS_TABLE)
        self._tails = self.env.open_db(TAILS_TABLE)
        self._extents = self.env.open_db(EXTENTS_TABLE)
        self._extent_tails = self.env.open_db(EXTENT_TAILS_TABLE)

    def _old_format_blocks(self) -> int:
        """How many blocks a cache written before blocks had tails holds (each block on two
        pages, see the module docstring; its values do not read as heads), 0 for any other.
        Every block is written with its tail in one transaction, so blocks without a single
        tail are such a cache."""
        with self.env.begin() as txn:
            blocks: int = txn.stat(self._blocks)["entries"]
            return blocks if blocks and not txn.stat(self._tails)["entries"] else 0

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    def _walk(self, txn: lmdb.Transaction, file_id: int, version: int,
              segments: list[_Segment]) -> tuple[list[memoryview], list[memoryview]] | None:
        """The heads and the tails of ``segments`` (``_segments``), or None unless all of them
        are stored; raises ``_DamagedExtent``. Valid only inside ``txn``."""
        heads: list[memoryview] = []
        tails: list[memoryview] = []
        for first, values, packed in segments:
            step = EXTENT_BLOCKS if packed else 1
            db_heads, db_tails = ((self._extents, self._extent_tails) if packed
                                  else (self._blocks, self._tails))
            walked = _walk_run(txn, db_heads, file_id, version, first, values, step)
            if walked is None:
                return None
            # The checksum alone would pass a value cut short together with its stored one.
            if packed and any(len(head) != EXTENT_VALUE_BYTES for head in walked):
                raise _DamagedExtent
            heads += walked
            walked = _walk_run(txn, db_tails, file_id, version, first, values, step)
            if walked is None:
                return None
            if packed:
                if any(len(row) != EXTENT_TAIL_ROW_BYTES for row in walked):
                    raise _DamagedExtent
                walked = [row[:EXTENT_TAIL_BYTES] for row in walked]
            tails += walked
        return heads, tails

    def _read_part(self, txn: lmdb.Transaction, file_id: int, version: int, extent: int,
                   first: int, count: int) -> tuple[bytes, memoryview] | None:
        """Blocks ``[first, first + count)``, part of the stored extent from block ``extent``,
        each checked against its own checksum, and the extent's head; None if the extent is not
        stored; raises ``_DamagedExtent`` if it or a block read fails its check."""
        key = _KEY.pack(file_id, version, extent)
        head = txn.get(key, db=self._extents)
        row = txn.get(key, db=self._extent_tails)
        if head is None or row is None:
            return None
        if len(head) != EXTENT_VALUE_BYTES or len(row) != EXTENT_TAIL_ROW_BYTES:
            raise _DamagedExtent
        skip = first - extent
        start = CHECKSUM_BYTES + skip * BLOCK_SIZE
        if skip + count < EXTENT_BLOCKS:
            data = bytes(head[start:start + count * BLOCK_SIZE])
        else:
            data = b"".join((head[start:], row[:EXTENT_TAIL_BYTES]))
        stored = list(_EXTENT_SUMS.unpack_from(row, EXTENT_TAIL_BYTES)[skip:skip + count])
        with memoryview(data) as view:
            if list(map(xxhash.xxh3_64_intdigest,
                        map(view.__getitem__, _whole_block_slices(count)))) != stored:
                raise _DamagedExtent
        return data, head

    def read_part(self, file_id: int, version: int, extent: int, first: int, count: int
                  ) -> bytes | None:
        """Blocks ``[first, first + count)`` inside the stored extent from block ``extent``,
        each checked against its own checksum; None if the extent is not stored or fails a
        check (``read_run`` and ``get_many`` then sort out which)."""
        with self.env.begin(buffers=True) as txn:
            try:
                part = self._read_part(txn, file_id, version, extent, first, count)
            except _DamagedExtent:
                return None
        return None if part is None else part[0]

    def get_many(self, keys: Iterable[BlockKey]) -> tuple[dict[BlockKey, bytes], list[BlockKey]]:
        """Blocks found (verified), and keys whose stored bytes failed their checksum. A block
        of an extent is checked against its own checksum, as a block on its own is."""
        found: dict[BlockKey, bytes] = {}
        corrupt: list[BlockKey] = []
        with self.env.begin(buffers=True) as txn:
            for key in keys:
                packed = key.pack()
                head = txn.get(packed, db=self._blocks)
                if head is None:
                    file_id, version, block = key
                    try:
                        part = self._read_part(txn, file_id, version, extent_of(block), block, 1)
                    except _DamagedExtent:
                        corrupt.append(key)
                        continue
                    if part is not None:
                        found[key] = part[0]
                    continue
                tail = txn.get(packed, db=self._tails)
                data = bytes(head[CHECKSUM_BYTES:]) + (b"" if tail is None else bytes(tail))
                if tail is not None and block_checksum(data) == bytes(head[:CHECKSUM_BYTES]):
                    found[key] = data
                else:
                    corrupt.append(key)
        return found, corrupt

    def _read(self, txn: lmdb.Transaction, file_id: int, version: int, first: int, count: int,
              extents: Sequence[int]) -> tuple[RunBytes, list[memoryview], list[_Segment]] | None:
        """The run's blocks verified, with its walk's heads and segments (for their places)."""
        if (len(extents) == 1 and count < EXTENT_BLOCKS and extents[0] <= first
                and first + count <= extents[0] + EXTENT_BLOCKS):
            try:
                part = self._read_part(txn, file_id, version, extents[0], first, count)
            except _DamagedExtent:
                return None
            return None if part is None else (part[0], [part[1]], [_Segment(extents[0], 1, True)])
        segments = (_segments(first, first + count, extents) if extents
                    else [_Segment(first, count, False)])
        try:
            walked = self._walk(txn, file_id, version, segments)
        except _DamagedExtent:
            return None
        data = None if walked is None else _join_verified(*walked)
        if data is None or walked is None:
            return None
        skip = first - segments[0].first
        return _trimmed(data, skip, count), walked[0], segments

    def read_run_located(self, file_id: int, version: int, first: int, count: int,
                         extents: Sequence[int] = ()) -> tuple[RunBytes, list[int]] | None:
        """``read_run``, and where each block lies in the map (``read_run_resident`` needs
        that; the index does not read it, see ``index``): each block of the run widened to
        its ``extents``' ends."""
        with self.env.begin(buffers=True) as txn:
            read = self._read(txn, file_id, version, first, count, extents)
            return None if read is None else (read[0], _head_addresses(read[1], read[2]))

    def read_run(self, file_id: int, version: int, first: int, count: int,
                 addresses: list[int] | None = None, length: int = VALUE_BYTES,
                 extents: Sequence[int] = ()) -> RunBytes | None:
        """Blocks ``[first, first + count)`` of one file version joined, each checksum verified,
        or None unless every one of them is stored and intact (``get_many`` then sorts out which).
        ``extents`` are the first blocks of the stored extents that hold blocks of the run,
        sorted (the cache knows them): each is read whole and checked with its one checksum,
        but for a run within one extent, whose blocks are checked with their own.

        One read transaction and a cursor walk over the neighbouring keys in each table (heads,
        then tails), the values taken as views of LMDB's map and copied once, by the join: per
        block this costs a fraction of a ``get`` and a ``bytes`` copy (``python -m
        bench.read_path_costs``). ``addresses``, where the heads lie if known (or, with
        ``length``, one stretch of the map that holds them: ``residency.run_stretch``), are handed
        to the kernel first if any of their pages is not in RAM (``will_need``): the map is read
        without readahead, so a walk over pages on disk would fault them in one at a time
        (sequential 16 KiB reads of a warm spoke whose cache file is on disk: 33 -> 346 MB/s,
        ``bench.throughput --quick``). Called from one thread at a time (the cache's reader
        thread), which ``_thread_probe`` is for.
        """
        if count <= 0:
            return b""
        if addresses and not self._thread_probe.all_resident(addresses, length):
            will_need(addresses, length, self.will_need_bytes)
        with self.env.begin(buffers=True) as txn:
            read = self._read(txn, file_id, version, first, count, extents)
            return None if read is None else read[0]

    def read_run_resident(self, file_id: int, version: int, first: int, count: int,
                          addresses: list[int], probe: ResidencyProbe,
                          extents: Sequence[int] = ()) -> RunBytes | None:
        """``read_run``, but only if no page of the run's heads needs the disk; else None.
        ``addresses`` must then cover the whole of the ``extents`` the run reads.

        For the event loop, which must never wait for the disk. ``addresses`` are where the
        run's values were when they were last written or read in a thread (``write_batch``,
        ``read_run_located``); their pages are checked with ``probe`` (``mincore``) before the walk,
        because py-lmdb touches every page of a value inside the cursor step that finds it
        (its ``preload``, done with the GIL released so that other threads run meanwhile).
        A stale address can only make the check look at the wrong pages: the bytes still come
        from the walk, checksum-verified. The walk also reads LMDB's branch and leaf pages, the
        tails' among them; they are a small part of the map (one leaf holds the keys or the
        tails of ~60-100 blocks), read ahead at mount (``page_in_trees``) and descended by
        every lookup and every write batch, so they stay in the page cache while the heads they
        point to come and go. None also
        for a run not wholly stored or damaged: the caller then takes the path that may wait,
        which sorts that out.
        """
        if count <= 0:
            return b""
        if not probe.all_resident(addresses, VALUE_BYTES):
            return None
        return self.read_run(file_id, version, first, count, extents=extents)

    def write_batch(self, puts: dict[BlockKey, bytes], deletes: Iterable[BlockKey],
                    stamps: dict[BlockKey, tuple[int, int, int | None]],
                    extents: Sequence[BlockKey] = (), unpacked: Iterable[BlockKey] = ()
                    ) -> Written:
        """Apply one batch in one write transaction (all or nothing); returns where in the map
        each put block now lies (see ``read_run_resident``) and whether its extents were
        stored. ``stamps`` maps a key to its last-use stamp, its block's size and its value's
        address if known. A put's address is known only once its transaction is committed: a
        second one records it in the stamp row the batch gives the put. A key's stamp row
        must be written with or after its block, so every row stands for a stored block.

        ``extents``, keys of first blocks, are stored as extents, their ``EXTENT_BLOCKS``
        blocks taken from ``puts`` (whole blocks, all of them); ``unpacked`` extents are
        deleted first (their blocks are ``deletes`` or ``puts`` of this batch or were of an
        earlier one). If the map has no room left for an extent's 16 pages side by side, the
        batch is written again with every block on its own (a freed page each is enough)."""
        deletes, unpacked = list(deletes), list(unpacked)  # a second try walks them again
        try:
            self._write(puts, deletes, stamps, extents, unpacked)
        except lmdb.MapFullError:
            if not extents:
                raise
            log.warning("no room in the cache file for %d extents of %d pages; their blocks "
                        "are stored one by one", len(extents), EXTENT_BLOCKS)
            extents = ()
            self._write(puts, deletes, stamps, extents, unpacked)
        addresses = {}
        # A write transaction holds its pages in its own memory; after the commit they are
        # in the map, where readers find them (pages just written: in the page cache).
        with self.env.begin(buffers=True) as txn:
            for first in extents:
                value = txn.get(_KEY.pack(*first), db=self._extents)
                if value is not None:
                    file_id, version, block = first
                    places = _extent_block_addresses(buffer_address(value))
                    for i, place in enumerate(places):
                        addresses[BlockKey(file_id, version, block + i)] = place
            for key in puts:
                if key not in addresses:
                    value = txn.get(_KEY.pack(*key), db=self._blocks)
                    if value is not None:
                        addresses[key] = buffer_address(value)
        base = self.map_base
        placed = [(key, address) for key, address in addresses.items() if key in stamps]
        if placed and base is not None:
            with self.env.begin(write=True, db=self._stamps) as txn:
                for key, address in placed:
                    stamp, size, _ = stamps[key]
                    txn.put(_KEY.pack(*key), _STAMP_ROW.pack(stamp, size, address - base))
        return Written(addresses, bool(extents))

    def _write(self, puts: dict[BlockKey, bytes], deletes: Iterable[BlockKey],
               stamps: dict[BlockKey, tuple[int, int, int | None]],
               extents: Sequence[BlockKey], unpacked: Iterable[BlockKey]) -> None:
        """``write_batch``'s transaction."""
        with self.env.begin(write=True) as txn:
            for first in unpacked:
                packed = _KEY.pack(*first)
                txn.delete(packed, db=self._extents)
                txn.delete(packed, db=self._extent_tails)
            in_extents: set[BlockKey] = set()
            loose = txn.cursor(self._blocks)
            for file_id, version, block in extents:
                keys = [BlockKey(file_id, version, b) for b in range(block, block + EXTENT_BLOCKS)]
                data = b"".join([puts[key] for key in keys])
                if block % EXTENT_BLOCKS or len(data) != EXTENT_BYTES:
                    raise ValueError(f"not an extent: {EXTENT_BLOCKS} whole blocks of file "
                                     f"{file_id} from block {block}")
                packed = _KEY.pack(file_id, version, block)
                txn.put(packed, block_checksum(data) + data[:EXTENT_HEAD_BYTES], db=self._extents)
                txn.put(packed, data[EXTENT_HEAD_BYTES:] + range_checksums(data),
                        db=self._extent_tails)
                in_extents.update(keys)
                # Rows a block put again may have of its own (one seek finds that there are none).
                end = _KEY.pack(file_id, version, block + EXTENT_BLOCKS)
                while loose.set_range(packed) and loose.key() < end:
                    txn.delete(loose.key(), db=self._tails)
                    loose.delete()
            for key, data in puts.items():
                if key in in_extents:
                    continue
                packed = _KEY.pack(*key)
                txn.put(packed, block_checksum(data) + data[:HEAD_BYTES], db=self._blocks)
                txn.put(packed, data[HEAD_BYTES:], db=self._tails)
            for key in deletes:
                packed = _KEY.pack(*key)
                txn.delete(packed, db=self._blocks)
                txn.delete(packed, db=self._tails)
                txn.delete(packed, db=self._stamps)
            base = self.map_base
            for key, (stamp, size, address) in stamps.items():
                offset = 0  # not known: the row still stands for the block
                if address is not None and base is not None and address > base:
                    offset = address - base
                txn.put(_KEY.pack(*key), _STAMP_ROW.pack(stamp, size, offset), db=self._stamps)

    def page_in_trees(self) -> int:
        """Have the kernel read the trees of the stamp, extent and block tables (not their
        values' own pages) from the disk at once (``lmdb_pages``; at most ``1 /
        TREE_RAM_SHARE`` of the RAM); returns the pages asked for. The index walk that follows,
        and the first lookups of each block after a mount over a cache file not in memory, then
        find them there, rather than fault them in a page at a time: those lookups are made on
        the event loop for the runs it reads itself (``read_run_resident``, which checks the
        values' pages only)."""
        budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // TREE_RAM_SHARE
        return page_in_tables(self.env, [STAMPS_TABLE, EXTENTS_TABLE, EXTENT_TAILS_TABLE,
                                         BLOCKS_TABLE, TAILS_TABLE],
                              budget // self.env.stat()["psize"], self.will_need_bytes)

    def extents(self) -> list[BlockKey]:
        """The stored extents, by the key of their first block (read from ``extent_tails``,
        whose rows share leaf pages: the extents' own pages are not touched)."""
        with self.env.begin(db=self._extent_tails, buffers=True) as txn:
            return [BlockKey.unpack(bytes(raw)) for raw in txn.cursor().iternext(values=False)]

    def index(self) -> list[IndexEntry]:
        """Every cached block with its size, last-use stamp and value address (where its row
        records one), least recently used first.

        Read from the stamp table alone. Stepping a cursor over the blocks themselves makes
        LMDB read the first page of every value: a mount read its whole cache file (a 256 MiB
        cache: 544 MB paged in and 8.3 s, ``python -m bench.mount_index``). A row from an
        older cache holds only the stamp: its block counts as a whole one, its place unknown.
        """
        base = self.map_base
        end = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        entries: list[IndexEntry] = []
        with self.env.begin(db=self._stamps, buffers=True) as txn:
            for raw_key, raw in txn.cursor():
                if len(raw) == _STAMP_ROW.size:
                    stamp, size, offset = _STAMP_ROW.unpack(raw)
                else:
                    (stamp,), size, offset = _STAMP.unpack(raw), BLOCK_SIZE, 0
                address = base + offset if base is not None and 0 < offset < end else None
                entries.append(IndexEntry(_KEY.unpack(raw_key), size, stamp, address))
        entries.sort(key=lambda e: e.stamp)
        return entries
