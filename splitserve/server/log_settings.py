"""Triton's logging extension: the node's log levels, read and changed at run time.

Triton's switches map onto the level of the ``splitserve`` logger (the node's own
messages; its worker processes keep the level they started with): ``log_verbose_level``
above 0 is DEBUG, else the lowest of ``log_info``, ``log_warning`` and ``log_error`` that is
on. Python's levels are a threshold, so a set of switches that is not one (INFO on with
WARNING off) is refused rather than half applied. Logs go where the server's logging
sends them, in its format: ``log_file`` and ``log_format`` can be read, and only set to
what they are.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from splitserve.errors import InvalidInput

KEYS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
_SWITCHES = (("log_info", logging.INFO), ("log_warning", logging.WARNING), ("log_error", logging.ERROR))
_FIXED = {"log_file": "", "log_format": "default"}
# Nothing at all: every switch off.
_SILENT = logging.CRITICAL + 10


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"log setting {key!r} must be true or false, got {value!r}")
    return value


def _verbose(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"log setting 'log_verbose_level' must be a non-negative integer, got {value!r}")
    return value


class LogSettings:
    """The log settings of ``logger`` (the node's ``splitserve`` logger), Triton's form."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.verbose = 1 if logger.getEffectiveLevel() <= logging.DEBUG else 0

    def settings(self) -> dict[str, Any]:
        level = self.logger.getEffectiveLevel()
        out: dict[str, Any] = dict(_FIXED)
        out.update({key: level <= lvl for key, lvl in _SWITCHES})
        out["log_verbose_level"] = self.verbose if level <= logging.DEBUG else 0
        return out

    def update(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (all checked first: a bad one changes nothing); the settings now."""
        now = self.settings()
        for key, value in changes.items():
            if key not in KEYS:
                raise InvalidInput(f"unknown log setting {key!r}; the settings are {', '.join(KEYS)}")
            if value is None:
                continue
            if key in _FIXED:
                if value != _FIXED[key]:
                    raise InvalidInput(f"{key} cannot be changed: the server logs where and how its logging was "
                                       f"configured at start ({key} is {_FIXED[key]!r})")
            elif key == "log_verbose_level":
                now[key] = _verbose(value)
            else:
                now[key] = _bool(key, value)
        on = [lvl for key, lvl in _SWITCHES if now[key]]
        if on and on != [lvl for _k, lvl in _SWITCHES if lvl >= on[0]]:
            raise InvalidInput("log levels are a threshold here: with log_info on, log_warning and log_error must be "
                               "on too, and with log_warning on, log_error")
        if now["log_verbose_level"] > 0:
            level = logging.DEBUG
        else:
            level = on[0] if on else _SILENT
        self.verbose = now["log_verbose_level"]
        self.logger.setLevel(level)
        self.logger.info("log level set to %s", logging.getLevelName(level))
        return self.settings()
