"""bench cluster-check's arithmetic: the real bill on the run's clock, what counts as an
answer, nodes over time, and the side-by-side figures (no cluster)."""

from __future__ import annotations

import pytest

from splitserve.bench.scenarios.cluster_check import Side, agreement, answered, compare, figures, ledger_of, mean_nodes
from splitserve.cluster.policy.cost import CostLedger
from splitserve.cluster.pools import Market

T0 = 1_700_000_000.0
OD, SPOT = 32.7726, 9.8318


def _rec(node, market, price, requested, ready=None, drained=None, ended=None, evicted=False) -> dict:
    return {"node": node, "node_type": market, "market": market, "price_per_hour": price,
            "requested_at": T0 + requested, "ready_at": None if ready is None else T0 + ready,
            "drained_at": None if drained is None else T0 + drained,
            "ended_at": None if ended is None else T0 + ended, "evicted": evicted}


def test_the_real_bill_is_put_on_the_runs_clock_and_cut_at_its_end():
    bill = [_rec("a", "spot", SPOT, 0.0, 20.0, 60.0, 100.0, evicted=True),
            _rec("b", "on-demand", OD, 30.0, 55.0),  # still running at the end: billed to it
            _rec("c", "spot", SPOT, 130.0)]  # requested after the end: not in this run
    ledger = ledger_of(bill, T0, end=120.0)
    recs = {r.node: r for r in ledger.records()}
    assert set(recs) == {"a", "b"}
    assert (recs["a"].ready_at, recs["a"].drained_at, recs["a"].ended_at, recs["a"].evicted) == (20.0, 60.0, 100.0, True)
    assert recs["b"].ended_at is None
    assert ledger.total(120.0) == pytest.approx((SPOT * 100.0 + OD * 90.0) / 3600.0)


def test_an_error_with_a_code_is_an_answer_and_a_timeout_is_not():
    assert answered(True, None)
    assert answered(False, "ModelNotReady: no node serves lenet")
    assert answered(False, "QueueFull: every node's window is full")
    assert not answered(False, "TimeoutError: no answer to call 7")
    assert not answered(False, "no answer before the run ended")
    assert not answered(False, "ConnectionError: connection lost")


def test_nodes_over_time_are_weighted_by_how_long_each_count_lasted():
    timeline = [(0.0, 0, 1), (20.0, 1, 1), (60.0, 1, 2), (100.0, 1, 1)]
    serving, billed = mean_nodes(timeline, end=120.0)
    assert serving == pytest.approx(100.0 / 120.0)
    assert billed == pytest.approx((60.0 + 80.0 + 20.0) / 120.0)
    assert mean_nodes([], 10.0) == (0.0, 0.0)


def _side(spot_s: float, od_s: float, met: int, lost: int = 0) -> Side:
    bill = CostLedger()
    bill.requested("s", "node", Market.SPOT, SPOT, 0.0)
    bill.ended("s", spot_s, evicted=True)
    bill.requested("o", "node", Market.ON_DEMAND, OD, 0.0)
    bill.ended("o", od_s)
    return Side(100, 100 - lost, lost, 50, met, 1, 1, 1, bill, 100.0, [(0.0, 1, 2), (50.0, 1, 1)])


def test_both_runs_give_the_same_figures_and_their_differences():
    reference = OD * 100.0 / 3600.0  # one on-demand node for the whole run
    sim, real = figures(_side(50.0, 100.0, 50), reference), figures(_side(60.0, 90.0, 48, lost=1), reference)
    assert sim["spot nodes requested"] == sim["on-demand nodes requested"] == 1
    assert sim["evictions"] == 1 and sim["strict SLO compliance %"] == 100.0
    assert sim["cost / on-demand-only"] == pytest.approx((SPOT * 50.0 + OD * 100.0) / (OD * 100.0))
    assert sim["mean billed nodes"] == pytest.approx(1.5)
    rows = {k: (s, r, d) for k, s, r, d in compare(sim, real)}
    assert rows["strict SLO compliance %"] == (100.0, 96.0, -4.0)
    assert rows["lost"] == (0, 1, 1)
    assert rows["cost $"][2] == pytest.approx((SPOT * 10.0 - OD * 10.0) / 3600.0)
    agree = agreement(sim, real)
    assert agree == {"nothing lost": False, "compliance": True, "cost": True}
