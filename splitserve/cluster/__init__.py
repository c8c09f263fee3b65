"""Cluster mode (issue 13): the pure half.

Deciders with no I/O, no Ray and no clock of their own (``now`` and a seeded
``random.Random`` are passed in): node pools and prices (``pools``), dispatch and model
placement (``dispatch``), node health from pings (``health``), the gateway's in-flight
ledger (``ledger``), the cluster autoscaler (``autoscale``), procurement policies
(``procurement``), the seeded revocation emulator (``revocation``), the cost ledger
(``cost``) and a discrete-event cluster built from all of them (``sim``). The Ray half
(controller, node servers, gateway) drives the same objects; see docs/cluster.md.
"""
