"""Hostile input (guarantees.md § "The hardening faults", faults 12, 13, 14): the failing-first
tests.

Tried as an adversarial user would: through a real worker (and beat) on the embedded default
(``filesystem://`` broker, SQLite ledger), the ``celery-ledger`` console script as a
subprocess, and a producer app whose ``LedgerTask.apply_async`` records publish intents (on by
default for ``filesystem://``). Each input gets a clear refusal and loses nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from faults_app import FAULT_TASKS
from kombu.utils.json import dumps

from celery_ledger import LedgerTask, create_app
from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    LedgerError,
    LedgerStore,
    Owner,
    entry_key,
)
from helpers import effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

BIN = Path(sys.executable).parent
DEPTH = 5000


def nested(depth: int = DEPTH) -> list[Any]:
    """A list nested ``depth`` deep, built without recursion."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@contextmanager
def deep_recursion() -> Iterator[None]:
    """What the hostile sender did: raise its recursion limit so that it can encode ``nested``."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 8 * DEPTH))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def producer_app(env: dict[str, str], ledger: str, name: str) -> Any:
    """A producer that publishes ``faults_app.echo`` as a LedgerTask (publish intents on)."""
    producer = create_app(
        name,
        data_dir=env["CELERY_LEDGER_DATA_DIR"],
        ledger_url=ledger,
        task_default_queue=env["TEST_QUEUE"],
    )

    @producer.task(base=LedgerTask, bind=True, name="faults_app.echo", shared=False)
    def echo(self: Any, tag: str, value: Any) -> None:
        raise AssertionError("the producer never runs the body")

    return echo


def ledger_cli(ledger: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env["NO_COLOR"] = "1"
    return subprocess.run(
        [str(BIN / "celery-ledger"), "--url", ledger, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


# == fault 12: an argument nested 5,000 deep ====================================================


def test_sender_refuses_an_argument_no_worker_can_decode(tmp_path):
    """Fault 12. The sender raised its recursion limit and sent a list nested 5,000 deep. No
    worker can decode it (``DecodeError(RecursionError)``), so the sender must refuse it with a
    clear error, and leave neither a message nor a publish intent behind."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    echo = producer_app(env, ledger, "producer12")
    deep = nested()
    with deep_recursion(), pytest.raises(Exception) as info:
        echo.apply_async(("deep-1", deep), task_id="deep-1")
    assert isinstance(info.value, (LedgerError, ValueError)), repr(info.value)
    said = str(info.value).lower()
    assert any(w in said for w in ("nest", "deep", "depth")), str(info.value)
    assert not list((Path(env["CELERY_LEDGER_DATA_DIR"]) / "broker").glob("*.msg"))
    store = LedgerStore(ledger)
    live = store.list_entries(statuses=["running", "interrupted", "retrying"])
    assert live == [], [(e.task_id, e.status.value) for e in live]


def test_entry_whose_snapshot_cannot_be_read_is_shown_and_resolvable(tmp_path):
    """Fault 12. What an older sender left behind: a publish intent whose snapshot no process
    can read, and a message the worker drops (``DecodeError``). The sweep kept re-marking it
    under the resume owner, ``show`` crashed with a traceback, ``release`` refused it (live
    lease) and ``list --stuck`` did not show it. It must be parked where an operator sees it,
    shown, and released."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=ledger,
        CELERY_LEDGER_LEASE_SECONDS="2",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    task_id = "deep-2"
    key = entry_key("faults_app.echo", task_id)
    deep = nested()
    with deep_recursion():
        snapshot = dumps(
            {"args": ["deep-2", deep], "kwargs": {}, "queue": env["TEST_QUEUE"], "ledger_key": None}
        )
    store = LedgerStore(ledger)
    assert store.record_intent(
        ClaimRequest(
            key=key,
            task_name="faults_app.echo",
            task_id=task_id,
            args_hash="task-id",
            snapshot=snapshot,
            side_effect="non_idempotent",
            owner=Owner("sender@host", "b0", 1),
            lease_seconds=1.0,
        )
    )
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        procs.beat()
        with deep_recursion():
            app.send_task("faults_app.echo", args=("deep-2", deep), task_id=task_id)
        worker.wait_log("deep-2", timeout=30)  # the worker met it (and could not decode it)

        def parked() -> bool:
            entry = store.get_entry(key)
            return entry.status is EntryStatus.BLOCKED and "snapshot" in (entry.reason or "")

        try:
            wait_for(parked, timeout=30, what="the unreadable entry to be parked")
        except AssertionError as exc:
            entry = store.get_entry(key)
            raise AssertionError(
                f"{exc}: it is {entry.status.value} (owner {entry.owner}, fence {entry.fence}, "
                f"reason {entry.reason!r}); "
                f"events {event_names(store, key)[-6:]}"
            ) from None
        # The queue still flows.
        fine = app.send_task("faults_app.echo", args=("fine-2", 7))
        assert fine.get(timeout=60) == 7
    stuck = ledger_cli(ledger, "list", "--stuck", "--json")
    assert stuck.returncode == 0, stuck.stderr
    assert key in [e["key"] for e in json.loads(stuck.stdout)["entries"]]
    shown = ledger_cli(ledger, "show", key)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr[-2000:]
    released = ledger_cli(
        ledger,
        "release",
        key,
        "--verified",
        "completed",
        "--result-json",
        "null",
        "--by",
        "ops",
        "--reason",
        "sender's bug; dropped",
    )
    assert released.returncode == 0, released.stderr
    assert store.get_entry(key).status is EntryStatus.COMPLETED


# == fault 13: a task id reused with other arguments =============================================


def test_task_id_reused_with_other_arguments_is_a_conflict(tmp_path):
    """Fault 13. ``apply_async(args=("same", 1), task_id=T)`` and ``apply_async(args=("same",
    2), task_id=T)``: both callers got the result of 1, and 2 was recorded nowhere. A fresh
    publish (no retry count) with other arguments under a task id must be a conflict, said to
    the sender or recorded by the claim; the body never runs for it."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    echo = producer_app(env, ledger, "producer13")
    store = LedgerStore(ledger)
    key = key_of("faults_app.echo", "same-id")
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        echo.apply_async(("same", 1), task_id="same-id")
        refused: BaseException | None = None
        try:
            echo.apply_async(("same", 2), task_id="same-id")
        except Exception as exc:  # noqa: BLE001 - a refusal at publish is one right answer
            refused = exc
        wait_for(
            lambda: (
                store.peek_status(key) is not None
                and store.get_entry(key).status is EntryStatus.COMPLETED
            ),
            timeout=60,
            what="one of the two to complete",
        )
        if refused is None:
            try:
                wait_for(
                    lambda: "conflict" in event_names(store, key),
                    timeout=30,
                    what="the other delivery's claim to record a conflict",
                )
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}: the publish with other arguments was neither refused nor "
                    f"recorded; events {event_names(store, key)}; the stored result "
                    f"{store.get_entry(key).result} went to both callers"
                ) from None
        else:
            assert "argument" in str(refused), refused
    ran = {value: sum(effect_counts(ledger, f"same:{value}").values()) for value in (1, 2)}
    assert sorted(ran.values()) == [0, 1], ran
    if refused is not None:
        assert ran == {1: 1, 2: 0}


def test_task_id_reused_with_other_arguments_conflicts_at_the_claim(tmp_path):
    """Fault 13, the claim's side: sent by name (``send_task``, nothing checks at publish),
    the second publish of a task id with other arguments reaches a worker. Its claim must
    answer CONFLICT (the arguments are hashed for task-id keys too), run nothing, and keep
    the first call's result in the ledger."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    store = LedgerStore(ledger)
    key = key_of("faults_app.echo", "same-2")
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        first = app.send_task("faults_app.echo", args=("same2", 1), task_id="same-2")
        assert first.get(timeout=60) == 1
        app.send_task("faults_app.echo", args=("same2", 2), task_id="same-2")
        wait_for(
            lambda: "conflict" in event_names(store, key),
            timeout=30,
            what=f"the second delivery's claim to record a conflict; events "
            f"{event_names(store, key)}",
        )
        # Both calls share one task id, so one result in Celery's backend: the worker's
        # log is where the second delivery's refusal is said.
        worker.wait_log("task id was first claimed with different arguments", timeout=30)
    ran = {value: sum(effect_counts(ledger, f"same2:{value}").values()) for value in (1, 2)}
    assert ran == {1: 1, 2: 0}, ran
    entry = store.get_entry(key)
    assert (entry.status, entry.result) == (EntryStatus.COMPLETED, "1")


def test_retry_may_change_the_arguments_under_one_task_id(tmp_path):
    """Fault 13's counterpart (passes today; guards the fix): ``self.retry(args=...)`` changes
    the arguments of the same effect under the same task id, and that is no conflict."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task("faults_app.retry_new_args", args=("rn", 1))
        assert result.get(timeout=60) == "charge:rn:2"
    assert effect_counts(ledger, "rn:2") == {("rn:2", "charge"): 1}
    key = key_of("faults_app.retry_new_args", result.id)
    assert "conflict" not in event_names(LedgerStore(ledger), key)


# == fault 14: step names ==========================================================================

BAD_NAMES = {
    "empty": "",
    "10 KB": "n" * 10_000,
    "newline": "charge\nsettled  completed",
    "escape": "\x1b[2J\x1b[31mcharge\x1b[0m",
}


def test_bad_step_names_are_refused_before_anything_runs(tmp_path):
    """Fault 14. An empty step name, a 10 KB one, and names with a newline or terminal escape
    sequences were stored and printed raw (breaking ``show``'s table). ``self.step`` must
    refuse each with a clear error before the step runs or anything is written."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    store = LedgerStore(ledger)
    outcomes: dict[str, str] = {}
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        sent = {
            case: app.send_task("faults_app.named_step", args=(f"nm-{i}", name))
            for i, (case, name) in enumerate(BAD_NAMES.items())
        }
        for i, (case, result) in enumerate(sent.items()):
            try:
                outcomes[case] = f"ran: {str(result.get(timeout=60))[:40]!r}"
            except Exception as exc:  # noqa: BLE001
                outcomes[case] = f"refused: {type(exc).__name__}: {str(exc)[:120]}"
            rows = store.load_steps(key_of("faults_app.named_step", result.id))
            if rows:
                outcomes[case] += f"; stored {len(rows)} step row(s)"
            if effect_counts(ledger, f"nm-{i}"):
                outcomes[case] += "; the step ran"
    wrong = {
        case: said
        for case, said in outcomes.items()
        if not said.startswith("refused") or "step name" not in said or ";" in said
    }
    assert not wrong, wrong
