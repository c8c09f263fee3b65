"""Name lists and tunables: one enum per list with a factory that refuses unknown names,
used by every place that takes the name; every tunable in ``ServerConfig`` with a
``SPLITSERVE_*`` name; only ``config.py`` reads the environment."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import typer

from splitserve.cli import app
from splitserve.config import ServerConfig, TransportSection
from splitserve.errors import InvalidInput
from splitserve.modelconfig import ArtifactConfig, ArtifactKind, ModelConfig
from splitserve.models.loader import load_artifact
from splitserve.placement.packrat import PackratConfig, PlacementKind
from splitserve.scheduler.model_scheduler import ClassOrder, ModelScheduler, RtPolicy
from splitserve.scheduler.policy import (
    Adaptive, BatchingConfig, BatchingPolicyKind, NoBatching, Timeout, WorkConserving, make_policy,
)
from splitserve.scheduler.priority import PriorityMode

PACKAGE = Path(__file__).resolve().parents[2] / "splitserve"


def _refused(*parts: str) -> str:
    """A regex for a message with these parts in this order (the setting, the name given,
    every valid name)."""
    return ".*".join(parts)


def test_preemption_modes_round_trip_and_an_unknown_one_is_refused(monkeypatch):
    for mode in PriorityMode:
        assert PriorityMode.parse(str(mode)) is mode
        assert ServerConfig.of(preemption=mode.value).reef.preemption is mode
        monkeypatch.setenv("SPLITSERVE_PREEMPTION", mode.value)
        assert ServerConfig.from_env().reef.preemption is mode
    with pytest.raises(InvalidInput, match=_refused("preemption", "'lifo'", "reef, idle, seq, concurrent, rt-only")):
        ServerConfig.of(preemption="lifo")
    monkeypatch.setenv("SPLITSERVE_PREEMPTION", "REEF")
    with pytest.raises(InvalidInput, match=_refused("SPLITSERVE_PREEMPTION", "'REEF'", "reef, idle, seq, concurrent, rt-only")):
        ServerConfig.from_env()


def test_rt_policies_round_trip_and_an_unknown_one_is_refused():
    for policy in RtPolicy:
        assert RtPolicy.parse(policy.value) is policy
        assert ServerConfig.of(rt_policy=policy.value).reef.rt_policy is policy
        assert ModelScheduler("m", WorkConserving(), 2, 8, rt_policy=policy.value).rt_policy is policy
    with pytest.raises(InvalidInput, match=_refused("rt_policy", "'lifo'", "fifo, edf")):
        ServerConfig.of(rt_policy="lifo")
    with pytest.raises(InvalidInput, match=_refused("rt_policy", "'lifo'", "fifo, edf")):
        ModelScheduler("m", WorkConserving(), 2, 8, rt_policy="lifo")


def test_placements_round_trip_and_an_unknown_one_is_refused():
    for kind in PlacementKind:
        assert PlacementKind.parse(kind.value) is kind
        assert ServerConfig.of(placement=kind.value).packrat.placement is kind
        parsed = PackratConfig.parse({"kind": kind.value, "threads": 1}, 8)
        assert (parsed is None) == (kind is PlacementKind.FIXED)
        # the server's default applies to a model whose [placement] names no kind
        assert (PackratConfig.parse({}, 8, kind) is None) == (kind is PlacementKind.FIXED)
    with pytest.raises(InvalidInput, match=_refused("placement", "'magic'", "fixed, packrat")):
        ServerConfig.of(placement="magic")
    with pytest.raises(InvalidInput, match=_refused("placement.kind", "'magic'", "fixed, packrat")):
        PackratConfig.parse({"kind": "magic"}, 8)


def test_artifact_kinds_round_trip_and_an_unknown_one_is_refused(tmp_path):
    tensor = {"name": "x", "datatype": "FP32", "shape": [4]}
    for kind in ArtifactKind:
        assert ArtifactKind.parse(kind.value) is kind
        art = ArtifactConfig(kind=kind.value, arch="lenet", file="model.bin")
        assert art.kind is kind
        cfg = ModelConfig.from_dict({"name": "m", "artifact": {"kind": kind.value, "arch": "lenet", "file": "m.bin"},
                                     "inputs": [tensor], "outputs": [tensor]})
        # configs travel as JSON (registry rows, worker specs) and come back as the same kind
        again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg and again.artifact.kind is kind
    assert {k for k in ArtifactKind if k.runs_code} == {ArtifactKind.TORCHSCRIPT, ArtifactKind.EXPORT,
                                                         ArtifactKind.EAGER}
    valid = "zoo, safetensors, torchscript, export, eager"
    with pytest.raises(InvalidInput, match=_refused("artifact.kind", "'pickle'", valid, "torch.save")):
        ArtifactConfig(kind="pickle", file="m.pt")
    with pytest.raises(InvalidInput, match=_refused("'pickle'", valid)):
        load_artifact("pickle", tmp_path / "m.pt", "lenet")


def test_batching_policies_round_trip_and_an_unknown_one_is_refused():
    built = {BatchingPolicyKind.WORK_CONSERVING: WorkConserving, BatchingPolicyKind.TIMEOUT: Timeout,
             BatchingPolicyKind.NONE: NoBatching, BatchingPolicyKind.ADAPTIVE: Adaptive}
    assert set(built) == set(BatchingPolicyKind)
    for kind, policy in built.items():
        assert BatchingPolicyKind.parse(kind.value) is kind
        cfg = BatchingConfig(policy=kind.value)
        assert cfg.policy is kind and isinstance(make_policy(cfg), policy)
    valid = "work_conserving, timeout, none, adaptive"
    for bad in ("fifo", 3, None):
        with pytest.raises(InvalidInput, match=_refused("batching.policy", valid)):
            BatchingConfig(policy=bad)


def test_the_cli_offers_exactly_the_enums_names():
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    ctx = serve.make_context("serve", [], resilient_parsing=True)
    params = {p.name: p for p in serve.params}
    for name, enum in (("preemption", PriorityMode), ("rt_policy", RtPolicy), ("placement", PlacementKind),
                       ("class_order", ClassOrder)):
        option = params[name]
        assert [c.value for c in option.shell_complete(ctx, "")] == [m.value for m in enum], name
        assert all(option.process_value(ctx, m.value) is m for m in enum), name
        with pytest.raises(typer.BadParameter):
            option.process_value(ctx, "bogus")


def test_every_tunable_has_an_environment_name(monkeypatch):
    """The fields that were constants in the code are read from SPLITSERVE_* like the rest."""
    given = {"worker_reap_timeout_s": 3.5, "coordinator_events": 17, "batch_time_weight": 0.5,
             "segment_time_weight": 0.125, "max_labels": 9, "max_top_k": 4, "http_start_poll_s": 0.25,
             "log_level": "DEBUG", "spare_workers": 2, "recycle_slack_bytes": 1 << 20,
             "evict_drop_cache": True}
    for name, value in given.items():
        monkeypatch.setenv(f"SPLITSERVE_{name.upper()}", str(value))
    cfg = ServerConfig.from_env()
    assert {name: cfg.setting(name) for name in given} == given


@pytest.mark.parametrize("bad", [{"segment_time_weight": 0.0}, {"batch_time_weight": 1.5}, {"max_top_k": 0},
                                 {"coordinator_events": 0}, {"worker_reap_timeout_s": 0.0},
                                 {"log_level": "LOUD"}, {"spare_workers": -1},
                                 {"recycle_slack_bytes": -1}])
def test_bad_tunables_are_refused_at_start_up(bad):
    with pytest.raises(InvalidInput, match=next(iter(bad))):
        ServerConfig.from_env(**bad)


def test_the_cache_dir_comes_from_the_config_or_its_environment_name(monkeypatch, tmp_path):
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR", raising=False)
    assert ServerConfig.of(data_dir=tmp_path).cache_path == tmp_path / "cache"
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert ServerConfig.of(data_dir=tmp_path).cache_path == tmp_path / "elsewhere"
    assert ServerConfig.of(data_dir=tmp_path, cache_dir=tmp_path / "given").cache_path == tmp_path / "given"


def test_a_port_of_minus_one_is_off_from_a_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_HTTP_PORT", "-1")
    cfg = ServerConfig.from_env(grpc_port=-1)
    assert (cfg.frontends.http_port, cfg.frontends.grpc_port) == (None, None)
    assert cfg.transports.fast_port == TransportSection.fast_port


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: os.environ.get / [...] / os.getenv (copying os.environ
    for a child process is not reading a setting)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "environ":
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            lines.append(node.lineno)
    return lines


def test_only_the_config_module_reads_the_environment():
    reads = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if (lines := _environment_reads(ast.parse(p.read_text())))}
    assert set(reads) == {"config.py"}, reads


# (section, field, what the environment says, the value it gives): a few fields of every
# section, each read from the environment name it had before the sections
_SECTION_ENV = [
    (None, "host", "0.0.0.0", "0.0.0.0"),
    (None, "log_level", "DEBUG", "DEBUG"),
    ("transports", "fast_port", "9100", 9100),
    ("transports", "udp_segment", "4096", 4096),
    ("transports", "fast_direct", "1", True),
    ("transports", "direct_spin_us", "50", 50),
    ("transports", "front_end_spin_us", "3000", 3000),
    ("batching", "queue_slots", "64", 64),
    ("batching", "watchdog_period_s", "2.5", 2.5),
    ("memory", "memory_budget_bytes", "2GiB", 2 << 30),
    ("memory", "spare_workers", "0", 0),
    ("memory", "pinned_tier_bytes", "1048576", 1 << 20),
    ("packrat", "placement", "packrat", PlacementKind.PACKRAT),
    ("packrat", "packrat_default_share", "0.25", 0.25),
    ("protean", "partitioning", "static", "static"),
    ("protean", "protean_t_low", "0.5", 0.5),
    ("protean", "partition_max_instances", "3", 3),
    ("reef", "preemption", "seq", PriorityMode.SEQ),
    ("reef", "rt_policy", "edf", RtPolicy.EDF),
    ("reef", "batch_time_weight", "0.5", 0.5),
    ("frontends", "http_port", "-1", None),
    ("frontends", "codec_threads", "3", 3),
    ("frontends", "shm_max_regions", "8", 8),
    ("frontends", "otlp_endpoint", "http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/traces"),
    ("workers", "worker_start_timeout_s", "30", 30.0),
    ("workers", "worker_omp_wait_policy", "passive", "passive"),
    ("workers", "fork_workers", "0", False),
    ("gpu", "gpu_admin", "true", True),
    ("gpu", "gpu_listing_max_age_s", "5", 5.0),
    ("gpu", "zoo_device", "cuda:1", "cuda:1"),
]


@pytest.mark.parametrize(("section", "name", "raw", "value"), _SECTION_ENV)
def test_every_section_reads_its_fields_from_the_same_environment_names(monkeypatch, section, name, raw, value):
    monkeypatch.setenv(f"SPLITSERVE_{name.upper()}", raw)
    cfg = ServerConfig.from_env()
    assert ServerConfig.section_of(name) == section
    assert getattr(cfg if section is None else getattr(cfg, section), name) == value
    assert cfg.setting(name) == value


def test_the_table_covers_every_section_and_no_field_is_in_two():
    assert {s for s, *_ in _SECTION_ENV} - {None} == set(ServerConfig.SECTIONS)
    names = [f.name for kind in ServerConfig.SECTIONS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == 101
    assert len(ServerConfig.field_names()) == 107


def test_a_field_by_name_goes_to_its_section_and_an_unknown_one_is_refused():
    cfg = ServerConfig.of(fast_port=0, spare_workers=0, host="::1")
    assert (cfg.transports.fast_port, cfg.memory.spare_workers, cfg.host) == (0, 0, "::1")
    assert cfg.replaced(fast_port=5).transports.fast_port == 5 and cfg.transports.fast_port == 0
    with pytest.raises(TypeError, match="no field 'fast_prot'"):
        ServerConfig.of(fast_prot=1)


def test_serve_help_groups_its_options_by_config_section():
    from typer.testing import CliRunner

    from splitserve.cli.serve import PANELS

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for title in ("Node", "Transports", "Batching", "Memory (Rafiqi)", "Placement (Packrat)",
                  "Partitions (PROTEAN)", "Scheduling (REEF)", "Front ends"):
        assert f"─ {title}" in out, title
    # an option sits in its section's panel: --memory-budget after the memory title, before the next one
    memory = out.index(f"─ {PANELS['memory']}")
    assert memory < out.index("--memory-budget") < min(out.index(f"─ {PANELS[s]}", memory + 1) for s in PANELS
                                                       if f"─ {PANELS[s]}" in out[memory + 1:])


@pytest.mark.parametrize("instances, be_instances, ok", [(2, 1, True), (1, 0, True), (1, 1, False), (2, -1, False)])
def test_be_instances_leave_an_instance_for_real_time_calls(instances, be_instances, ok):
    tensor = {"name": "x", "datatype": "FP32", "shape": [4]}
    d = {"name": "m", "artifact": {"kind": "zoo", "arch": "lenet"}, "inputs": [tensor], "outputs": [tensor],
         "instances": instances, "be_instances": be_instances}
    if ok:
        assert ModelConfig.from_dict(d).be_instances == be_instances
    else:
        with pytest.raises(InvalidInput, match="be_instances"):
            ModelConfig.from_dict(d)
