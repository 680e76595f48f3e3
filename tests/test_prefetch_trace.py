"""The trace format: round trip, tolerance of a cut-off tail, and the generated traces."""

import numpy as np
import pytest

from bench.traces import TRACE_NAMES, generate
from neuralcache.hints import HintRecord
from neuralcache.trace import READ_DTYPE, Trace, parse_trace, read_trace, write_trace

SMALL = 4 << 20


def test_round_trip(tmp_path):
    reads = np.array([(0.0, 1, 7, 1, 0, 4096), (0.5, 2, 7, 2, 8192, 100)], dtype=READ_DTYPE)
    trace = Trace({1: ("a/x", 10_000), 2: ("a/y", 9000)}, reads,
                  [(0.25, HintRecord(1, (("a/y", 8192, 100),), "r0")),
                   (0.3, HintRecord(1, (("a/x", 0, 100),), "r1", exact=True))], {"name": "t"})
    path = str(tmp_path / "t.trace")
    write_trace(path, trace)
    back = read_trace(path)
    assert back.files == trace.files and back.hints == trace.hints and back.meta == trace.meta
    assert back.reads.tolist() == reads.tolist()
    assert back.catalog().file_id("a/y") == 2


def test_a_cut_off_trace_reads_up_to_the_last_whole_record(tmp_path):
    reads = np.array([(float(i), 0, 0, 1, i * 4096, 4096) for i in range(10)], dtype=READ_DTYPE)
    path = str(tmp_path / "t.trace")
    write_trace(path, Trace({1: ("f", 1 << 20)}, reads))
    data = open(path, "rb").read()
    assert len(parse_trace(data[:-3]).reads) == 9


def test_not_a_trace_is_rejected():
    with pytest.raises(ValueError):
        parse_trace(b"\x93\x01\x02\x03")


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_generated_traces_are_well_formed(name):
    trace = generate(name, SMALL)
    reads = trace.reads
    assert len(trace.meta["epoch_starts"]) == 3
    assert np.all(np.diff(reads["t"]) >= 0)
    sizes = {fid: size for fid, (_, size) in trace.files.items()}
    assert all(o + n <= sizes[f] for f, o, n in zip(reads["file_id"], reads["offset"],
                                                    reads["length"]))
    assert bool(trace.hints) == (name == "shuffle_hinted")
