"""Fakes of the node's seams, for the test suite and the benchmarks.

What is here implements a seam of ``docs/node.md`` (a ``FastPathHost``, a ``ModelPort``) well
enough to drive the real part on the other side of it in-process, with no server, worker or
model behind it: ``fastpath_host`` is the host the fast-path transports are fuzzed and tested
against. The server's own packages never import this package (``tests/unit/test_import_graph.py``
checks it), so nothing here runs in a server; it needs nothing beyond the core dependencies,
so the tests use it without the ``bench`` extra.
"""
