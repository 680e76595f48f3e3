"""Test-only helpers around real processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def start_proxy(target: str, mode: str):
    """A proxy that flips a byte in hub read replies ('always' or only the 'once' first)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.corrupting_proxy", target, mode],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip())
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
