"""The cluster's model registry as the controller keeps it: the cluster's own func id per
model name, never reused, and the spec each node registers."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.cluster.gateway.modelspec import ModelSpec


@dataclass
class ModelRegistry:
    """The cluster's models: a func id each (the cluster's own, not any node's) and the spec a
    node registers (None: built in everywhere)."""

    ids: dict[str, int] = field(default_factory=dict)
    specs: dict[str, ModelSpec | None] = field(default_factory=dict)
    # ids are never given twice: a client that kept an unregistered model's id must not reach another model
    last_id: int = 0
    removing: set[str] = field(default_factory=set)  # unregistered, still being removed from nodes

    def add(self, name: str, spec: ModelSpec | None, func_id: int | None = None) -> int:
        """Add ``name`` (with ``func_id``: as stored by an earlier controller) and return its id."""
        if name not in self.ids:
            if func_id is None:
                func_id = max(self.last_id, max(self.ids.values(), default=0)) + 1
            self.last_id = max(self.last_id, func_id)
            self.ids[name] = func_id
            self.specs[name] = spec
        return self.ids[name]

    def remove(self, name: str) -> None:
        """Forget ``name``; its id is not given again (``last_id`` keeps it)."""
        self.ids.pop(name, None)
        self.specs.pop(name, None)
