"""PROTEAN on one node: strict and best-effort work over resource partitions.

The paper's node-level half lives here, deciders apart from their applier:

- ``distributor``: Algorithm 1 (job distribution, §4.3): which partition runs each batch.
- ``geometry``: the partition geometries (MIG "g" units, Table 2) and their CPU carving.
- ``reconfig``: Algorithm 2 (the reconfigurator, §4.4) and ``ProteanSettings``.
- ``slowdown``: the slowdown model over co-located work (RDF latency profiles, fitted FBRs).
- ``node_partitions``: the node's partitions from ``partitioning`` and the worker cores.
- ``instance_autoscale``: instances per model and partition, with the keep-alive rule.
- ``profiles``: what the deciders read of the node's stored profiles.
- ``partitions``: ``PartitionManager``, the applier that reads the node, calls the deciders
  on timers and carries out their decisions through the node's placement changer.

The vocabulary of partitions shared with Packrat (``Partition``, ``Carved``, ``OnPartition``)
is ``splitserve.placement.partition``; MIG devices are listed by ``splitserve.placement.gpus``
and planned by ``splitserve.placement.mig``. The cluster-level half (spot and on-demand
procurement, revocations, node autoscaling, cost) is in ``splitserve.cluster``'s policy modules.
"""
