"""bench/memfs.py, the Python FUSE ceiling: a real mount of several files served from memory
(or from maps of them, ``--mapped``), as ``bench.repro``'s memfs target mounts the export's
shards."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from bench import mount_procs
from fuse_mount.launch import is_mounted


@pytest.mark.parametrize("mapped", [False, True], ids=["in memory", "mapped"])
def test_every_source_is_served_byte_for_byte_and_nothing_else(tmp_path: Path,
                                                               mapped: bool) -> None:
    sources = []
    for name, size in (("a.tokens", 3 * 4096 + 17), ("b.tokens", 1 << 20), ("empty", 0)):
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        sources.append(str(path))
    mountpoint = str(tmp_path / "mnt")
    with mount_procs.memfs(mountpoint, *sources, mapped=mapped) as served:
        assert served == [os.path.join(mountpoint, os.path.basename(s)) for s in sources]
        assert sorted(os.listdir(mountpoint)) == ["a.tokens", "b.tokens", "empty"]
        for source, path in zip(sources, served):
            assert Path(path).read_bytes() == Path(source).read_bytes()
            assert os.stat(path).st_size == os.stat(source).st_size
        with open(served[1], "rb") as f:  # a read inside, and one across the end
            assert os.pread(f.fileno(), 100, 5000) == Path(sources[1]).read_bytes()[5000:5100]
            assert os.pread(f.fileno(), 100, (1 << 20) - 10) == Path(sources[1]).read_bytes()[-10:]
        with pytest.raises(FileNotFoundError):
            os.stat(os.path.join(mountpoint, "c.tokens"))
        with pytest.raises(OSError) as refused:
            open(served[0], "r+b")
        assert refused.value.errno == errno.EROFS
    assert not is_mounted(mountpoint)


def test_two_sources_of_one_name_are_refused(tmp_path: Path) -> None:
    for directory in ("x", "y"):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "same").write_bytes(b"1")
    with pytest.raises(RuntimeError, match="memfs did not start"):
        with mount_procs.memfs(str(tmp_path / "mnt"), str(tmp_path / "x" / "same"),
                               str(tmp_path / "y" / "same")):
            pass
