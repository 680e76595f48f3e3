"""``neuralcache status``: one snapshot of a mount, read from the daemon's Prometheus registry
(so it agrees with the metrics endpoint by construction), and its table for humans."""

from __future__ import annotations

import functools
import math
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled sample not yet touched."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _labelled(registry: CollectorRegistry, family: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of a labelled gauge, with its labels."""
    return [(s.labels, s.value) for metric in registry.collect() if metric.name == family
            for s in metric.samples if s.name == family]


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def snapshot(mount: dict[str, Any], warmup: dict[str, Any],
             registry: CollectorRegistry = REGISTRY) -> dict[str, Any]:
    """The figures ``status`` shows (``--json`` prints exactly this). Byte figures in bytes,
    times in seconds, rates in bytes per second, ratios in [0, 1] or None before any sample."""
    v = functools.partial(_value, registry)
    states = [labels for labels, value in _labelled(registry, "neuralcache_fabric_state")
              if value == 1]
    connections = {labels["role"]: int(value)
                   for labels, value in _labelled(registry, "neuralcache_fabric_connections")}

    def count(name: str, **labels: str) -> int:
        """Bytes and blocks are whole numbers, though Prometheus keeps every value as a float."""
        return int(v(name, **labels))

    hits = count("neuralcache_cache_hit_blocks_total")
    misses = count("neuralcache_cache_miss_blocks_total")
    used = count("neuralcache_cache_used_bytes")
    capacity = count("neuralcache_cache_capacity_bytes")
    issued = count("neuralcache_prefetch_issued_bytes_total")
    useful = count("neuralcache_prefetch_useful_bytes_total")
    return {
        **mount,
        "link": {
            "up": v("neuralcache_hub_link_up") == 1,
            "connections": connections,
            "controller": states[0]["controller"] if states else None,
            "state": states[0]["state"] if states else None,
            "btl_bw_bytes_per_second": v("neuralcache_fabric_btl_bw_bytes_per_second"),
            "min_rtt_seconds": v("neuralcache_fabric_min_rtt_seconds"),
            "srtt_seconds": v("neuralcache_fabric_srtt_seconds"),
            "pacing_rate_bytes_per_second":
                v("neuralcache_fabric_pacing_rate_bytes_per_second"),
            "inflight_bytes": count("neuralcache_fabric_inflight_bytes"),
            "loss_ratio": v("neuralcache_fabric_loss_ratio"),
        },
        "cache": {
            "hit_blocks": hits,
            "miss_blocks": misses,
            "hit_ratio": _ratio(hits, hits + misses),
            "used_bytes": used,
            "capacity_bytes": capacity,
            "fill_ratio": _ratio(used, capacity),
            "evicted_blocks": count("neuralcache_cache_evictions_total"),
            "corrupt_blocks": count("neuralcache_cache_corrupt_blocks_total"),
        },
        "reads": {
            "cache_bytes": count("neuralcache_read_bytes_total", source="cache"),
            "hub_bytes": count("neuralcache_read_bytes_total", source="hub"),
        },
        "prefetch": {
            "issued_bytes": issued,
            "useful_bytes": useful,
            "late_bytes": count("neuralcache_prefetch_late_bytes_total"),
            "wasted_bytes": count("neuralcache_prefetch_wasted_bytes_total"),
            "failed_bytes": count("neuralcache_prefetch_failed_bytes_total"),
            "accuracy": _ratio(useful, issued),
            "inflight_bytes": count("neuralcache_prefetch_inflight_bytes"),
        },
        "warmup": warmup,
    }


# --- formatting ---------------------------------------------------------------------------------

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as ``--cache-size`` takes them)."""
    unit = 0
    while abs(n) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        n /= 1024
        unit += 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {_BINARY_UNITS[unit]}"


def count_of(n: int, noun: str) -> str:
    """3, 'file' -> '3 files'; 1, 'file' -> '1 file'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def human_rate(bytes_per_second: float) -> str:
    """Link rates in Mbit/s, as the mount's ``--link-bandwidth`` takes them."""
    return f"{bytes_per_second * 8 / 1e6:.1f} Mbit/s"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f} %"


def _ms(seconds: float) -> str:
    return "-" if not seconds or not math.isfinite(seconds) else f"{seconds * 1e3:.1f} ms"


def format_warmup(w: dict[str, Any]) -> str:
    if w["state"] == "idle":
        return "none"
    text = (f"{w['state']}: {human_bytes(w['done_bytes'])} of {human_bytes(w['total_bytes'])} "
            f"in {count_of(w['files'], 'file')}")
    if w["failed_bytes"]:
        text += f", {human_bytes(w['failed_bytes'])} failed"
    return text


def format_status(s: dict[str, Any]) -> str:
    """The snapshot as a two-column table."""
    link, cache, pf, reads = s["link"], s["cache"], s["prefetch"], s["reads"]
    conns = ", ".join(f"{n} {role}" for role, n in sorted(link["connections"].items()))
    model = f"{link['controller']} ({link['state']})" if link["controller"] else "-"
    rows = [
        ("mount", s["mountpoint"]),
        ("hub", f"{s['hub']}  link {'up' if link['up'] else 'DOWN'}"
                + (f"  [{conns} connections]" if conns else "")),
        ("congestion model", model),
        ("  bottleneck bw", human_rate(link["btl_bw_bytes_per_second"])),
        ("  min / smoothed RTT", f"{_ms(link['min_rtt_seconds'])} / {_ms(link['srtt_seconds'])}"),
        ("  pacing rate", human_rate(link["pacing_rate_bytes_per_second"])),
        ("  loss", _percent(link["loss_ratio"])),
        ("cache hit ratio", f"{_percent(cache['hit_ratio'])}  ({cache['hit_blocks']:,} of "
                            f"{cache['hit_blocks'] + cache['miss_blocks']:,} blocks read)"),
        ("cache fill", f"{human_bytes(cache['used_bytes'])} of "
                       f"{human_bytes(cache['capacity_bytes'])}  "
                       f"({_percent(cache['fill_ratio'])})"),
        ("  evicted / corrupt", f"{cache['evicted_blocks']:,} / "
                                f"{cache['corrupt_blocks']:,} blocks"),
        ("bytes read", f"{human_bytes(reads['cache_bytes'])} from cache, "
                       f"{human_bytes(reads['hub_bytes'])} from hub"),
        ("prefetch accuracy", f"{_percent(pf['accuracy'])}  "
                              f"(useful {human_bytes(pf['useful_bytes'])}"
                              f" of {human_bytes(pf['issued_bytes'])} issued)"),
        ("  late / wasted / failed", f"{human_bytes(pf['late_bytes'])} / "
                                     f"{human_bytes(pf['wasted_bytes'])} / "
                                     f"{human_bytes(pf['failed_bytes'])}"),
        ("in flight", f"{human_bytes(pf['inflight_bytes'])} prefetch, "
                      f"{human_bytes(link['inflight_bytes'])} on the hub link"),
        ("warm-up", format_warmup(s["warmup"])),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
