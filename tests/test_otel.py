"""OpenTelemetry spans (``celery_ledger.otel``, docs/otel.md) from real workers.

The workers load ``otel_app``: each pool process sets the SDK's tracer provider, instruments
Celery with ``CeleryInstrumentor`` and appends every finished span to a file as a JSON line,
which the test reads. The ledger's spans must be children of the task span Celery's
instrumentation makes (same trace, its span id as their parent), and a resumed task's replayed
steps must say so. Without ``opentelemetry`` importable the runtime runs as before, every hook
a no-op (in a subprocess whose ``sys.modules`` hides it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from otel_app import OTEL_TASKS

from celery_ledger import otel
from celery_ledger.ledger import EntryStatus, LedgerStore
from celery_ledger.settings import LedgerSettings
from helpers import business_key, effect_counts
from procs import processes, test_env, wait_for
from test_delivery import client_app

ORDER = "tests_app.order"
STEPS = ["reserve", "charge", "receipt"]


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans the workers finished so far, in the order they ended."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    """``parent``'s children, in the order they started, each checked to be in its trace."""
    found = [s for s in spans if s["parent_id"] == parent["context"]["span_id"]]
    for span in found:
        assert span["context"]["trace_id"] == parent["context"]["trace_id"], span["name"]
    return sorted(found, key=lambda s: s["start_time"])


def event_names(span: dict[str, Any]) -> list[str]:
    return [e["name"] for e in span["events"]]


def ledger_children(spans: list[dict[str, Any]], task_span: dict[str, Any]) -> list[str]:
    return [s["name"] for s in children(spans, task_span) if s["name"].startswith("celery_ledger")]


@pytest.mark.processes
def test_claim_steps_and_settle_are_children_of_the_celery_task_span(
    tmp_path: Path, sqlite_url: str
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    env = test_env(tmp_path, broker=None, ledger_url=sqlite_url, TEST_OTEL_SPANS=str(spans_file))
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=OTEL_TASKS)
        assert app.send_task(ORDER, args=("t1", 5)).get(timeout=60)["order_id"] == "t1"
        # The sweep task: its sweep is a span under its own task span (no result is kept).
        # The task's span ends after the sweep's, so waiting for it waits for both: the
        # worker is stopped next, and a span not yet written would be lost with it.
        app.send_task("celery_ledger.sweep")
        wait_for(
            lambda: named(read_spans(spans_file), "run/celery_ledger.sweep"),
            timeout=60,
            what="the sweep task's span",
        )
    spans = read_spans(spans_file)

    (task_span,) = named(spans, f"run/{ORDER}")
    assert ledger_children(spans, task_span) == [
        otel.CLAIM_SPAN,
        *(otel.STEP_SPAN + step for step in STEPS),
        otel.SETTLE_SPAN,
    ]
    key = business_key(ORDER, order_id="t1")
    claim, *steps, settle = (
        s for s in children(spans, task_span) if s["name"].startswith("celery_ledger")
    )
    assert claim["attributes"] == {
        "celery_ledger.task_name": ORDER,
        "celery_ledger.key": key,
        "celery_ledger.gate": "run",
        "celery_ledger.fence": 1,
        "celery_ledger.executions": 0,
    }
    assert event_names(claim) == ["celery_ledger.claimed"]
    for step, name in zip(steps, STEPS, strict=True):
        assert step["attributes"] == {
            "celery_ledger.key": key,
            "celery_ledger.fence": 1,
            "celery_ledger.side_effect": "non_idempotent",
            "celery_ledger.step.name": name,
            "celery_ledger.step.effect": True,
            "celery_ledger.step.position": 0,
            "celery_ledger.step.replayed": False,
            "celery_ledger.step.status": otel.STEP_COMPLETED,
        }, name
    assert settle["attributes"] == {
        "celery_ledger.key": key,
        "celery_ledger.fence": 1,
        "celery_ledger.status": "completed",
        "celery_ledger.settle.refused": False,
    }
    (settled,) = settle["events"]
    assert settled["name"] == "celery_ledger.settled"
    assert settled["attributes"]["celery_ledger.status"] == "completed"

    (sweep_task,) = named(spans, "run/celery_ledger.sweep")
    (sweep,) = children(spans, sweep_task)
    assert sweep["name"] == otel.SWEEP_SPAN
    assert sweep["attributes"]["celery_ledger.actor"] == "sweep"
    assert sweep["attributes"]["celery_ledger.sweep.errors"] == 0


@pytest.mark.processes
def test_a_resumed_task_shows_its_replayed_steps(tmp_path: Path, redis: str, pg_url: str) -> None:
    """SIGKILLed once ``reserve`` completed; Redis redelivers, the claim takes over, and the
    resumed attempt's ``reserve`` is a replayed step span, the others run."""
    spans_file = tmp_path / "spans.jsonl"
    crash_at = "step-completed:reserve"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        TEST_OTEL_SPANS=str(spans_file),
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=OTEL_TASKS)
        assert app.send_task(ORDER, args=("r1", 5)).get(timeout=90)["order_id"] == "r1"
        # The result is stored before Celery's task span ends (``task_postrun``).
        wait_for(
            lambda: named(read_spans(spans_file), f"run/{ORDER}"),
            timeout=30,
            what="the task's span",
        )
        log = worker.log_text()
    assert Path(f"{tmp_path / 'crash-once'}.{crash_at.replace(':', '_')}").exists()
    assert "SIGKILL" in log, "no pool process died of SIGKILL"
    assert effect_counts(pg_url, "r1") == {("r1", s): 1 for s in STEPS}
    key = business_key(ORDER, order_id="r1")
    assert LedgerStore(pg_url).get_entry(key).status is EntryStatus.COMPLETED
    spans = read_spans(spans_file)

    # The killed attempt's claim ended before the kill; its task span never did.
    first, resumed = sorted(named(spans, otel.CLAIM_SPAN), key=lambda s: s["start_time"])
    assert (
        first["attributes"]["celery_ledger.gate"],
        first["attributes"]["celery_ledger.fence"],
    ) == ("run", 1)
    (task_span,) = named(spans, f"run/{ORDER}")
    assert resumed in children(spans, task_span)
    assert resumed["attributes"]["celery_ledger.gate"] == "takeover"
    # A fence of its own, past the killed one's (the interruption moved it too).
    fence = resumed["attributes"]["celery_ledger.fence"]
    assert fence > 1
    assert event_names(resumed) == ["celery_ledger.resumed"]

    steps = [s for s in children(spans, task_span) if s["name"].startswith(otel.STEP_SPAN)]
    assert [s["attributes"]["celery_ledger.step.name"] for s in steps] == STEPS
    assert [s["attributes"]["celery_ledger.step.replayed"] for s in steps] == [True, False, False]
    assert {s["attributes"]["celery_ledger.step.status"] for s in steps} == {otel.STEP_COMPLETED}
    assert {s["attributes"]["celery_ledger.fence"] for s in steps} == {fence}
    # The delivery tells how many steps it replayed, as an event of the task span.
    (replayed,) = [e for e in task_span["events"] if e["name"] == "celery_ledger.replayed"]
    assert replayed["attributes"]["celery_ledger.steps"] == 1
    assert ledger_children(spans, task_span)[-1] == otel.SETTLE_SPAN


WITHOUT_OPENTELEMETRY = """
import sys

# ``import opentelemetry`` raises ImportError, as where the extra is not installed.
for name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.context"):
    sys.modules[name] = None

from celery_ledger import LedgerTask, create_app, otel, runtime
from celery_ledger.app import sweep_now
from celery_ledger.settings import LedgerSettings

app = create_app("no_otel", data_dir=sys.argv[1], task_always_eager=True)


@app.task(base=LedgerTask, bind=True, name="no_otel.order")
def order(self, n):
    hooks = self.ledger_attempt.tracing
    return [self.step("one", lambda: n + 1), self.step("two", lambda: n + 2), hooks is otel.OFF]


assert order.delay(1).get() == [2, 3, True]
assert sweep_now(app).errors == 0
assert otel.available() is False
assert otel.tracing(runtime.settings_for(app)) is otel.OFF
# Every hook hands back the one shared do-nothing context manager.
assert otel.OFF.claim("t") is otel.OFF.sweep("sweep") is otel.OFF.settle(None, "completed")
assert not [n for n, m in sys.modules.items() if n.startswith("opentelemetry") and m is not None]
try:
    LedgerSettings.from_mapping({"ledger_otel": True}, env={})
except ValueError as exc:
    assert "celery-ledger[otel]" in str(exc), exc
else:
    raise AssertionError("ledger_otel=True without opentelemetry was accepted")
print("ok")
"""


def test_without_opentelemetry_the_runtime_runs_and_every_hook_is_a_no_op(
    tmp_path: Path,
) -> None:
    script = tmp_path / "no_otel.py"
    script.write_text(textwrap.dedent(WITHOUT_OPENTELEMETRY))
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_spans_need_a_tracer_provider_and_ledger_otel_false_turns_them_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    default = LedgerSettings.from_mapping({}, env={})
    off = LedgerSettings.from_mapping({}, env={"CELERY_LEDGER_OTEL": "0"})
    assert otel.available()
    # This process sets no global provider: the API's default would make no-op spans.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    assert otel.tracing(default) is otel.OFF
    monkeypatch.setattr(otel, "_spans", otel.Spans(trace, TracerProvider()))
    assert isinstance(otel.tracing(default), otel.Spans)
    assert otel.tracing(off) is otel.OFF


class Refused(Exception):
    """A step's provider refused the call before it went out (declared: not executed)."""


#: What each run of ``pay`` raises to its caller.
EXPECTED: dict[str, type[BaseException]] = {
    "read": ValueError,
    "refused": Refused,
    "crossed": RuntimeError,  # the entry is parked; the caller gets what the step raised
}


def test_a_step_span_tells_what_a_raising_step_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process (eager ``apply``), with the SDK's in-memory exporter: each way out of a
    step is its span's ``step.status``, and the ``blocked`` the attempt sends is an event of
    the span that was current."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from celery_ledger import LedgerTask, create_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # This test's provider, not the process's global one (which can be set only once).
    monkeypatch.setattr(otel, "_spans", otel.Spans(trace, provider))
    app = create_app(
        "otel_eager", data_dir=tmp_path / "data", ledger_url=f"sqlite:///{tmp_path}/l.db"
    )

    def no_such_order() -> None:
        raise ValueError("no such order")

    def refused() -> None:
        raise Refused("provider said no")

    def reset_mid_call() -> None:
        raise RuntimeError("connection reset mid-call")

    @app.task(base=LedgerTask, bind=True, name="otel_eager.pay", not_executed_on=(Refused,))
    def pay(self: LedgerTask, how: str) -> None:
        if how == "read":
            self.step("look", no_such_order, effect=False)
        if how == "refused":
            self.step("charge", refused)
        self.step("charge", reset_mid_call)

    root = provider.get_tracer("test")
    for how in ("read", "refused", "crossed"):
        with root.start_as_current_span(f"root/{how}"), pytest.raises(EXPECTED[how]):
            pay.apply((how,)).get()
    finished = {s.name: s for s in exporter.get_finished_spans() if s.name.startswith("root/")}
    steps = [s for s in exporter.get_finished_spans() if s.name.startswith(otel.STEP_SPAN)]
    assert [(s.name, s.attributes["celery_ledger.step.status"]) for s in steps] == [
        (otel.STEP_SPAN + "look", otel.STEP_FAILED),
        (otel.STEP_SPAN + "charge", otel.STEP_NOT_EXECUTED),
        (otel.STEP_SPAN + "charge", otel.STEP_AMBIGUOUS),
    ]
    assert all(s.status.status_code is trace.StatusCode.ERROR for s in steps)
    # The step that may have crossed parks the entry: ``blocked``, where the delivery was.
    events = [e.name for e in finished["root/crossed"].events]
    assert "celery_ledger.blocked" in events, events
