"""What every scenario shares: its parameters, the run context, and what it hands back.

A scenario module defines ``NAME``, ``SUMMARY``, a ``Params`` dataclass (defaults are the full
run; ``Params.quick()`` the one-minute size) and ``run(ctx) -> ScenarioOutput``. The context
gives it a server (started here, or the one ``--url`` names), the echo floor, the validation
phase and a progress bar; ``runner.run_scenario`` writes what it returns into the results
folder. Scenarios never print: the CLI prints ``ScenarioOutput.summary``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.bench.results import ResultsDir
from splitserve.bench.transports import BASELINES, DIRECT, SERVER_TRANSPORTS, Target, Unavailable, close_sync, open_sync
from splitserve.bench.validate import Check, Expected, check, check_all, reference_outputs
from splitserve.config import env_cache_dir

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.progress import Progress

    from splitserve.bench.echo import EchoProcess
    from splitserve.bench.timing import CallTimes
    from splitserve.launcher import ServerProcess

logger = logging.getLogger(__name__)


# One colour per transport, the same in every scenario's plots.
COLOURS = {"tcp": "#2b7bba", "unix": "#17becf", "udp": "#9467bd", "http-json": "#ff7f0e",
           "http-binary": "#d62728", "grpc": "#2ca02c"}


@dataclass
class Params:
    """Parameters every scenario has. Subclasses add their own fields with full-run defaults."""

    models: tuple[str, ...] = ()
    transports: tuple[str, ...] = ()
    seed: int = 0  # inputs and arrival schedules
    validate_samples: int = 3  # inputs checked per model and transport before timing
    device: str = "cpu"  # where the served models compute: cpu, cuda or cuda:N (the node hands each instance a GPU)

    @classmethod
    def quick(cls) -> Params:
        """The size that finishes in under a minute on a 2-core machine."""
        return cls()

    def resolved(self) -> Params:
        """The parameters a run uses: a scenario whose named setting changes defaults (e.g. protean's
        ``scenario=crowded``) fills in here what the user left at its default, so the report's
        header and result.json record what ran."""
        return self

    def check(self) -> None:
        """Raise ValueError for parameters the scenario cannot run with (before anything starts)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_value(text: str, kind: Any, name: str) -> Any:
    """``text`` as a value of the annotated type ``kind`` (int, float, str, bool, tuples, optionals)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if text.strip().lower() in ("none", "null", "") and len(options) < len(typing.get_args(kind)):
            return None
        return _parse_value(text, options[0], name)
    if origin is tuple:
        args = typing.get_args(kind)
        item = args[0] if args else str
        return tuple(_parse_value(p.strip(), item, name) for p in text.split(",") if p.strip())
    if kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"parameter {name}: expected true or false, got {text!r}")
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"parameter {name}: expected {getattr(kind, '__name__', kind)}, got {text!r}") from None


def apply_overrides(params: Params, overrides: Mapping[str, str]) -> Params:
    """``params`` with ``name=value`` strings from the command line applied, type-checked."""
    if not overrides:
        return params
    hints = typing.get_type_hints(type(params))
    known = {f.name for f in dataclasses.fields(params)}
    changes: dict[str, Any] = {}
    for name, text in overrides.items():
        key = name.replace("-", "_")
        if key not in known:
            raise ValueError(f"unknown parameter {name!r}; this scenario takes: {', '.join(sorted(known))}")
        changes[key] = _parse_value(text, hints[key], name)
    return dataclasses.replace(params, **changes)


@dataclass
class ScenarioOutput:
    """What a scenario hands back: numbers, the markdown report, figures and summary lines."""

    result: dict[str, Any]
    report: str
    figures: dict[str, Figure] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    # Promises the server broke during the run (chaos: lost, duplicate or wrong answers); the
    # numbers are still written, and the run ends with ``runner.EXIT_BROKEN``.
    broken: list[str] = field(default_factory=list)


def report_intro(doc: str | None) -> str:
    """What a scenario's report.md opens with: its module docstring less the first paragraph
    (the one-line title; the scenario's ``SUMMARY`` is what ``--help`` lists)."""
    parts = (doc or "").split("\n\n", 1)
    return parts[1].strip() if len(parts) == 2 else ""


def note_generator_bottleneck(report: list[str], lines: list[str], notes: Sequence[str],
                              counted: str = "at {n} point(s)", explain: str | None = None) -> None:
    """Where the load generator could not keep up (``notes``, one per run or point), add a
    section to the report and one summary line saying how many (``counted``, with ``{n}``);
    nothing when there are none. ``explain``: a paragraph that opens the section."""
    if not notes:
        return
    report += ["## The generator was the bottleneck", ""] + ([explain, ""] if explain else [])
    report += [f"- {n}" for n in notes] + [""]
    lines.append(f"the load generator was the bottleneck {counted.format(n=len(notes))}; see report.md")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    """A number for a report table; '-' for missing."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def narrow(requested: Sequence[str], allowed: Sequence[str], what: str) -> tuple[str, ...]:
    """``requested`` checked against ``allowed`` (order of ``allowed`` kept for allowed ones)."""
    unknown = [r for r in requested if r not in allowed]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return tuple(requested)


class Context:
    """One scenario run: results folder, parameters, progress, server, echo floor, validation."""

    def __init__(self, results: ResultsDir, params: Params, urls: Sequence[str] = (),
                 progress: Progress | None = None, quick: bool = False, start_timeout_s: float = 300.0) -> None:
        self.results = results
        self.params = params
        self.urls = tuple(urls)
        self.progress = progress
        self.quick = quick
        self.start_timeout_s = start_timeout_s
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}
        self.checks: list[Check] = []
        self.server_info: dict[str, Any] = {}
        self.data_dir: Path | None = None  # the measured server's data directory, where known
        self._servers: list[ServerProcess] = []
        self._echo: EchoProcess | None = None
        self._tmp: list[Path] = []

    # -- progress --------------------------------------------------------------------

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A progress-bar line; the yielded function advances it."""
        if self.progress is None:
            yield lambda n=1: None
            return
        tid = self.progress.add_task(description, total=total)
        try:
            yield lambda n=1: self.progress.advance(tid, n)  # type: ignore[union-attr]
        finally:
            self.progress.update(tid, completed=total)

    # -- server ----------------------------------------------------------------------

    def weights_cache(self) -> Path:
        """Where the servers this run starts keep their models' weights: ``SPLITSERVE_CACHE_DIR``
        when set, else ``<out>/.weights-cache`` (kept between runs, as Packrat's profiles are).
        Without it each server draws every seeded model's weights again in its own data
        directory (seconds of CPU for a DISB model), once per server a scenario starts."""
        return env_cache_dir() or self.results.path.parent / ".weights-cache"

    def target(self, load: Sequence[str] = (), repository: Path | None = None, direct: bool = False,
               spin_us: int | None = None) -> Target:
        """The server to measure: the one ``--url`` names, or a fresh one with ``load`` ready.

        A fresh server runs every front end it has (HTTP and gRPC included) on free loopback
        ports, from a temporary data directory; it is stopped by ``close()``. ``direct``: its
        workers serve the direct path too (``fast_direct``), for the ``direct`` transport,
        polling up to ``spin_us`` for their next call before they sleep (``direct_spin_us``;
        None: as the environment says).
        """
        if self.urls:
            target = Target.parse(self.urls)
            self.data_dir = next((p if p.is_dir() else p.parent for p in map(Path, self.urls)
                                  if "://" not in str(p) and ((p / "server.json").is_file() or p.is_file())), None)
            self.server_info = {"started_by_bench": False, "urls": target.urls}
            if direct and spin_us is not None:
                self.notes.append("the server named by --url polls for direct calls as it was started "
                                  "(worker_spin_us applies to a server the bench starts)")
            return target
        from splitserve.launcher import start_server

        data_dir = Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
        self._tmp.append(data_dir)
        args = [a for m in load for a in ("--load", m)]
        if self.params.device != "cpu":
            args += ["--zoo-device", self.params.device]
        if repository is not None:
            args += ["--repository", str(repository)]
        with self.task(f"starting a server with {', '.join(load) or 'no models'}", 1):
            env = None
            if direct:
                env = {**os.environ, "SPLITSERVE_FAST_DIRECT": "1"}
                if spin_us is not None:
                    env["SPLITSERVE_DIRECT_SPIN_US"] = str(spin_us)
            server = start_server(data_dir, *args, http=True, grpc=True, timeout=self.start_timeout_s, env=env,
                                  cache_dir=self.weights_cache())
            self._servers.append(server)
            server.settle(self.start_timeout_s)
        self.data_dir = data_dir
        target = Target(server.urls)
        self.server_info = {"started_by_bench": True, "urls": target.urls, "args": args, "fast_direct": direct}
        if env is not None:
            self.server_info["direct_spin_us"] = env.get("SPLITSERVE_DIRECT_SPIN_US")  # None: the default
        return target

    def failed(self, transport: str, model: str, error: BaseException) -> None:
        """A transport that passed validation failed while being timed: note it, go on without it."""
        self.unavailable[transport] = f"failed while timing {model}: {type(error).__name__}: {error}"
        logger.warning("%s failed while timing %s: %s", transport, model, error)

    def echo(self) -> EchoProcess:
        """The plain TCP echo server (the floor), started once per run."""
        if self._echo is None:
            from splitserve.bench.echo import EchoProcess

            self._echo = EchoProcess.start()
        return self._echo

    def close(self) -> None:
        """Stop what this run started; keep the server logs in the results folder."""
        if self._echo is not None:
            self._echo.stop()
            self._echo = None
        for i, s in enumerate(self._servers):
            died = s.proc.poll()
            code = s.stop()
            if died is not None:
                self.notes.append(f"the server process had exited (code {died}) before the run ended; "
                                  "see server.log")
            elif code not in (0, None):
                self.notes.append(f"the server exited with code {code} when stopped")
            self.server_info["exit_code"] = code
            try:
                shutil.copyfile(s.log, self.results.path / (f"server-{i}.log" if i else "server.log"))
            except OSError:
                pass
        self._servers.clear()
        for d in self._tmp:
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.clear()

    # -- validation ------------------------------------------------------------------

    def validate(self, target: Target, expected: Mapping[str, Expected], transports: Sequence[str]) -> list[str]:
        """Check every served model over every server transport before timing (SplitRPC §6.1).

        Returns the transports that can be measured. Unavailable ones are recorded in
        ``self.unavailable`` with the reason; a wrong answer raises ``ValidationFailed``.
        """
        from splitserve.bench.inputs import make_inputs
        from splitserve.models.catalog import zoo_entry

        wanted = [t for t in transports if t in SERVER_TRANSPORTS]
        inputs = {name: make_inputs(zoo_entry(e.arch).inputs, self.params.validate_samples, self.params.seed + 7)
                  for name, e in expected.items()}
        references = {name: reference_outputs(e.arch, e.seed, inputs[name]) for name, e in expected.items()}
        usable: list[str] = []
        checks: list[Check] = []
        with self.task("validating answers", len(wanted) * len(expected)) as advance:
            for transport in wanted:
                try:
                    client = open_sync(transport, target.url(transport))
                except Unavailable as e:
                    self.unavailable[transport] = str(e)
                    advance(len(expected))
                    continue
                def send(model: str, x: Any, client: Any = client) -> dict[str, Any]:
                    return client.infer_result(model, x).outputs

                try:
                    for name in expected:
                        checks.append(check(send, name, transport, inputs[name], references[name]))
                        advance(1)
                    offered = all(client.direct_endpoints(name) for name in expected) if transport in DIRECT else True
                finally:
                    close_sync(client)
                if not offered:  # the calls went through the front end: not what this transport names
                    self.unavailable[transport] = "the server offers no direct endpoints (start it with fast_direct)"
                    continue
                usable.append(transport)
        self.checks.extend(checks)
        check_all(checks)
        return usable + [t for t in transports if t in BASELINES]


def write_repository(root: Path, variants: Mapping[str, dict[str, Any]], device: str = "cpu") -> Path:
    """A model repository: ``root/<name>/config.toml`` for each variant's config dict, each
    on ``device`` unless its dict names one.

    Values are written as TOML: strings, numbers, booleans and lists of them, at the top
    level and in one-level tables (``artifact``, ``batching``, ``placement``).
    """

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    root.mkdir(parents=True, exist_ok=True)
    for name, cfg in variants.items():
        if device != "cpu":
            cfg = {"device": device, **cfg}
        lines = [f'name = "{name}"']
        tables = {k: v for k, v in cfg.items() if isinstance(v, Mapping)}
        lines += [f"{k} = {value(v)}" for k, v in cfg.items() if not isinstance(v, Mapping)]
        for t, body in tables.items():
            lines.append(f"\n[{t}]")
            lines += [f"{k} = {value(v)}" for k, v in body.items()]
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def time_transport(ctx: "Context", transport: str, url: str, model: str, sample: Sequence[Any],
                   requests: int, warmup: int, **options: Any) -> "CallTimes | None":
    """``requests`` timed sequential calls over ``transport`` (``options``: the client's own
    keywords, as ``open_sync`` takes them); None, noted as a failure of that transport, when it
    cannot be reached or breaks while being timed."""
    from splitserve.bench.timing import time_calls
    from splitserve.errors import SplitServeError

    try:
        client = open_sync(transport, url, **options)
        try:
            return time_calls(client, model, sample, requests, warmup)
        finally:
            close_sync(client)
    except (SplitServeError, Unavailable, OSError, TimeoutError) as e:
        ctx.failed(transport, model, e)
        return None
