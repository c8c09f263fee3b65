"""bench peers without processes or sockets: the report's ratios, the peers' environment
command lines and the client kinds the benchmark's transports resolve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.bench.peers import PEERS, build_env, env_commands
from splitserve.bench.peers.clients import CLIENTS, classes
from splitserve.bench.runner import build_params
from splitserve.bench.scenarios.peers import BY_NAME, ENDPOINTS, FAST_PATH, ratios
from splitserve.bench.transports import DIRECT, PEER_CLIENTS


def _cell(p50: float, tputs: dict[str, float]) -> dict:
    return {"single_us": {"p50": p50}, "closed": {c: {"throughput_rps": t} for c, t in tputs.items()}}


def test_ratios_compare_each_peer_with_splitserve_over_the_same_client_and_the_fast_path():
    cells = {
        "splitserve/fast-path": _cell(100.0, {"1": 9000.0, "32": 20000.0}),
        "splitserve/http": _cell(400.0, {"1": 2000.0, "32": 8000.0}),
        "splitserve/grpc": _cell(500.0, {"1": 1500.0, "32": 6000.0}),
        "triton/http": _cell(1600.0, {"1": 500.0, "32": 2000.0}),
        "triton/grpc": _cell(1000.0, {"1": 750.0, "32": 3000.0}),
        "ray/http": _cell(4000.0, {"1": 200.0, "32": 400.0}),
    }
    r = ratios(cells)
    assert set(r) == {"triton/http", "triton/grpc", "ray/http"}  # splitserve is never its own peer
    assert r["triton/http"]["counterpart"] == "splitserve/http"
    assert r["triton/http"]["p50_vs_counterpart"] == pytest.approx(4.0)
    assert r["triton/grpc"]["p50_vs_counterpart"] == pytest.approx(2.0)  # gRPC is compared with gRPC
    assert r["triton/grpc"]["p50_vs_fast_path"] == pytest.approx(10.0)
    assert r["triton/http"]["throughput_vs_counterpart"] == {"1": pytest.approx(4.0), "32": pytest.approx(4.0)}
    assert r["ray/http"]["throughput_vs_fast_path"]["32"] == pytest.approx(50.0)


def test_ratios_are_none_where_a_side_was_not_measured():
    # splitserve's gRPC front end and the fast path gave no numbers; Ray had no 32-client point
    cells = {"splitserve/http": _cell(400.0, {"1": 2000.0, "32": 8000.0}),
             "triton/grpc": _cell(1000.0, {"1": 750.0}),
             "ray/http": _cell(4000.0, {"1": 200.0, "32": 0.0})}
    r = ratios(cells)
    assert r["triton/grpc"]["p50_vs_counterpart"] is None
    assert r["triton/grpc"]["p50_vs_fast_path"] is None
    assert r["ray/http"]["p50_vs_counterpart"] == pytest.approx(10.0)
    assert r["ray/http"]["throughput_vs_counterpart"]["32"] is None  # never a division by zero
    assert ratios({}) == {}


def test_env_commands_build_an_isolated_venv_from_the_given_python(tmp_path: Path):
    venv = tmp_path / "triton"
    cmds = env_commands(PEERS["triton"], "/usr/bin/python3.11", venv, "torch==2.13.0")
    assert cmds[0] == ["/usr/bin/python3.11", "-m", "venv", "--clear", str(venv)]
    assert not any("--system-site-packages" in c for cmd in cmds for c in cmd)  # the peer's pins stay its own
    install = cmds[-1]
    assert install[:4] == [str(venv / "bin" / "python"), "-m", "pip", "install"]
    assert "nvidia-pytriton" in install and "torch==2.13.0" in install
    assert "splitserve" not in " ".join(install)
    assert "ray[serve]" in env_commands(PEERS["ray"], "py", tmp_path / "ray", "torch")[-1]


def test_build_env_reuses_an_environment_built_by_the_same_commands(tmp_path: Path):
    peer = PEERS["ray"]
    venv = tmp_path / peer.name
    venv.mkdir()
    (venv / ".splitserve-peer.json").write_text(json.dumps(env_commands(peer, "/no/python", venv, "torch")))
    # built before: nothing runs, not even the missing interpreter
    assert build_env(peer, "/no/python", tmp_path, "torch", 1.0, tmp_path / "log") == venv / "bin" / "python"


def test_build_env_without_its_python_says_so(tmp_path: Path):
    from splitserve.bench.peers import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="no Python at /no/python"):
        build_env(PEERS["ray"], "/no/python", tmp_path, "torch", 1.0, tmp_path / "log")


def test_every_endpoint_has_a_known_client_and_peer():
    assert set(CLIENTS) == set(PEER_CLIENTS)
    for e in ENDPOINTS:
        assert e.client in PEER_CLIENTS + ("direct-tcp",)
        assert e.server == "splitserve" or e.front_end in {fe for fe, _, _ in PEERS[e.server].front_ends}
    # splitserve's fast path is timed as a user gets it: the client's defaults, direct to the workers
    assert BY_NAME[FAST_PATH].client in DIRECT
    for kind in CLIENTS:
        blocking, asynchronous = classes(kind)
        assert blocking is not asynchronous
    with pytest.raises(ValueError, match="unknown client"):
        classes("carrier-pigeon")


def test_quick_params_are_small_and_lenet_only():
    p = build_params("peers", quick=True)
    assert p.models == ("lenet",) and p.clients == (1, 8, 32) and p.duration_s <= 3
    with pytest.raises(ValueError, match="clients"):
        build_params("peers", overrides={"clients": "0"})
