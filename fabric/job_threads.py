"""Long-lived threads that run blocking reads for a trio event loop, so the loop never waits
on the disk: the spoke's LMDB reads (one thread: ``BlockCache.read_run``; reads whose pages are
in RAM the loop may do itself), its requests for pages ahead of them (another:
``BlockCache.page_in``) and the hub's reads of its export (a few threads, so several disk reads
are in progress at once).

A read of a few blocks is mostly the hand-off to a thread and back, which ``JobThreads`` keeps
as cheap as it gets on Linux.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")

log = logging.getLogger(__name__)


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    # The job is already queued and will answer; a read of a few blocks is short, so wait.
    return trio.lowlevel.Abort.FAILED


_libc = ctypes.CDLL(None, use_errno=True)


class JobThreads:
    """Long-lived threads, waiting on one queue, that run short blocking jobs for the loop.

    A warm FUSE read is a few microseconds of LMDB work, and the hand-off to a thread and back
    costs more than that. A thread already waiting on a queue and answering through the trio
    token costs less per call than ``trio.to_thread.run_sync`` (limiter, context copy, thread
    cache), and less again when it runs on the CPU the loop runs on, as a ``SCHED_BATCH``
    thread: the GIL lets only one of the two run Python at a time anyway, and a wake-up on the
    same CPU is a context switch where one on another CPU is an inter-processor interrupt (on
    an idle VM, where each is a VM exit, that halves the round trip).
    ``python -m bench.read_path_costs`` measures all three (``follow_loop_cpu=False`` leaves the
    thread wherever the scheduler puts it); ``python -m bench.hub_cpu`` the hub's reads.
    ``threads`` > 1 serve one queue, for jobs that wait on the disk in parallel; they are never
    bound to the loop's CPU. The threads start on first use and stop at ``close``; calls may
    come from successive ``trio.run``s.

    ``on_wait(seconds)``, if given, is called on the loop after each ``run`` with the time its
    job spent not running: queued behind other jobs, waiting for the thread to get a CPU and
    the GIL, and waiting for the loop to take the result back. A thread that is the bottleneck
    shows there, not in the job's own time.
    """

    def __init__(self, *, threads: int = 1, follow_loop_cpu: bool = True,
                 name: str = "neuralcache-lmdb-reader",
                 on_wait: Callable[[float], None] | None = None) -> None:
        if threads < 1 or (threads > 1 and follow_loop_cpu):
            raise ValueError("one thread or more; only a single thread follows the loop's CPU")
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._count = threads
        self._name = name
        self._follow = follow_loop_cpu
        self._cpu = -1  # the CPU the thread is bound to, -1 for none
        self._on_wait = on_wait

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of the threads; not cancellable once queued (it is short)."""
        self._start()
        if self._follow:
            self._follow_loop_cpu()
        queued = time.perf_counter()
        self._jobs.put((fn, args, trio.lowlevel.current_task(),
                        trio.lowlevel.current_trio_token()))
        result, ran = await trio.lowlevel.wait_task_rescheduled(_refuse_abort)
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - queued - ran)
        return result.unwrap()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` in one of the threads, with no one waiting for it (advice to the
        kernel, whose result nobody needs); an exception it raises is logged."""
        self._start()
        self._jobs.put((fn, args, None, None))

    def _start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._serve, name=self._name, daemon=True)
                             for _ in range(self._count)]
            for thread in self._threads:
                thread.start()

    def _follow_loop_cpu(self) -> None:
        """Bind the thread to the CPU the caller runs on now (again if the caller moved)."""
        cpu = _libc.sched_getcpu()
        if cpu == self._cpu or cpu < 0:
            return
        native_id = self._threads[0].native_id
        assert native_id is not None
        try:
            os.sched_setaffinity(native_id, {cpu})
        except OSError:  # e.g. a cpuset that forbids it: the thread just runs anywhere
            return
        self._cpu = cpu

    def _serve(self) -> None:
        try:
            # A thread handed a job must not preempt the loop (on its CPU, or on the other one
            # where the loop's peers run): it would only block on the GIL the loop still holds.
            # As a batch thread it runs once the loop sleeps (bench.daemon_cpu: ~2 involuntary
            # switches per read fewer).
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass  # not allowed here: the thread still works, with more switches
        while (job := self._jobs.get()) is not None:
            fn, args, task, token = job
            if task is None:
                try:
                    fn(*args)
                except Exception:
                    log.exception("a posted job (%s) failed", getattr(fn, "__name__", fn))
                continue
            started = time.perf_counter()
            result = outcome.capture(fn, *args)
            ran = time.perf_counter() - started
            token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.Value((result, ran)))

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._cpu = -1
