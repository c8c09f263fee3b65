"""What every cluster test shares: no load outlives the test that started it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.clients import stop_left_running


@pytest.fixture(autouse=True)
def _no_load_left_running() -> Iterator[None]:
    yield
    stop_left_running()
