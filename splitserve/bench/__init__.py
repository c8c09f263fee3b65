"""``splitserve bench``: the load generator, traces, DISB workloads, scenarios and reports.

The benchmarks need the ``bench`` extra (``pip install 'splitserve[bench]'``); the server and
the other commands never import this package. Importing it without the extra fails at once,
naming what is missing, rather than after a run's measurements when the plots are drawn.
"""

from importlib.util import find_spec

# the bench extra's packages in pyproject.toml, by import name
EXTRA_MODULES: tuple[str, ...] = ("matplotlib", "tritonclient", "httpx")

_missing = [m for m in EXTRA_MODULES if find_spec(m) is None]
if _missing:
    raise ModuleNotFoundError(f"splitserve.bench needs {', '.join(_missing)} (the bench extra)", name=_missing[0])
