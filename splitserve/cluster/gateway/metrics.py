"""The gateway's ``GET /metrics``: its own series and every node's, as one Prometheus text.

The gateway's series (``splitserve_gateway_*``) are read from ``GatewayCore`` at each scrape
(a registry of its own; nothing on the request path touches prometheus-client). Each node's
own ``/metrics`` is fetched from its HTTP port (``NodeRoute.http_port``) at the same time,
all nodes at once, each within ``metrics_scrape_timeout_s`` and ``metrics_scrape_bytes``; its
samples get ``node`` (the node id's first 12 characters, as in the logs) and ``market``
labels. A node that does not answer in time, answers with an error, sends too much or text
that does not parse is left out of this scrape and counted in
``splitserve_gateway_scrape_errors_total{node}``.

``relabel`` and ``merge`` are pure (text in, text out), parsing and writing with
prometheus-client's own parser and exposition, so a family appears once, with one HELP
and TYPE, however many nodes report it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.gateway.core import GatewayCore, NodeRoute
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.policy.health import Health
from splitserve.errors import PayloadTooLarge

log = logging.getLogger(__name__)

NODE_LABEL_CHARS = 12  # a node's label: its id's prefix, as the gateway's and controller's logs print it


def node_label(node: str) -> str:
    return node[:NODE_LABEL_CHARS]


def relabel(text: str, labels: Mapping[str, str]) -> list[Metric]:
    """The families of the Prometheus text ``text``, each sample with ``labels`` added (they
    replace labels of the same name). Raises ValueError when ``text`` does not parse."""
    out = []
    for family in text_string_to_metric_families(text):
        metric = Metric(family.name, family.documentation, family.type, family.unit)
        metric.samples = [s._replace(labels={**s.labels, **labels}) for s in family.samples]
        out.append(metric)
    return out


class _Families:
    """A collector of fixed families, so that prometheus-client writes the merged text."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge(own: str, nodes: Sequence[Sequence[Metric]]) -> str:
    """``own`` (the gateway's text) and every node's relabelled families as one text: each
    family once, its HELP and TYPE from the first source that has it, its samples from all.
    A node's family whose type differs from the first one's is left out (a node of another
    version), as a text may not give one name two types."""
    families: dict[str, Metric] = {}
    for source in (relabel(own, {}), *nodes):
        for family in source:
            have = families.get(family.name)
            if have is None:
                families[family.name] = family
            elif have.type == family.type:
                have.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


class _GatewaySeries:
    """The gateway's own series, read from its core at each collect."""

    def __init__(self, core: GatewayCore, scrape_errors: Mapping[str, int]) -> None:
        self.core = core
        self.scrape_errors = scrape_errors

    def collect(self) -> Iterator[Metric]:
        core = self.core
        stats = core.stats()
        routes = {n.node: n for n in core.routes.nodes}

        def counter(name: str, doc: str, values: Mapping[str, int] | int, label: str | None = None) -> Metric:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            if isinstance(values, int):
                family.add_metric([], values)
            else:
                for key, n in sorted(values.items()):
                    family.add_metric([key], n)
            return family

        yield counter("splitserve_gateway_requests_accepted", "Requests the gateway accepted (each gets one answer)",
                      stats["accepted"])
        yield counter("splitserve_gateway_requests_answered", "Accepted requests answered: a result, or the error's "
                      "status", stats["answered"], "outcome")
        yield counter("splitserve_gateway_requests_refused", "Requests refused before they were accepted, by status",
                      stats["refused"], "status")
        yield counter("splitserve_gateway_requests_resent", "Sends again after a node was lost or did not run the "
                      "request", stats["resent"])
        yield counter("splitserve_gateway_duplicates_dropped", "Late or duplicate answers from nodes, dropped",
                      stats["dropped"])
        yield counter("splitserve_gateway_dispatch_waits", "Requests that waited for a node serving their model",
                      stats["waits"])
        yield counter("splitserve_gateway_slo_requests", "Strict requests with an SLO, by outcome, as the gateway's "
                      "clients see them", stats["slo"], "outcome")
        yield counter("splitserve_gateway_scrape_errors", "Node /metrics scrapes left out (no answer in time, an "
                      "error, too long, not Prometheus text)", self.scrape_errors, "node")
        held = GaugeMetricFamily("splitserve_gateway_held_requests", "Requests accepted and not yet answered")
        held.add_metric([], stats["held"])
        yield held
        waiting = GaugeMetricFamily("splitserve_gateway_dispatch_waiting", "Requests waiting now for a node")
        waiting.add_metric([], stats["waiting"])
        yield waiting
        in_flight = GaugeMetricFamily("splitserve_gateway_in_flight", "Requests sent to a node and not yet answered",
                                      labels=["node", "market"])
        for node, n in sorted(stats["in_flight"].items()):
            route = routes.get(node)
            in_flight.add_metric([node_label(node), str(route.market) if route else ""], n)
        yield in_flight
        health = GaugeMetricFamily("splitserve_gateway_node_health", "1 for each routed node's health as the "
                                   "gateway's pings see it (alive, suspect, dead), 0 for the others",
                                   labels=["node", "market", "state"])
        for node, state in sorted(core.health_states().items()):
            for h in Health:
                health.add_metric([node_label(node), str(routes[node].market), str(h)], float(h is state))
        yield health


class GatewayMetrics:
    """The text of the gateway's ``/metrics``; one scrape of the nodes at a time, shared by
    the calls that arrive while it runs."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.scrape_errors: Counter[str] = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_GatewaySeries(core, self.scrape_errors))  # type: ignore[arg-type]
        self._running: asyncio.Future[str] | None = None

    async def text(self) -> str:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._render())
        return await asyncio.shield(self._running)

    async def _render(self) -> str:
        nodes = [n for n in self.core.routes.nodes if n.http_port is not None and n.state is not NodeState.DEAD]
        cfg = self.core.cfg
        async with httpx.AsyncClient(timeout=cfg.metrics_scrape_timeout_s, trust_env=False) as http:
            scraped = await asyncio.gather(*(self._scrape(http, n) for n in nodes))
        routed = {node_label(n.node) for n in self.core.routes.nodes}
        for gone in self.scrape_errors.keys() - routed:  # bounded by the routes, not by every node ever seen
            del self.scrape_errors[gone]
        return merge(generate_latest(self.registry).decode(), [f for f in scraped if f is not None])

    async def _scrape(self, http: httpx.AsyncClient, route: NodeRoute) -> list[Metric] | None:
        """``route``'s node's families, relabelled; None (and counted) when it fails."""
        label = node_label(route.node)
        limit = self.core.cfg.metrics_scrape_bytes
        try:
            async with asyncio.timeout(self.core.cfg.metrics_scrape_timeout_s):
                async with http.stream("GET", f"http://{route.host}:{route.http_port}/metrics") as r:
                    r.raise_for_status()
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise PayloadTooLarge(f"more than {limit} bytes")
            return relabel(body.decode(errors="replace"), {"node": label, "market": str(route.market)})
        except (TimeoutError, httpx.HTTPError, PayloadTooLarge, ValueError) as e:
            log.info("node %s: /metrics left out of the gateway's: %s", label, e or type(e).__name__)
            self.scrape_errors[label] += 1
            return None
