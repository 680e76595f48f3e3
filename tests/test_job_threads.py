"""JobThreads: results and errors come back to the loop, several threads work in parallel,
a posted job runs with no one waiting, a job's time spent waiting is told apart from its
running, and close stops them."""

import threading
import time

import pytest
import trio

from fabric.job_threads import JobThreads


def named(name: str) -> int:
    """Live threads called ``name`` (counting all threads would race with trio's own, which
    exit when idle)."""
    return sum(1 for t in threading.enumerate() if t.name == name)


def test_a_thread_returns_results_raises_errors_and_stops() -> None:
    reader = JobThreads(name="test-one-thread")

    def fail() -> None:
        raise ValueError("from the reader thread")

    async def main() -> None:
        assert await reader.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="from the reader thread"):
            await reader.run(fail)
    trio.run(main)
    trio.run(main)  # a later trio.run is served by the same thread
    assert named("test-one-thread") == 1
    reader.close()
    assert named("test-one-thread") == 0


def test_several_threads_run_their_jobs_at_once() -> None:
    pool = JobThreads(threads=3, follow_loop_cpu=False, name="test-pool")
    barrier = threading.Barrier(3, timeout=10)  # broken unless three jobs wait at once

    async def main() -> list[int]:
        results: list[int] = []

        async def one(k: int) -> None:
            results.append(await pool.run(lambda: barrier.wait() * 0 + k))
        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(one, k)
        return results
    assert sorted(trio.run(main)) == [0, 1, 2]
    assert named("test-pool") == 3
    pool.close()
    assert named("test-pool") == 0


def test_a_posted_job_runs_with_no_one_waiting_and_its_error_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    pager = JobThreads(follow_loop_cpu=False, name="test-post")
    done = threading.Event()

    def fail() -> None:
        raise ValueError("advice refused")
    pager.post(fail)
    pager.post(done.set)  # runs after the failed one: the thread goes on
    assert done.wait(10)
    pager.close()
    assert named("test-post") == 0
    assert any("posted job (fail) failed" in r.getMessage() and r.exc_info
               for r in caplog.records)


def test_only_a_single_thread_follows_the_loops_cpu() -> None:
    with pytest.raises(ValueError):
        JobThreads(threads=2)


def test_the_time_a_job_waits_behind_another_is_reported_apart_from_its_own() -> None:
    waits: list[float] = []
    hold = 0.3  # seconds the first job keeps the one thread
    reader = JobThreads(follow_loop_cpu=False, name="test-wait", on_wait=waits.append)
    first_running = threading.Event()

    def slow() -> str:
        first_running.set()
        time.sleep(hold)
        return "slow"

    def fail() -> None:
        raise ValueError("after the wait")

    async def main() -> None:
        async def second() -> None:
            await trio.to_thread.run_sync(first_running.wait)
            with pytest.raises(ValueError, match="after the wait"):
                await reader.run(fail)  # queued behind the slow one

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            assert await reader.run(slow) == "slow"
    trio.run(main)
    reader.close()
    # (trio may resume either task first.) The slow job's own run is not in its wait; the
    # failed job, queued once the slow one had started, waited for most of it.
    shorter, longer = sorted(waits)
    assert 0 <= shorter < hold / 2
    assert hold / 2 < longer < hold * 2
