"""The controller's view of several gateways: their stats added up, a silent one dropped."""

from splitserve.cluster.gateway.fleet import GatewayReports, merge_stats


def test_stats_add_up_and_the_routes_version_is_the_highest() -> None:
    a = {"routes": 5, "held": 2, "in_flight": {"n1": 2}, "slo": {"met": 3}, "links": ["n1"], "models": {"n1": [1]}}
    b = {"routes": 7, "held": 1, "in_flight": {"n1": 1, "n2": 4}, "slo": {"met": 1, "missed": 2}, "links": ["n1", "n2"],
         "models": {"n1": [1, 2], "n2": [2]}}
    assert merge_stats([a, b]) == {"routes": 7, "held": 3, "in_flight": {"n1": 3, "n2": 4},
                                   "slo": {"met": 4, "missed": 2}, "links": ["n1", "n2"],
                                   "models": {"n1": [1, 2], "n2": [2]}}
    assert merge_stats([]) == {}


def test_a_gateway_that_stopped_reporting_no_longer_counts() -> None:
    r = GatewayReports(stale_s=10.0)
    assert r.record("g0", {"held": 2, "in_flight": {"n1": 2}}, now=0.0)
    assert r.record("g1", {"held": 1, "in_flight": {"n1": 1}}, now=5.0)
    assert not r.record("g0", {"held": 0, "in_flight": {}}, now=6.0)  # its second report: not a new gateway
    assert r.merged(now=7.0) == {"held": 1, "in_flight": {"n1": 1}}
    assert r.names() == ["g0", "g1"]
    assert r.merged(now=15.5) == {"held": 0, "in_flight": {}}  # g1 silent for over 10 s: its held work no longer counts
    assert r.names() == ["g0"]
