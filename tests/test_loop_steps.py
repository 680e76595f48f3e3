"""The long-step instrument (``mount --loop-steps``): counted by task, in a real trio loop."""

from __future__ import annotations

import time

import trio

from fuse_mount.loop_steps import FUSE_TASK, LongSteps, task_kind
from tests.fabric_helpers import metric


def _steps(task: str) -> tuple[float, float]:
    """The long-step counters of ``task`` as scraped (0 before its first long step)."""
    return (metric("neuralcache_loop_long_steps_total", {"task": task}),
            metric("neuralcache_loop_long_step_seconds_total", {"task": task}))


def test_task_kinds_are_bounded() -> None:
    assert task_kind("pyfuse-03") == task_kind("pyfuse-17") == FUSE_TASK
    assert task_kind("fuse_mount.prefetch.PrefetchPump.run") == "PrefetchPump.run"
    assert task_kind("main") == "main"


def test_counts_steps_at_or_over_the_threshold_only() -> None:
    now = [0.0]
    steps = LongSteps(threshold=0.001, clock=lambda: now[0])

    class Task:
        name = "tests.FakeOwner.short_then_long"

    before = _steps("FakeOwner.short_then_long")
    for took in (0.0005, 0.001, 0.004):
        steps.before_task_step(Task())  # type: ignore[arg-type]
        now[0] += took
        steps.after_task_step(Task())  # type: ignore[arg-type]
    count, seconds = _steps("FakeOwner.short_then_long")
    assert count - before[0] == 2
    assert abs(seconds - before[1] - 0.005) < 1e-9


async def _blocks_the_loop() -> None:
    await trio.sleep(0)
    time.sleep(0.005)  # a step that holds the loop, as a long plan would
    await trio.sleep(0)


async def _quick() -> None:
    for _ in range(10):
        await trio.sleep(0)


def test_a_real_loop_counts_the_task_that_held_it() -> None:
    blocker, quick = task_kind(_blocks_the_loop.__qualname__), task_kind(_quick.__qualname__)
    blocked_before, quick_before = _steps(blocker), _steps(quick)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_blocks_the_loop, name=_blocks_the_loop.__qualname__)
            nursery.start_soon(_quick, name=_quick.__qualname__)

    trio.run(main, instruments=[LongSteps()])
    count, seconds = _steps(blocker)
    assert count - blocked_before[0] >= 1
    assert seconds - blocked_before[1] >= 0.005
    assert _steps(quick) == quick_before
