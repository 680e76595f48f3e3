"""Read a Prometheus endpoint back into numbers (used by the demo, the benches and the tests)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    """All samples of ``http://host:port/metrics``, keyed by (name, sorted label pairs)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent: a labelled counter not yet touched)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
