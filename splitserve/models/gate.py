"""``gate``: a model that holds each sample until a test (or an operator) lets it through.

Fault tests need a batch that is *deterministically* mid-run: a preempted batch on a
draining instance, a duplicate request id while the first is in flight, a worker killed
during a batch. Sleeping and hoping the model is still running flakes on fast or loaded
machines, so the gate's first segment waits while the file ``<gate dir>/<key>`` exists,
where ``key`` is the sample's input; removing the file releases it. The output is the key.
A held sample marks itself with ``<key>.held``, so a test knows its batch is mid-run.
Loading waits the same way while ``<gate dir>/load`` exists, which holds a worker before
READY (start time-outs, a signal during a long ``--load``).

The gate directory is ``<server cache dir>/gates`` (the worker's cache directory), so a
test that starts a server with its own cache directory owns its gates. A sample is never
held longer than ``MAX_HOLD_S``, so a forgotten gate cannot hang a test run for ever.
The gate is not a built-in model of every server: a test registers it through a
repository (``artifact = {kind = "zoo", arch = "gate"}``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor, nn

from splitserve.models.segmented import SegmentedModel

MAX_HOLD_S = 120.0
_POLL_S = 0.001


def gate_dir(cache_dir: Path) -> Path:
    """Where the gate files of a server with this cache directory live."""
    return cache_dir / "gates"


LOAD_KEY = "load"


def _wait_while(files: list[Path]) -> None:
    give_up = time.monotonic() + MAX_HOLD_S
    while any(f.exists() for f in files) and time.monotonic() < give_up:
        time.sleep(_POLL_S)


class _Hold(nn.Module):
    """Waits while any sample's gate file exists, then passes the keys on unchanged."""

    def __init__(self, gates: Path | None) -> None:
        super().__init__()
        self.gates = gates

    def forward(self, key: Tensor) -> Tensor:
        """Block until every sample's gate is open (or ``MAX_HOLD_S`` passed); return ``key``."""
        if self.gates is not None:
            files = [self.gates / str(int(k)) for k in key.reshape(-1).tolist()]
            for f in files:
                if f.exists():
                    f.with_suffix(".held").touch()
            _wait_while(files)
        return key.clone()


class _Pass(nn.Module):
    def forward(self, key: Tensor) -> Tensor:
        """The keys, as a new tensor (segments never alias their inputs)."""
        return key.clone()


def gate_model(cache_dir: Path | None = None) -> SegmentedModel:
    """The gate: segment 0 holds closed samples, segment 1 passes the keys through.

    Two segments give a preemption point after the hold; without ``cache_dir`` nothing
    is ever held. Building it waits while the load gate is closed."""
    gates = gate_dir(cache_dir) if cache_dir is not None else None
    if gates is not None:
        _wait_while([gates / LOAD_KEY])
    return SegmentedModel([_Hold(gates), _Pass()])


class Gates:
    """The test side of the gate: close a key before sending it, open it to let it run."""

    def __init__(self, cache_dir: Path) -> None:
        self.dir = gate_dir(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def close(self, key: int | str) -> None:
        """Samples with this key (``LOAD_KEY``: workers loading the gate) wait from now on."""
        (self.dir / str(key)).touch()

    def open(self, key: int | str) -> None:
        """Samples with this key run (those waiting are released within a millisecond)."""
        (self.dir / str(key)).unlink(missing_ok=True)

    def held(self, key: int) -> bool:
        """A sample with this key has waited at its gate (its batch is mid-run)."""
        return (self.dir / f"{key}.held").exists()

    def open_all(self) -> None:
        for f in self.dir.iterdir():
            f.unlink(missing_ok=True)
