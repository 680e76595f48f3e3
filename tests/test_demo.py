"""The README's first command runs ``neuralcache demo``; it must work and leave nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_fuse

pytestmark = [pytest.mark.mount, needs_fuse]


def test_demo_reads_cold_then_warm_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "fuse_mount.cli", "demo", "--workdir",
                             str(workdir)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.startswith(("cold ", "warm "))}
    # Cold blocks come from the hub (some may already be prefetched); warm ones all from the cache.
    assert float(rows["cold"][-1].rstrip("%")) < 100.0
    assert rows["warm"][-1] == "100.0%"
    assert "every byte checked" in result.stdout
    assert not workdir.exists()
    with open("/proc/mounts") as f:
        assert str(workdir) not in f.read()
