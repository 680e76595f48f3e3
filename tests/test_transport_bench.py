"""bench.transport's own parsing and its plain-TCP ceiling's plumbing (the measurements
themselves are the bench's, not a test's)."""

import subprocess
import sys
import threading
from typing import Iterator

import pytest

from bench import tcp_ceiling
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
