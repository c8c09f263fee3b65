"""The Ray half of cluster mode: the actors (controller, node servers, Gateway, provider),
the controller's store, ``LocalCluster``, and every private or version-sensitive Ray call
(``raycompat``). Imported only by ``splitserve cluster`` and Ray's own processes."""
