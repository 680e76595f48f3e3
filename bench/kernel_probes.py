"""How long the hub kernel's BBR spends in PROBE_RTT on the bulk connections, sampled with ``ss``.

Linux's BBR (``tcp_bbr.c``) enters PROBE_RTT when its min-RTT sample is 10 s old: it holds
the connection's window at 4 segments until its data in flight has drained and then for a
round trip more, about two round trips in all (1.8 s at 900 ms), and a connection in it
sends nothing new. The connections of one spoke share one bottleneck, so they often see its
queue drain at the same moment and take their new minimum together: then they probe together
10 s later, and the whole pipe idles. ``ProbeSampler`` looks at the hub's connections every
``SAMPLE_PERIOD`` (``ss -tin`` in the hub's namespace) and counts how many of those running BBR
are in that state (by its gains, as ``ss`` shows them); ``ProbeSummary`` says for how much of a
run one of them, and all of them, were.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass

SAMPLE_PERIOD = 0.25
"""Seconds between looks: a probe lasts about two round trips, 120 ms at 60 ms."""

PROBE_GAINS = "pacing_gain:1,cwnd_gain:1)"
"""How ``ss`` shows BBR's gains in PROBE_RTT (both 1); no other state of it has a window gain
of 1 (PROBE_BW's is 2, STARTUP's and DRAIN's 2.89)."""


def probing(ss_output: str) -> tuple[int, int]:
    """``(connections running BBR, of them in PROBE_RTT)`` in ``ss -tin`` output."""
    bbr = probing_now = 0
    for line in ss_output.splitlines():
        if "bbr" not in line.split():  # the info line of a BBR connection names its control
            continue
        bbr += 1
        probing_now += PROBE_GAINS in line
    return bbr, probing_now


@dataclass(frozen=True)
class ProbeSummary:
    """A run's samples: seconds (samples times the period) with any and with every BBR
    connection in PROBE_RTT, and the most in it at once."""

    samples: int
    any_seconds: float
    all_seconds: float
    most_at_once: int

    @classmethod
    def of(cls, counts: list[tuple[int, int]], period: float = SAMPLE_PERIOD) -> "ProbeSummary":
        return cls(samples=len(counts),
                   any_seconds=period * sum(1 for _, p in counts if p),
                   all_seconds=period * sum(1 for n, p in counts if p and p == n),
                   most_at_once=max((p for _, p in counts), default=0))

    def line(self) -> str:
        return (f"kernel PROBE_RTT: {self.any_seconds:.1f} s with a bulk connection in it, "
                f"{self.all_seconds:.1f} s with all of them (at most {self.most_at_once} at "
                f"once)")


class ProbeSampler:
    """Samples ``ss -tin`` in namespace ``netns`` from a thread until ``stop``."""

    def __init__(self, netns: str, period: float = SAMPLE_PERIOD) -> None:
        self._netns = netns
        self._period = period
        self._counts: list[tuple[int, int]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-probes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> ProbeSummary:
        self._stopped.set()
        self._thread.join()
        return ProbeSummary.of(self._counts, self._period)

    def _run(self) -> None:
        command = ["ip", "netns", "exec", self._netns, "ss", "-tinH", "state", "established"]
        next_at = time.monotonic()
        while not self._stopped.is_set():
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode == 0:
                self._counts.append(probing(out.stdout))
            next_at += self._period
            self._stopped.wait(max(0.0, next_at - time.monotonic()))
