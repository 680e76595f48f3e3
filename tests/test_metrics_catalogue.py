"""The Prometheus metrics catalogue: what a live hub and spoke serve, what docs/metrics.md lists and
what the Grafana dashboard queries must all be the same set of metrics, with the same types,
labels and help text, and the values must add up after a cold and a warm read of a tree."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample

import fabric.metrics
import fuse_mount.metrics
from fabric import hub_metrics
from fabric.export import Export
from fabric.hub import _Retransmissions
from fabric.transport import tcp
from fuse_mount.launch import Hub, Spoke
from fuse_mount.loop_metrics import LoopFamily
from neuralcache.blocks import BLOCK_SIZE
from tests.conftest import needs_fuse

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "metrics.md"
DASHBOARD = REPO / "docs" / "grafana" / "neuralcache-dashboard.json"
PREFIX = "neuralcache_"
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
"""Suffixes of the series a histogram is exposed as; queries name those, the catalogue the base."""


@dataclass(frozen=True)
class Entry:
    """One catalogue metric as exposed: ``name`` carries the ``_total`` of a counter."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def exposed_name(family_name: str, kind: str) -> str:
    """The name a family is written under: prometheus-client drops a counter's ``_total`` from
    the family name (both when registering and when parsing) and writes it back on exposure."""
    return f"{family_name}_total" if kind == "counter" else family_name


def module_entries(*modules: ModuleType) -> dict[str, Entry]:
    """Every metric the modules define, keyed by exposed name: metric objects, and the families
    of collectors that read their values at scrape time (unlabelled), and the event loop's
    lock-free families (``loop_metrics``)."""
    out = {}
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, MetricWrapperBase):
                family = obj.describe()[0]
                name = exposed_name(family.name, family.type)
                out[name] = Entry(name, family.type, tuple(obj._labelnames), family.documentation)
            elif isinstance(obj, LoopFamily):
                family = obj.family()
                name = exposed_name(family.name, family.type)
                out[name] = Entry(name, family.type, tuple(obj.labelnames), family.documentation)
            elif (callable(getattr(obj, "describe", None))
                  and not isinstance(obj, (type, CollectorRegistry))):
                for family in obj.describe():
                    name = exposed_name(family.name, family.type)
                    out[name] = Entry(name, family.type, (), family.documentation)
    return out


ALL_ENTRIES = module_entries(fuse_mount.metrics, fabric.metrics, hub_metrics)
SPOKE = module_entries(fuse_mount.metrics, fabric.metrics)
"""What the spoke serves: the daemon's and the hub client's metrics (the default registry of a
process that never imports the hub server)."""
HUB_SERVED = {exposed_name(f.name, f.type) for f in hub_metrics.REGISTRY.collect()
              if f.name.startswith(PREFIX)}
"""What the hub serves: the ``neuralcache_`` families of its own registry."""
HUB = {name: ALL_ENTRIES[name] for name in HUB_SERVED if name in ALL_ENTRIES}
CATALOGUE = set(SPOKE) | set(HUB)


def base_metric(series: str) -> str:
    """A queried series name -> the catalogue name it belongs to."""
    if series in ALL_ENTRIES:
        return series
    for suffix in HISTOGRAM_SERIES:
        entry = ALL_ENTRIES.get(series.removesuffix(suffix))
        if series.endswith(suffix) and entry is not None and entry.type == "histogram":
            return entry.name
    return series


# --- the code's catalogue against itself ----------------------------------------------------

def test_every_metric_follows_the_naming_conventions() -> None:
    assert set(HUB) == HUB_SERVED, "the hub serves a metric none of the metric modules define"
    hub_only = set(HUB) - set(SPOKE)
    assert hub_only and set(HUB) - hub_only == {"neuralcache_protocol_errors_total"}
    for entry in ALL_ENTRIES.values():
        assert entry.name.startswith(PREFIX), entry.name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", entry.name), entry.name
        assert entry.help.strip(), f"{entry.name} has no help text"
        assert entry.name.endswith("_total") == (entry.type == "counter"), entry.name
        assert not re.search(r"_(milli|micro|kilo|mega)|_ms$|_kb|_mb|_bits", entry.name), (
            f"{entry.name}: use base units (seconds, bytes)")


# --- docs/metrics.md ------------------------------------------------------------------------

_ROW = re.compile(r"^\|\s*`(neuralcache_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|")


def doc_tables() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """Per ``## `` section of the doc: metric name -> (type, labels) from its table rows."""
    sections: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {}
    current: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].split()[0].lower(), {})
        elif m := _ROW.match(line):
            assert m.group(1) not in current, f"{m.group(1)} listed twice in one section"
            current[m.group(1)] = (m.group(2), tuple(re.findall(r"`(\w+)`", m.group(3))))
    return sections


@pytest.mark.parametrize("section, served", [("spoke", SPOKE), ("hub", HUB)])
def test_the_doc_lists_exactly_the_registered_metrics(section: str, served: dict[str, Entry]
                                                      ) -> None:
    listed = doc_tables()[section]
    assert set(listed) == set(served), (
        f"missing from the doc: {sorted(set(served) - set(listed))}; "
        f"in the doc but not registered: {sorted(set(listed) - set(served))}")
    for name, (kind, labels) in listed.items():
        assert (kind, set(labels)) == (served[name].type, set(served[name].labels)), name


def test_every_metric_the_doc_mentions_exists() -> None:
    """The queries and prose may name only real series (a histogram's _bucket etc. included)."""
    mentioned = set(re.findall(r"neuralcache_[a-z0-9_]*[a-z0-9]", DOC.read_text()))
    assert {base_metric(s) for s in mentioned} <= CATALOGUE, sorted(
        s for s in mentioned if base_metric(s) not in CATALOGUE)


# --- the Grafana dashboard ------------------------------------------------------------------

def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_the_dashboard_queries_only_catalogue_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    queried: set[str] = set()
    panels = [p for p in dashboard_panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in dashboard_panels(dashboard)}) == len(dashboard_panels(dashboard))
    taken: set[tuple[int, int]] = set()
    for panel in dashboard_panels(dashboard):  # on Grafana's 24-column grid, none overlapping
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            names = re.findall(r"neuralcache_[a-z0-9_]*[a-z0-9]", target["expr"])
            assert names, f"{panel['title']}: {target['expr']}"
            queried |= {base_metric(n) for n in names}
    for variable in variables.values():
        if variable["type"] == "query":
            queried |= set(re.findall(r"neuralcache_[a-z0-9_]*[a-z0-9]", variable["definition"]))
    assert queried <= CATALOGUE, sorted(queried - CATALOGUE)
    for wanted in ("neuralcache_read_bytes_total", "neuralcache_read_latency_seconds",
                   "neuralcache_cache_hit_blocks_total", "neuralcache_cache_used_bytes",
                   "neuralcache_prefetch_useful_bytes_total",
                   "neuralcache_prefetch_wasted_bytes_total",
                   "neuralcache_fabric_btl_bw_bytes_per_second",
                   "neuralcache_fabric_min_rtt_seconds",
                   "neuralcache_fabric_pacing_rate_bytes_per_second",
                   "neuralcache_hub_requests_total", "neuralcache_hub_errors_total"):
        assert wanted in queried, f"the dashboard has no panel on {wanted}"


# --- the new gauges and counters, without a mount -------------------------------------------

def test_metadata_sync_age_counts_from_the_load() -> None:
    now = [100.0]
    fuse_mount.metrics.metadata_loaded(42, clock=lambda: now[0])
    now[0] += 7.5
    value = {s.name: s.value for s in fuse_mount.metrics.METADATA_SYNC_AGE.collect()[0].samples}
    assert value == {"neuralcache_metadata_sync_age_seconds": 7.5}
    entries = fuse_mount.metrics.METADATA_ENTRIES.collect()[0].samples
    assert [s.value for s in entries] == [42]


class _FakeTcpSocket:
    """Answers TCP_INFO with a chosen tcpi_bytes_retrans (offset 208 of struct tcp_info)."""

    def __init__(self) -> None:
        self.retrans = 0

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_INFO)
        info = bytearray(size)
        struct.pack_into("=Q", info, 208, self.retrans)
        return bytes(info)


def _counter_value(counter: Counter) -> float:
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def test_hub_retransmissions_count_each_connections_increase_once() -> None:
    sock = _FakeTcpSocket()
    tracker = _Retransmissions(sock)  # type: ignore[arg-type]
    before = _counter_value(hub_metrics.HUB_RETRANSMITTED_BYTES)
    for retrans in (0, 1448, 1448, 4344):
        sock.retrans = retrans
        tracker.update()
    assert _counter_value(hub_metrics.HUB_RETRANSMITTED_BYTES) - before == 4344
    _Retransmissions(object()).update()  # type: ignore[arg-type]  # not a socket: no count
    assert _counter_value(hub_metrics.HUB_RETRANSMITTED_BYTES) - before == 4344


def test_retransmitted_bytes_reads_a_real_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                client.sendall(b"x" * 100_000)
                assert peer.recv(1) == b"x"
                assert tcp.retransmitted_bytes(client) == 0  # loopback loses nothing
    assert tcp.retransmitted_bytes(object()) is None


# --- a live hub and spoke -------------------------------------------------------------------

Families = dict[str, tuple[str, str, list[Sample]]]


def scrape_families(port: int) -> Families:
    """The ``neuralcache_`` families at ``http://127.0.0.1:port/metrics``: name -> (type, help,
    samples), parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {exposed_name(f.name, f.type): (f.type, f.documentation, f.samples)
            for f in text_string_to_metric_families(text) if f.name.startswith(PREFIX)}


def value(families: Families, series: str, **labels: str) -> float:
    """One sample's value; 0 for a labelled series not yet touched."""
    name = base_metric(series)
    matches = [s.value for s in families[name][2] if s.name == series and s.labels == labels]
    assert len(matches) <= 1
    return matches[0] if matches else 0.0


def assert_serves_the_catalogue(families: Families, catalogue: dict[str, Entry]) -> None:
    assert set(families) == set(catalogue), (
        f"missing: {sorted(set(catalogue) - set(families))}; "
        f"not in the catalogue: {sorted(set(families) - set(catalogue))}")
    for name, (kind, help_text, samples) in families.items():
        assert (kind, help_text) == (catalogue[name].type, catalogue[name].help), name
        for s in samples:
            assert set(s.labels) - {"le"} == set(catalogue[name].labels), (name, s.labels)
            assert not math.isnan(s.value), name


def read_everything(mnt: Path, files: dict[str, bytes], *, evict_first: bool) -> None:
    """Read every file whole; ``evict_first`` drops its pages from the kernel's page cache
    (``posix_fadvise(DONTNEED)``) so the reads reach the daemon again."""
    for rel, data in files.items():
        fd = os.open(mnt / rel, os.O_RDONLY)
        try:
            if evict_first:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, len(data) + 1, 0) == data, rel
        finally:
            os.close(fd)


@pytest.mark.mount
@needs_fuse
def test_live_hub_and_spoke_serve_the_catalogue_and_it_adds_up(
        export: tuple[Path, dict[str, bytes]], hub: Hub, spoke: Spoke) -> None:
    root, files = export
    total = sum(len(d) for d in files.values())
    blocks = sum(-(-len(d) // BLOCK_SIZE) for d in files.values())
    # Without the prefetcher every block a cold read needs comes from the hub on demand, so
    # the byte counts are exact.
    spoke.mount(hub.address, "--no-prefetch")

    read_everything(spoke.mountpoint, files, evict_first=False)
    hub_side = scrape_families(hub.metrics_port)  # before the spoke: requests are sent first
    cold = scrape_families(spoke.metrics_port)
    assert_serves_the_catalogue(hub_side, HUB)
    assert_serves_the_catalogue(cold, SPOKE)

    assert value(cold, "neuralcache_metadata_entries") == len(Export(str(root)).scan())
    assert 0 < value(cold, "neuralcache_metadata_sync_age_seconds") < 120
    assert value(cold, "neuralcache_read_bytes_total", source="hub") == total
    assert value(cold, "neuralcache_read_bytes_total", source="cache") == 0
    assert value(cold, "neuralcache_cache_miss_blocks_total") == blocks
    assert value(cold, "neuralcache_cache_hit_blocks_total") == 0
    assert value(cold, "neuralcache_cache_blocks") == blocks
    assert value(cold, "neuralcache_cache_used_bytes") == total
    assert value(cold, "neuralcache_cache_capacity_bytes") >= total
    assert value(cold, "neuralcache_cache_evictions_total") == 0
    reads = value(cold, "neuralcache_reads_total", outcome="ok")
    assert 0 < value(cold, "neuralcache_read_latency_seconds_count", source="hub") <= reads
    assert value(cold, "neuralcache_read_latency_seconds_count", source="cache") == 0
    assert value(cold, "neuralcache_checksum_failures_total") == 0
    assert value(cold, "neuralcache_hub_link_up") == 1
    assert value(cold, "neuralcache_fabric_connections", role="demand") >= 1
    assert value(cold, "neuralcache_fabric_pacing_rate_bytes_per_second") > 0
    demand_requests = value(cold, "neuralcache_fabric_requests_total", priority="demand")
    # The loop's thread is the one watched: it ran (this process's loop did all the reads),
    # and for less than the daemon has lived (the snapshot's age is most of that life).
    assert 0 < value(cold, "neuralcache_loop_cpu_seconds_total") < (
        value(cold, "neuralcache_metadata_sync_age_seconds") + 5)
    assert len(cold["neuralcache_loop_runqueue_seconds_total"][2]) == 1  # a sample, not none
    assert len(cold["neuralcache_loop_disk_waits_total"][2]) == 1
    assert len(cold["neuralcache_cache_reader_disk_waits_total"][2]) == 1

    assert value(hub_side, "neuralcache_hub_connected_spokes") == 1
    assert value(hub_side, "neuralcache_hub_requests_total", kind="meta") >= 1
    assert 0 < value(hub_side, "neuralcache_hub_requests_total", kind="read") <= demand_requests
    # Small demand reads are hedged (sent on two connections), so the hub may send a block
    # twice; it never sends less than the spoke was given.
    assert total <= value(hub_side, "neuralcache_hub_sent_bytes_total") <= 2 * total
    assert not hub_side["neuralcache_hub_errors_total"][2]
    assert value(hub_side, "neuralcache_hub_retransmitted_bytes_total") == 0  # loopback

    read_everything(spoke.mountpoint, files, evict_first=True)
    warm = scrape_families(spoke.metrics_port)
    # Nothing more from the hub, exactly. The kernel may ask the daemon for a page twice in
    # one pass (seen once in CI: 5 blocks more; its page cache is not ours to control), so
    # the cache served every byte at least once, not exactly once.
    assert value(warm, "neuralcache_read_bytes_total", source="hub") == total  # unchanged
    assert value(warm, "neuralcache_cache_miss_blocks_total") == blocks  # unchanged
    assert value(warm, "neuralcache_read_bytes_total", source="cache") >= total
    assert value(warm, "neuralcache_cache_hit_blocks_total") >= blocks
    assert value(warm, "neuralcache_read_latency_seconds_count", source="cache") > 0
    assert value(scrape_families(hub.metrics_port), "neuralcache_hub_sent_bytes_total") == (
        value(hub_side, "neuralcache_hub_sent_bytes_total"))
