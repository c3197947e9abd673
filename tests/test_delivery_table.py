"""The delivery as a table (design.md § "The delivery as a table"): ``GATES`` and ``ESCAPES``.

The first tests read the real module: every gate of the ledger has exactly one handler, every
exception a delivery can meet maps to one row of ``ESCAPES``, no row is shadowed by an earlier
one, and the tables in the design document are these tables, in this order. The others run
one delivery of each gate through real ``celery worker`` processes, and crash at
``after-claim``, the crash point the delivery owns that no other test uses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import Ignore, Reject, Retry
from time_app import TIME_TASKS

from celery_ledger import delivery
from celery_ledger.delivery import ESCAPES, GATES, Delivery, Outcome, escape_of
from celery_ledger.errors import StepUsageError, Stopped
from celery_ledger.ledger import (
    EntryNotFound,
    EntryStatus,
    Fenced,
    Gate,
    KeyConflict,
    LedgerBlocked,
    LedgerStore,
    LedgerUnavailable,
    PayloadTooLarge,
    TaskCancelled,
)
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"

#: Every exception class a delivery can see escape the body, with the outcome the design gives
#: it and the handler that carries it out.
SEEN: list[tuple[BaseException, Outcome, str]] = [
    (Stopped(Ignore()), Outcome.RAISE, "after_stop"),
    (Retry(), Outcome.SETTLE, "after_retry"),
    (Reject("why", requeue=True), Outcome.SETTLE, "after_reject"),
    (Fenced("superseded"), Outcome.RAISE, "after_fenced"),
    (LedgerBlocked("parked"), Outcome.RAISE, "after_blocked"),
    (LedgerUnavailable("down"), Outcome.REDELIVER, "after_unreachable"),
    (Ignore(), Outcome.SETTLE, "after_ignore"),
    (ValueError("the task's own"), Outcome.SETTLE, "after_failure"),
    (StepUsageError("misused"), Outcome.SETTLE, "after_failure"),
    (PayloadTooLarge("too big"), Outcome.SETTLE, "after_failure"),
    (TaskCancelled("a step's own"), Outcome.SETTLE, "after_failure"),
    (KeyboardInterrupt(), Outcome.RAISE, "after_exit"),
    (SystemExit(1), Outcome.RAISE, "after_exit"),
]


def _doc_table(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after ``heading`` in docs/design.md (cells
    stripped of their backticks)."""
    text = DESIGN.read_text()
    start = text.index(heading)
    rows: list[list[str]] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header row


# -- the tables, read from the module ---------------------------------------------------------


def test_every_gate_has_exactly_one_handler() -> None:
    assert set(GATES) == set(Gate)
    for gate, row in GATES.items():
        handler = getattr(Delivery, row.handler, None)
        assert callable(handler), f"{gate}: Delivery.{row.handler} does not exist"
    # RUN and TAKEOVER share the run; every other gate has a handler of its own.
    by_handler: dict[str, list[Gate]] = {}
    for gate, row in GATES.items():
        by_handler.setdefault(row.handler, []).append(gate)
    assert sorted(by_handler.pop("run")) == sorted([Gate.RUN, Gate.TAKEOVER])
    assert all(len(gates) == 1 for gates in by_handler.values()), by_handler


def test_every_escaping_exception_maps_to_one_row() -> None:
    for exc, outcome, handler in SEEN:
        row = escape_of(exc)
        assert (row.outcome, row.handler) == (outcome, handler), type(exc).__name__
        assert callable(getattr(Delivery, row.handler, None)), row.handler


def test_no_escape_row_is_shadowed_by_an_earlier_one() -> None:
    """The first matching row decides: a row whose type is a subclass of an earlier row's
    would never be reached."""
    for i, row in enumerate(ESCAPES):
        for earlier in ESCAPES[:i]:
            assert not issubclass(row.kind, earlier.kind), (row.kind, earlier.kind)
    assert ESCAPES[-1].kind is BaseException  # nothing escapes the table


def test_the_design_documents_these_tables_in_this_order() -> None:
    gates = _doc_table("### The gate table")
    assert [(g, e, h) for g, e, h, *_ in gates] == [
        (gate.name, row.event, row.handler) for gate, row in GATES.items()
    ]
    escapes = _doc_table("### The escape table")
    assert [(k, o, h) for k, o, h, *_ in escapes] == [
        (row.kind.__name__, row.outcome.value, row.handler) for row in ESCAPES
    ]


def test_the_delivery_looks_up_the_runtime_once() -> None:
    """The app's runtime (settings, store, events) is looked up once, in the delivery's
    constructor; ``owner_for`` (this process's owner) is no look-up on the app."""
    source = Path(delivery.__file__).read_text()
    calls = re.findall(r"runtime\.(\w+)\(", source)
    assert sorted(calls) == ["owner_for", "runtime_of"]
    init = source[source.index("    def __init__") : source.index("    def __call__")]
    assert "runtime.runtime_of(" in init


# -- one delivery of each gate, through a real worker -----------------------------------------


def _status(store: LedgerStore, key: str) -> EntryStatus | None:
    try:
        return store.get_entry(key).status
    except EntryNotFound:
        return None  # not claimed yet


def _fails_with(result: Any, name: str, timeout: float = 60) -> str:
    with pytest.raises(Exception) as raised:
        result.get(timeout=timeout)
    assert type(raised.value).__name__ == name, repr(raised.value)
    return str(raised.value)


@pytest.mark.processes
def test_each_gate_through_a_worker(tmp_path: Path, pg_url: str) -> None:
    """RUN, RETURN, CONFLICT, WAIT and HOLD, one delivery each, on one worker; the body of
    each entry runs at most once."""
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=pg_url,
        CELERY_LEDGER_WAIT_COUNTDOWN_MAX="1",
    )
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2, extra=TIME_TASKS)
        # RUN: a new entry; the body runs and settles completed.
        first = app.send_task("tests_app.order", args=("gt-1", 5))
        done = first.get(timeout=60)
        key = business_key("tests_app.order", order_id="gt-1")
        assert store.get_entry(key).status is EntryStatus.COMPLETED
        # RETURN: the same call again hands back the stored result; nothing runs.
        assert app.send_task("tests_app.order", args=("gt-1", 5)).get(timeout=60) == done
        # CONFLICT: the key with other arguments is refused; nothing runs.
        _fails_with(app.send_task("tests_app.order", args=("gt-1", 6)), KeyConflict.__name__)
        assert effect_counts(pg_url, "gt-1") == {
            ("gt-1", "reserve"): 1,
            ("gt-1", "charge"): 1,
            ("gt-1", "receipt"): 1,
        }
        assert {"claimed", "returned", "conflict"} <= set(event_names(store, key))

        # WAIT: a second delivery of a running entry re-queues itself, then returns its result.
        slow = app.send_task("tests_app.slow_effect", args=("gt-w", 4.0))
        slow_key = key_of("tests_app.slow_effect", slow.id)
        wait_for(
            lambda: effect_counts(pg_url, "gt-w").get(("gt-w", "body")) == 1,
            timeout=30,
            what="the slow body to start",
        )
        again = app.send_task("tests_app.slow_effect", args=("gt-w", 4.0), task_id=slow.id)
        assert again.get(timeout=60) == "done:gt-w"
        assert "waited" in event_names(store, slow_key)
        assert effect_counts(pg_url, "gt-w") == {("gt-w", "body"): 1}

        # HOLD: a sleeping entry; its delivery runs nothing and is acked.
        sleeper = app.send_task("time_app.sleeper", args=("gt-h", 3600.0))
        sleep_key = key_of("time_app.sleeper", sleeper.id)
        wait_for(
            lambda: _status(store, sleep_key) is EntryStatus.SLEEPING,
            timeout=30,
            what="the sleeper to sleep",
        )
        app.send_task("time_app.sleeper", args=("gt-h", 3600.0), task_id=sleeper.id)
        wait_for(lambda: "held" in event_names(store, sleep_key), timeout=30, what="the HOLD gate")
        assert store.get_entry(sleep_key).status is EntryStatus.SLEEPING
        assert effect_counts(pg_url, "gt-h") == {("gt-h", "before"): 1}
    store.dispose()


@pytest.mark.processes
def test_takeover_and_block_through_a_worker(tmp_path: Path, redis: str, pg_url: str) -> None:
    """A pool process killed at ``after-claim`` (claimed, body not started): nothing tells
    the redelivery the body did not start, so its TAKEOVER parks the entry (``LedgerBlocked``
    escapes: RAISE), and a later delivery meets the BLOCK gate. One killed after a completed
    step: the TAKEOVER replays it and runs the rest, each step once."""
    once = tmp_path / "crash-once"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_CRASH_AT="after-claim,step-completed:reserve",
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        # Killed at after-claim; the TAKEOVER parks it.
        parked = app.send_task("tests_app.order", args=("gt-b", 1))
        assert "may have executed" in _fails_with(parked, LedgerBlocked.__name__, timeout=90)
        assert Path(f"{once}.after-claim").exists()
        parked_key = business_key("tests_app.order", order_id="gt-b")
        assert store.get_entry(parked_key).status is EntryStatus.BLOCKED
        assert "takeover" in event_names(store, parked_key)
        # BLOCK: the same call again runs nothing and raises.
        again = app.send_task("tests_app.order", args=("gt-b", 1))
        assert "is blocked" in _fails_with(again, LedgerBlocked.__name__)
        assert "block-gate" in event_names(store, parked_key)
        assert effect_counts(pg_url, "gt-b") == {}  # killed before the body began
        # Killed after its first step completed; the TAKEOVER replays it.
        result = app.send_task("tests_app.order", args=("gt-t", 1))
        assert result.get(timeout=90)["steps"] == ["reserve:gt-t", "charge:gt-t", "receipt:gt-t"]
        assert Path(f"{once}.step-completed_reserve").exists()
        key = business_key("tests_app.order", order_id="gt-t")
        assert "takeover" in event_names(store, key)
        assert effect_counts(pg_url, "gt-t") == {
            ("gt-t", "reserve"): 1,
            ("gt-t", "charge"): 1,
            ("gt-t", "receipt"): 1,
        }
    store.dispose()
