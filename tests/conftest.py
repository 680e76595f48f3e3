"""Fixtures that start real hubs and spoke mounts, and always tear them down."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Iterator

import pytest

from fuse_mount.launch import Hub, Spoke

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")


@pytest.fixture(autouse=True, scope="session")
def _isolated_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the daemons' mount records out of /run while testing."""
    os.environ["NEURALCACHE_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("run"))


def make_tree(root: Path, seed: int = 7) -> dict[str, bytes]:
    """A small export with the sizes that stress block math, nested dirs and symlinks."""
    rng = random.Random(seed)
    sizes = [0, 1, 4095, 4096, 4097, 65536, 100_003, 1 << 20, 3 * (1 << 20) + 17]
    files: dict[str, bytes] = {}
    for i, size in enumerate(sizes):
        rel = f"d{i % 3}/sub{i % 2}/f{i}.bin" if i % 2 else f"top{i}.bin"
        files[rel] = rng.randbytes(size)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "empty_dir").mkdir()
    (root / "inside_link").symlink_to("top0.bin")
    (root / "escape_link").symlink_to("/etc/passwd")
    return files


@pytest.fixture
def export(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "export"
    root.mkdir()
    return root, make_tree(root)


@pytest.fixture
def hub(export: tuple[Path, dict[str, bytes]]) -> Iterator[Hub]:
    h = Hub(export[0]).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def spoke(tmp_path: Path) -> Iterator[Spoke]:
    s = Spoke(tmp_path / "mnt", tmp_path / "cache")
    try:
        yield s
    finally:
        s.cleanup()
