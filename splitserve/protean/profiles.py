"""The profiles PROTEAN reads on a node, from the registry's one profile table.

Solo time per partition size comes from the latency profile (on a CPU a partition of c cores
runs an instance with c threads: L[c, b], so RDF = L[c, b] / L[C_all, b] needs no new
measurement), the FBR from the ``fbr`` kind fitted over co-location runs, and a batch's
memory from the per-batch ``footprint`` kind, falling back to the private bytes a load
measured (the ``memory`` kind: the load plus one batch at max batch, so an upper
bound for smaller batches). Each model's rows are read once, on first use, and kept: the
deciders ask per batch and must not wait on SQLite each time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import fbr_of, footprint_at, machine_id
from splitserve.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Rows:
    """One model's stored profiles, as read."""

    latency: LatencyProfile | None
    fbr: float | None
    footprint: dict[int, int]
    private_bytes: int | None


class ProteanProfiles:
    """The node's ``ProteanProfileSource`` over its registry (built by ``Server``)."""

    def __init__(self, registry: Registry, machine: str | None = None) -> None:
        self.registry = registry
        self.machine = machine or machine_id()
        self._rows: dict[str, _Rows] = {}

    def _read(self, model: str) -> _Rows:
        rows = self._rows.get(model)
        if rows is None:
            footprint = {int(b): int(n) for b, n in (self._load(model, "footprint") or {}).items()}
            rows = self._rows[model] = _Rows(self._latency(model), self._fbr(model), footprint,
                                             self._private_bytes(model))
        return rows

    def _load(self, model: str, kind: str) -> object:
        return self.registry.load_profile(model, self.machine, kind)

    def _latency(self, model: str) -> LatencyProfile | None:
        stored = self._load(model, "latency")
        if stored is None:
            return None
        try:
            return LatencyProfile.from_dict(stored)
        except InvalidInput as e:  # a bad row is "not profiled", and said so
            log.warning("model %s: stored latency profile unreadable: %s", model, e)
            return None

    def _fbr(self, model: str) -> float | None:
        stored = self._load(model, "fbr")
        if stored is None:
            return None
        from splitserve.protean.slowdown import FbrFit  # scipy: paid only by a node with a stored fit

        return fbr_of(FbrFit.from_dict(stored), model)

    def _private_bytes(self, model: str) -> int | None:
        stored = self._load(model, "memory")
        return int(stored["private_bytes"]) if isinstance(stored, dict) and "private_bytes" in stored else None

    def solo(self, model: str, cores: int, batch: int) -> float | None:
        lat = self._read(model).latency
        if lat is None or not 1 <= cores <= lat.max_threads or batch < 1:
            return None
        return lat.latency(cores, batch)

    def fbr(self, model: str) -> float | None:
        return self._read(model).fbr

    def footprint(self, model: str, batch: int) -> int | None:
        rows = self._read(model)
        measured = footprint_at(rows.footprint, batch)
        return measured if measured is not None else rows.private_bytes

    def forget(self, model: str | None = None) -> None:
        if model is None:
            self._rows.clear()
        else:
            self._rows.pop(model, None)
