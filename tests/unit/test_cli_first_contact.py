"""First contact with the CLI, without a server: ``splitserve models`` fits an 80-column
terminal, and ``splitserve infer`` says what a model is doing while its first call waits."""

from __future__ import annotations

import concurrent.futures
import io
from pathlib import Path

import pytest
from rich.console import Console

from splitserve.cli.infer import answer_with_progress, model_state
from splitserve.cli.models import ModelRow, models_table, short_shapes
from splitserve.client.common import ModelInfo
from splitserve.errors import ModelNotReady
from splitserve.registry import Registry
from splitserve.types import TensorSpec


@pytest.fixture
def builtin_records(tmp_path: Path) -> list:
    reg = Registry(tmp_path)
    try:
        reg.sync()
        return reg.list()
    finally:
        reg.close()


def render(table: object, width: int) -> str:
    out = io.StringIO()
    Console(width=width, file=out, color_system=None).print(table)
    return out.getvalue()


@pytest.mark.parametrize("with_states", [True, False])
def test_models_fits_80_columns_without_cutting_a_name_or_shape(builtin_records: list, with_states: bool) -> None:
    states = ({r.name: {"state": "evicted", "residency": "EVICTED", "bytes": 46_800_000} for r in builtin_records}
              if with_states else None)
    rows = [ModelRow.of(r, states[r.name] if states else None) for r in builtin_records]
    text = render(models_table(rows, wide=False), 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for r in builtin_records:
        row = next(line for line in text.splitlines() if f" {r.name} " in line)
        assert short_shapes(r.config.inputs) in row and short_shapes(r.config.outputs) in row
        assert not with_states or ("EVICTED" in row and "44.6M" in row)


def test_wide_lists_every_field(builtin_records: list) -> None:
    live = {"state": "ready", "residency": "RESIDENT", "bytes": 1}
    text = render(models_table([ModelRow.of(r, live) for r in builtin_records], wide=True), 200)
    assert "…" not in text and "func_id" in text and "instances x threads" in text
    assert all(f" {r.name} " in text for r in builtin_records)
    assert "token_type_ids INT32[512]" in text and "start_logits FP32[512]" in text


def test_short_shapes_count_runs_of_equal_tensors() -> None:
    ids = [TensorSpec(n, "INT32", (512,)) for n in ("ids", "mask", "types")]
    assert short_shapes(ids) == "3×INT32[512]"
    assert short_shapes([TensorSpec("x", "FP32", (3, 224, 224)), TensorSpec("k", "INT64", (1,))]) == \
        "FP32[3,224,224], INT64[1]"


def test_infer_shows_what_the_model_does_until_its_answer_comes() -> None:
    pending: concurrent.futures.Future[str] = concurrent.futures.Future()
    states = iter(["unloaded", "loading", "ready"])
    shown: list[str] = []
    now = [100.0]

    def state() -> str:
        now[0] += 5.0
        s = next(states)
        if s == "ready":
            pending.set_result("answer")  # the answer comes while the model runs
        return s

    assert answer_with_progress(pending, state, shown.append, "digits", 0.0, lambda: now[0]) == "answer"
    assert [line.split(" (")[0] for line in shown] == ["digits: loading", "digits: loading", "digits: running"]
    assert shown[1] == "digits: loading (10 s; its first call starts it)"


def test_infer_without_a_wait_shows_nothing_and_errors_pass_through() -> None:
    done: concurrent.futures.Future[str] = concurrent.futures.Future()
    done.set_result("fast")
    shown: list[str] = []
    assert answer_with_progress(done, lambda: "ready", shown.append, "lenet", 0.0) == "fast" and shown == []
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(ModelNotReady("lenet failed to load"))
    with pytest.raises(ModelNotReady):
        answer_with_progress(failed, lambda: "failed", shown.append, "lenet", 0.0)


def test_model_state_from_every_transport_s_lookup() -> None:
    def info(extra: dict) -> ModelInfo:
        return ModelInfo("m", 1, (), (), 1, extra)

    assert model_state(info({"state": "loading"})) == "loading"  # fast path
    assert model_state(info({"parameters": {"state": "ready"}})) == "ready"  # HTTP metadata
    assert model_state(info({"parameters": {"state": {"string_param": "evicted"}}})) == "evicted"  # gRPC
    assert model_state(info({})) is None
