"""Event-loop steps long enough to hold FUSE requests up (``neuralcache mount --loop-steps``).

Every read of the mount shares the daemon's one trio loop with the prefetcher and the hub
client. A FUSE request that becomes ready while another task runs waits until that task
yields, so the readers' tail latency follows the loop's longest steps (docs/repro.md, session
37). This trio instrument times each task step and counts those of ``LONG_STEP`` or more, by
task, as Prometheus counters. Wall time: a step the kernel preempted holds the requests up
just the same. Off unless asked for: it runs twice in every scheduler step, a cost
``loop_load`` avoids on every mount.
"""

from __future__ import annotations

import time
from typing import Callable

import trio

from . import metrics

LONG_STEP = 0.001
"""Seconds from which a step is counted: a warm 16 KiB read is answered in a tenth of that, so
a step this long holds a request up for several of its own service times."""

FUSE_TASK_PREFIX = "pyfuse-"
"""pyfuse3 names its request workers ``pyfuse-NN``: one label for all of them."""
FUSE_TASK = "fuse_requests"


def task_kind(name: str) -> str:
    """A bounded label for a task: pyfuse3's workers as one, any other task by the last two
    parts of its function's dotted name (``PrefetchPump.run``, ``HubClient._keep_up``)."""
    if name.startswith(FUSE_TASK_PREFIX):
        return FUSE_TASK
    return ".".join(name.split(".")[-2:])


class LongSteps(trio.abc.Instrument):
    """Counts the loop's task steps of at least ``threshold`` seconds, by task kind."""

    def __init__(self, threshold: float = LONG_STEP,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.threshold = threshold
        self._clock = clock
        self._started = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = self._clock()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = self._clock() - self._started
        if took >= self.threshold:
            kind = task_kind(task.name)
            metrics.LOOP_LONG_STEPS.labels(kind).inc()
            metrics.LOOP_LONG_STEP_SECONDS.labels(kind).inc(took)
