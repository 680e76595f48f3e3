"""Prometheus metrics of the fabric shared by both ends and of the spoke's hub client, each defined once
here (the hub server's own live in ``hub_metrics``, so a spoke does not export them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PROTOCOL_ERRORS = Counter(
    "neuralcache_protocol_errors_total",
    "Connections closed because the peer sent a malformed, truncated or oversized frame.", ["side"])
CHECKSUM_FAILURES = Counter(
    "neuralcache_checksum_failures_total",
    "Blocks received from the hub whose checksum did not match; they are never stored or served.")
HUB_FETCH_RETRIES = Counter(
    "neuralcache_hub_fetch_retries_total",
    "Read requests the spoke sent again after a lost connection, a checksum failure or a timeout.")
HUB_LINK_UP = Gauge(
    "neuralcache_hub_link_up", "1 while the spoke holds a working connection to the hub, else 0.")
