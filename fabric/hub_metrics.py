"""Prometheus metrics of the hub block server, each defined once here, and the registry the hub's
endpoint serves.

The hub is one command of the same program as the spoke, so the spoke's metric modules are
imported in the hub process too and register their metrics in the default registry. The hub
therefore serves ``REGISTRY`` below: its own metrics, the shared protocol-error counter and
the process' own figures, not a page of spoke metrics stuck at zero. Its metrics are in the
default registry as well, where in-process tests read them.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, PlatformCollector,
                               ProcessCollector)
from prometheus_client.registry import Collector

from . import metrics

REGISTRY = CollectorRegistry()
"""What ``neuralcache hub --metrics-port`` serves."""
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)
REGISTRY.register(metrics.PROTOCOL_ERRORS)

_C = TypeVar("_C", bound=Collector)


def _served(collector: _C) -> _C:
    REGISTRY.register(collector)
    return collector


HUB_REQUESTS = _served(Counter(
    "neuralcache_hub_requests_total", "Requests the hub received, by kind.", ["kind"]))
HUB_SENT_BYTES = _served(Counter(
    "neuralcache_hub_sent_bytes_total", "Block bytes the hub sent to spokes."))
HUB_READS = _served(Counter(
    "neuralcache_hub_reads_total",
    "Block reads the hub served, by where it did them: 'inline' on its event loop (a small "
    "read, every page already cached) or 'thread' in a worker thread.", ["path"]))
HUB_MIRRORED = _served(Counter(
    "neuralcache_hub_mirrored_requests_total",
    "Copies of requests a spoke sent on two connections (Mirror), by what the hub did with "
    "each: 'served' (the first), 'duplicate' (its twin, dropped), 'no_link' (the connection "
    "the reply belonged on was gone: dropped, the spoke asks again) or 'full' (that "
    "connection had its most requests in progress: dropped, its own copy waits its turn).",
    ["outcome"]))
HUB_ERRORS = _served(Counter(
    "neuralcache_hub_errors_total", "Requests the hub answered with an error, by code.",
    ["code"]))
HUB_CONNECTED_SPOKES = _served(Gauge(
    "neuralcache_hub_connected_spokes",
    "Spokes (by the name they said hello with) holding at least one connection to the hub."))
HUB_RETRANSMITTED_BYTES = _served(Counter(
    "neuralcache_hub_retransmitted_bytes_total",
    "Bytes the hub's TCP sent again after a loss on its spoke connections (tcpi_bytes_retrans); "
    "over neuralcache_hub_sent_bytes_total it is the paths' loss rate."))
HUB_BULK_CONGESTION = _served(Gauge(
    "neuralcache_hub_bulk_congestion_control",
    "1 for the TCP congestion control the hub's bulk connections run (nc_paced where it could "
    "be loaded: it only follows the spokes' pacing).", ["name"]))
