"""Model management shared by the HTTP and gRPC front ends (Rafiqi §3.1, TorchServe's
management API, the v2 repository and statistics extensions).

Every function here runs on the server's event loop; registry, SQLite and file work is
moved off it with ``asyncio.to_thread``. Management calls on one server are serialized by
one lock, so two registrations of the same name, or a scale racing an unload, cannot
interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.errors import (
    InsufficientStorage, InvalidInput, ModelNotReady, SplitServeError, Unauthorized, UnknownModel,
)
from splitserve.modelconfig import ArtifactKind, BatchingConfig, ModelConfig, check_model_name
from splitserve.protocol.v2 import json_number
from splitserve.registry import ModelRecord
from splitserve.scheduler.policy import make_policy

if TYPE_CHECKING:
    from splitserve.config import ServerConfig
    from splitserve.server.app import Server
    from splitserve.server.runtime import ModelRuntime

log = logging.getLogger(__name__)

TOKEN_FILE = "token"
UPLOAD_DIR = ".uploads"  # beside the repository (same file system, so rename is atomic)
# runtime state -> v2 repository extension state
_STATES = {"ready": "READY", "loading": "LOADING", "stopping": "UNLOADING",
           "failed": "UNAVAILABLE", "unloaded": "UNAVAILABLE"}

_locks: "weakref.WeakKeyDictionary[Server, asyncio.Lock]" = weakref.WeakKeyDictionary()
_tokens: "weakref.WeakKeyDictionary[Server, str]" = weakref.WeakKeyDictionary()


def _lock(server: "Server") -> asyncio.Lock:
    lock = _locks.get(server)
    if lock is None:
        lock = _locks[server] = asyncio.Lock()
    return lock


def record(server: "Server", name: str, version: str | None = None) -> ModelRecord:
    """A registered model; a version, if given (not empty), must be the one it serves."""
    rec = server.records.get(name)
    if rec is None:
        raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(server.records)) or 'none'}")
    if version and version != str(rec.version):
        raise UnknownModel(f"model {name!r} has no version {version!r}; it serves version {rec.version}")
    return rec


def server_ready(server: "Server") -> bool:
    """Ready (HTTP and gRPC alike): not stopping, and every start-up (``--load``) model is
    ready; other models load on first use, so they do not count."""
    return not server.stopping and all(server.model_state(m) == "ready" for m in server.config.load)


# -- security -----------------------------------------------------------------------------


def ensure_token(server: "Server") -> str:
    """The management token: read ``data_dir/token``, or create it (mode 0600) on first start."""
    cached = _tokens.get(server)
    if cached is not None:
        return cached
    path = server.config.data_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("management token %s had mode %o; setting 0600", path, mode)
            os.chmod(path, 0o600)
        token = path.read_text().strip()
        if not token:
            raise InvalidInput(f"management token file {path} is empty; delete it to make a new one")
        log.info("management token: %s", path)
    else:
        token = secrets.token_urlsafe(32)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        log.info("created management token %s (send it as 'Authorization: Bearer <token>')", path)
    _tokens[server] = token
    return token


def check_token(server: "Server", authorization: str | None) -> None:
    """Accept ``Bearer <token>``; raise Unauthorized otherwise (constant-time compare)."""
    if not authorization:
        raise Unauthorized(f"management calls need 'Authorization: Bearer <token>'; the token is in "
                           f"{server.config.data_dir / TOKEN_FILE}")
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <token>'")
    if not secrets.compare_digest(given.strip().encode(), ensure_token(server).encode()):
        raise Unauthorized("wrong management token")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name other than localhost is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(config: "ServerConfig") -> str | None:
    """What a bind to a non-loopback ``config.host`` lets anyone reach without the token
    (None on loopback). Only management (register, load, unload, scale) needs the token."""
    if is_loopback(config.host):
        return None
    open_ = []
    if config.fast_port is not None:
        open_.append(f"the fast path on TCP {config.fast_port} (inference on every registered model)")
    if config.udp_port is not None:
        open_.append(f"UDP {config.udp_port} (inference; answers go to the datagram's source address, "
                     "so spoofed requests reflect traffic)")
    if config.http_port is not None:
        open_.append(f"HTTP {config.http_port}: inference, /classify, /metrics, /v2/scheduler/events, placement "
                     "and model metadata")
    if config.grpc_port is not None:
        open_.append(f"gRPC {config.grpc_port}: inference, metadata and statistics")
    if not open_:
        return None
    return (f"listening on {config.host}, which is not loopback: anyone who can reach it can use, without the "
            f"management token, {'; '.join(open_)}; and any registered model starts its workers on its first "
            "request. Bind to 127.0.0.1 (--host) or firewall these ports unless that is intended")


# -- registration -----------------------------------------------------------------------


def _parse_labels(labels: str, limit: int) -> list[str]:
    out = [line.strip() for line in labels.splitlines()]
    while out and not out[-1]:
        out.pop()
    if not out:
        raise InvalidInput("the labels file is empty: give one label per line")
    if len(out) > limit:
        raise InvalidInput(f"the labels file has {len(out)} lines; at most {limit} are allowed")
    if any(ch < " " or ch == "\x7f" for label in out for ch in label):
        raise InvalidInput("labels must not contain control characters")
    return out


def _with_labels(config_toml: str, labels: list[str]) -> str:
    """The config text with a top-level ``labels = [...]`` line, so the repository keeps them.

    JSON string literals without ASCII escaping are valid TOML basic strings (control
    characters were refused above), and a key before the first table is top level.
    """
    return "labels = [" + ", ".join(json.dumps(s, ensure_ascii=False) for s in labels) + "]\n" + config_toml


@contextlib.contextmanager
def _storage(server: "Server") -> Iterator[None]:
    """A full disk (or quota) while registering is the client's InsufficientStorage, not a bug."""
    try:
        yield
        return
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        reason = os.strerror(e.errno)
    except sqlite3.OperationalError as e:
        if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
            raise
        reason = "the registry database is full"
    log.error("registration refused, no storage left in %s: %s", server.config.data_dir, reason)
    raise InsufficientStorage(f"the server has no storage left for the model ({reason}); nothing was registered, "
                              "retry once space is freed")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """Make the entries of ``path`` (a rename into it, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(server: "Server", config_toml: str, artifact: bytes | None, labels: str | None) -> tuple[ModelConfig, Path]:
    """Validate and write the model's files into a fresh directory beside the repository."""
    cfg = ModelConfig.from_toml(config_toml)
    if cfg.artifact.kind.runs_code and not server.config.allow_code_artifacts:
        raise InvalidInput(f"artifact.kind '{cfg.artifact.kind}' can run code on the server, so this server refuses "
                           "uploads of it; upload safetensors weights of a zoo architecture, or start the server "
                           "with --allow-code-artifacts (SPLITSERVE_ALLOW_CODE_ARTIFACTS=1) if every token holder "
                           "may run code on it")
    if labels is not None:
        if cfg.labels:
            raise InvalidInput("give labels either in config.toml or as a labels file, not both")
        config_toml = _with_labels(config_toml, _parse_labels(labels, server.config.max_labels))
        cfg = ModelConfig.from_toml(config_toml)
    if cfg.labels and len(cfg.labels) != cfg.outputs[0].numel:
        raise InvalidInput(f"{len(cfg.labels)} labels for output {cfg.outputs[0].name!r} of "
                           f"{cfg.outputs[0].numel} values: give one label per value")
    if cfg.artifact.kind is ArtifactKind.ZOO:
        if artifact:
            raise InvalidInput("a zoo artifact takes no file; set artifact.kind to 'safetensors' to upload weights")
    elif not artifact:
        raise InvalidInput(f"a {cfg.artifact.kind} artifact needs its file ({cfg.artifact.file!r}) uploaded")
    uploads = server.config.data_dir / UPLOAD_DIR
    with _storage(server):
        uploads.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{cfg.name}-", dir=uploads))
        try:
            _write_synced(tmp / "config.toml", config_toml.encode())
            if artifact:
                _write_synced(tmp / str(cfg.artifact.file), artifact)
            _sync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return cfg, tmp


def _commit(server: "Server", cfg: ModelConfig, tmp: Path) -> ModelRecord:
    """Move the prepared directory into the repository and add the model to the registry."""
    reg = server.registry
    dest = reg.model_dir(cfg.name)
    if reg.find(cfg.name) is not None or dest.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidInput(f"model {cfg.name!r} already exists; unregister it first "
                           f"(DELETE /v2/repository/models/{cfg.name})")
    with _storage(server):
        try:
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            # the rename is durable only once the repository directory itself is synced
            _sync_dir(dest.parent)
            return reg.upsert(cfg, "registered", dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise


def _remove(server: "Server", name: str) -> None:
    """Registry row and repository directory of a registered model (func_id is kept)."""
    reg = server.registry
    if reg.find(name) is not None:
        reg.remove(name)
    shutil.rmtree(reg.model_dir(name), ignore_errors=True)


async def _drop_runtime(server: "Server", name: str) -> None:
    rt = server.runtimes.pop(name, None)
    if rt is not None:
        rt.enabled = False
        await rt.unload()
        rt.close()


async def register_model(server: "Server", config_toml: str, artifact: bytes | None,
                         labels: str | None) -> ModelRecord:
    """Validate, persist (repository + registry) and load a model; undo it all on failure.

    A model that fails to load is unregistered again and InvalidInput carries the
    worker's message.
    """
    cfg, tmp = await asyncio.to_thread(_prepare, server, config_toml, artifact, labels)
    async with _lock(server):
        if cfg.name in server.records:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise InvalidInput(f"model {cfg.name!r} already exists; unregister it first "
                               f"(DELETE /v2/repository/models/{cfg.name})")
        rec = await asyncio.to_thread(_commit, server, cfg, tmp)
        server.remember(rec)
        try:
            await server.runtime(rec.name).wait_ready()
        except (SplitServeError, TimeoutError) as e:
            await _drop_runtime(server, rec.name)
            server.forget(rec.name)
            await asyncio.to_thread(_remove, server, rec.name)
            msg = e.message if isinstance(e, SplitServeError) else f"model {rec.name!r} did not load in time"
            log.warning("registration of %s rolled back: %s", rec.name, msg)
            raise InvalidInput(msg) from None
        except BaseException:
            await _drop_runtime(server, rec.name)
            server.forget(rec.name)
            await asyncio.to_thread(_remove, server, rec.name)
            raise
    log.info("registered model %s (func_id %d) in %s", rec.name, rec.func_id, rec.path)
    return rec


async def unregister_model(server: "Server", name: str) -> None:
    """Unload a registered model and delete it from the registry and repository."""
    check_model_name(name)
    async with _lock(server):
        rec = record(server, name)
        if rec.source != "registered":
            raise InvalidInput(f"model {name!r} is {rec.source}, not registered at run time; it cannot be deleted")
        await _drop_runtime(server, name)
        server.forget(name)
        await asyncio.to_thread(_remove, server, name)
    log.info("unregistered model %s", name)


# -- load, unload, scale, batching ----------------------------------------------------------


async def load_model(server: "Server", name: str) -> None:
    """Start the model's workers (again) and wait until it is ready."""
    async with _lock(server):
        record(server, name)
        rt = server.runtime(name)
        rt.enabled = True
        try:
            await rt.wait_ready()
        except TimeoutError:
            raise ModelNotReady(f"model {name!r} did not load in time") from None


async def unload_model(server: "Server", name: str) -> None:
    """Stop the model's workers; it refuses requests (MODEL_NOT_READY) until loaded again."""
    async with _lock(server):
        record(server, name)
        rt = server.runtime(name)
        rt.enabled = False
        await rt.unload()


async def set_instances(server: "Server", name: str, instances: Any) -> None:
    """Scale the model to ``instances`` worker processes without dropping requests."""
    instances = json_number("instances", instances, int)
    if not 1 <= instances <= 64:
        raise InvalidInput(f"instances must be an integer between 1 and 64, got {instances!r}")
    async with _lock(server):
        record(server, name)
        rt = server.runtime(name)
        # returns once retired instances are stopped and, for a loaded model, new ones serve
        await rt.resize(instances)
        log.info("model %s: %d instance(s)", name, instances)


async def set_batching(server: "Server", name: str, policy: Any, max_batch_size: Any, max_delay_ms: Any,
                       preferred_batch: Any) -> None:
    """Swap the model's batching policy (and batch limit) in place; queued requests stay.

    The values are as a client sent them (None: unchanged); each is checked here."""
    async with _lock(server):
        record(server, name)
        rt = server.runtime(name)
        if rt.packrat is not None:
            raise InvalidInput(f"model {name!r} uses packrat placement: its batching follows Packrat's plan")
        cur = rt.config.batching
        if policy is not None and not isinstance(policy, str):
            raise InvalidInput(f"batching.policy must be a string, got {policy!r}")
        new = BatchingConfig(policy or cur.policy,
                             cur.max_delay_ms if max_delay_ms is None else json_number("batching.max_delay_ms",
                                                                                   max_delay_ms, float),
                             cur.preferred_batch if preferred_batch is None else json_number("batching.preferred_batch",
                                                                                         preferred_batch, int))
        if max_batch_size is not None:
            max_batch_size = json_number("max_batch_size", max_batch_size, int)
        if max_batch_size is not None and not 1 <= max_batch_size <= rt.config.max_batch_size:
            raise InvalidInput(f"max_batch_size must be 1..{rt.config.max_batch_size} for {name!r} "
                               "(the tensor queues were sized for that; register a new version to raise it)")
        rt.sched.policy = make_policy(new)
        if max_batch_size is not None:
            rt.sched.max_batch = int(max_batch_size)
        rt.config = rt.config.with_changes(batching=asdict(new))
        rt.kick()
        log.info("model %s: batching %s, max batch %d", name, new, rt.sched.max_batch)


# -- read-only views ------------------------------------------------------------------------


def repository_index(server: "Server", ready_only: bool = False) -> list[dict]:
    """The v2 repository extension's index: every model with its state."""
    out = []
    for name, rec in sorted(server.records.items(), key=lambda kv: kv[1].func_id):
        rt = server.runtimes.get(name)
        state = rt.state if rt is not None else "unloaded"
        v2 = _STATES.get(state, "UNAVAILABLE")
        if ready_only and v2 != "READY":
            continue
        if rt is not None and not rt.enabled:
            reason = "unloaded"
        elif state == "failed":
            reason = (rt.error if rt is not None else None) or "failed to load"
        elif state == "unloaded":
            reason = "not loaded yet (loads on first use)"
        else:
            reason = ""
        out.append({"name": name, "version": str(rec.version), "state": v2, "reason": reason})
    return out


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": int(count), "ns": int(ns)}


def _model_stats(rec: ModelRecord, rt: "ModelRuntime | None") -> dict[str, Any]:
    from splitserve.server.runtime import ModelStats

    st = rt.stats if rt is not None else ModelStats()
    # Inputs and outputs live in shared-memory tensor queues the worker reads in place, so
    # there is no separate input/output copy to time: those durations are 0 by design.
    return {
        "name": rec.name,
        "version": str(rec.version),
        "last_inference": st.last_inference_ms,
        "inference_count": st.inference_count,
        "execution_count": st.execution_count,
        "inference_stats": {
            "success": _duration(st.success, st.request_ns),
            "fail": _duration(st.failure, st.failure_ns),
            "queue": _duration(st.success, st.queue_ns),
            "compute_input": _duration(st.execution_count, 0),
            "compute_infer": _duration(st.execution_count, st.compute_ns),
            "compute_output": _duration(st.execution_count, 0),
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": _duration(n, 0), "compute_infer": _duration(n, 0),
             "compute_output": _duration(n, 0)}
            for size, n in sorted(st.batch_sizes.items())
        ],
        "preemptions": st.preemptions,
    }


def model_statistics(server: "Server", name: str | None = None) -> dict:
    """The Triton statistics extension: one entry per model (or just ``name``)."""
    if name is not None:
        recs = [record(server, name)]
    else:
        recs = sorted(server.records.values(), key=lambda r: r.func_id)
    return {"model_stats": [_model_stats(r, server.runtimes.get(r.name)) for r in recs]}


def model_metadata(server: "Server", name: str) -> dict:
    """v2 model metadata: shapes carry -1 for the batch dimension."""
    rec = record(server, name)
    cfg = server.runtimes[name].config if name in server.runtimes else rec.config

    def tensors(specs: tuple) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in specs]

    return {
        "name": rec.name,
        "versions": [str(rec.version)],
        "platform": "pytorch",
        "inputs": tensors(cfg.inputs),
        "outputs": tensors(cfg.outputs),
        # splitserve additions (clients of the spec ignore them)
        "parameters": {"func_id": rec.func_id, "max_batch_size": cfg.max_batch_size,
                       "default_class": cfg.default_class, "labels": bool(cfg.labels)},
    }


def placement(server: "Server", name: str) -> dict:
    """How ``name`` is placed now and how it got there (for benchmarks and operators)."""
    rt = server.runtime(name)
    serving = rt.sched.serving()
    out: dict[str, Any] = {
        "model": name, "placement": "packrat" if rt.packrat is not None else "fixed", "now": time.perf_counter(),
        "instances": [{"id": i, "threads": rt.threads[i], "batch": rt.sched.instances[i].max_batch or
                       rt.config.max_batch_size, "cpus": rt.cpus[i], "ready": rt.sched.instances[i].ready}
                      for i in serving],
        "reconfigurations": rt.reconfigurations,
    }
    if rt.packrat is not None:
        out["batch"] = rt.packrat.batch
        out["plan"] = rt.packrat.plan().to_dict()
        out["threads_budget"] = rt.packrat.threads
    return out


def scheduler_events(server: "Server", since: float = 0.0, limit: int = 10000) -> dict:
    """The coordinator's event log after ``since`` (perf_counter seconds on the server)."""
    events = [asdict(e) for e in server.coordinator.events if e.t > since][-max(1, min(limit, 100_000)):]
    return {"mode": server.coordinator.mode.value, "now": time.perf_counter(), "events": events}
