"""OpenTelemetry in ``test_otel``'s workers: ``celery -A tests_app worker -I otel_app``.

Each pool process, once forked (``worker_process_init``), sets the SDK's tracer provider and
instruments Celery (``CeleryInstrumentor``), as an application using the ``otel`` extra does.
The spans are in the pool processes, not the test's: each finished span is appended to the file
``TEST_OTEL_SPANS`` as one JSON line (the SDK's ``to_json``), written as the span ends
(``SimpleSpanProcessor``), so a process killed later keeps what it finished before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from celery import signals
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

#: Worker option that imports this module.
OTEL_TASKS = ["-I", "otel_app"]


class JsonLinesExporter(SpanExporter):
    """Appends each span to a file as one line of JSON (one ``write`` per span: processes
    appending to the same file do not interleave their lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json(indent=None))) + "\n" for s in spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


@signals.worker_process_init.connect(weak=False)
def _trace_this_process(**_: Any) -> None:
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(JsonLinesExporter(os.environ["TEST_OTEL_SPANS"]))
    )
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
