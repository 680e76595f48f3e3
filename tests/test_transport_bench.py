"""bench.transport's own parsing (the measurement itself is the bench's, not a test's)."""

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
