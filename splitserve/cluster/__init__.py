"""Cluster mode: many serving nodes behind one gateway, with Ray carrying control only.

Three layers, each importing only the ones above it in this list (docs/cluster.md):

- ``policy``: every decision the cluster makes, pure (no I/O, no Ray, the clock and a seeded
  ``random.Random`` passed in): dispatch and placement, node health, the in-flight ledger,
  the autoscaler, procurement, the revocation emulator, the cost ledger, and a
  discrete-event cluster built from them (``policy.sim``);
- ``gateway``: the gateway's data-plane process, no Ray: the fast path in front of the
  nodes (``gateway.core``), its composition root with HTTP and gRPC (``gateway.dataplane``),
  its upcalls to the Gateway actor, its ``/metrics`` and the ``ModelSpec`` it sends up;
- ``actors``: the Ray half: the controller, node server, Gateway and provider actors, every
  private Ray call (``actors.raycompat``), the controller's store and ``LocalCluster``.

Beside them: ``pools`` (markets, prices and policy names, which ``splitserve.config`` names
without importing any layer) and ``cli`` (``splitserve cluster up|status|down``).
"""
