"""The gateway's /metrics merge (pure: texts in, text out): each family once, with one HELP
and TYPE, every node's samples labelled with its node and market."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.gateway.metrics import merge, node_label, relabel


def _node_text(requests: int, extra_label: str | None = None) -> str:
    """A node's /metrics as a node writes it (prometheus-client, its own registry)."""
    r = CollectorRegistry()
    Counter("splitserve_requests", "Requests answered", ("model", "class"), registry=r).labels("lenet", "rt").inc(
        requests)
    Histogram("splitserve_request_duration_seconds", "Time from header to answer", ("model",), buckets=(0.1, 1.0),
              registry=r).labels("lenet").observe(0.5)
    if extra_label:
        Gauge("splitserve_queue_depth", "Requests waiting", ("node",), registry=r).labels(extra_label).set(3)
    return generate_latest(r).decode()


def _own_text() -> str:
    r = CollectorRegistry()
    Counter("splitserve_gateway_requests_accepted", "Requests the gateway accepted", registry=r).inc(5)
    return generate_latest(r).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {_key(s.name, **s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_every_family_appears_once_with_each_nodes_samples_labelled_with_its_node_and_market():
    a = relabel(_node_text(3), {"node": "aaaa", "market": "spot"})
    b = relabel(_node_text(4, extra_label="theirs"), {"node": "bbbb", "market": "on-demand"})
    text = merge(_own_text(), [a, b])
    for kind in ("# HELP", "# TYPE"):
        names = [line.split()[2] for line in text.splitlines() if line.startswith(kind)]
        assert len(names) == len(set(names)), f"a family has more than one {kind}"
    assert "# TYPE splitserve_request_duration_seconds histogram" in text
    s = _samples(text)
    assert s[_key("splitserve_gateway_requests_accepted_total")] == 5
    rt = {"class": "rt", "model": "lenet"}
    assert s[_key("splitserve_requests_total", **rt, market="spot", node="aaaa")] == 3
    assert s[_key("splitserve_requests_total", **rt, market="on-demand", node="bbbb")] == 4
    assert s[_key("splitserve_request_duration_seconds_bucket", le="1.0", market="spot", model="lenet",
                  node="aaaa")] == 1
    # the gateway's node label wins over a node's own label of that name
    assert s[_key("splitserve_queue_depth", market="on-demand", node="bbbb")] == 3


def test_a_family_of_another_type_from_a_later_node_is_left_out_and_a_bad_text_does_not_parse():
    counter = relabel(_node_text(1), {"node": "aaaa"})
    gauge = relabel("# HELP splitserve_requests x\n# TYPE splitserve_requests gauge\nsplitserve_requests 9\n",
                    {"node": "bbbb"})
    s = _samples(merge("", [counter, gauge]))
    assert [k for k in s if ("node", "bbbb") in k[1]] == []
    assert s[_key("splitserve_requests_total", model="lenet", node="aaaa", **{"class": "rt"})] == 1
    with pytest.raises(ValueError):
        relabel("splitserve_requests_total{model= 1 2 3\n", {"node": "cccc"})


def test_a_nodes_label_is_its_ids_prefix():
    assert node_label("0123456789abcdef0123") == "0123456789ab"
