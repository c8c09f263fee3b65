"""The cluster gateway's ``/metrics`` without Ray: its own series and a real node's, merged,
the node's relabelled with its node and market; a node that does not answer is left out and
counted as a scrape error."""

from __future__ import annotations

import socket

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.gateway.core import NodeRoute
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.pools import Market
from tests.gateway_front import through_gateway


def test_the_gateways_metrics_have_its_own_series_and_each_nodes_labelled_with_its_node(tmp_path):
    x = np.zeros((1, 1, 28, 28), np.uint8)
    body = {"inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 1, 28, 28], "data": [0] * 784}],
            "parameters": {"class": "rt", "slo_ms": 60_000}}
    # a node that accepts connections and never answers: its scrape times out
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        other = NodeRoute("silent-node", "127.0.0.1", port, Market.SPOT, NodeState.ACTIVE, frozenset(), port)

        def calls(port: int) -> dict:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as h:
                assert h.post("/v2/models/lenet/infer", json=body).status_code == 200
                r = h.get("/metrics")
            return {"status": r.status_code, "text": r.text}

        # the scrape's bound: the silent node's scrape waits it out, and the real node, in this
        # process beside the gateway on a loaded test machine, answers well within it (at 1 s,
        # the default, one run of the suite lost the node's series)
        _, out, _ = through_gateway(tmp_path, "http", x, calls, node_http=True, others=(other,),
                                    cluster=ClusterConfig(metrics_scrape_timeout_s=4.0))
    assert out["status"] == 200
    text = out["text"]
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)), "a family appears more than once"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    # the gateway's own series
    assert value("splitserve_gateway_requests_accepted_total") == 1
    assert value("splitserve_gateway_requests_answered_total", outcome="result") == 1
    assert value("splitserve_gateway_slo_requests_total", outcome="met") == 1
    assert value("splitserve_gateway_node_health", node="node-1", market="on-demand", state="alive") == 1
    assert value("splitserve_gateway_scrape_errors_total", node="silent-node") == 1
    assert samples.get(("splitserve_gateway_scrape_errors_total", (("node", "node-1"),)), 0) == 0  # read in time
    # the node's own, labelled with its node and market; nothing from the silent one
    assert value("splitserve_requests_total", model="lenet", node="node-1", market="on-demand", path="front",
                 **{"class": "rt"}) == 1
    assert not [k for k in samples if ("node", "silent-node") in k[1] and not k[0].startswith("splitserve_gateway")]
