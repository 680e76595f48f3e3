"""The one thread that runs the spoke's LMDB reads that may wait for the disk, so the event
loop never does (reads whose pages are in RAM the loop may do itself: ``BlockCache.read_run``).

One thread, not a pool: the GIL lets one thread run Python at a time anyway, and a warm read is
mostly the hand-off, which ``ReaderThread`` keeps as cheap as it gets on Linux.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    # The job is already queued and will answer; an LMDB read is short, so wait for it.
    return trio.lowlevel.Abort.FAILED


_libc = ctypes.CDLL(None, use_errno=True)


class ReaderThread:
    """A long-lived thread that runs LMDB reads for the event loop, on the loop's CPU.

    A warm FUSE read is a few microseconds of LMDB work, and the hand-off to a thread and back
    costs more than that. A thread already waiting on a queue and answering through the trio
    token costs less per call than ``trio.to_thread.run_sync`` (limiter, context copy, thread
    cache), and less again when it runs on the CPU the loop runs on, as a ``SCHED_BATCH``
    thread: the GIL lets only one of the two run Python at a time anyway, and a wake-up on the
    same CPU is a context switch where one on another CPU is an inter-processor interrupt (on
    an idle VM, where each is a VM exit, that halves the round trip).
    ``python -m bench.read_path_costs`` measures all three (``follow_loop_cpu=False`` leaves the
    thread wherever the scheduler puts it). The thread starts on first use and stops at
    ``close``; calls may come from successive ``trio.run``s.
    """

    def __init__(self, *, follow_loop_cpu: bool = True) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._follow = follow_loop_cpu
        self._cpu = -1  # the CPU the thread is bound to, -1 for none

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the reader thread; not cancellable once queued (it is short)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="neuralcache-lmdb-reader",
                                            daemon=True)
            self._thread.start()
        if self._follow:
            self._follow_loop_cpu()
        self._jobs.put((fn, args, trio.lowlevel.current_task(),
                        trio.lowlevel.current_trio_token()))
        return await trio.lowlevel.wait_task_rescheduled(_refuse_abort)

    def _follow_loop_cpu(self) -> None:
        """Bind the thread to the CPU the caller runs on now (again if the caller moved)."""
        cpu = _libc.sched_getcpu()
        if cpu == self._cpu or cpu < 0:
            return
        assert self._thread is not None and self._thread.native_id is not None
        try:
            os.sched_setaffinity(self._thread.native_id, {cpu})
        except OSError:  # e.g. a cpuset that forbids it: the thread just runs anywhere
            return
        self._cpu = cpu

    def _serve(self) -> None:
        try:
            # Sharing the loop's CPU, the thread must not preempt the loop when handed a job:
            # it would only block on the GIL the loop still holds. As a batch thread it runs
            # once the loop sleeps (bench.daemon_cpu: ~2 involuntary switches per read fewer).
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass  # not allowed here: the thread still works, with more switches
        while (job := self._jobs.get()) is not None:
            fn, args, task, token = job
            token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.capture(fn, *args))

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            self._cpu = -1
