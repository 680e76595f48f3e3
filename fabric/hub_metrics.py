"""Prometheus metrics of the hub block server, each defined once here."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

HUB_REQUESTS = Counter(
    "neuralcache_hub_requests_total", "Requests the hub received, by kind.", ["kind"])
HUB_SENT_BYTES = Counter(
    "neuralcache_hub_sent_bytes_total", "Block bytes the hub sent to spokes.")
HUB_ERRORS = Counter(
    "neuralcache_hub_errors_total", "Requests the hub answered with an error, by code.", ["code"])
HUB_CONNECTED_SPOKES = Gauge(
    "neuralcache_hub_connected_spokes", "Spoke connections currently open on the hub.")
