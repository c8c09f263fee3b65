"""The ``adaptive`` batching policy on a real server: a burst and a lone request are answered
right, and the policy is switched to adaptive and back at run time over HTTP."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve import Client
from splitserve.client.http import HttpClient
from splitserve.errors import InvalidInput
from splitserve.models.zoo import build_zoo_model
from tests.inproc import write_model


def lenet(xs: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        (y,) = build_zoo_model("lenet")(torch.from_numpy(xs))
    return y.numpy()


def burst_and_lone(url: str, xs: np.ndarray, want: np.ndarray) -> None:
    with Client(url) as c:
        calls = [c.submit("ada", x[None]) for x in xs]  # pipelined: they queue together
        got = np.concatenate([p.result().value() for p in calls])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # alone, it waits for a quantum boundary (the threshold is 0 once the burst's has decayed)
        np.testing.assert_allclose(c.infer("ada", xs[:1]), want[:1], rtol=1e-4, atol=1e-5)


def test_adaptive_policy_answers_bursts_and_lone_requests_and_can_be_switched_at_run_time(server_factory, tmp_path):
    write_model(tmp_path / "repo", "ada", "lenet",
                'max_batch_size = 16\n[batching]\npolicy = "adaptive"\nquantum_ms = 5.0\nthreshold_cap = 16\n')
    s = server_factory("--repository", str(tmp_path / "repo"), "--load", "ada", http=True)
    token = (s.data_dir / "token").read_text().strip()
    xs = np.random.default_rng(0).integers(0, 256, (40, 1, 28, 28), dtype=np.uint8)
    want = lenet(xs)
    burst_and_lone(s.tcp, xs, want)
    with HttpClient(s.http, token=token) as h:
        cfg = h.configure("ada", batching={"policy": "work_conserving"})
        assert cfg["batching"]["policy"] == "work_conserving"
        burst_and_lone(s.tcp, xs, want)
        cfg = h.configure("ada", batching={"policy": "adaptive", "rule": "aimd", "quantum_ms": 2.0,
                                           "adaptive_quantum": True})
        assert {k: cfg["batching"][k] for k in ("policy", "rule", "quantum_ms", "adaptive_quantum", "threshold_cap")} \
            == {"policy": "adaptive", "rule": "aimd", "quantum_ms": 2.0, "adaptive_quantum": True, "threshold_cap": 16}
        burst_and_lone(s.tcp, xs, want)
        with pytest.raises(InvalidInput, match="alpha"):
            h.configure("ada", batching={"alpha": 1.5})
        with pytest.raises(InvalidInput, match="unknown batching keys"):
            h.configure("ada", batching={"quantum": 5})
        assert h.configure("ada", batching={"policy": "none"})["batching"]["rule"] == "aimd"  # the rest stays
        burst_and_lone(s.tcp, xs, want)
