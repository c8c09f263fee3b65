"""``splitserve bench protean``: PROTEAN's evaluation (§5-6) on one node, every scheme a set of
server settings over the same code, on identical arrivals (see ``scenario``)."""
