"""What mounting over a warm cache costs: the mount's time and how much of the cache file it reads.

    python -m bench.mount_index [--size 256M] [--workdir DIR]

Fills a spoke cache with a file of ``--size`` (one cold sequential pass, hub on loopback,
``--no-prefetch``), unmounts, evicts the cache file's pages, mounts again over it and prints the
seconds the mount command took and the bytes of the cache file in the page cache right after
(``mincore``). A mount should read the index of its cache, not its blocks: nodes mount at boot,
and a cache may be terabytes. The dataset stays in ``WORKDIR/export-SIZE``; the cache is removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from bench import mount_procs
from bench.read_pass import MB, SEQUENTIAL
from bench.read_pass import run as run_pass
from bench.throughput import DATA_NAME, DEFAULT_WORKDIR, make_dataset
from fuse_mount.cli import parse_size
from fuse_mount.residency import file_resident_bytes

DEFAULT_SIZE = "256M"
PASS_TIMEOUT = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mount_index",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE))
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    mount_procs.exit_on_sigterm()
    workdir = os.path.abspath(args.workdir)
    data = make_dataset(workdir, args.size)
    scratch = os.path.join(workdir, f"mount-index-{os.getpid()}")
    cache, mountpoint = os.path.join(scratch, "cache"), os.path.join(scratch, "mnt")
    options = ("--cache-size", str(2 * args.size), "--no-prefetch")
    try:
        with mount_procs.hub(os.path.dirname(data)) as hub:
            with mount_procs.spoke(hub.address, cache, mountpoint, *options):
                run_pass(SEQUENTIAL, os.path.join(mountpoint, DATA_NAME), None, PASS_TIMEOUT)
            cache_file = mount_procs.cache_file(cache)
            mount_procs.drop_page_cache(cache_file)
            before = file_resident_bytes(cache_file)
            with mount_procs.spoke(hub.address, cache, mountpoint, *options) as (_, seconds):
                after = file_resident_bytes(cache_file)
            size = os.path.getsize(cache_file)
        print(f"cache file {size / MB:.0f} MB for {args.size / MB:.0f} MB of blocks; in the page "
              f"cache {before / MB:.1f} MB before the mount, {after / MB:.1f} MB after it; "
              f"mount took {seconds:.2f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
