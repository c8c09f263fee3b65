"""The controller's view of several gateways: their stats added up, a silent one dropped."""

import json

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


def test_a_direct_client_gets_each_nodes_workers_at_its_address_with_its_func_id() -> None:
    from splitserve.client.common import Endpoint, ModelInfo
    from splitserve.client.route import _direct_targets
    from splitserve.cluster.gateway.direct import direct_routes

    reply = json.dumps({"direct_tcp": ["tcp://0.0.0.0:41000", "tcp://0.0.0.0:41001"],
                        "direct_tcp_classes": ["rt", "be"]}).encode()
    older = json.dumps({"direct_tcp": ["tcp://0.0.0.0:41000", "tcp://0.0.0.0:41001"]}).encode()  # names no classes
    routes = direct_routes([("n1", "10.0.0.5", 3, reply), ("n2", "fe80::2", 9, older),
                            ("n3", "10.0.0.7", 4, json.dumps({"direct": ["unix:///x"]}).encode())])
    assert routes == [{"node": "n1", "func_id": 3, "direct_tcp": ["tcp://10.0.0.5:41000", "tcp://10.0.0.5:41001"],
                       "direct_tcp_classes": ["rt", "be"]},
                      {"node": "n2", "func_id": 9, "direct_tcp": ["tcp://[fe80::2]:41000", "tcp://[fe80::2]:41001"],
                       "direct_tcp_classes": ["rt", "rt"]}]
    info = ModelInfo.from_json({"name": "m", "func_id": 1, "inputs": [], "outputs": [], "max_batch_size": 1,
                                "nodes": routes})
    # each with the node's func id, and whether it serves best-effort calls only
    assert _direct_targets(Endpoint.parse("tcp://gw:8100"), info) == [
        ("tcp://10.0.0.5:41000", 3, False), ("tcp://10.0.0.5:41001", 3, True), ("tcp://[fe80::2]:41000", 9, False),
        ("tcp://[fe80::2]:41001", 9, False)]
