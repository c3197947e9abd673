"""OpenTelemetry spans for the ledger's work (the ``celery-ledger[otel]`` extra).

A delivery's claim, each step, the settle and a sweep are spans, children of whatever span is
current: under ``opentelemetry-instrumentation-celery`` (``CeleryInstrumentor``), the task's
``run/<task name>`` span. Every ``task-ledger-<kind>`` event the worker sends (``Delivery.emit``)
is also an event of the current span, ``celery_ledger.<kind>``, with the same fields: the
runtime already knows each of them, so no event costs a database read.

Switched on by installing the extra: with ``opentelemetry-api`` importable the spans go to the
API's tracer provider once the application sets one (the SDK's ``TracerProvider``, as it does
for ``CeleryInstrumentor``); until then none are made. ``ledger_otel = False``
(``CELERY_LEDGER_OTEL=0``) turns them off; ``ledger_otel = True`` makes a worker without the
extra refuse to start (``LedgerSettings.validate``) instead of tracing nothing quietly.

What it costs without the extra: ``tracing(settings)`` is ``OFF`` after one cached failed
import, and every ``OFF`` hook hands back one shared do-nothing context manager. The runtime
writes each hook as a ``with`` at its call site and never asks whether tracing is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from celery_ledger.ledger import Claim, SideEffect
    from celery_ledger.recovery import SweepReport
    from celery_ledger.replay import Ident

#: The instrumentation scope the spans are made under.
SCOPE = "celery_ledger"
#: Every attribute and event name starts with this.
PREFIX = "celery_ledger."

#: Span names. A step's is ``celery_ledger.step/<step name>`` (as Celery's is ``run/<task>``).
CLAIM_SPAN = "celery_ledger.claim"
STEP_SPAN = "celery_ledger.step/"
SETTLE_SPAN = "celery_ledger.settle"
SWEEP_SPAN = "celery_ledger.sweep"

#: What a step span's ``celery_ledger.step.status`` says the step left behind.
STEP_COMPLETED = "completed"  # its output is stored (run now, or replayed: ``step.replayed``)
STEP_NOT_EXECUTED = "not-executed"  # a declared exception proved it did not run
STEP_AMBIGUOUS = "ambiguous"  # it raised after its ``started`` row: it may have executed
STEP_FAILED = "failed"  # it raised, or was refused, and left no row that says it ran

_UNSET: Any = object()
_api: Any = _UNSET


def _trace_api() -> Any:
    """``opentelemetry.trace``, or None when it is not importable; imported once."""
    global _api
    if _api is _UNSET:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = None
        else:
            _api = trace
    return _api


def available() -> bool:
    """Whether ``opentelemetry-api`` is importable (the ``otel`` extra is installed)."""
    return _trace_api() is not None


class Switch(Protocol):
    """What ``tracing`` reads of the settings (``LedgerSettings``, which imports this module
    for ``available``)."""

    @property
    def otel(self) -> bool | None: ...


class Attempted(Protocol):
    """What a step or settle span reads from its attempt (``attempt.Attempt``)."""

    key: str
    fence: int
    side_effect: SideEffect
    #: The step that raised after its ``started`` row, if one did.
    ambiguous: Ident | None


class Note:
    """What a span learns while its block runs; ``OFF``'s notes drop it."""

    def claimed(self, claim: Claim) -> None:
        """The claim's outcome (claim span)."""

    def placed(self, ident: Ident, *, replayed: bool) -> None:
        """The step's replay row identity (its position is ``ident[2]``, the n-th call of its
        name), and whether it replays."""

    def settled(self, ok: bool) -> None:
        """Whether the settle was taken (False: the fence moved)."""

    def swept(self, report: SweepReport) -> None:
        """What the sweep did (its report's counts)."""


class Tracing:
    """The hooks the runtime calls; this class is ``OFF``, every hook a no-op."""

    _nothing: contextlib.nullcontext[Note] = contextlib.nullcontext(Note())

    def claim(self, task_name: str) -> contextlib.AbstractContextManager[Note]:
        return self._nothing

    def step(
        self,
        attempt: Attempted,
        name: str,
        *,
        effect: bool,
        not_executed_on: tuple[type[BaseException], ...],
    ) -> contextlib.AbstractContextManager[Note]:
        return self._nothing

    def settle(self, attempt: Attempted, status: str) -> contextlib.AbstractContextManager[Note]:
        return self._nothing

    def sweep(self, actor: str) -> contextlib.AbstractContextManager[Note]:
        return self._nothing

    def event(self, kind: str, key: str, fence: int, fields: dict[str, Any]) -> None:
        """Add ``celery_ledger.<kind>`` to the current span."""


#: Tracing off: no extra, or ``ledger_otel = False``.
OFF = Tracing()


def _attributes(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as span attributes: prefixed, and only the types an attribute may hold."""
    return {
        PREFIX + name: value
        for name, value in fields.items()
        if isinstance(value, (str, bool, int, float))
    }


class _SpanNote(Note):
    def __init__(self, span: Any) -> None:
        self.span = span
        self.ident: Ident | None = None

    def claimed(self, claim: Claim) -> None:
        found = None if claim.found is None else claim.found.value
        self.span.set_attributes(
            _attributes(
                {
                    "key": claim.key,
                    "gate": claim.gate.value,
                    "fence": claim.fence,
                    "found": found,
                    "executions": claim.executions,
                }
            )
        )

    def placed(self, ident: Ident, *, replayed: bool) -> None:
        self.ident = ident
        self.span.set_attributes(
            {PREFIX + "step.position": ident[2], PREFIX + "step.replayed": replayed}
        )

    def settled(self, ok: bool) -> None:
        self.span.set_attribute(PREFIX + "settle.refused", not ok)

    def swept(self, report: SweepReport) -> None:
        counts = {k: v for k, v in report.as_dict().items() if isinstance(v, int)}
        self.span.set_attributes(_attributes({f"sweep.{k}": v for k, v in counts.items()}))


class Spans(Tracing):
    """The hooks with ``opentelemetry-api`` importable: each makes a span under the current one."""

    def __init__(self, trace: Any, provider: Any = None) -> None:
        """``trace``: the API's module; ``provider``: a tracer provider of one's own (a
        test's), else the API's global one."""
        self._trace = trace
        self._provider = provider
        # The global one's is a ProxyTracer until the application sets a provider, then the
        # provider's own: spans made before that are no-ops, none are lost after.
        self._tracer = (provider or trace).get_tracer(SCOPE)
        self._unset = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)

    def live(self) -> bool:
        """Whether a tracer provider is set. Until one is, the API's default makes no-op spans,
        each still some 10 us of context handling: a runtime makes none (``OFF``) instead."""
        return self._provider is not None or not isinstance(
            self._trace.get_tracer_provider(), self._unset
        )

    @contextlib.contextmanager
    def _span(self, name: str, attributes: dict[str, Any]) -> Iterator[_SpanNote]:
        with self._tracer.start_as_current_span(name, attributes=_attributes(attributes)) as span:
            yield _SpanNote(span)

    def claim(self, task_name: str) -> contextlib.AbstractContextManager[Note]:
        return self._span(CLAIM_SPAN, {"task_name": task_name})

    @contextlib.contextmanager
    def step(
        self,
        attempt: Attempted,
        name: str,
        *,
        effect: bool,
        not_executed_on: tuple[type[BaseException], ...],
    ) -> Iterator[Note]:
        fields = {
            "key": attempt.key,
            "fence": attempt.fence,
            "side_effect": attempt.side_effect.value,
            "step.name": name,
            "step.effect": effect,
        }
        with self._span(STEP_SPAN + name, fields) as note:
            try:
                yield note
            except BaseException as exc:
                if effect and isinstance(exc, not_executed_on):
                    status = STEP_NOT_EXECUTED
                elif note.ident is not None and attempt.ambiguous == note.ident:
                    status = STEP_AMBIGUOUS
                else:
                    status = STEP_FAILED
                note.span.set_attribute(PREFIX + "step.status", status)
                raise
            note.span.set_attribute(PREFIX + "step.status", STEP_COMPLETED)

    def settle(self, attempt: Attempted, status: str) -> contextlib.AbstractContextManager[Note]:
        return self._span(
            SETTLE_SPAN, {"key": attempt.key, "fence": attempt.fence, "status": status}
        )

    def sweep(self, actor: str) -> contextlib.AbstractContextManager[Note]:
        return self._span(SWEEP_SPAN, {"actor": actor})

    def event(self, kind: str, key: str, fence: int, fields: dict[str, Any]) -> None:
        span = self._trace.get_current_span()
        if span.is_recording():
            span.add_event(PREFIX + kind, _attributes({"key": key, "fence": fence, **fields}))


#: The hooks with the API importable, made on first need.
_spans: Spans | None = None


def tracing(settings: Switch) -> Tracing:
    """The hooks for a runtime with these settings: the spans (``Spans``) once a tracer
    provider is set, else ``OFF``. Asked per delivery and per sweep, so a provider set after
    the worker started (``worker_process_init``) is used from the next one on."""
    if settings.otel is False:
        return OFF
    global _spans
    if _spans is None:
        trace = _trace_api()
        if trace is None:
            return OFF
        _spans = Spans(trace)
    return _spans if _spans.live() else OFF
