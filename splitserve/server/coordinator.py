"""Node-wide coordination of batches across models: where RT vs BE policy lives.

Each model's scheduler proposes batches for its own idle instances; the coordinator
sees every model and decides which may start now. ``Concurrent`` is the baseline with no
priority (like several GPU streams): every proposed batch starts at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from splitserve.scheduler.request import Batch
from splitserve.worker.messages import DoneMsg

if TYPE_CHECKING:
    from splitserve.server.runtime import ModelRuntime


class Coordinator(ABC):
    """Called by every ModelRuntime on its event loop."""

    @abstractmethod
    def admit(self, rt: "ModelRuntime", batches: list[Batch], now: float) -> list[Batch]:
        """Of the batches ``rt``'s scheduler proposes, those to start now."""

    def preempted(self, rt: "ModelRuntime", instance: int, msg: DoneMsg) -> None:
        """A worker stopped a batch at a segment boundary (REEF)."""
        raise RuntimeError(f"{type(self).__name__} never preempts, but {rt.name} reported a preemption")

    def finished(self, rt: "ModelRuntime", instance: int, batch: Batch, msg: DoneMsg) -> None:
        """A batch finished on ``instance``."""


class Concurrent(Coordinator):
    """RT and BE side by side with no priority between models."""

    def admit(self, rt: "ModelRuntime", batches: list[Batch], now: float) -> list[Batch]:
        return batches
