"""Model management shared by the HTTP and gRPC front ends (Rafiqi §3.1, TorchServe's
management API, the v2 repository and statistics extensions).

``ModelManager`` is one object per node, owned by the composition root: it holds the
management lock, the token and the upload directory, and reaches the node's models only
through ``ports.ModelDirectory`` (each one a ``ports.ManagedModel``). Every method runs on
the node's event loop; registry, SQLite and file work is moved off it with
``asyncio.to_thread``. Management calls are serialized by the one lock, so two
registrations of the same name, or a scale racing an unload, cannot interleave.
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
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from splitserve.config import ServerConfig
from splitserve.errors import (
    InsufficientStorage, InvalidInput, ModelNotReady, NotFound, SplitServeError, Unauthorized, UnknownModel,
)
from splitserve.modelconfig import ArtifactKind, ModelConfig, check_model_name
from splitserve.placement.resources import ResourceManager
from splitserve.protocol.triton_config import triton_model_config
from splitserve.protocol import v2
from splitserve.protocol.v2 import json_number
from splitserve.registry import ModelRecord, Registry
from splitserve.server.ports import (
    BatchTimes, EventLog, GpuView, ManagedModel, MemoryReport, ModelDirectory, ModelState, ModelStats, PartitionControl,
)
from splitserve.worker.counters import DirectTally

log = logging.getLogger(__name__)

TOKEN_FILE = "token"
UPLOAD_DIR = ".uploads"  # beside the repository (same file system, so rename is atomic)
# runtime state -> v2 repository extension state
_STATES = {ModelState.READY: "READY", ModelState.LOADING: "LOADING", ModelState.STOPPING: "UNLOADING",
           ModelState.FAILED: "UNAVAILABLE", ModelState.UNLOADED: "UNAVAILABLE", ModelState.EVICTED: "UNAVAILABLE"}
# runtime state -> the index's reason (Triton's state names, with the residency as /v2/memory names it)
_REASONS = {ModelState.EVICTED: "EVICTED (loads on next request)",
            ModelState.UNLOADED: "EVICTED (not loaded yet; loads on first use)",
            ModelState.LOADING: "LOADING", ModelState.READY: "RESIDENT"}


# -- security ----------------------------------------------------------------------------


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
    if config.transports.fast_port is not None:
        open_.append(f"the fast path on TCP {config.transports.fast_port} (inference on every registered model)")
    if config.direct_tcp_host is not None:
        open_.append("each loaded model's workers' direct endpoints on TCP ports the OS picks (inference on that "
                     "model; LOOKUP names them)")
    if config.transports.udp_port is not None:
        open_.append(f"UDP {config.transports.udp_port} (inference; answers go to the datagram's source address, "
                     "so spoofed requests reflect traffic)")
    if config.frontends.http_port is not None:
        open_.append(f"HTTP {config.frontends.http_port}: inference, /classify, /metrics, /v2/scheduler/events, "
                     "placement and model metadata")
    if config.frontends.grpc_port is not None:
        open_.append(f"gRPC {config.frontends.grpc_port}: inference, metadata and statistics")
    if not open_:
        return None
    return (f"listening on {config.host}, which is not loopback: anyone who can reach it can use, without the "
            f"management token, {'; '.join(open_)}; and any registered model starts its workers on its first "
            "request. Bind to 127.0.0.1 (--host) or firewall these ports unless that is intended")


# -- registration helpers (pure file work, run off the loop) ---------------------------------


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


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": int(count), "ns": int(ns)}


def _model_stats(rec: ModelRecord, rt: ManagedModel | None) -> dict[str, Any]:
    st = rt.stats if rt is not None else ModelStats()
    tally = rt.direct_tally() if rt is not None else DirectTally()  # first: it brings st.slo up to date
    # Both paths: the front end's calls and batches, and the workers' direct ones, each
    # counted once, where it was answered (a direct call by its worker, in its page).
    # A direct batch's time is its model run, counted as compute_infer.
    batches = {size: replace(b) for size, b in st.batches.items()}
    for size, (n, ns) in tally.sizes.items():
        b = batches.setdefault(size, BatchTimes())
        b.count += n
        b.infer_ns += ns
    d = tally.all_calls()
    ok = st.success + d.ok
    # Each successful call counts its queue wait and its batch's worker times (input copy,
    # model, output copy), as Triton counts them; what is left of its duration is the
    # front end's receive, hand-off and answer (on the direct path: the worker's receive
    # and answer). inference_count is the answered calls' samples (a batch may run more
    # rows: a late direct payload's hole).
    return {
        "name": rec.name,
        "version": str(rec.version),
        "last_inference": max(st.last_inference_ms, d.last_ms),
        "inference_count": st.inference_count + d.samples,
        "execution_count": sum(b.count for b in batches.values()),
        "inference_stats": {
            "success": _duration(ok, st.request_ns + d.ok_ns),
            "fail": _duration(st.failure + d.failed, st.failure_ns + d.fail_ns),
            "queue": _duration(ok, st.queue_ns + d.queue_ns),
            "compute_input": _duration(ok, st.compute_input_ns + d.input_ns),
            "compute_infer": _duration(ok, st.compute_infer_ns + d.infer_ns),
            "compute_output": _duration(ok, st.compute_output_ns + d.output_ns),
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": _duration(b.count, b.input_ns),
             "compute_infer": _duration(b.count, b.infer_ns), "compute_output": _duration(b.count, b.output_ns)}
            for size, b in sorted(batches.items())
        ],
        "preemptions": st.preemptions,
        # splitserve addition: what loading the weights cost, and what they take now
        "residency": {"loads": st.loads, "load_ns": st.load_ns, "evictions": st.evictions,
                      "weights_bytes": st.weights_bytes},
        # splitserve addition: soft SLOs of its real-time calls (met, missed = served late, dropped = an error)
        "slo": dict(st.slo),
        # splitserve addition: calls its workers took straight from clients (fast_direct), read
        # from the workers' pages (their calls and batches are in the counts above too)
        "direct": tally.counts.to_dict(),
    }


def ensure_token_file(path: Path) -> str:
    """The management token in ``path``, created (mode 0600) when it is not there; also the
    cluster's one token, which every node server is given (``splitserve cluster up``)."""
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
    return token


def check_bearer(authorization: str | None, token: str, where: str) -> None:
    """Accept the header ``Authorization: Bearer <token>``; raise Unauthorized otherwise
    (constant-time compare), saying ``where`` the token is kept. A node's management and a
    cluster gateway's check the same way."""
    if not authorization:
        raise Unauthorized(f"management calls need 'Authorization: Bearer <token>'; the token is in {where}")
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <token>'")
    if not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("wrong management token")


class ModelManager:
    """Register, unregister, load, unload, scale and re-batch the node's models, and the
    read-only views of them (index, statistics, metadata, placement, scheduler events).

    Built by the composition root once the registry is open; the HTTP and gRPC front ends
    call it. It owns the management lock and the token (``ensure_token`` creates it).
    """

    def __init__(self, config: ServerConfig, registry: Registry, models: ModelDirectory, events: EventLog,
                 resources: ResourceManager, memory: MemoryReport, partitions: PartitionControl | None = None,
                 gpus: GpuView | None = None) -> None:
        self.config = config
        self.partitions = partitions
        self.gpus = gpus
        self.memory = memory
        self.registry = registry
        self.models = models
        self.events = events
        self.resources = resources
        self._lock = asyncio.Lock()
        self._token: str | None = None

    # -- lookups ----------------------------------------------------------------------

    @property
    def records(self) -> Mapping[str, ModelRecord]:
        """Every registered model by name."""
        return self.models.records

    def record(self, name: str, version: str | None = None) -> ModelRecord:
        """A registered model; a version, if given (not empty), must be the one it serves."""
        records = self.models.records
        rec = records.get(name)
        if rec is None:
            raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(records)) or 'none'}")
        if version and version != str(rec.version):
            raise UnknownModel(f"model {name!r} has no version {version!r}; it serves version {rec.version}")
        return rec

    def version(self, name: str, version: str | None = None) -> str:
        """The version ``name`` serves (``record``'s checks)."""
        return str(self.record(name, version).version)

    def model_config(self, name: str) -> ModelConfig:
        """The model's configuration as served now (batching may have changed at run time)."""
        rec = self.record(name)
        rt = self.models.loaded(name)
        return rt.config if rt is not None else rec.config

    # -- security ---------------------------------------------------------------------

    def ensure_token(self) -> str:
        """The management token: read ``data_dir/token``, or create it (mode 0600) on first start."""
        if self._token is None:
            self._token = ensure_token_file(self.config.data_dir / TOKEN_FILE)
        return self._token

    def check_token(self, authorization: str | None) -> None:
        """Accept ``Bearer <token>``; raise Unauthorized otherwise (constant-time compare)."""
        check_bearer(authorization, self.ensure_token(), str(self.config.data_dir / TOKEN_FILE))

    # -- registration -----------------------------------------------------------------

    @contextlib.contextmanager
    def _storage(self) -> Iterator[None]:
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
        log.error("registration refused, no storage left in %s: %s", self.config.data_dir, reason)
        raise InsufficientStorage(f"the server has no storage left for the model ({reason}); nothing was "
                                  "registered, retry once space is freed")

    def _prepare(self, config_toml: str, artifact: bytes | None, labels: str | None,
                 from_model_store: bool = False) -> tuple[ModelConfig, Path]:
        """Validate and write the model's files into a fresh directory beside the repository."""
        cfg = ModelConfig.from_toml(config_toml)
        # TorchScript the operator put in the model store is theirs, as a repository's is
        operators = from_model_store and cfg.artifact.kind is ArtifactKind.TORCHSCRIPT
        if cfg.artifact.kind.runs_code and not self.config.frontends.allow_code_artifacts and not operators:
            raise InvalidInput(f"artifact.kind {cfg.artifact.kind!r} can run code on the server, so this server refuses "
                               "uploads of it; upload safetensors weights of a zoo architecture, or start the server "
                               "with --allow-code-artifacts (SPLITSERVE_ALLOW_CODE_ARTIFACTS=1) if every token holder "
                               "may run code on it")
        if labels is not None:
            if cfg.labels:
                raise InvalidInput("give labels either in config.toml or as a labels file, not both")
            config_toml = _with_labels(config_toml, _parse_labels(labels, self.config.frontends.max_labels))
            cfg = ModelConfig.from_toml(config_toml)
        if cfg.labels and len(cfg.labels) != cfg.outputs[0].numel:
            raise InvalidInput(f"{len(cfg.labels)} labels for output {cfg.outputs[0].name!r} of "
                               f"{cfg.outputs[0].numel} values: give one label per value")
        if cfg.artifact.kind is ArtifactKind.ZOO:
            if artifact:
                raise InvalidInput("a zoo artifact takes no file; set artifact.kind to 'safetensors' to upload weights")
        elif not artifact:
            raise InvalidInput(f"a {cfg.artifact.kind} artifact needs its file ({cfg.artifact.file!r}) uploaded")
        uploads = self.config.data_dir / UPLOAD_DIR
        with self._storage():
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

    def _commit(self, cfg: ModelConfig, tmp: Path) -> ModelRecord:
        """Move the prepared directory into the repository and add the model to the registry."""
        reg = self.registry
        dest = reg.model_dir(cfg.name)
        if reg.find(cfg.name) is not None or dest.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            raise InvalidInput(f"model {cfg.name!r} already exists; unregister it first "
                               f"(DELETE /v2/repository/models/{cfg.name})")
        with self._storage():
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

    def _remove(self, name: str) -> None:
        """Registry row and repository directory of a registered model (func_id is kept)."""
        reg = self.registry
        if reg.find(name) is not None:
            reg.remove(name)
        shutil.rmtree(reg.model_dir(name), ignore_errors=True)

    async def register(self, config_toml: str, artifact: bytes | None, labels: str | None,
                       from_model_store: bool = False) -> ModelRecord:
        """Validate, persist (repository + registry) and load a model; undo it all on failure.
        ``from_model_store``: the artifact is a TorchScript file of an archive in the
        operator's model store, not the caller's upload.

        A model that fails to load is unregistered again and InvalidInput carries the
        worker's message.
        """
        cfg, tmp = await asyncio.to_thread(self._prepare, config_toml, artifact, labels, from_model_store)
        async with self._lock:
            if cfg.name in self.models.records:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
                raise InvalidInput(f"model {cfg.name!r} already exists; unregister it first "
                                   f"(DELETE /v2/repository/models/{cfg.name})")
            rec = await asyncio.to_thread(self._commit, cfg, tmp)
            await self.models.remember(rec)
            try:
                await self.models.runtime(rec.name).wait_ready()
            except (SplitServeError, TimeoutError) as e:
                await self._roll_back(rec.name)
                msg = e.message if isinstance(e, SplitServeError) else f"model {rec.name!r} did not load in time"
                log.warning("registration of %s rolled back: %s", rec.name, msg)
                raise InvalidInput(msg) from None
            except BaseException:
                await self._roll_back(rec.name)
                raise
        log.info("registered model %s (func_id %d) in %s", rec.name, rec.func_id, rec.path)
        return rec

    async def _roll_back(self, name: str) -> None:
        await self.models.drop(name)
        await asyncio.to_thread(self._remove, name)

    async def unregister(self, name: str) -> None:
        """Unload a registered model and delete it from the registry and repository."""
        check_model_name(name)
        async with self._lock:
            rec = self.record(name)
            if rec.source != "registered":
                raise InvalidInput(f"model {name!r} is {rec.source}, not registered at run time; it cannot be deleted")
            await self._roll_back(name)
        log.info("unregistered model %s", name)

    # -- load, unload, scale, batching ---------------------------------------------------

    async def load(self, name: str, keep_resident: Any = None) -> None:
        """Start the model's workers (again) and wait until it is ready; ``keep_resident``
        (a bool, None: unchanged) says whether the memory manager may evict it."""
        if keep_resident is not None and not isinstance(keep_resident, bool):
            raise InvalidInput(f"parameter keep_resident must be true or false, got {keep_resident!r}")
        async with self._lock:
            self.record(name)
            rt = self.models.runtime(name)
            if keep_resident is not None:
                rt.keep_resident = keep_resident
            try:
                await rt.load()
            except TimeoutError:
                raise ModelNotReady(f"model {name!r} did not load in time") from None

    async def unload(self, name: str) -> None:
        """Stop the model's workers; it refuses requests (MODEL_NOT_READY) until loaded again."""
        async with self._lock:
            self.record(name)
            await self.models.runtime(name).unload(disable=True)

    async def evict(self, name: str) -> bool:
        """Release the model's weights (every instance's) but keep it registered and
        enabled: calls queue and the first one loads it again. False if nothing was
        resident."""
        async with self._lock:
            self.record(name)
            rt = self.models.loaded(name)
            return rt is not None and await rt.evict()

    def state(self, name: str) -> ModelState:
        """The model's state once served, UNLOADED before its first use."""
        self.record(name)
        rt = self.models.loaded(name)
        return rt.state if rt is not None else ModelState.UNLOADED

    async def set_instances(self, name: str, instances: Any) -> None:
        """Scale the model to ``instances`` worker processes without dropping requests."""
        instances = json_number("instances", instances, int)
        if not 1 <= instances <= 64:
            raise InvalidInput(f"instances must be an integer between 1 and 64, got {instances!r}")
        async with self._lock:
            self.record(name)
            # returns once retired instances are stopped and, for a loaded model, new ones serve
            await self.models.runtime(name).resize(instances)
            log.info("model %s: %d instance(s)", name, instances)

    async def set_batching(self, name: str, changes: Mapping[str, Any], max_batch_size: Any) -> None:
        """Swap the model's batching policy (and batch limit) in place; queued requests stay.

        ``changes`` are ``[batching]`` keys as a client sent them (absent or null: unchanged) and
        ``max_batch_size`` None leaves the limit; each value is checked here."""
        async with self._lock:
            self.record(name)
            rt = self.models.runtime(name)
            new = rt.config.batching.changed(changes)
            limit = None if max_batch_size is None else json_number("max_batch_size", max_batch_size, int)
            rt.set_batching(new, limit)
            log.info("model %s: batching %s, max batch %d", name, new, rt.dispatch_max_batch)

    # -- read-only views ----------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """The v2 repository extension's index: every model with its state."""
        out = []
        for name, rec in sorted(self.models.records.items(), key=lambda kv: kv[1].func_id):
            rt = self.models.loaded(name)
            state = self.state(name)
            v2 = _STATES.get(state, "UNAVAILABLE")
            if ready_only and v2 != "READY":
                continue
            # Triton's state names, with the residency (as /v2/memory names it) as the reason.
            if rt is not None and not rt.enabled:
                reason = "UNLOADED"
            elif state is ModelState.FAILED:
                reason = f"FAILED: {(rt.error if rt is not None else None) or 'failed to load'}"
            else:
                reason = _REASONS.get(state, "")
            out.append({"name": name, "version": str(rec.version), "state": v2, "reason": reason})
        return out

    def model_statistics(self, name: str | None = None) -> dict:
        """The Triton statistics extension: one entry per model (or just ``name``)."""
        if name is not None:
            recs = [self.record(name)]
        else:
            recs = sorted(self.models.records.values(), key=lambda r: r.func_id)
        return {"model_stats": [_model_stats(r, self.models.loaded(r.name)) for r in recs]}

    def model_metadata(self, name: str) -> dict:
        """v2 model metadata: shapes carry -1 for the batch dimension."""
        rec = self.record(name)
        cfg = self.model_config(name)
        return v2.model_metadata(rec.name, str(rec.version), cfg.inputs, cfg.outputs, {
            "func_id": rec.func_id, "max_batch_size": cfg.max_batch_size, "default_class": cfg.default_class,
            "labels": bool(cfg.labels), "state": self.state(name)})

    def triton_config(self, name: str) -> dict:
        """The model's configuration as served now, in Triton's model-configuration schema;
        splitserve's own settings are its ``parameters``."""
        rec, rt, cfg = self.record(name), self.models.loaded(name), self.model_config(name)
        placement = cfg.placement or {"kind": str(self.config.packrat.placement)}
        return triton_model_config(cfg, rt.instance_count if rt is not None else cfg.instances,
                                   {"residency": self.state(name), "placement": placement,
                                    "func_id": rec.func_id, "version": rec.version})

    def serving_config(self, name: str) -> dict:
        """The model's config.toml as JSON, with its state and serving shape (splitserve's own
        schema; ``triton_config`` is Triton's)."""
        rec = self.record(name)
        rt = self.models.loaded(name)
        cfg = rt.config if rt is not None else rec.config
        return {**cfg.to_dict(), "func_id": rec.func_id, "source": rec.source,
                "state": self.state(name),
                "instances": rt.instance_count if rt is not None else cfg.instances,
                "dispatch_max_batch": rt.dispatch_max_batch if rt is not None else cfg.max_batch_size}

    def placement(self, name: str) -> dict:
        """How ``name`` is placed now and how it got there (for benchmarks and operators): its
        instances, its decider's plan, its changes so far and its partitions."""
        self.record(name)
        return self.models.runtime(name).placement()

    def node_placement(self) -> dict:
        """Every partition of the node's CPUs and the instances sitting on each."""
        return self.resources.snapshot()

    def partition_status(self) -> dict:
        """``GET /v2/partitions``: the node's partitions, their tags and instances, the geometry
        controller's last tick and the cold starts, and its GPUs (``gpus``: whole GPUs and MIG
        slices, or why there are none). A node without CPU partitions answers
        ``partitioning: none`` and no partitions, with its GPUs."""
        gpus = self.gpus.snapshot() if self.gpus is not None else None
        if self.partitions is None:
            return {"partitioning": "none", "partitions": [], "gpus": gpus}
        return {**self.partitions.snapshot(), "gpus": gpus}

    async def set_geometry(self, geometry: Any) -> dict:
        """``POST /v2/partitions``: re-carve the partitions (core counts), under the management
        lock, moving every model's instances without a request lost."""
        if not isinstance(geometry, str) or not geometry.strip():
            raise InvalidInput(f'geometry must be a string of partition core counts, e.g. "1,1", got {geometry!r}')
        control = self._partitions()
        async with self._lock:
            return await control.set_geometry(geometry)

    def _partitions(self) -> PartitionControl:
        if self.partitions is None:
            raise NotFound("this node has no partitions: start it with --partitioning static, colocate or protean")
        return self.partitions

    def memory_status(self) -> dict:
        """``GET /v2/memory``: the memory manager's budget, reservations, LRU order and models.
        Registered models it has not seen yet are listed as EVICTED (they load on first use)."""
        out = self.memory.status()
        for name in self.models.records:
            out["models"].setdefault(name, {
                "residency": "EVICTED", "reason": None, "weights_bytes": 0, "private_bytes": 0, "reserved_bytes": 0,
                "instances": 0, "loads": 0, "evictions": 0, "last_load_ms": None,
                "keep_resident": self.models.records[name].config.memory.keep_resident, "last_used_s_ago": None,
                "device_bytes": 0, "device_reserved_bytes": {}, "pinned_bytes": 0})
        return out

    def scheduler_events(self, since: float = 0.0, limit: int = 10000) -> dict:
        """The coordinator's event log after ``since`` (perf_counter seconds on the server)."""
        events = [asdict(e) for e in self.events.events if e.t > since][-max(1, min(limit, 100_000)):]
        return {"mode": self.events.mode.value, "class_order": self.events.class_order.value,
                "now": time.perf_counter(), "events": events}
