"""Whether a node's advertised fast path answers the head (the I/O behind
``policy/reach``): a TCP connection opened and closed, nothing sent."""

from __future__ import annotations

import asyncio
import contextlib
import os

from splitserve.cluster.actors.node_server import NodeEndpoint
from splitserve.cluster.policy.reach import address_problem, probe_reason

PROBE_TIMEOUT_S = 2.0  # a connect on a LAN takes well under a millisecond; a dropped SYN waits forever


async def tcp_probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``, else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        return f"no answer to a TCP connect within {timeout_s:g} s"
    except OSError as e:
        return f"TCP connect failed: {os.strerror(e.errno) if e.errno else e}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class Reachability:
    """Checks a node's endpoint from the Ray node ``prober_ip`` (the head's, where the
    controller and the gateway run): an address that cannot work is refused without a
    probe, any other is probed."""

    def __init__(self, prober_ip: str) -> None:
        self.prober_ip = prober_ip

    async def __call__(self, e: NodeEndpoint) -> str | None:
        """None when the gateway can reach ``e``, else why not."""
        return address_problem(e.host, e.node_ip or self.prober_ip, self.prober_ip) \
            or probe_reason(e.host, e.fast_port, await tcp_probe(e.host, e.fast_port))
