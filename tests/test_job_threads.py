"""JobThreads: results and errors come back to the loop, several threads work in parallel,
a posted job runs with no one waiting, and close stops them."""

import threading

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
