"""The hub's export: what a scan lists, and which reads it serves or refuses."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.export import Export, ExportError, content_version
from fabric.protocol import ErrorCode, MetaEntry
from neuralcache.blocks import BLOCK_SIZE

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


def scanned(root: Path) -> tuple[Export, dict[str, MetaEntry]]:
    export = Export(str(root))
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


@settings(max_examples=40)
@given(first=st.integers(0, 6), count=st.integers(1, 6))
def test_read_blocks_returns_the_right_bytes(tmp_path_factory: pytest.TempPathFactory,
                                             first: int, count: int) -> None:
    root = tmp_path_factory.getbasetemp() / "read_blocks_tree"
    data = FILES["dir/b.bin"]
    if not root.exists():
        (root / "dir").mkdir(parents=True)
        (root / "dir/b.bin").write_bytes(data)
    export, entries = scanned(root)
    e = entries["dir/b.bin"]
    got = export.read_blocks(e.file_id, e.version, first, count)
    assert got == data[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


@pytest.mark.parametrize("first,count", [(2**64 - 1, 1), (2**51, 1), (0, 2**64 - 1), (1, 2**62)])
def test_block_numbers_at_the_protocols_limits_read_nothing_past_the_end(
        tree: Path, first: int, count: int) -> None:
    """Any 64-bit range a request can carry is answered, never an overflow in the hub."""
    export, entries = scanned(tree)
    e = entries["dir/b.bin"]
    assert export.read_blocks(e.file_id, e.version, first, count) == \
        FILES["dir/b.bin"][first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


def _refused(export: Export, entry: MetaEntry) -> str:
    with pytest.raises(ExportError) as info:
        export.read_blocks(entry.file_id, entry.version, 0, 1)
    return info.value.code


def test_a_file_appended_to_after_the_scan_is_stale(tree: Path) -> None:
    export, entries = scanned(tree)
    with open(tree / "a.txt", "ab") as f:
        f.write(b"more")
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


def test_a_file_touched_after_the_scan_is_stale(tree: Path) -> None:
    export, entries = scanned(tree)
    st_ = os.stat(tree / "a.txt")
    os.utime(tree / "a.txt", ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000_000))
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


def test_a_file_replaced_by_rename_is_stale(tree: Path) -> None:
    export, entries = scanned(tree)
    (tree / "new").write_bytes(FILES["a.txt"])
    os.replace(tree / "new", tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.STALE


def test_a_file_replaced_by_a_symlink_to_etc_passwd_is_refused(tree: Path) -> None:
    export, entries = scanned(tree)
    os.remove(tree / "a.txt")
    os.symlink("/etc/passwd", tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.NOT_FOUND


def test_a_directory_replaced_by_a_symlink_leading_outside_is_refused(tree: Path) -> None:
    export, entries = scanned(tree)
    outside = tree.parent / "elsewhere"
    outside.mkdir()
    os.link(tree / "dir/b.bin", outside / "b.bin")  # even the very same inode, seen from outside
    os.rename(tree / "dir", tree.parent / "moved")
    os.symlink(str(outside), tree / "dir")
    assert _refused(export, entries["dir/b.bin"]) in {ErrorCode.NOT_FOUND, ErrorCode.STALE}


def test_a_deleted_file_is_not_found(tree: Path) -> None:
    export, entries = scanned(tree)
    os.remove(tree / "a.txt")
    assert _refused(export, entries["a.txt"]) == ErrorCode.NOT_FOUND


def test_an_unknown_id_or_a_directory_id_is_not_found(tree: Path) -> None:
    export, entries = scanned(tree)
    unknown = MetaEntry("x", "f", 0, 0, 0, max(e.file_id for e in entries.values()) + 1, 0)
    assert _refused(export, unknown) == ErrorCode.NOT_FOUND
    assert _refused(export, entries["dir"]) == ErrorCode.NOT_FOUND


def test_reads_need_a_scan_first(tree: Path) -> None:
    export = Export(str(tree))
    st_ = os.stat(tree / "a.txt")
    with pytest.raises(ExportError) as info:
        export.read_blocks(st_.st_ino, content_version(st_), 0, 1)
    assert info.value.code == ErrorCode.NOT_FOUND


def test_an_export_root_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(FileNotFoundError):
            Export(str(root))


def test_an_export_reached_through_a_symlink_serves_its_files(tree: Path) -> None:
    alias = tree.parent / "alias"
    alias.symlink_to(tree)
    export, entries = scanned(alias)
    e = entries["a.txt"]
    assert export.read_blocks(e.file_id, e.version, 0, 1) == FILES["a.txt"]
