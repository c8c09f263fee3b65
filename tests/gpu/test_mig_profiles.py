"""PROTEAN's profiles on real MIG devices: lenet's latency measured once per MIG profile of
the node (each process seeing only its device), co-location runs on one device, both stored
per profile and read back by the node's profile source. Skipped without CUDA, and on a
node whose GPUs have MIG off (never turned on here: that needs an administrator)."""

from __future__ import annotations

import pytest
import torch

from splitserve.modelconfig import ModelConfig
from splitserve.placement.devices import partitions_of
from splitserve.placement.gpus import PynvmlNvml, read_gpus
from splitserve.placement.mig_profiler import devices_by_profile, profile_mig, profile_mig_colocation
from splitserve.placement.profiler import fit_stored_fbr, save_colocation, save_profile
from splitserve.protean.profiles import ProteanProfiles
from splitserve.registry import Registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_lenet_is_profiled_per_mig_profile_and_read_back_per_profile(tmp_path):
    listing = read_gpus(PynvmlNvml())
    parts = partitions_of(listing)
    devices = devices_by_profile(parts)
    if not devices:
        pytest.skip(f"no MIG devices on this node ({listing.reason or 'MIG is off on every GPU'})")
    cfg = ModelConfig.from_dict({"name": "lenet", "max_batch_size": 8, "artifact": {"kind": "zoo", "arch": "lenet"}})
    reg = Registry(tmp_path)
    try:
        profs = profile_mig(cfg, None, tmp_path / "cache", parts, [1, 8], min_iters=3, max_iters=20, budget_s=0.3)
        assert list(profs) == list(devices)
        for name, prof in profs.items():
            save_profile(reg, prof, mig=name)
        first = next(iter(devices.values()))
        runs = profile_mig_colocation([cfg], first, 8, tmp_path / "cache", sets=[("lenet", "lenet")], budget_s=0.3)
        assert runs.runs and all(s > 0 for s in runs.runs[0].slowdowns) and runs.cores == first.compute_slices
        save_colocation(reg, runs, mig=first.profile)
        fit_stored_fbr(reg, ["lenet"], first.compute_slices, runs.machine, mig=first.profile)
        source = ProteanProfiles(reg, runs.machine)
        for name in devices:
            assert (source.solo("lenet", name, 8) or 0) > 0
        assert source.solo("lenet", 1, 8) is None  # nothing measured on the CPUs
    finally:
        reg.close()
