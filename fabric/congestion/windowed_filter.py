"""Kathleen Nichols' windowed min/max filter (the algorithm of Linux's lib/win_minmax.c).

It tracks the best, second-best and third-best sample of a sliding window in O(1) memory,
so BBR can ask "the largest delivery rate of the last 10 round trips" without keeping
every sample. Time is whatever unit the caller uses (BBR uses round-trip counts).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Sample:
    time: float
    value: float


class WindowedFilter:
    """Running best-of-window estimate; `better(a, b)` is True when a should replace b.

    The estimate is always a sample taken within the last `window` time units, and it is
    never worse than the newest sample.
    """

    def __init__(self, window: float, better: Callable[[float, float], bool]) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self._better = better
        self._s: list[_Sample] = []

    @classmethod
    def max_filter(cls, window: float) -> WindowedFilter:
        """Windowed maximum (BBR's bottleneck-bandwidth filter)."""
        return cls(window, operator.ge)

    @classmethod
    def min_filter(cls, window: float) -> WindowedFilter:
        """Windowed minimum (e.g. an RTT floor)."""
        return cls(window, operator.le)

    def get(self) -> float | None:
        """The current best value, or None before the first sample."""
        return self._s[0].value if self._s else None

    def reset(self, value: float, time: float) -> float:
        """Forget everything and start over from one sample."""
        sample = _Sample(time, value)
        self._s = [sample, sample, sample]
        return value

    def update(self, value: float, time: float) -> float:
        """Add a sample taken at `time` (non-decreasing) and return the windowed best."""
        s = self._s
        if not s or self._better(value, s[0].value) or time - s[2].time > self.window:
            # New best, or even the third choice has aged out: restart from this sample.
            return self.reset(value, time)
        sample = _Sample(time, value)
        if self._better(value, s[1].value):
            s[1] = s[2] = sample
        elif self._better(value, s[2].value):
            s[2] = sample
        return self._subwindow_update(sample)

    def _subwindow_update(self, sample: _Sample) -> float:
        """Age the three choices so that the best is always from inside the window."""
        s = self._s
        dt = sample.time - s[0].time
        if dt > self.window:
            # The best has expired: promote second and third, take the new sample as third.
            s[0], s[1], s[2] = s[1], s[2], sample
            if sample.time - s[0].time > self.window:
                s[0], s[1], s[2] = s[1], s[2], sample
        elif s[1].time == s[0].time and dt > self.window / 4:
            # A quarter window passed with no second choice: take one from this subwindow.
            s[1] = s[2] = sample
        elif s[2].time == s[1].time and dt > self.window / 2:
            # Half a window passed with no third choice: take one from this subwindow.
            s[2] = sample
        return s[0].value
