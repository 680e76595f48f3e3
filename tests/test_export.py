"""The hub's export: what a scan lists, and which reads it serves or refuses."""

from __future__ import annotations

import errno
import os
import random
import socket
import stat
import time
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from bench.mount_procs import drop_page_cache
from fabric import openat2
from fabric.export import Confinement, Export, ExportError, WouldBlock, content_version
from fabric.protocol import ErrorCode, MetaEntry
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import EVICTED_READ_PAUSE, EVICTED_READ_TRIES

FILES = {
    "a.txt": b"hello\n",
    "empty": b"",
    "dir/b.bin": bytes(range(256)) * (3 * BLOCK_SIZE // 256) + b"tail" * 25,
    "dir/sub/c": b"c" * BLOCK_SIZE,
}
INSIDE_LINKS = {
    "link_in": "a.txt",
    "dir/link_up": "../a.txt",
    "link_dir": "dir",
    "dir/sub/link_deep": "../../dir/b.bin",
    "link_dangling": "does-not-exist",
    "loop_a": "loop_b",  # a loop never resolves, so it cannot lead anywhere
    "loop_b": "loop_a",
    "here": ".",
}
ESCAPING_LINKS = {
    "link_abs": "/etc/passwd",
    "link_out": "../outside.txt",
    "dir/link_out_deep": "../../outside.txt",
    "link_reenter": "../export/a.txt",  # back inside on the hub, but not on the spoke's mirror
    "link_via_here": "here/../export/a.txt",  # the same, hidden behind a symlink to "."
    "link_via_escape": "link_out",  # leads outside through another link
    "link_up_root": "..",
}


def _kernel_has_openat2() -> bool:
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        return openat2.supports(fd, openat2.RESOLVE_BENEATH)
    finally:
        os.close(fd)


needs_openat2 = pytest.mark.skipif(not _kernel_has_openat2(), reason="kernel without openat2")
BOTH_CONFINEMENTS = pytest.mark.parametrize(
    "confinement", [pytest.param(Confinement.OPENAT2, marks=needs_openat2, id="openat2"),
                    pytest.param(Confinement.REALPATH, id="realpath")])
"""The refusals hold whether the kernel confines the open (openat2) or the hub checks the fd's
real path after it (the fallback for kernels without openat2)."""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "outside.txt").write_bytes(b"secret")
    root = tmp_path / "export"
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "empty_dir").mkdir()
    for rel, target in {**INSIDE_LINKS, **ESCAPING_LINKS}.items():
        (root / rel).symlink_to(target)
    os.mkfifo(root / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock"))
    return root


def scanned(root: Path, confinement: Confinement | None = None
            ) -> tuple[Export, dict[str, MetaEntry]]:
    export = Export(str(root), confinement=confinement)
    return export, {e.path: e for e in export.scan()}


def test_scan_lists_files_dirs_and_inside_links_only(tree: Path) -> None:
    _, entries = scanned(tree)
    dirs = {"", "dir", "dir/sub", "empty_dir"}
    assert set(entries) == dirs | set(FILES) | set(INSIDE_LINKS)
    assert {p for p, e in entries.items() if e.kind == "d"} == dirs
    assert {p for p, e in entries.items() if e.kind == "l"} == set(INSIDE_LINKS)


def test_scan_lists_the_root_first_and_parents_before_children(tree: Path) -> None:
    paths = [e.path for e in Export(str(tree)).scan()]
    assert paths[0] == ""
    for i, path in enumerate(paths[1:], 1):
        parent = path.rpartition("/")[0]
        assert parent in paths[:i]


def test_scan_entries_describe_the_files(tree: Path) -> None:
    _, entries = scanned(tree)
    for rel, data in FILES.items():
        st_ = os.stat(tree / rel)
        e = entries[rel]
        assert (e.kind, e.size, e.file_id, e.version, e.mode, e.mtime_ns) == (
            "f", len(data), st_.st_ino, content_version(st_), stat.S_IMODE(st_.st_mode),
            st_.st_mtime_ns)
    for rel, target in INSIDE_LINKS.items():
        assert (entries[rel].target, entries[rel].size) == (target, len(target))


@BOTH_CONFINEMENTS
@settings(max_examples=40)
@given(first=st.integers(0, 6), count=st.integers(1, 6))
def test_read_blocks_returns_the_right_bytes(tmp_path_factory: pytest.TempPathFactory,
                                             confinement: Confinement, first: int,
                                             count: int) -> None:
    root = tmp_path_factory.getbasetemp() / "read_blocks_tree"
    data = FILES["dir/b.bin"]
    if not root.exists():
        (root / "dir").mkdir(parents=True)
        (root / "dir/b.bin").write_bytes(data)
    export, entries = scanned(root, confinement)
    e = entries["dir/b.bin"]
    got = export.read_blocks(e.file_id, e.version, first, count)
    assert got == data[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


@BOTH_CONFINEMENTS
@pytest.mark.parametrize("first,count", [(2**64 - 1, 1), (2**51, 1), (0, 2**64 - 1), (1, 2**62)])
def test_block_numbers_at_the_protocols_limits_read_nothing_past_the_end(
        tree: Path, confinement: Confinement, first: int, count: int) -> None:
    """Any 64-bit range a request can carry is answered, never an overflow in the hub."""
    export, entries = scanned(tree, confinement)
    e = entries["dir/b.bin"]
    assert export.read_blocks(e.file_id, e.version, first, count) == \
        FILES["dir/b.bin"][first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


def _refused(export: Export, entry: MetaEntry) -> str:
    with pytest.raises(ExportError) as info:
        export.read_blocks(entry.file_id, entry.version, 0, 1)
    return info.value.code


@BOTH_CONFINEMENTS
def test_a_file_appended_to_after_the_scan_is_stale(tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    with open(tree / "a.txt", "ab") as f:
        f.write(b"more")
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


@BOTH_CONFINEMENTS
def test_a_file_touched_after_the_scan_is_stale(tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    st_ = os.stat(tree / "a.txt")
    os.utime(tree / "a.txt", ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000_000))
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


@BOTH_CONFINEMENTS
def test_a_file_replaced_by_rename_is_stale(tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    (tree / "new").write_bytes(FILES["a.txt"])
    os.replace(tree / "new", tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


@BOTH_CONFINEMENTS
def test_a_file_replaced_by_a_symlink_to_etc_passwd_is_refused(
        tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    os.remove(tree / "a.txt")
    os.symlink("/etc/passwd", tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.NOT_FOUND


@BOTH_CONFINEMENTS
def test_a_directory_replaced_by_a_symlink_leading_outside_is_refused(
        tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    outside = tree.parent / "elsewhere"
    outside.mkdir()
    os.link(tree / "dir/b.bin", outside / "b.bin")  # even the very same inode, seen from outside
    os.rename(tree / "dir", tree.parent / "moved")
    os.symlink(str(outside), tree / "dir")
    assert _refused(export, entries["dir/b.bin"]) in {ErrorCode.NOT_FOUND, ErrorCode.STALE}


@BOTH_CONFINEMENTS
def test_a_deleted_file_is_not_found(tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    os.remove(tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.NOT_FOUND


@BOTH_CONFINEMENTS
def test_an_unknown_id_or_a_directory_id_is_not_found(tree: Path, confinement: Confinement) -> None:
    export, entries = scanned(tree, confinement)
    unknown = MetaEntry("x", "f", 0, 0, 0, max(e.file_id for e in entries.values()) + 1, 0)
    assert _refused(export, unknown) == ErrorCode.NOT_FOUND
    assert _refused(export, entries["dir"]) == ErrorCode.NOT_FOUND


@BOTH_CONFINEMENTS
def test_reads_need_a_scan_first(tree: Path, confinement: Confinement) -> None:
    export = Export(str(tree), confinement=confinement)
    st_ = os.stat(tree / "a.txt")
    with pytest.raises(ExportError) as info:
        export.read_blocks(st_.st_ino, content_version(st_), 0, 1)
    assert info.value.code == ErrorCode.NOT_FOUND


def test_an_export_root_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(FileNotFoundError):
            Export(str(root))


@BOTH_CONFINEMENTS
def test_an_export_reached_through_a_symlink_serves_its_files(
        tree: Path, confinement: Confinement) -> None:
    alias = tree.parent / "alias"
    alias.symlink_to(tree)
    export, entries = scanned(alias, confinement)
    e = entries["a.txt"]
    assert export.read_blocks(e.file_id, e.version, 0, 1) == FILES["a.txt"]


# -- the confined open -------------------------------------------------------------------------

def test_the_default_confinement_is_the_kernels_where_it_has_openat2(tree: Path) -> None:
    expected = Confinement.OPENAT2 if _kernel_has_openat2() else Confinement.REALPATH
    assert Export(str(tree)).confinement is expected


@BOTH_CONFINEMENTS
@pytest.mark.parametrize("rel", ["../outside.txt", "dir/../../outside.txt", "/etc/passwd",
                                 "link_in", "link_abs", "a.txt/x", "missing"])
def test_no_path_out_of_the_export_or_onto_a_symlink_is_opened(
        tree: Path, confinement: Confinement, rel: str) -> None:
    with pytest.raises(ExportError) as info:
        Export(str(tree), confinement=confinement).open_confined(rel)
    assert info.value.code == ErrorCode.NOT_FOUND


@needs_openat2
@pytest.mark.parametrize("rel, errno_", [
    ("../outside.txt", errno.EXDEV), ("/etc/passwd", errno.EXDEV),
    ("link_in", errno.ELOOP), ("link_dir/b.bin", errno.ELOOP), ("dir/sub/link_deep", errno.ELOOP),
])
def test_openat2_says_exdev_for_an_escape_and_eloop_for_any_symlink_both_not_found(
        tree: Path, rel: str, errno_: int) -> None:
    """Even a symlink that stays inside (``link_dir``) is refused: no path the scan lists
    passes through one, so meeting one means the tree changed under the snapshot."""
    root_fd = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    how = openat2.OpenHow(os.O_RDONLY | os.O_NOFOLLOW, 0, openat2.RESOLVE_BENEATH
                          | openat2.RESOLVE_NO_SYMLINKS | openat2.RESOLVE_NO_MAGICLINKS)
    try:
        with pytest.raises(OSError) as raw:
            os.close(openat2.openat2(root_fd, os.fsencode(rel), how))
    finally:
        os.close(root_fd)
    assert raw.value.errno == errno_
    with pytest.raises(ExportError) as info:
        Export(str(tree), confinement=Confinement.OPENAT2).open_confined(rel)
    assert info.value.code == ErrorCode.NOT_FOUND


# -- nowait reads --------------------------------------------------------------------------------

NOWAIT_BLOCKS = 256
NOWAIT_FILE = random.Random(5).randbytes(NOWAIT_BLOCKS * BLOCK_SIZE)


@needs_openat2
def test_a_nowait_read_serves_cached_pages_and_would_block_on_evicted_ones(tree: Path) -> None:
    export, entries = scanned(tree, Confinement.OPENAT2)
    e, data = entries["dir/b.bin"], FILES["dir/b.bin"]
    assert export.nowait_reads
    (tree / "dir/b.bin").read_bytes()
    assert export.read_blocks(e.file_id, e.version, 0, 4, nowait=True) == data
    blocked = False
    for _ in range(EVICTED_READ_TRIES):
        time.sleep(EVICTED_READ_PAUSE)
        drop_page_cache(tree / "dir/b.bin")
        try:
            assert export.read_blocks(e.file_id, e.version, 0, 4, nowait=True) == data
        except WouldBlock:
            blocked = True
            break
    assert blocked
    assert export.read_blocks(e.file_id, e.version, 0, 4) == data


@needs_openat2
def test_a_nowait_read_still_refuses_what_a_read_refuses(tree: Path) -> None:
    export, entries = scanned(tree, Confinement.OPENAT2)
    (tree / "new").write_bytes(FILES["a.txt"])
    os.replace(tree / "new", tree / "a.txt")
    os.remove(tree / "dir/sub/c")
    for rel, code in (("a.txt", ErrorCode.STALE), ("dir/sub/c", ErrorCode.NOT_FOUND)):
        with pytest.raises(ExportError) as info:
            export.read_blocks(entries[rel].file_id, entries[rel].version, 0, 1, nowait=True)
        assert info.value.code == code


def test_without_openat2_every_nowait_read_would_block(tree: Path) -> None:
    """A path open may read directories from disk, and nothing can make it say so instead."""
    export, entries = scanned(tree, Confinement.REALPATH)
    assert not export.nowait_reads
    with pytest.raises(WouldBlock):
        export.read_blocks(entries["a.txt"].file_id, entries["a.txt"].version, 0, 1, nowait=True)


@needs_openat2
@settings(max_examples=40, deadline=None)
@given(cached_first=st.integers(0, NOWAIT_BLOCKS - 1), cached_count=st.integers(1, 16),
       delta=st.integers(-4, 20), count=st.integers(1, 8))
def test_a_nowait_read_returns_the_right_bytes_or_nothing(
        tmp_path_factory: pytest.TempPathFactory, cached_first: int, cached_count: int,
        delta: int, count: int) -> None:
    """With only a run of blocks read back into the page cache (a blocking read, which may
    read ahead beyond it), a range inside that run is served whole; any other may be
    WouldBlock, but is never served short or wrong. (The whole file is evicted each time:
    the page cache drops a large folio only whole, so a partial eviction may do nothing.)"""
    root = tmp_path_factory.getbasetemp() / "nowait_tree"
    if not root.exists():
        root.mkdir()
        (root / "f").write_bytes(NOWAIT_FILE)
    export, entries = scanned(root, Confinement.OPENAT2)
    e = entries["f"]
    drop_page_cache(root / "f")
    fd = os.open(root / "f", os.O_RDONLY)
    try:
        os.pread(fd, cached_count * BLOCK_SIZE, cached_first * BLOCK_SIZE)
    finally:
        os.close(fd)
    first = max(0, cached_first + delta)
    inside = cached_first <= first and first + count <= cached_first + cached_count
    try:
        got = export.read_blocks(e.file_id, e.version, first, count, nowait=True)
    except WouldBlock:
        event("would block")
        assert not inside
    else:
        event("served inside the cached run" if inside else "served")
        assert got == NOWAIT_FILE[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]
