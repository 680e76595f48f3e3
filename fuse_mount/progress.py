"""A progress line for long jobs (``warmup --wait``): bytes done of total, recent rate, ETA.

Sans I/O: ``ProgressMeter`` takes (now, done) samples and says the rate over the last few
seconds (a job's start, when already-cached chunks complete at once, would otherwise inflate it
for good); ``render`` makes the line, with a bar for a terminal and plain text for a log.
"""

from __future__ import annotations

from collections import deque

from .status import human_bytes

RATE_WINDOW = 10.0
"""Seconds of samples the rate is measured over: long enough to be steady, short enough to
follow a link that changes speed."""
BAR_WIDTH = 30
"""Characters of the bar on a terminal."""


class ProgressMeter:
    """Recent rate and time left from (time, bytes done) samples."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, done: int) -> None:
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    @property
    def rate(self) -> float | None:
        """Bytes per second over the window, None until two samples apart in time."""
        if len(self._samples) < 2:
            return None
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def eta(self, total: int) -> float | None:
        """Seconds until ``total`` at the current rate; None if unknown or stalled."""
        rate = self.rate
        if not rate or not self._samples:
            return None
        return max(0.0, (total - self._samples[-1][1]) / rate)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def render(done: int, total: int, rate: float | None, eta: float | None, *, bar: bool,
           failed: int = 0) -> str:
    """'[#####-----]  45.2 MiB / 100.0 MiB  45 %  12.3 MiB/s  ETA 0:04' (no bar: plain)."""
    fraction = done / total if total else 1.0
    parts = [f"{human_bytes(done)} / {human_bytes(total)}", f"{fraction * 100:3.0f} %",
             f"{human_bytes(rate)}/s" if rate is not None else "-/s", f"ETA {_clock(eta)}"]
    if failed:
        parts.append(f"{human_bytes(failed)} failed")
    text = "  ".join(parts)
    if bar:
        filled = int(BAR_WIDTH * min(1.0, fraction))
        text = f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}]  {text}"
    return text
