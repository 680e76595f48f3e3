"""bench.transport's own parsing and its plain-TCP ceiling's plumbing (the measurements
themselves are the bench's, not a test's)."""

import subprocess
import sys
import threading
from typing import Iterator

import pytest

from bench import tcp_ceiling
from bench.kernel_probes import ProbeSummary, probing
from bench.transport import parse_mib

NETSTAT = """TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes
TcpExt: 0 17 4
IpExt: InNoRoutes InOctets
IpExt: 0 123456789012
"""


def test_parse_mib_pairs_each_group_s_names_with_its_values():
    assert parse_mib(NETSTAT) == {"TcpExt:SyncookiesSent": 0, "TcpExt:TCPTimeouts": 17,
                                  "TcpExt:TCPLossProbes": 4, "IpExt:InNoRoutes": 0,
                                  "IpExt:InOctets": 123456789012}


def test_parse_mib_reads_negative_values_and_ignores_a_trailing_name_line():
    text = "Tcp: RtoMin MaxConn\nTcp: 200 -1\nUdp: InDatagrams\n"
    assert parse_mib(text) == {"Tcp:RtoMin": 200, "Tcp:MaxConn": -1}


@pytest.fixture
def tcp_source() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``bench.transport tcp-source`` on a free loopback port, stopped after the test."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.transport", "tcp-source", "--listen",
                             "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[0] == "ready", ready
        yield proc, int(ready[1])
    finally:
        proc.kill()
        proc.wait()


def test_the_plain_tcp_ceiling_records_what_each_connection_read(tcp_source):
    _, port = tcp_source
    result = tcp_ceiling.receive("127.0.0.1", port, duration=0.5, connections=2)
    assert result["demand"] == [] and result["model"] == []
    times = [t for t, _ in result["delivered"]]
    assert times == sorted(times) and 0 < times[0]
    # Every connection records in steps of about RECORD_BYTES, the last one at the deadline.
    assert all(n > 0 for _, n in result["delivered"])
    assert sum(n for t, n in result["delivered"] if t <= 0.5) >= tcp_ceiling.RECORD_BYTES


def test_the_plain_tcp_ceiling_fails_when_its_source_goes_away(tcp_source):
    proc, port = tcp_source
    threading.Timer(0.3, proc.kill).start()
    with pytest.raises(OSError):
        tcp_ceiling.receive("127.0.0.1", port, duration=5.0, connections=2)


# ``ss -tinH state established`` in a hub namespace during a 900 ms run (trimmed): a bulk
# connection in PROBE_RTT, one that is not, and a demand connection (CUBIC).
SS_OUTPUT = """\
0      17593107    198.18.0.1:7070   198.18.0.2:37346
\t bbr wscale:12,12 rto:2208 rtt:1588.45/15.728 mss:1448 cwnd:4 bytes_acked:18485690 \
bbr:(bw:35659504bps,mrtt:1602.51,pacing_gain:1,cwnd_gain:1) send 29171bps
0      8123456     198.18.0.1:7070   198.18.0.2:37330
\t bbr wscale:12,12 rto:2072 rtt:1200.1/20.2 mss:1448 cwnd:8721 bytes_acked:9485690 \
bbr:(bw:25659504bps,mrtt:899,pacing_gain:2.88672,cwnd_gain:2.88672) send 84171bps
0      0           198.18.0.1:7070   198.18.0.2:37288
\t cubic wscale:12,12 rto:2700 rtt:899.373/449.686 mss:1448 cwnd:3 bytes_sent:52
"""


def test_probing_counts_bbr_connections_and_those_at_probe_rtt_s_window():
    assert probing(SS_OUTPUT) == (2, 1)
    assert probing("") == (0, 0)


def test_probe_summary_counts_seconds_with_any_and_with_every_connection_probing():
    counts = [(0, 0), (4, 0), (4, 1), (4, 4), (4, 4), (3, 2)]
    summary = ProbeSummary.of(counts, period=0.5)
    assert summary == ProbeSummary(samples=6, any_seconds=2.0, all_seconds=1.0, most_at_once=4)
    assert "1.0 s with all of them" in summary.line()
