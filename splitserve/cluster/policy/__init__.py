"""The cluster's deciders: no I/O, no Ray and no clock of their own (``now`` and a seeded
``random.Random`` are passed in), so the Ray half and the simulator (``sim``) drive the same
objects."""
