"""Clairvoyance: the training job announces its upcoming read order to the mount.

Wire format of the control file ``MOUNT/.neuralcache/hints`` (write-only): a byte stream of
records, each a 4-byte big-endian length followed by that many bytes of one msgpack map::

    {"v": 1, "epoch": int, "source": str, "items": [[path, offset, length], ...], "exact": bool}

``path`` is relative to the mount root; ``source`` names the announcer (a rank) so several
samplers' orders stay separate sequences; records with the same source and epoch append to one
another in order, so one epoch may span many records and many writes. ``exact`` (optional, false
when absent) says the job reads these files only with read calls of the announced ranges, never
through ``mmap``, so the mount may hand it exactly those reads, without the kernel's readahead.
A record may be split across writes (the kernel cuts large writes), so the mount feeds every
write of one open file to a ``HintDecoder``. Unknown keys are ignored, so later versions can add
fields.

``announce`` is the client helper; ``HintedSampler`` wraps a PyTorch sampler (torch is never
imported here: the DataLoader accepts any iterable with ``__len__`` as a sampler).
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack

HINTS_VERSION = 1
CONTROL_FILE = ".neuralcache/hints"
"""Path of the control file relative to the mount root."""

_LENGTH = struct.Struct(">I")

MAX_RECORD_BYTES = 16 * 1024 * 1024
"""Largest record the decoder accepts (a corrupt length must not make the mount buffer GBs)."""

ITEMS_PER_RECORD = 2048
"""``encode_hints`` splits longer orders into records of at most this many items (~50 KB). The
mount decodes and registers a record in one go on its event loop, so records this small let it
serve reads between them while a DataLoader's workers open their files and start reading
(docs/prefetcher.md, "Hints")."""

HEAD_ITEMS = 1024
"""``HintedSampler`` announces this many of an epoch's first items before it yields an index.
They cover the DataLoader's first requests (8 workers x prefetch factor 4 x batch 24 = 768
samples), so the mount knows the files and the first reads before any worker opens a file."""

Item = tuple[str, int, int]


class HintFormatError(ValueError):
    """The bytes written to the control file are not valid hint records."""


@dataclass(frozen=True, slots=True)
class HintRecord:
    """Part of one announcer's read order for one epoch: (path, offset, length) in read order."""

    epoch: int
    items: tuple[Item, ...]
    source: str = ""
    exact: bool = False  # read only with read calls of these ranges, never mapped


def record_map(record: HintRecord) -> dict[str, object]:
    """A record as the msgpack map of the wire format (the trace keeps hints in it too)."""
    return {"v": HINTS_VERSION, "epoch": record.epoch, "source": record.source,
            "items": [list(item) for item in record.items], "exact": record.exact}


def _pack(record: HintRecord) -> bytes:
    body = msgpack.packb(record_map(record), use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def encode_hints(items: Iterable[Item], epoch: int, source: str = "",
                 items_per_record: int = ITEMS_PER_RECORD, exact: bool = False) -> bytes:
    """Encode an epoch's read order as one or more length-prefixed records."""
    chunk: list[Item] = []
    out = bytearray()
    for path, offset, length in items:
        chunk.append((str(path), int(offset), int(length)))
        if len(chunk) >= items_per_record:
            out += _pack(HintRecord(epoch, tuple(chunk), source, exact))
            chunk = []
    if chunk or not out:
        out += _pack(HintRecord(epoch, tuple(chunk), source, exact))
    return bytes(out)


def _parse(body: bytes) -> HintRecord:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise HintFormatError(f"not a msgpack record: {exc}") from exc
    if not isinstance(msg, dict) or msg.get("v") != HINTS_VERSION:
        raise HintFormatError("expected a map with v=1")
    epoch, source, raw_items = msg.get("epoch"), msg.get("source", ""), msg.get("items")
    exact = msg.get("exact", False)
    if not isinstance(epoch, int) or not isinstance(source, str) or not isinstance(raw_items, list):
        raise HintFormatError("epoch must be an int, source a str, items a list")
    if not isinstance(exact, bool):
        raise HintFormatError("exact must be a bool")
    items: list[Item] = []
    for item in raw_items:
        if (not isinstance(item, (list, tuple)) or len(item) != 3 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or not isinstance(item[2], int)
                or item[1] < 0 or item[2] <= 0):
            raise HintFormatError(f"bad item {item!r}: expected [path, offset>=0, length>0]")
        items.append((item[0], item[1], item[2]))
    return HintRecord(epoch, tuple(items), source, exact)


class HintDecoder:
    """Incremental decoder for one open control file: feed writes, get complete records."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an incomplete record still buffered."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[HintRecord]:
        """Append written bytes; return the records they complete."""
        self._buf += data
        out: list[HintRecord] = []
        while len(self._buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buf)
            if size > MAX_RECORD_BYTES:
                self._buf.clear()
                raise HintFormatError(f"record of {size} bytes exceeds {MAX_RECORD_BYTES}")
            if len(self._buf) < _LENGTH.size + size:
                break
            body = bytes(self._buf[_LENGTH.size:_LENGTH.size + size])
            del self._buf[:_LENGTH.size + size]
            out.append(_parse(body))
        return out


def decode_hints(data: bytes) -> list[HintRecord]:
    """Decode a complete byte string of records (raises on a truncated tail)."""
    decoder = HintDecoder()
    records = decoder.feed(data)
    if decoder.pending:
        raise HintFormatError(f"{decoder.pending} trailing bytes do not form a record")
    return records


def _relative(mountpoint: str, path: str) -> str:
    """A path inside the mount, as the mount-relative form the wire format carries."""
    mount = os.path.abspath(mountpoint)
    if os.path.isabs(path):
        rel = os.path.relpath(os.path.abspath(path), mount)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise ValueError(f"{path} is not inside the mount {mountpoint}")
        return rel.replace(os.sep, "/")
    return path.replace(os.sep, "/")


def announce(mountpoint: str, items: Iterable[Item], epoch: int = 0, source: str = "",
             exact: bool = False) -> int:
    """Tell the mount at ``mountpoint`` the upcoming reads, in order; returns bytes written.

    Paths may be absolute (inside the mount) or relative to its root. ``exact``: see the
    module's docstring.
    """
    data = encode_hints(((_relative(mountpoint, p), o, n) for p, o, n in items), epoch, source,
                        exact=exact)
    with open(os.path.join(mountpoint, CONTROL_FILE), "wb", buffering=0) as control:
        view = memoryview(data)
        while view:
            written = control.write(view)
            view = view[written:]
    return len(data)


class HintedSampler:
    """Wraps a sampler; each epoch, announces the reads its indices will cause and yields them.

    ``index_to_ranges(i)`` maps a dataset index to the (path, offset, length) reads it causes.
    ``source`` separates announcers (defaults to the wrapped sampler's ``rank`` if it has one).
    ``exact_reads=True`` says the dataset reads each range with one read call and never maps
    the files (``mmap``, ``np.memmap``): the mount then opens them without kernel readahead,
    which in a shuffled epoch fetches bytes past each sample (see docs/prefetcher.md). A file
    opened this way cannot be mapped shared (the kernel answers ENODEV), hence opt-in.

    The epoch's first ``head_items`` reads are announced before the first index is yielded, so
    the mount knows the files before a worker opens one; the rest is announced by a background
    thread (which calls ``index_to_ranges``), so the epoch's first batch does not wait for it:
    an epoch of 32,768 samples is 1.3 MB of hints that the mount decodes on its event loop, and
    it held the first batch of a warm ``bench.repro`` run for 0.3-0.8 s. Epochs are announced
    in order (an epoch's head goes out with its tail when the previous tail is still being
    written); ``wait_announced`` waits for the latest. A failed announcement (not a NeuralCache
    mount) warns once and never stops training.
    """

    def __init__(self, sampler: Iterable[int], mountpoint: str,
                 index_to_ranges: Callable[[int], Sequence[Item]], source: str | None = None,
                 announce_fn: Callable[..., Any] = announce, exact_reads: bool = False,
                 head_items: int = HEAD_ITEMS) -> None:
        self.sampler = sampler
        self.mountpoint = mountpoint
        self.index_to_ranges = index_to_ranges
        self.source = source if source is not None else str(getattr(sampler, "rank", ""))
        self.exact_reads = exact_reads
        self.head_items = head_items
        self.epoch = 0
        self._epoch_set = False
        self._announce = announce_fn
        self._warned = False
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (DistributedSampler reshuffles by epoch)."""
        self.epoch = epoch
        self._epoch_set = True
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(iter(self.sampler))
        previous = self._thread
        head = 0
        if previous is None or not previous.is_alive():
            head = min(self.head_items, len(indices))
            if head:
                self._announce_part(indices[:head], self.epoch)
            previous = None
        self._thread = threading.Thread(
            target=self._announce_rest, args=(indices[head:], self.epoch, previous, head > 0),
            name="neuralcache-hints", daemon=True)
        self._thread.start()
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        return iter(indices)

    def __getstate__(self) -> dict[str, Any]:
        """Copyable and picklable (a sampler may be copied, or saved with a checkpoint):
        without the announcing thread, which stays with the original."""
        state = self.__dict__.copy()
        state["_thread"] = None
        return state

    def wait_announced(self, timeout: float | None = None) -> bool:
        """Wait until the latest epoch's announcement is written (or failed); False if it is
        still going after ``timeout`` seconds."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _announce_rest(self, indices: list[int], epoch: int,
                       previous: threading.Thread | None, head_sent: bool) -> None:
        if previous is not None:
            previous.join()  # the mount appends records of one source in the order written
        if indices or not head_sent:
            self._announce_part(indices, epoch)

    def _announce_part(self, indices: list[int], epoch: int) -> None:
        try:
            items = [r for i in indices for r in self.index_to_ranges(i)]
            self._announce(self.mountpoint, items, epoch=epoch, source=self.source,
                           exact=self.exact_reads)
        except Exception as exc:  # noqa: BLE001 - reported, and training goes on regardless
            if not self._warned:
                self._warned = True
                warnings.warn(f"neuralcache: could not announce hints: {exc!r}", stacklevel=1)
