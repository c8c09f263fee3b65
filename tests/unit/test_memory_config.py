"""The memory manager's settings: sizes as users write them, from flags or SPLITSERVE_*."""

from __future__ import annotations

import pytest

from splitserve.config import ServerConfig, parse_bytes
from splitserve.errors import InvalidInput


@pytest.mark.parametrize("text,size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("500MB", 500_000_000),
                                       ("123", 123), (" 1kib ", 1024)])
def test_sizes_accept_binary_and_decimal_units_and_plain_bytes(text, size):
    assert parse_bytes(text, "--memory-budget") == size


def test_a_size_that_is_not_one_is_refused_naming_where_it_came_from():
    with pytest.raises(InvalidInput, match="--memory-budget='lots' is not a size"):
        parse_bytes("lots", "--memory-budget")


def test_the_budget_and_the_model_count_come_from_their_environment_names(monkeypatch):
    assert not ServerConfig.from_env().memory.managed  # unset: no manager, as before
    monkeypatch.setenv("SPLITSERVE_MEMORY_BUDGET_BYTES", "2GiB")
    monkeypatch.setenv("SPLITSERVE_MAX_RESIDENT_MODELS", "4")
    monkeypatch.setenv("SPLITSERVE_MAX_CONCURRENT_LOADS", "2")
    cfg = ServerConfig.from_env()
    memory = cfg.memory
    assert (memory.memory_budget_bytes, memory.max_resident_models, memory.max_concurrent_loads) == (2 << 30, 4, 2)
    assert cfg.memory.managed


def test_a_device_budget_alone_makes_a_manager(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_DEVICE_BUDGET_BYTES", "20GiB")
    memory = ServerConfig.from_env().memory
    assert memory.device_budget_bytes == 20 << 30 and memory.memory_budget_bytes is None and memory.managed


@pytest.mark.parametrize("bad", [{"memory_budget_bytes": 0}, {"max_resident_models": 0}, {"max_concurrent_loads": 0},
                                 {"device_budget_bytes": 0}])
def test_limits_below_one_are_refused(bad):
    with pytest.raises(InvalidInput):
        ServerConfig.from_env(**bad)
