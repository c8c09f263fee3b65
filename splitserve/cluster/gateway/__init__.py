"""The gateway's data-plane process: one asyncio process on the head that never imports Ray
(the Gateway actor in ``cluster.actors.ingress`` supervises it). ``dataplane`` is its
composition root."""
