"""Fuzzing the fast path's parsers: the control header, the stream frame state machine and
UDP reassembly.

Each target module defines ``NAME``, a ``generate(rnd)`` that draws one input from a
``random.Random`` and a property check that raises ``PropertyViolation``. The stream and UDP
targets drive the real transport classes over real sockets on a real event loop against the
small fake server of ``splitserve.testing.fastpath_host``, whose rings are real tensor queues
watched for stray writes.
The property tests in ``tests/unit/test_fuzz_*.py`` run them at small example counts under
hypothesis; ``splitserve bench fuzz`` (``run``) runs them for a budget of inputs.
"""

from splitserve.testing.fastpath_host import PropertyViolation

__all__ = ["PropertyViolation"]
