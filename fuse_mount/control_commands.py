"""``neuralcache warmup``, ``status`` and ``cache drop|verify``: the commands that talk to a running
mount's daemon over its control socket. Paths are given as they appear under the mountpoint;
the mount is found from them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from .control_client import ControlClient, ControlError, mount_of, only_mount, resolve_mount
from .progress import ProgressMeter, render
from .runtime import MountRecord, live_records
from .status import count_of, format_status, human_bytes

WAIT_POLL = 0.5
"""Seconds between progress polls while ``warmup --wait`` watches."""
PLAIN_EVERY = 5.0
"""Seconds between progress lines when stderr is not a terminal (a log, CI)."""


def _fail(message: str) -> int:
    print(f"neuralcache: {message}", file=sys.stderr)
    return 1


def _paths_in_one_mount(paths: list[str]) -> tuple[MountRecord, list[str]]:
    """The one mount all ``paths`` are in, and each path inside it."""
    found = [mount_of(p) for p in paths]
    mounts = {record.mountpoint for record, _ in found}
    if len(mounts) > 1:
        raise ControlError(f"the paths span several mounts ({', '.join(sorted(mounts))}); "
                           "give one mount's paths at a time")
    return found[0][0], [rel for _, rel in found]


# --- warmup -------------------------------------------------------------------------------------

def _warmup_request(args: argparse.Namespace) -> tuple[MountRecord, dict[str, Any] | None]:
    """The mount and the warm-up request the arguments ask for (None: only watch)."""
    if args.profile is not None or args.cancel:
        if len(args.paths) > 1:
            raise ControlError("with --profile or --cancel, give at most one path: the mount")
        record = resolve_mount(args.paths[0] if args.paths else None)
        return record, None if args.cancel else {"profile": os.path.abspath(args.profile)}
    if args.paths:
        record, rel = _paths_in_one_mount(args.paths)
        return record, {"paths": rel, "recursive": args.recursive}
    if args.wait:
        return only_mount(), None
    raise ControlError("warmup needs PATHs, --profile FILE, --wait or --cancel")


def _accepted(reply: dict[str, Any]) -> None:
    job = reply["job"]
    print(f"neuralcache: warm-up accepted: {count_of(job['files'], 'file')}, "
          f"{human_bytes(job['total_bytes'])}", flush=True)  # before the progress on stderr
    if reply["skipped"]:
        names = ", ".join(reply["skipped_paths"])
        more = f" and {reply['skipped'] - len(reply['skipped_paths'])} more" \
            if reply["skipped"] > len(reply["skipped_paths"]) else ""
        print(f"neuralcache: {count_of(reply['skipped'], 'file')} of the profile not in this mount "
              f"(skipped): {names}{more}", file=sys.stderr)
    if job["total_bytes"] > reply["cache_capacity_bytes"]:
        print(f"neuralcache: warning: the warm-up ({human_bytes(job['total_bytes'])}) exceeds "
              f"the cache ({human_bytes(reply['cache_capacity_bytes'])}); its last blocks "
              "will evict its first", file=sys.stderr)


def _watch(client: ControlClient, out: TextIO) -> int:
    """Show progress until the job ends; 0 only if every chunk was warmed."""
    tty = out.isatty()
    meter = ProgressMeter()
    last_plain = -float("inf")
    while True:
        job = client.request("warmup_progress")["job"]
        if job["state"] == "idle":
            print("neuralcache: no warm-up has run since the mount started", file=out)
            return 0
        now = time.monotonic()
        meter.update(now, job["done_bytes"])
        running = job["state"] == "running"
        line = render(job["done_bytes"], job["total_bytes"], meter.rate,
                      meter.eta(job["total_bytes"] - job["failed_bytes"]), bar=tty,
                      failed=job["failed_bytes"])
        if tty:
            out.write(f"\r{line}\x1b[K" + ("" if running else "\n"))
        elif not running or now - last_plain >= PLAIN_EVERY:
            out.write(line + "\n")
            last_plain = now
        out.flush()
        if not running:
            break
        time.sleep(WAIT_POLL)
    state = job["state"]
    if state == "done":
        print(f"neuralcache: warm-up done: {human_bytes(job['done_bytes'])} in "
              f"{count_of(job['files'], 'file')}", file=out)
        return 0
    if state == "cancelled":
        print("neuralcache: warm-up cancelled", file=out)
    else:
        print(f"neuralcache: warm-up failed: {human_bytes(job['failed_bytes'])} in "
              f"{job['failed_chunks']} chunks could not be fetched from the hub (see "
              "'neuralcache status' and the daemon's log). Run it again to retry; a restarted "
              "daemon retries it by itself", file=out)
    return 1


def cmd_warmup(args: argparse.Namespace) -> int:
    try:
        record, request = _warmup_request(args)
        with ControlClient(record) as client:
            if args.cancel:
                reply = client.request("warmup_cancel")
                print("neuralcache: warm-up cancelled" if reply["cancelled"]
                      else "neuralcache: no warm-up is running")
                return 0
            if request is not None:
                _accepted(client.request("warmup", timeout=None, **request))
            if not args.wait:
                return 0
            try:
                return _watch(client, sys.stderr)
            except KeyboardInterrupt:
                print("\nneuralcache: stopped watching; the warm-up goes on "
                      "(neuralcache warmup --cancel stops it)", file=sys.stderr)
                return 130
    except ControlError as exc:
        return _fail(str(exc))


# --- status -------------------------------------------------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    try:
        if args.mountpoint is not None:
            record = mount_of(args.mountpoint)[0]
        else:
            records = live_records()
            if not records:
                return _fail("no neuralcache mount is running on this machine")
            if len(records) > 1:
                _list_mounts(records, args.json)
                return 0
            record = records[0]
        with ControlClient(record) as client:
            status = client.request("status")["status"]
    except ControlError as exc:
        return _fail(str(exc))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _list_mounts(records: list[MountRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"mounts": [{"mountpoint": r.mountpoint, "hub": r.hub, "pid": r.pid}
                                     for r in records]}, indent=2))
        return
    print("several mounts; run neuralcache status MOUNTPOINT for one of them:")
    for r in records:
        print(f"  {r.mountpoint}  (hub {r.hub}, pid {r.pid})")


# --- cache --------------------------------------------------------------------------------------

def cmd_cache(args: argparse.Namespace) -> int:
    try:
        record, rel = _paths_in_one_mount(args.paths)
        with ControlClient(record) as client:
            reply = client.request(f"cache_{args.cache_command}", timeout=None, paths=rel,
                                   recursive=args.recursive)
    except ControlError as exc:
        return _fail(str(exc))
    if args.cache_command == "drop":
        print(f"neuralcache: dropped {count_of(reply['dropped_blocks'], 'cached block')} of "
              f"{count_of(reply['files'], 'file')}")
        return 0
    corrupt = reply["corrupt_blocks"]
    print(f"neuralcache: checked {count_of(reply['checked_blocks'], 'cached block')} of "
          f"{count_of(reply['files'], 'file')}: "
          + (f"{corrupt} corrupt, dropped (they will be fetched again)" if corrupt
             else "none corrupt"))
    return 1 if corrupt else 0


# --- parser -------------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    """Add ``warmup``, ``status`` and ``cache`` to the ``neuralcache`` parser."""
    warmup = sub.add_parser(
        "warmup", help="fetch files (or a recorded run's reads) into a mount's cache",
        description="Fetch files into the cache ahead of training, at prefetch priority, in the "
                    "order they will be read. The daemon keeps an unfinished warm-up and "
                    "resumes it after a restart.")
    warmup.add_argument("paths", nargs="*", metavar="PATH",
                        help="files or directories under a mountpoint (with --profile or "
                             "--cancel: the mount, if there are several)")
    warmup.add_argument("-r", "--recursive", action="store_true",
                        help="warm directories and everything below them")
    warmup.add_argument("--profile", metavar="FILE",
                        help="warm what a run recorded with 'mount --record-trace FILE' read, "
                             "in the order it first read it")
    warmup.add_argument("--wait", action="store_true",
                        help="show progress on stderr until done; exit 1 if anything failed "
                             "(alone: watch the running warm-up)")
    warmup.add_argument("--cancel", action="store_true", help="stop the running warm-up")
    warmup.set_defaults(func=cmd_warmup)

    status = sub.add_parser("status", help="a mount's hub link, cache and prefetch figures")
    status.add_argument("mountpoint", nargs="?",
                        help="the mount (or any path in it) [the only mount]")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.set_defaults(func=cmd_status)

    cache = sub.add_parser("cache", help="drop or verify the cached blocks of files")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    for name, text in (("drop", "forget the cached blocks of PATHs (read again from the hub)"),
                       ("verify", "check the cached blocks of PATHs against their checksums; "
                                  "corrupt ones are dropped; exit 1 if any were")):
        action = actions.add_parser(name, help=text)
        action.add_argument("paths", nargs="+", metavar="PATH", help="files or directories "
                                                                     "under a mountpoint")
        action.add_argument("-r", "--recursive", action="store_true",
                            help="include directories and everything below them")
    cache.set_defaults(func=cmd_cache)
