"""What the cluster keeps of a model registered with it: the files a node's register call takes.

Its own module, free of Ray, because the gateway's data plane (which never imports Ray) sends
one up to the controller when a client registers a model there (``cluster/gateway/upcall.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A model registered with the cluster: what a node's register call needs (no spec for a
    built-in model: every node has those)."""

    name: str
    config_toml: str
    artifact: bytes | None = None
    labels: str | None = None
