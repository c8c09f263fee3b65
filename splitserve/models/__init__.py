"""Models splitserve can serve: the zoo's catalogue (``catalog``, no torch), building and
seeding zoo models (``zoo``), the segmented model contract (``segmented``) and artifact
loading (``loader``).

This package imports none of them itself: the front end reads only ``catalog`` and must
not pay torch's import through a package re-export (``tests/unit/test_import_graph.py``).
"""
