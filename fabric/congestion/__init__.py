"""Sans-IO congestion control for the hub<->spoke transport, chosen by name (`--congestion`).

A "packet" is one range-read request counted by its response size; see base.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .base import (
    DEFAULT_INITIAL_RTT,
    DEFAULT_MSS,
    CongestionController,
    CongestionStats,
    DeliveryRateSampler,
    RateSample,
    ResumableController,
    SentPacket,
)
from .bbr import BBR, BBRState
from .cubic import Cubic
from .pacer import Pacer
from .windowed_filter import WindowedFilter

CONTROLLERS: Mapping[str, Callable[..., CongestionController]] = MappingProxyType(
    {"bbr": BBR, "cubic": Cubic}
)
"""Controller factories by the name accepted on the command line."""


def create_controller(
    name: str,
    *,
    initial_rtt: float = DEFAULT_INITIAL_RTT,
    mss: int = DEFAULT_MSS,
    **kw: Any,
) -> CongestionController:
    """Build the controller called `name`; extra keywords (e.g. BBR's seed) go to its class."""
    try:
        factory = CONTROLLERS[name]
    except KeyError:
        raise ValueError(
            f"unknown congestion controller {name!r}; choose one of {', '.join(CONTROLLERS)}"
        ) from None
    return factory(initial_rtt=initial_rtt, mss=mss, **kw)


__all__ = [
    "BBR",
    "BBRState",
    "CONTROLLERS",
    "CongestionController",
    "CongestionStats",
    "Cubic",
    "DEFAULT_INITIAL_RTT",
    "DEFAULT_MSS",
    "DeliveryRateSampler",
    "Pacer",
    "RateSample",
    "ResumableController",
    "SentPacket",
    "WindowedFilter",
    "create_controller",
]
