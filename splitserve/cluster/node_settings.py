"""The settings every serving node of a cluster runs with: ``serve``'s own, given once to
``cluster up`` (its node flags, or a node config file) and applied on every node.

They travel as the ``SPLITSERVE_*`` variables a node's ``splitserve serve`` reads
(``NodeSpec.env``), so a node takes them the way one server takes its environment, and they
are checked on the driver by that same reader (``ServerConfig.from_env``) before any node
starts: a bad value is refused at ``cluster up``, not in every node's log.

A node config file is TOML with ``serve``'s setting names (``ServerConfig``'s fields), at the top
level or under the table of their section::

    memory_budget_bytes = "8GiB"
    partitioning = "protean"

    [reef]
    preemption = "idle"

The settings the cluster sets on each node itself (addresses, ports, data directory, models)
are refused: a node's routes and models come from the controller.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitserve.config import ServerConfig, env_fields, settings_env
from splitserve.errors import InvalidInput

# Set by the cluster on each node: its own addresses and ports, where its files go, and the
# models the controller gives it.
CLUSTER_OWNED = frozenset({"host", "fast_port", "udp_port", "http_port", "grpc_port", "unix_path", "data_dir",
                           "cache_dir", "repository", "load"})


def read_node_config(path: Path) -> dict[str, Any]:
    """The settings in the node config file at ``path``, by name (sections flattened); a
    name that is no setting of ``serve``, or one under another section's table, is refused."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise InvalidInput(f"cannot read the node config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"the node config {path} is not TOML: {e}") from None
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in ServerConfig.SECTIONS and isinstance(value, dict):
            for name, inner in value.items():
                if ServerConfig.section_of(name) != key:
                    raise InvalidInput(f"the node config {path}: [{key}] has no setting {name!r}")
                out[name] = inner
        else:
            out[key] = value
    return out


def node_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """``settings`` (by name) as the ``SPLITSERVE_*`` variables each node's server reads,
    once a server's own configuration reader has accepted them."""
    owned = sorted(CLUSTER_OWNED & settings.keys())
    if owned:
        raise InvalidInput(f"the cluster sets {', '.join(owned)} on each node itself; leave them out of the node "
                           "settings")
    unknown = sorted(settings.keys() - env_fields())
    if unknown:
        raise InvalidInput(f"no node setting {', '.join(map(repr, unknown))} that a cluster can give its nodes; "
                           f"`splitserve serve --help` and splitserve/config.py list them")
    for name, value in settings.items():
        if isinstance(value, (dict, list)):
            raise InvalidInput(f"node setting {name!r} takes one value, not {type(value).__name__} {value!r}")
    env = settings_env(settings)
    ServerConfig.from_env(environ=env)  # refuses what a node would refuse, with the setting's name
    return env


def resident_room(env: Mapping[str, str]) -> int | None:
    """The models a node with the node settings ``env`` keeps resident at once (its
    ``max_resident_models``; None: no limit), as its server reads it."""
    return ServerConfig.from_env(environ=env).memory.max_resident_models
