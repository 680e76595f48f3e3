"""Prometheus metrics of the fabric shared by both ends and of the spoke's hub client, each
defined once here (the hub server's own live in ``hub_metrics``, so a spoke does not export
them), and the HTTP endpoint both processes serve them on. docs/metrics.md lists every metric."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import (REGISTRY, CollectorRegistry, Counter, Gauge,
                               disable_created_metrics, start_http_server)

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

# The transport's congestion model (fabric/transport, fabric/congestion), as the spoke's
# controller sees the path to its hub. Byte figures count read-reply payload.
FABRIC_BTL_BW = Gauge(
    "neuralcache_fabric_btl_bw_bytes_per_second",
    "Bottleneck bandwidth estimate (BBR's windowed max delivery rate; CUBIC: latest rate).")
FABRIC_MIN_RTT = Gauge(
    "neuralcache_fabric_min_rtt_seconds",
    "Smallest request round trip seen (request sent to reply fully received); 0 before any.")
FABRIC_SRTT = Gauge(
    "neuralcache_fabric_srtt_seconds", "Smoothed request round trip; 0 before any sample.")
FABRIC_PACING_RATE = Gauge(
    "neuralcache_fabric_pacing_rate_bytes_per_second",
    "Rate at which the spoke releases prefetch requests (the controller's pacing rate).")
FABRIC_CWND = Gauge(
    "neuralcache_fabric_cwnd_bytes", "Reply bytes the controller allows in flight.")
FABRIC_INFLIGHT = Gauge(
    "neuralcache_fabric_inflight_bytes", "Reply bytes requested and not yet received.")
FABRIC_HEADROOM = Gauge(
    "neuralcache_fabric_prefetch_headroom_ratio",
    "Fraction of the pacing rate prefetch leaves unused to keep the bottleneck queue empty.")
FABRIC_QUEUED = Gauge(
    "neuralcache_fabric_prefetch_queued_bytes", "Prefetch bytes waiting to be requested.")
FABRIC_STATE = Gauge(
    "neuralcache_fabric_state",
    "1 for the congestion controller's current state, 0 for states it has left.",
    ["controller", "state"])
FABRIC_LOST_REQUESTS = Counter(
    "neuralcache_fabric_lost_requests_total",
    "Requests given up on by the transport (connection lost or no answer in time).")
FABRIC_LOSS_RATIO = Gauge(
    "neuralcache_fabric_loss_ratio",
    "Fraction of requested reply bytes lost so far (lost / (delivered + lost)).")
FABRIC_RESENT_RATIO = Gauge(
    "neuralcache_fabric_resent_ratio",
    "Share of the reply bytes delivered over the last 10 s that the hub's TCP had to resend "
    "(its loss repairs, reported in every read reply); small demand reads are hedged while it "
    "is at least 0.001.")
FABRIC_REQUESTS = Counter(
    "neuralcache_fabric_requests_total",
    "Read requests sent to the hub, by priority (a hedged demand read counts each copy).",
    ["priority"])
FABRIC_MIRRORED_REQUESTS = Counter(
    "neuralcache_fabric_mirrored_requests_total",
    "Bulk read requests also sent on a second connection while a path shorter than 200 ms "
    "loses segments (the hub answers the first copy to arrive, on the first connection).")
FABRIC_DISPATCH_WAIT = Counter(
    "neuralcache_fabric_prefetch_dispatch_wait_seconds_total",
    "Seconds the spoke's prefetch dispatcher waited before its next request, by what for: "
    "pacer (the pacing rate), pacer_late (past the pacer's time, for the busy event loop), "
    "window (the congestion window full), empty (no prefetch queued), connections (no bulk "
    "connection with room).", ["reason"])
FABRIC_EXPEDITED_BLOCKS = Counter(
    "neuralcache_fabric_expedited_blocks_total",
    "Blocks a reader needed while their prefetch request still waited in the spoke's queue; "
    "they were sent at once as demand requests.")
FABRIC_PATH_RESUMES = Counter(
    "neuralcache_fabric_path_resumes_total",
    "Starts of the hub client with a kept model of its path (fabric/path_memory.py), by "
    "outcome: resumed (the controller started from it), other_path (another hub or "
    "controller), expired (older than a day), rtt_changed (the greeting's round trip is not "
    "the one remembered), not_resumable (the controller cannot resume or had begun).",
    ["outcome"])
FABRIC_PATH_SAVE_ERRORS = Counter(
    "neuralcache_fabric_path_save_errors_total",
    "Failed writes of the path's model to its record (disk full, permissions); the transport "
    "goes on, and the next start learns the path from scratch.")
FABRIC_CONNECTIONS = Gauge(
    "neuralcache_fabric_connections", "Live connections to the hub, by role.", ["role"])


def serve_metrics(port: int, addr: str, registry: CollectorRegistry = REGISTRY) -> WSGIServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a background thread.

    Counters and histograms lose their ``_created`` companion series: the Prometheus text
    format has no use for them and they would double every counter's series.
    """
    disable_created_metrics()
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
