"""Settings that reach worker processes through their spec, not through the environment."""

from __future__ import annotations

import asyncio
import re

from splitserve.models.segmented import save_safetensors
from splitserve.models.zoo import build_zoo_model
from tests.inproc import quiet_config, run_server

BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs


def test_the_servers_settings_reach_its_workers_and_coordinator(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_LOG_LEVEL", raising=False)  # the worker must not need it
    d = tmp_path / "repo" / "weights"
    d.mkdir(parents=True)
    (d / "config.toml").write_text('name = "weights"\n[artifact]\nkind = "safetensors"\narch = "lenet"\n'
                                   'file = "model.safetensors"\n')
    save_safetensors(build_zoo_model("lenet"), d / "model.safetensors")
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", load=("weights",), log_level="INFO",
                       segment_time_weight=0.5, worker_reap_timeout_s=3.0, coordinator_events=7)

    async def scenario(server):
        handle = server.runtimes["weights"].workers[0]
        return handle.pid, handle.spec, handle.reap_timeout_s, server.coordinator.events.maxlen

    pid, spec, reap_s, events = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    # the worker's own INFO line (its stderr is the server's): below the old WARNING default
    assert re.search(rf"worker\[{pid}\] INFO loading safetensors artifact", capfd.readouterr().err)
    assert (spec.log_level, spec.segment_time_weight, reap_s, events) == ("INFO", 0.5, 3.0, 7)
