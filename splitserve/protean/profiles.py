"""The profiles PROTEAN reads on a node, from the registry's one profile table.

Solo time per partition size comes from the latency profile (on a CPU a partition of c cores
runs an instance with c threads: L[c, b], so RDF = L[c, b] / L[C_all, b] needs no new
measurement), the FBR from the ``fbr`` kind fitted over co-location runs, and a batch's
memory from the per-batch ``footprint`` kind, falling back to the private bytes a load
measured (the ``memory`` kind: the load plus one batch at max batch, so an upper
bound for smaller batches). A MIG profile has its own rows of each kind (see
``ProteanProfiles``). Each model's rows are read once, on first use, and kept: the
deciders ask per batch and must not wait on SQLite each time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import fbr_of, footprint_at, machine_id, profile_kind
from splitserve.protean.slowdown import Shape
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
    """The node's ``ProteanProfileSource`` over its registry (built by ``Server``).

    A core count reads the CPU profiles (L[cores, b], ``fbr``); a MIG profile name
    (``"1g.18gb"``) reads that profile's own (``latency@1g.18gb``, measured by one process
    with one host thread on a device of the profile: L[1, b] there; ``fbr@1g.18gb``), never
    the CPU's: a core set's numbers say nothing of a slice."""

    def __init__(self, registry: Registry, machine: str | None = None) -> None:
        self.registry = registry
        self.machine = machine or machine_id()
        self._rows: dict[tuple[str, str | None], _Rows] = {}

    def _read(self, model: str, mig: str | None = None) -> _Rows:
        rows = self._rows.get((model, mig))
        if rows is None:
            footprint = {int(b): int(n) for b, n in (self._load(model, "footprint", mig) or {}).items()}
            private = self._private_bytes(model) if mig is None else None  # host bytes: not a slice's
            rows = self._rows[(model, mig)] = _Rows(self._latency(model, mig), self._fbr(model, mig), footprint,
                                                    private)
        return rows

    def _load(self, model: str, kind: str, mig: str | None = None) -> object:
        return self.registry.load_profile(model, self.machine, profile_kind(kind, mig))

    def _latency(self, model: str, mig: str | None) -> LatencyProfile | None:
        stored = self._load(model, "latency", mig)
        if stored is None:
            return None
        try:
            return LatencyProfile.from_dict(stored)
        except InvalidInput as e:  # a bad row is "not profiled", and said so
            log.warning("model %s: stored latency profile %s unreadable: %s", model,
                        profile_kind("latency", mig), e)
            return None

    def _fbr(self, model: str, mig: str | None) -> float | None:
        stored = self._load(model, "fbr", mig)
        if stored is None:
            return None
        from splitserve.protean.slowdown import FbrFit  # scipy: paid only by a node with a stored fit

        return fbr_of(FbrFit.from_dict(stored), model)

    def _private_bytes(self, model: str) -> int | None:
        stored = self._load(model, "memory")
        return int(stored["private_bytes"]) if isinstance(stored, dict) and "private_bytes" in stored else None

    def solo(self, model: str, shape: Shape, batch: int) -> float | None:
        if isinstance(shape, str):
            lat = self._read(model, shape).latency
            return lat.latency(1, batch) if lat is not None and batch >= 1 else None
        lat = self._read(model).latency
        if lat is None or not 1 <= shape <= lat.max_threads or batch < 1:
            return None
        return lat.latency(shape, batch)

    def fbr(self, model: str, mig: str | None = None) -> float | None:
        return self._read(model, mig).fbr

    def footprint(self, model: str, batch: int, mig: str | None = None) -> int | None:
        rows = self._read(model, mig)
        measured = footprint_at(rows.footprint, batch)
        return measured if measured is not None else rows.private_bytes

    def forget(self, model: str | None = None) -> None:
        if model is None:
            self._rows.clear()
        else:
            for key in [k for k in self._rows if k[0] == model]:
                del self._rows[key]
