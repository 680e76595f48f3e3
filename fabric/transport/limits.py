"""Limits the hub and the spoke agree on without negotiating them."""

from __future__ import annotations

MAX_REQUESTS_PER_CONNECTION = 128
"""Requests one connection may have outstanding at the hub. The hub stops reading a connection
at this many; the spoke never has more on one whose replies have not reached it, so its
request stream never stalls there. 128 x 64 KiB per bulk connection covers BBR's STARTUP
(2.9 BDP) on a 900 ms, 100 Mbit/s path with four of them."""
