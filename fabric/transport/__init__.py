"""The hub<->spoke data path: the pieces the hub server and the hub client are built from.

Sans-IO: ``request_pipe`` (which request leaves next under the congestion controller and
pacer; demand before prefetch) and ``fair_queue`` (the hub's demand-first, per-spoke deficit
round robin). Thin I/O helpers: ``framing`` (whole frames off a trio stream with few copies)
and ``tcp`` (socket options). ``limits`` holds what both ends assume. See docs/transport.md.
"""
