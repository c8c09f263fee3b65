"""Spans of traced calls through OpenTelemetry (Triton's trace extension, its
``opentelemetry`` mode).

When the monitor closes a call that ``TraceSampler`` picks, ``CallTracer`` makes one span
from the call's own stamps, with Triton's timestamp events: REQUEST_START (its first byte
read), QUEUE_START (its payload complete, queued), COMPUTE_START (the worker began its
batch), COMPUTE_INPUT_END and COMPUTE_OUTPUT_START (the worker's input and output copies),
COMPUTE_END and REQUEST_END (its answer handed to its transport). Nothing is built for a
call that is not traced, and tracing is off until a trace setting turns it on.

Spans go to the OTLP endpoint when one is configured (``otlp_endpoint``), to a trace file
when a scope names one (JSON lines in ``<data dir>/traces``), and to whatever span
processors are added to ``provider``. Exporting runs in the SDK's export thread, never on
the node's loop; its queue is bounded (the SDK drops spans past it and counts them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from splitserve import __version__
from splitserve.errors import SplitServeError
from splitserve.server.trace_settings import TraceSampler

log = logging.getLogger(__name__)

TRACE_DIR = "traces"
# Spans of one trace file held before they are written when its log_frequency asks for more
# than that: the bound on what a trace file's buffer keeps.
MAX_BUFFERED = 10_000


class TracedCall(Protocol):
    """What a span is made of (``server.monitor.Call``); times on ``time.perf_counter``."""

    req_id: int
    count: int
    t_first: float
    t_rx: float
    t_dispatch: float
    t_start_w: float
    t_work: float
    t_tx: float
    compute_ns: int
    input_ns: int
    output_ns: int


class TraceFiles(SpanExporter):
    """Writes spans as JSON lines to the trace file their scope names (``trace.file``), in
    ``directory``, once ``trace.log_frequency`` of them are held (0: at once)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._held: dict[str, list[str]] = {}
        self._lock = threading.Lock()  # export and shutdown may come from two threads

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                attrs = span.attributes or {}
                name = str(attrs.get("trace.file") or "")
                if not name:
                    continue
                held = self._held.setdefault(name, [])
                held.append(span.to_json(indent=None))
                if len(held) >= max(1, min(int(attrs.get("trace.log_frequency") or 0), MAX_BUFFERED)):
                    self._write(name)
        return SpanExportResult.SUCCESS

    def _write(self, name: str) -> None:
        lines = self._held.pop(name, [])
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.directory / name, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
        except OSError as e:
            log.error("trace file %s: %d span(s) not written: %s", self.directory / name, len(lines), e)

    def shutdown(self) -> None:
        with self._lock:
            for name in list(self._held):
                self._write(name)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.shutdown()
        return True


def _otlp_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


class CallTracer:
    """The node's tracer: ``sampler`` decides, ``closed`` builds the span of a traced call."""

    def __init__(self, data_dir: Path, otlp_endpoint: str = "") -> None:
        self.sampler = TraceSampler()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "splitserve",
                                                                 "service.version": __version__}))
        self._trace_dir = data_dir / TRACE_DIR
        self._files: BatchSpanProcessor | None = None  # added with the first span bound for a trace file
        if otlp_endpoint:
            self.provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(otlp_endpoint)))
            log.info("traced calls are exported over OTLP to %s", otlp_endpoint)
        self._tracer = self.provider.get_tracer("splitserve")
        # perf_counter -> epoch ns, fixed once: every span of the node is on one time line
        self._epoch_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * 1e9)

    def closed(self, model: str, call: TracedCall, error: SplitServeError | None) -> None:
        """``call`` to ``model`` was answered (``error``, or its result): its span, if traced."""
        settings = self.sampler.sample(model)
        if settings is None:
            return
        if settings.file and self._files is None:  # its export thread starts only when a file is asked for
            self._files = BatchSpanProcessor(TraceFiles(self._trace_dir))
            self.provider.add_span_processor(self._files)
        start, end = call.t_first, call.t_tx or call.t_work
        span = self._tracer.start_span("InferRequest", start_time=self._ns(start), attributes={
            "model_name": model, "request_id": call.req_id, "batch_size": call.count,
            "trace.file": settings.file, "trace.log_frequency": settings.log_frequency})
        span.add_event("REQUEST_START", timestamp=self._ns(start))
        if call.t_rx:
            span.add_event("QUEUE_START", timestamp=self._ns(call.t_rx))
        if call.t_start_w:
            w0 = self._ns(call.t_start_w)
            span.add_event("COMPUTE_START", timestamp=w0)
            span.add_event("COMPUTE_INPUT_END", timestamp=w0 + call.input_ns)
            span.add_event("COMPUTE_OUTPUT_START", timestamp=w0 + call.compute_ns - call.output_ns)
            span.add_event("COMPUTE_END", timestamp=w0 + call.compute_ns)
        span.add_event("REQUEST_END", timestamp=self._ns(end))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{error.status.name}: {error.message}"))
        span.end(end_time=self._ns(end))

    def close(self) -> None:
        """Export what is held (trace files written) and stop the export threads."""
        self.provider.shutdown()
