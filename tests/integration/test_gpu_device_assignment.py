"""A model asking for a GPU on a node whose NVML lists none (this machine, or any without the
driver) is answered, call after call, with MODEL_NOT_READY saying why, and the node keeps
serving its CPU models; a registration with ``--device`` says the same. On a GPU node the same
path hands the worker its partition (``tests/gpu``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.errors import ModelNotReady
from tests.inproc import quiet_config, run_server, write_model

BOUND_S = 60.0  # a hung load fails the test instead of the suite
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this node has a GPU: tests/gpu covers it")


def test_a_cuda_model_on_a_node_without_gpus_fails_its_load_and_says_why(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "ongpu", "digits", 'device = "cuda:0"')
    write_model(repo, "oncpu", "digits")
    cfg = quiet_config(tmp_path / "data", repository=repo)
    x = np.zeros((1, 1, 8, 8), np.float32)

    async def scenario(server):
        errors = []
        for _ in range(2):
            with pytest.raises(ModelNotReady) as e:
                await server.infer("ongpu", [x])
            errors.append(str(e.value))
        (y,) = (await server.infer("oncpu", [x])).outputs
        return errors, server.model_state("ongpu"), y.shape

    errors, state, shape = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert all("failed to load" in e and "device 'cuda:0'" in e and "no GPUs" in e for e in errors), errors
    assert str(state).lower().endswith("failed")
    assert shape[0] == 1


def test_models_register_device_serves_the_upload_on_that_device_and_says_why_it_cannot(
        server_factory, tmp_path):
    """``splitserve models register DIR --device cuda`` overrides the directory's config: on a
    node without GPUs the registration's load fails, naming the device and the reason."""
    s = server_factory(http=True)
    model = write_model(tmp_path / "elsewhere", "vec_gpu", "vecadd1k")
    before = (model / "config.toml").read_text()
    result = CliRunner().invoke(app, ["models", "register", str(model), "--url", s.http, "--data-dir",
                                      str(s.data_dir), "--device", "cuda"])
    assert result.exit_code != 0
    assert "device 'cuda'" in result.output and "no GPUs" in result.output, result.output
    assert (model / "config.toml").read_text() == before  # the directory is left as it was

