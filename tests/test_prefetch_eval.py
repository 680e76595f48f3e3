"""End-to-end on small generated traces: the simulator, the baselines and our predictor."""

import pytest

from bench.prefetch_eval import cache_bytes, evaluate, main
from bench.prefetch_sim import Link, LinkModel, MountModel, Transfer
from bench.traces import generate

SMALL = 16 << 20
LINK = LinkModel()


def test_link_gives_demand_priority_and_fills_gaps_with_prefetch():
    link = Link(LinkModel(rtt=0.1, bandwidth=1e6))
    pf = Transfer([1] * 250, 0.0, None)  # 250 blocks of prefetch: 1.024 s on the wire
    link.prefetch(0.0, pf)
    link.serialize_until(0.55)  # half a second of it sent (it reached the hub at 0.05)
    demand = Transfer([2] * 25, 0.0, None)  # 0.1024 s of demand, at the hub at 0.55
    assert link.demand(0.5, demand) == pytest.approx(0.55 + 0.1024 + 0.05)
    link.serialize_until(10.0)
    assert pf.arrival == pytest.approx(0.05 + 1.024 + 0.1024 + 0.05)  # waited for the demand


@pytest.fixture(scope="module")
def seq():
    return evaluate(generate("seq8", SMALL), ["none", "readahead", "ours", "oracle"], LINK)


def test_sequential_prefetching_approaches_the_oracle(seq):
    assert seq["none"].epoch_ratio(0) == 0.0
    assert seq["ours"].hit_ratio > seq["readahead"].hit_ratio + 0.1
    assert seq["ours"].hit_ratio > seq["oracle"].hit_ratio - 0.05
    assert seq["ours"].wasted_share < 0.05
    assert seq["ours"].makespan < seq["none"].makespan / 2


def test_every_block_is_accounted_for(seq):
    for r in seq.values():
        useful = r.useful_on_time + r.useful_late
        assert r.hit_blocks + r.demand_fetched + r.useful_late == r.demand_blocks
        assert useful + r.wasted <= r.prefetched


def test_hints_predict_a_shuffled_epoch():
    res = evaluate(generate("shuffle_hinted", SMALL), ["none", "ours", "ours+hints"], LINK)
    assert res["none"].epoch_ratio(0) < 0.05
    assert res["ours+hints"].epoch_ratio(0) > max(0.85, res["ours"].epoch_ratio(0))
    assert res["ours+hints"].makespan < res["ours"].makespan


def test_fixed_order_with_a_small_cache_is_replayed():
    trace = generate("fixed_shuffle", SMALL)
    assert cache_bytes(trace) < trace.data_bytes
    res = evaluate(trace, ["none", "ours"], LINK)
    later = [r.epoch_ratio(2) for r in (res["none"], res["ours"])]
    assert later[0] < 0.05 and later[1] > 0.6  # LRU alone thrashes on a cyclic order


def test_cli_writes_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p.png"
    md = tmp_path / "t.md"
    main(["--quick", "--traces", "records", "--policies", "none", "stride", "ours",
          "--plot", str(plot), "--markdown", str(md)])
    text = md.read_text()
    assert "| irregular records | ours |" in text and plot.stat().st_size > 1000


def test_mount_model_caps_prefetch_and_counts_hedged_bytes():
    """The real mount's limits, one at a time: a cap of a few prefetch requests at once leaves
    a hinted shuffle's 16 KiB items behind its readers; hedged demand moves bytes twice."""
    trace = generate("shuffle_hinted", SMALL)
    ideal = evaluate(trace, ["none", "ours+hints"], LINK)
    capped = evaluate(trace, ["ours+hints"], LINK, mount=MountModel(max_prefetch_requests=8))
    hedged = evaluate(trace, ["none"], LINK, mount=MountModel(hedge_blocks=32))
    assert capped["ours+hints"].epoch_ratio(0) < ideal["ours+hints"].epoch_ratio(0) - 0.1
    assert capped["ours+hints"].makespan > ideal["ours+hints"].makespan
    first_epoch = ideal["none"].link_per_read  # every block crosses once, in a 3-epoch trace
    assert hedged["none"].link_per_read == pytest.approx(2 * first_epoch, rel=0.01)
    assert ideal["ours+hints"].link_per_read == pytest.approx(first_epoch, rel=0.01)


def test_an_unpromoted_read_waits_for_the_queue_ahead_of_its_prefetch():
    link = Link(LinkModel(rtt=0.1, bandwidth=1e6))
    ahead, mine = Transfer([1] * 100, 0.0, None), Transfer([2] * 25, 0.0, None)
    link.prefetch(0.0, ahead)
    link.prefetch(0.0, mine)
    assert link.expected_arrival(mine) == pytest.approx(0.05 + 0.512 + 0.05)
