"""Time from ``neuralcache mount`` to a finished ``ls -lR`` of a large tree, on loopback.

    python -m bench.metadata_tree [--files 100000] [--rounds 3] [--workdir DIR]

The tree (``--files`` small files in directories of FILES_PER_DIR) is made once in
``WORKDIR/tree-FILES`` and reused. A hub exports it on loopback; each round then launches
``neuralcache mount`` over an empty cache and runs ``ls -lR MOUNT > /dev/null``, timing:

- hub scan: ``Export.scan`` of the tree in this process, the walk a hub does for a metadata
  request (the tree was just made or scanned, so the hub's dentries are warm, as on a live hub);
- mount returned: launch of ``neuralcache mount`` until it returns (the hub has scanned, the
  snapshot crossed the wire, the mount answers);
- ls -lR done: launch of ``neuralcache mount`` until ``ls -lR`` exits.

Metadata comes first: the round fails unless the hub sent no block bytes
(``neuralcache_hub_sent_bytes_total`` stays 0) and the spoke served no read. A walk of the mount
afterwards (untimed) must find every file. Everything is unmounted and stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from bench import mount_procs
from fabric.export import Export
from fuse_mount.launch import Hub
from fuse_mount.scrape import scrape

DEFAULT_FILES = 100_000
FILES_PER_DIR = 1000
"""The issue's shape: 100 directories of 1000 files for the default tree."""
FILE_BYTES = 512
"""Each file's size: small, like labels or captions; its content never moves in this bench."""
DEFAULT_ROUNDS = 3
TARGET_SECONDS = 15.0
"""The issue's goal: the whole tree listed within this many seconds of launching the mount."""
DEFAULT_WORKDIR = "/var/tmp/neuralcache-bench"
LIST_TIMEOUT = 300.0
"""Seconds ``ls -lR`` may run before it is killed and the bench fails (a hung mount)."""
CACHE_SIZE = "64M"
"""The spoke's cache; no block is read, so it only has to exist."""


def make_tree(workdir: str, files: int) -> str:
    """``WORKDIR/tree-FILES``: ``files`` files of FILE_BYTES in directories of FILES_PER_DIR."""
    root = os.path.join(workdir, f"tree-{files}")
    done = f"{root}.complete"  # beside the tree, so the hub does not export it
    if os.path.exists(done):
        return root
    print(f"making {files} files under {root}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    payload = b"x" * FILE_BYTES
    for start in range(0, files, FILES_PER_DIR):
        directory = os.path.join(root, f"d{start // FILES_PER_DIR:04d}")
        os.makedirs(directory)
        for i in range(start, min(start + FILES_PER_DIR, files)):
            with open(os.path.join(directory, f"f{i:07d}.txt"), "wb") as f:
                f.write(payload)
    with open(done, "w"):
        pass
    return root


def count_files(root: str) -> int:
    return sum(len(names) for _, _, names in os.walk(root))


@dataclass(frozen=True)
class Round:
    mount_returned: float
    listed: float
    hub_sent_bytes: float
    spoke_reads: float
    files_seen: int


def one_round(hub: Hub, scratch: str, index: int) -> Round:
    cache = os.path.join(scratch, f"cache-{index}")
    mountpoint = os.path.join(scratch, "mnt")
    sent_before = mount_procs.hub_sent_bytes(hub)
    started = time.perf_counter()
    with mount_procs.spoke(hub.address, cache, mountpoint, "--cache-size", CACHE_SIZE
                           ) as (sp, mount_seconds):
        subprocess.run(["ls", "-lR", mountpoint], stdout=subprocess.DEVNULL, check=True,
                       timeout=LIST_TIMEOUT)
        listed = time.perf_counter() - started
        reads = sum(v for (name, _), v in scrape(sp.metrics_port).items()
                    if name == "neuralcache_reads_total")
        files_seen = count_files(mountpoint)
    shutil.rmtree(cache)
    return Round(mount_seconds, listed, mount_procs.hub_sent_bytes(hub) - sent_before, reads,
                 files_seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metadata_tree",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=DEFAULT_FILES,
                        help=f"files in the tree [{DEFAULT_FILES}]")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"mounts timed; medians are reported [{DEFAULT_ROUNDS}]")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR,
                        help=f"tree and scratch space, not in the repo [{DEFAULT_WORKDIR}]")
    args = parser.parse_args(argv)
    mount_procs.exit_on_sigterm()
    load_at_start = os.getloadavg()[0]  # the cores are shared: say how busy they were

    workdir = os.path.abspath(args.workdir)
    tree = make_tree(workdir, args.files)
    started = time.perf_counter()
    entries = len(Export(tree).scan())
    scan = time.perf_counter() - started
    print(f"tree {tree}: {entries} entries; hub scan {scan:.2f} s", flush=True)

    scratch = os.path.join(workdir, f"run-{os.getpid()}")
    os.makedirs(scratch)
    rounds: list[Round] = []
    try:
        with mount_procs.hub(tree) as hub:
            for i in range(args.rounds):
                r = one_round(hub, scratch, i)
                rounds.append(r)
                print(f"  round {i + 1}: mount returned {r.mount_returned:.2f} s, "
                      f"ls -lR done {r.listed:.2f} s, {r.files_seen} files, "
                      f"hub sent {r.hub_sent_bytes:.0f} B, spoke reads {r.spoke_reads:.0f}",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"load average (1 min) at start {load_at_start:.1f}, at end {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    mount_returned = statistics.median(r.mount_returned for r in rounds)
    listed = statistics.median(r.listed for r in rounds)
    print()
    print(f"{'files':>8}{'hub scan':>11}{'mount returned':>17}{'ls -lR done':>14}{'target':>9}")
    print(f"{args.files:>8}{scan:>10.2f}s{mount_returned:>16.2f}s{listed:>13.2f}s"
          f"{TARGET_SECONDS:>8.0f}s")
    print(f"(medians of {len(rounds)} rounds; times from launching neuralcache mount)")
    print(f"target: tree listed within {TARGET_SECONDS:g} s of mount start: {listed:.2f} s "
          f"{'met' if listed <= TARGET_SECONDS else 'MISSED'}")
    failures = []
    if any(r.hub_sent_bytes or r.spoke_reads for r in rounds):
        failures.append("file data moved during the listing")
    if any(r.files_seen != args.files for r in rounds):
        failures.append(f"the mount did not show all {args.files} files")
    print("metadata first: " + ("; ".join(failures) if failures else
                                "hub sent 0 block bytes and the spoke served no read"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
