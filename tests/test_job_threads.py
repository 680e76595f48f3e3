"""JobThreads: results and errors come back to the loop, several threads work in parallel,
and close stops them."""

import threading

import pytest
import trio

from fabric.job_threads import JobThreads


def test_a_thread_returns_results_raises_errors_and_stops() -> None:
    reader = JobThreads()

    def fail() -> None:
        raise ValueError("from the reader thread")

    async def main() -> None:
        assert await reader.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="from the reader thread"):
            await reader.run(fail)
    trio.run(main)
    trio.run(main)  # a later trio.run is served by the same thread
    threads = threading.active_count()
    reader.close()
    assert threading.active_count() == threads - 1


def test_several_threads_run_their_jobs_at_once() -> None:
    pool = JobThreads(threads=3, follow_loop_cpu=False)
    barrier = threading.Barrier(3, timeout=10)  # broken unless three jobs wait at once

    async def main() -> list[int]:
        results: list[int] = []

        async def one(k: int) -> None:
            results.append(await pool.run(lambda: barrier.wait() * 0 + k))
        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(one, k)
        return results
    before = threading.active_count()
    assert sorted(trio.run(main)) == [0, 1, 2]
    assert threading.active_count() == before + 3
    pool.close()
    assert threading.active_count() == before


def test_only_a_single_thread_follows_the_loops_cpu() -> None:
    with pytest.raises(ValueError):
        JobThreads(threads=2)
