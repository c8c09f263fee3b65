"""Triton's trace settings (the trace extension): the node's and each model's, and which
calls they trace. Pure: settings in, decisions out; ``server/tracing.py`` builds the spans.

A model's settings are the node's with the keys set for that model on top; clearing a key
(``null`` over HTTP, an empty value over gRPC) gives it back to the node's, clearing a
node key gives it back its default. Of the calls a scope sees, every ``trace_rate``-th is
traced while its ``trace_count`` (-1: no limit) has traces left: a model with settings of
its own counts its own calls and traces.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from splitserve.errors import InvalidInput

# ``TIMESTAMPS`` is the one level splitserve records; ``TENSORS`` (the tensors' values) it does not.
LEVELS = ("OFF", "TIMESTAMPS")
# How spans leave: always OpenTelemetry (Triton's other mode writes its own JSON format).
MODE = "opentelemetry"
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
# A trace file is a plain name inside the node's trace directory, never a path.
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _int(key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidInput(f"trace setting {key!r} must be an integer (as a string), got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise InvalidInput(f"trace setting {key!r} must be an integer (as a string), got {value!r}") from None
    if n < least:
        raise InvalidInput(f"trace setting {key!r} must be at least {least}, got {n}")
    return n


def _level(value: Any) -> tuple[str, ...]:
    levels = [value] if isinstance(value, str) else value
    if not isinstance(levels, (list, tuple)) or not levels or not all(isinstance(v, str) for v in levels):
        raise InvalidInput(f"trace setting 'trace_level' must be a list of levels (OFF or TIMESTAMPS), got {value!r}")
    upper = tuple(v.upper() for v in levels)
    unknown = [v for v in upper if v not in LEVELS]
    if unknown:
        why = " (splitserve records timestamps, not tensors)" if "TENSORS" in unknown else ""
        raise InvalidInput(f"trace_level {unknown[0]!r} is not served{why}: use OFF or TIMESTAMPS")
    if "OFF" in upper and len(upper) > 1:
        raise InvalidInput("trace_level OFF cannot be combined with another level")
    return upper


def _file(value: Any) -> str:
    if not isinstance(value, str) or (value and not _FILE_NAME.fullmatch(value)):
        raise InvalidInput(f"trace_file must be a file name (letters, digits, '.', '_', '-'; no directories): the "
                           f"spans are written, as JSON lines, into the server's trace directory; got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """One scope's settings, with Triton's defaults: tracing off, every 1000th call when on,
    no limit on the count, spans exported at once, no trace file."""

    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0  # spans kept before a trace file is written (0: written as they come)
    file: str = ""  # a name in the trace directory ("": no file; OTLP, when configured, still gets them)

    @property
    def on(self) -> bool:
        return "TIMESTAMPS" in self.level

    def changed(self, changes: Mapping[str, Any]) -> "TraceSettings":
        """These settings with ``changes`` (Triton's keys, values checked; None: the default)."""
        out, default = self, TraceSettings()
        for key, value in changes.items():
            if key == "trace_level":
                out = replace(out, level=default.level if value is None else _level(value))
            elif key == "trace_rate":
                out = replace(out, rate=default.rate if value is None else _int(key, value, 1))
            elif key == "trace_count":
                out = replace(out, count=default.count if value is None else _int(key, value, -1))
            elif key == "log_frequency":
                out = replace(out, log_frequency=default.log_frequency if value is None else _int(key, value, 0))
            elif key == "trace_file":
                out = replace(out, file=default.file if value is None else _file(value))
            elif key == "trace_mode":
                if value is not None and value != MODE:
                    raise InvalidInput(f"trace_mode {value!r} is not served: splitserve's spans are OpenTelemetry's "
                                       f"({MODE!r})")
            else:
                raise InvalidInput(f"unknown trace setting {key!r}; the settings are {', '.join(KEYS)}")
        return out

    def to_triton(self, left: int) -> dict[str, Any]:
        """Triton's form: strings, ``trace_level`` a list; ``trace_count`` is what is ``left``."""
        return {"trace_level": list(self.level), "trace_rate": str(self.rate), "trace_count": str(left),
                "log_frequency": str(self.log_frequency), "trace_file": self.file, "trace_mode": MODE}


class _Scope:
    """The node's or one model's settings, the calls it saw and the traces it has left."""

    __slots__ = ("settings", "seen", "left", "overrides")

    def __init__(self, settings: TraceSettings, overrides: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.overrides = overrides or {}
        self.seen = 0
        self.left = settings.count


class TraceSampler:
    """The node's trace settings and each model's, and the decision for each answered call."""

    def __init__(self) -> None:
        self._node = _Scope(TraceSettings())
        self._models: dict[str, _Scope] = {}

    def settings(self, model: str | None = None) -> dict[str, Any]:
        """The settings in force for ``model`` (None: the node's), Triton's form."""
        scope = self._scope(model)
        return scope.settings.to_triton(scope.left)

    def _scope(self, model: str | None) -> _Scope:
        return self._node if model is None else self._models.get(model, self._node)

    def update(self, changes: Mapping[str, Any], model: str | None = None) -> dict[str, Any]:
        """Apply ``changes`` (all checked first: a bad one changes nothing) to the node or to
        ``model``; returns the settings now in force there."""
        if model is None:
            node = self._node
            node.settings = node.settings.changed(changes)
            if "trace_count" in changes:
                node.left = node.settings.count
            for scope in self._models.values():
                scope.settings = node.settings.changed(scope.overrides)
                if "trace_count" in changes and "trace_count" not in scope.overrides:
                    scope.left = scope.settings.count
            return self.settings()
        node = self._node.settings
        old = self._models.get(model)
        overrides = {**(old.overrides if old else {}), **changes}
        overrides = {k: v for k, v in overrides.items() if v is not None}
        settings = node.changed(overrides)  # raises before anything is kept
        if not overrides:
            self._models.pop(model, None)
            return self.settings(model)
        scope = _Scope(settings, overrides)
        if old is not None:
            scope.seen = old.seen
            if "trace_count" not in changes:
                scope.left = old.left
        self._models[model] = scope
        return self.settings(model)

    def forget(self, model: str) -> None:
        """``model`` was unregistered: its own settings go with it."""
        self._models.pop(model, None)

    def sample(self, model: str) -> TraceSettings | None:
        """Whether the call to ``model`` just answered is traced: the settings it is traced
        under, or None."""
        scope = self._scope(model)
        s = scope.settings
        if not s.on or scope.left == 0:
            return None
        scope.seen += 1
        if scope.seen % s.rate:
            return None
        if scope.left > 0:
            scope.left -= 1
        return s
