"""Task-level faults (guarantees.md § "The hardening faults"): the failing-first tests, with real
``celery worker`` and ``celery beat`` processes (``tests/procs.py``) over a real broker and ledger.

The tasks live in ``tests/faults_app.py`` (the worker imports it with ``-I faults_app``). Crash
tests run on Redis + PostgreSQL, as ``test_steps_crash.py`` does (Redis gives a killed pool
process's message back); the rest on the embedded default (``filesystem://`` + SQLite) unless
the fault is PostgreSQL's. Every wait is bounded and every process is stopped, pass or fail.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from faults_app import FAULT_TASKS

from celery_ledger import LedgerTask, create_app
from celery_ledger.codec import decode
from celery_ledger.ledger import (
    ClaimRequest,
    Entry,
    EntryStatus,
    LedgerStore,
    Owner,
    entry_key,
)
from helpers import effect_counts, event_names, key_of
from procs import TESTS, processes, test_env, wait_for
from servers import PG_ADMIN_URL
from test_delivery import client_app

pytestmark = pytest.mark.processes

ORDER_STEPS = ["reserve", "charge", "receipt"]


def effects_of(url: str, tag: str) -> dict[str, int]:
    return {effect: n for (_, effect), n in effect_counts(url, tag).items()}


def crash_run(
    tmp_path: Path,
    redis: str,
    pg_url: str,
    crash_at: str,
    task: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> tuple[Any, str, bool]:
    """Run ``task`` on one worker whose pool process is SIGKILLed once at ``crash_at``.

    Returns (the result or the exception it raised, the task id, whether the crash fired:
    its once-marker exists and the worker saw a pool process die of SIGKILL)."""
    once = tmp_path / "crash-once"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task(task, args=args, kwargs=kwargs or {})
        try:
            value: Any = result.get(timeout=90)
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            value = exc
        log = worker.log_text()
    fired = Path(f"{once}.{crash_at.replace(':', '_')}").exists() and "SIGKILL" in log
    return value, result.id, fired


def settles(store: LedgerStore, key: str, *, timeout: float, what: str = "") -> Entry:
    """Wait for ``key`` to be completed or failed; on timeout, say where it stands."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            entry = store.get_entry(key)
        except KeyError:
            entry = None
        if entry is not None and entry.status in (EntryStatus.COMPLETED, EntryStatus.FAILED):
            return entry
        if time.monotonic() > deadline:
            where = "no entry" if entry is None else f"{entry.status.value} fence {entry.fence}"
            raise AssertionError(
                f"{what or key[:12]} did not settle in {timeout}s: {where}; "
                f"events {event_names(store, key) if entry else []}"
            )
        time.sleep(0.2)


def pg_admin() -> Any:
    """A connection to the server's admin database (not to the ledger's own)."""
    import psycopg

    return psycopg.connect(PG_ADMIN_URL.replace("+psycopg", ""), autocommit=True)


def end_sessions(admin: Any, dbname: str) -> None:
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()",
        (dbname,),
    )


# == fault 2: a read-only ledger at claim: nothing runs, the task comes back =================


def test_read_only_ledger_at_claim_runs_nothing_and_the_task_comes_back(tmp_path, pg_url):
    """Fault 2. The ledger fails over to a read-only standby while a task arrives: the claim
    gets ReadOnlySqlTransaction. The body must not run, the message must come back with
    backoff (not FAILURE for good), and the task completes once the ledger takes writes."""
    setup = LedgerStore(pg_url)
    setup.ensure_ready()
    setup.dispose()
    dbname = pg_url.rsplit("/", 1)[1]
    effects = f"sqlite:///{tmp_path / 'effects.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=pg_url,
        effects_url=effects,
        CELERY_LEDGER_UNAVAILABLE_BACKOFF="0.5",
        CELERY_LEDGER_UNAVAILABLE_BACKOFF_MAX="1",
    )
    app = client_app(env)
    with pg_admin() as admin:
        admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
        try:
            with processes(tmp_path, env) as procs:
                worker = procs.worker("w1", concurrency=1)
                result = app.send_task("tests_app.order", args=("ro-1", 5))
                # Each delivery that meets the read-only ledger logs this and re-sends itself;
                # two of them prove the message came back. (Celery 5.7 logs a delivery as
                # "Task name[id] received", no longer "Received task: name[id]".)
                refused = f"ledger unavailable at claim task=tests_app.order task_id={result.id}"
                wait_for(
                    lambda: result.state == "FAILURE" or worker.log_text().count(refused) >= 2,
                    timeout=60,
                    what="the task to fail, or to come back",
                )
                assert result.state != "FAILURE", (
                    f"a read-only ledger failed the task for good: {result.result!r}"
                )
                assert effects_of(effects, "ro-1") == {}, "the body ran without a claim"
                admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = off')
                end_sessions(admin, dbname)  # sessions keep the default they started with
                value = result.get(timeout=60)
        finally:
            admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = off')
    assert value["steps"] == [f"{s}:ro-1" for s in ORDER_STEPS]
    assert effects_of(effects, "ro-1") == dict.fromkeys(ORDER_STEPS, 1)


# == fault 3: a retry whose message is lost is shown as stuck and re-sent =====================


def test_overdue_retry_whose_message_was_lost_is_shown_and_resent(tmp_path, monkeypatch):
    """Fault 3. ``self.retry(countdown=3)``: the entry is ``retrying`` and the worker holds the
    retry's message until its ETA; ``filesystem://`` has deleted the file. The worker is
    SIGKILLed: the retry is gone. Once it is overdue by its countdown plus the grace period,
    ``list --stuck`` must show it, and the sweep must re-send it; it then completes once.

    ``CELERY_LEDGER_RETRY_GRACE_SECONDS`` is the proposed setting for that grace period."""
    from click.testing import CliRunner

    from celery_ledger.cli.main import main

    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=ledger,
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        CELERY_LEDGER_RETRY_GRACE_SECONDS="1",
    )
    app = client_app(env)
    store = LedgerStore(ledger)
    queue_dir = Path(env["CELERY_LEDGER_DATA_DIR"]) / "broker"
    for name in (
        "CELERY_LEDGER_URL",
        "CELERY_LEDGER_DATA_DIR",
        "CELERY_LEDGER_RETRY_GRACE_SECONDS",
    ):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("NO_COLOR", "1")

    def stuck_keys() -> list[str]:
        out = CliRunner().invoke(main, ["list", "--stuck", "--json"], catch_exceptions=False)
        assert out.exit_code == 0, out.output
        return [e["key"] for e in decode(out.stdout)["entries"]]

    with processes(tmp_path, env) as procs:
        first = procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task("faults_app.retry_later", args=("rt-lost", 3.0))
        key = key_of("faults_app.retry_later", result.id)

        def retry_held() -> bool:
            try:
                retrying = store.get_entry(key).status is EntryStatus.RETRYING
            except KeyError:
                return False
            return retrying and not list(queue_dir.glob("*.msg"))

        wait_for(retry_held, timeout=30, what="the worker to hold the retry's message")
        first.kill()  # the retry dies with the worker
        wait_for(
            lambda: key in stuck_keys(),
            timeout=30,
            what=f"`list --stuck` to show the overdue retry {key[:12]} "
            f"(status {store.get_entry(key).status.value})",
        )
        procs.worker("w2", concurrency=1, extra=FAULT_TASKS)
        procs.beat()
        value = result.get(timeout=60)
    assert value == ["charge:rt-lost", "email:rt-lost"]
    assert effects_of(ledger, "rt-lost") == {"charge": 1, "email": 1}


# == fault 6: step identity drift ==============================================================


def _hex_tokens(text: str) -> list[str]:
    return re.findall(r"[0-9a-f]{8,64}", text)


def test_drifted_step_input_fails_closed_naming_the_step_and_both_hashes(tmp_path, redis, pg_url):
    """Fault 6. ``charge`` takes a timestamp read outside any step. Killed after ``charge``
    completed, the resumed attempt calls ``charge`` at the same name and position with a new
    input: that is drift. Without a declaration of which arguments identify the step it must
    fail closed (the card is charged once) with a reason that names the step and both input
    hashes; and any second execution must show in the duplicate-execution rate."""
    value, task_id, fired = crash_run(
        tmp_path, redis, pg_url, "step-completed:charge", "faults_app.drift_charge", ("d1",)
    )
    store = LedgerStore(pg_url)
    key = key_of("faults_app.drift_charge", task_id)
    charges = effects_of(pg_url, "d1").get("charge", 0)
    dup = store.stats().duplicate_executions
    assert charges - 1 <= dup, (
        f"charge ran {charges} times and the ledger counts {dup} duplicate execution(s)"
    )
    assert charges == 1, f"charge ran {charges} times"
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.BLOCKED, entry.status
    reason = entry.reason or ""
    first = min((s for s in store.load_steps(key) if s.name == "charge"), key=lambda s: s.seq)
    hashes = [t for t in _hex_tokens(reason) if not key.startswith(t)]
    assert "charge" in reason, reason
    assert any(first.input_hash.startswith(t) for t in hashes), (first.input_hash, reason)
    assert any(not first.input_hash.startswith(t) for t in hashes), reason
    assert type(value).__name__ == "LedgerBlocked", value
    assert fired, "the crash point did not fire"


def test_declared_step_identity_replays_across_drift(tmp_path, redis, pg_url):
    """Fault 6, the declaration: ``identify=("order_id",)`` says which arguments of the step
    identify it. The same drift (a new timestamp) then replays the stored output."""
    value, task_id, fired = crash_run(
        tmp_path,
        redis,
        pg_url,
        "step-completed:charge",
        "faults_app.drift_charge",
        ("d2",),
        {"declared": True},
    )
    assert not isinstance(value, BaseException), f"{type(value).__name__}: {value}"
    store = LedgerStore(pg_url)
    key = key_of("faults_app.drift_charge", task_id)
    (charge,) = [s for s in store.load_steps(key) if s.name == "charge"]
    assert value["charge"] == decode(charge.output)  # the first run's output, its timestamp
    assert effects_of(pg_url, "d2") == {"charge": 1, "receipt": 1}
    assert store.get_entry(key).status is EntryStatus.COMPLETED
    assert store.stats().duplicate_executions == 0
    assert fired, "the crash point did not fire"


def test_reordered_loop_items_replay_their_own_outputs(tmp_path, redis, pg_url):
    """Fault 6 (a guard for its fix): killed after every ``ship`` completed, the resumed
    attempt meets the items in reverse order. Each item must replay its own output, and
    nothing ships twice."""
    marker = tmp_path / "flip"
    value, task_id, fired = crash_run(
        tmp_path,
        redis,
        pg_url,
        "before-settle",
        "faults_app.ship_items",
        ("s1", ["a", "b", "c"], str(marker)),
    )
    assert value == ["shipped:c", "shipped:b", "shipped:a"], value
    for item in "abc":
        assert effects_of(pg_url, f"s1:{item}") == {"ship": 1}
    store = LedgerStore(pg_url)
    assert store.get_entry(key_of("faults_app.ship_items", task_id)).status is (
        EntryStatus.COMPLETED
    )
    assert store.stats().duplicate_executions == 0
    assert fired, "the crash point did not fire"


def test_reordered_declared_loop_items_after_a_partial_run(tmp_path, redis, pg_url):
    """Fault 6: killed after the first item shipped, the resumed attempt meets the items in
    reverse order; with ``identify=("item",)`` the shipped item replays its own output at
    its new position and the others ship once."""
    marker = tmp_path / "flip"
    value, task_id, fired = crash_run(
        tmp_path,
        redis,
        pg_url,
        "step-completed:ship",
        "faults_app.ship_items",
        ("s2", ["a", "b", "c"], str(marker)),
        {"declared": True},
    )
    assert value == ["shipped:c", "shipped:b", "shipped:a"], value
    for item in "abc":
        assert effects_of(pg_url, f"s2:{item}") == {"ship": 1}
    assert LedgerStore(pg_url).stats().duplicate_executions == 0
    assert fired, "the crash point did not fire"


# == fault 7: a publish that failed does not run later ========================================


class RecordingApp:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        self.sent.append(options["task_id"])


def test_failed_publish_leaves_nothing_for_the_sweep_to_send(tmp_path):
    """Fault 7. ``apply_async`` records the publish intent, then the broker refuses the
    publish: the caller gets the error (and may retry under a new task id). The intent must
    not survive it, or the sweep sends the task later and the caller's retry makes it two."""
    from celery_ledger.recovery import run_sweep

    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    producer = create_app(
        "producer7",
        data_dir=tmp_path / "data",
        broker_url="redis://127.0.0.1:1/0",  # nothing listens there: the broker is down
        ledger_url=ledger,
        ledger_publish_intent=True,
        ledger_publish_intent_seconds=0.2,
        task_publish_retry=False,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        broker_connection_timeout=2,
    )

    @producer.task(base=LedgerTask, bind=True, name="faults_app.echo", shared=False)
    def echo(self: Any, tag: str, value: Any) -> None:
        raise AssertionError("the producer never runs the body")

    with pytest.raises(Exception) as info:
        echo.apply_async(("pub-1", 1), task_id="pub-1")
    assert not isinstance(info.value, AssertionError)
    store = LedgerStore(ledger)
    key = key_of("faults_app.echo", "pub-1")
    wait_for(
        lambda: (found := store.peek_status(key)) is None or (found[1] or 0) <= 0,
        timeout=10,
        what="the intent's lease to pass",
    )
    app = RecordingApp()
    run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7)
    assert "pub-1" not in app.sent, (
        f"the sweep sent a task whose publish failed ({type(info.value).__name__}); "
        f"events {event_names(store, key)}"
    )


# == fault 8: record_external_ref inside a step with no intent row ============================


def test_record_external_ref_without_an_intent_row_works_or_says_why(tmp_path):
    """Fault 8. ``record_external_ref`` inside an ``idempotent`` task's step, or inside an
    ``effect=False`` step, has no ``started`` row to write to. It must either store the
    reference or fail the task with a clear usage error, never report "superseded" and leave
    the entry to cycle through lease expiry and resume."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    store = LedgerStore(ledger)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        runs = [
            (tag, task, app.send_task(task, args=(tag,)))
            for tag, task in (
                ("ri-1", "faults_app.ref_idempotent"),
                ("rr-1", "faults_app.ref_read_step"),
            )
        ]
        for tag, task, result in runs:
            key = key_of(task, result.id)
            entry = settles(store, key, timeout=40, what=f"{task}({tag!r})")
            events = event_names(store, key)
            assert "fenced" not in events and "settled" in events, events
            if entry.status is EntryStatus.COMPLETED:
                (row,) = store.load_steps(key)
                assert row.external_ref == f"ref-{tag}", row
            else:
                assert "record_external_ref" in (entry.error or ""), entry.error
            assert sum(effects_of(ledger, tag).values()) <= 1


# == fault 10: eager apply() from two processes on one host ====================================

EAGER = """
import os, sys, time
from celery_ledger import LedgerTask, create_app

ledger, effects, ready = sys.argv[1:4]
app = create_app("eager", data_dir=os.path.join(os.path.dirname(effects), f"data-{os.getpid()}"),
                 ledger_url=ledger)

@app.task(base=LedgerTask, bind=True, name="eager.charge", key_from=("order_id",),
          side_effect="idempotent")
def charge(self, order_id):
    with open(effects, "a") as f:
        f.write(f"{os.getpid()}\\n")
    open(ready, "w").close()
    time.sleep(float(os.environ["HOLD"]))
    return "charged"

result = charge.apply(args=("o-1",))
print(result.state)
"""


def test_eager_apply_from_two_processes_waits_for_the_live_lease(tmp_path):
    """Fault 10. Two processes on one host ``apply()`` the same business key (an idempotent
    task, so nothing stops a second run). Both use the host name as the node and each makes
    its own boot id, so the second took the first's live lease for a previous boot, took it
    over and ran beside it, and the first was fenced out. The contract says WAIT."""
    script = tmp_path / "eager_charge.py"
    script.write_text(EAGER)
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    effects = tmp_path / "effects.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])

    def start(name: str, hold: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(script), ledger, str(effects), str(tmp_path / f"{name}.ready")],
            env={**env, "HOLD": str(hold)},
            stdout=open(tmp_path / f"{name}.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    first = start("first", 6.0)
    second = None
    try:
        wait_for(
            lambda: (tmp_path / "first.ready").exists() or first.poll() is not None,
            timeout=60,
            what="the first apply() to be in its body",
        )
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        second = start("second", 0.0)
        second.wait(timeout=60)
        first.wait(timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    runs = effects.read_text().split()
    first_said = (tmp_path / "first.log").read_text()
    store = LedgerStore(ledger)
    names = event_names(store, entry_key("eager.charge", {"order_id": "o-1"}))
    assert "takeover" not in names, (
        f"the second apply() took over the first's live lease: events {names}; the first "
        f"said {first_said.strip()[-300:]!r}; the body ran {len(runs)} time(s)"
    )
    assert len(runs) == 1, f"the body ran {len(runs)} times on one business key"
    assert first_said.strip().endswith("SUCCESS"), first_said


# == fault 11: SystemExit / KeyboardInterrupt in the body ======================================


@pytest.mark.parametrize("how", ["SystemExit", "KeyboardInterrupt"])
def test_system_exit_in_the_body_leaves_the_entry_for_recovery(tmp_path, redis, pg_url, how):
    """Fault 11. The body raises SystemExit (or KeyboardInterrupt) once, after its first step.
    That is the process going away, not the task failing: the entry must stay for recovery,
    no BaseException may be stored for a later delivery to raise, and the redelivery
    completes the task with the first step replayed."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    marker = tmp_path / "exited"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task("faults_app.exit_once", args=("ex-1", how, str(marker)))
        try:
            value: Any = result.get(timeout=60)
        except Exception as exc:  # noqa: BLE001
            value = exc
    store = LedgerStore(pg_url)
    entry = store.get_entry(key_of("faults_app.exit_once", result.id))
    assert marker.exists(), "the body never raised"
    assert how not in (entry.error or ""), f"stored for good: {entry.status.value} {entry.error}"
    assert value == ["prepare:ex-1", "finish:ex-1"], value
    assert entry.status is EntryStatus.COMPLETED
    assert effects_of(pg_url, "ex-1") == {"prepare": 1, "finish": 1}


# == fault 15: smaller ones =====================================================================


def test_snapshot_over_its_limit_names_its_own_limit(tmp_path, caplog):
    """Fault 15. An argument snapshot over its 16 MiB limit was reported as over
    ``ledger_max_result_bytes``, a setting whose default is 1 MiB and that does not govern it."""
    producer = create_app(
        "producer15",
        data_dir=tmp_path / "data",
        broker_url="memory://",
        ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        ledger_publish_intent=True,
    )

    @producer.task(base=LedgerTask, bind=True, name="faults_app.echo", shared=False)
    def echo(self: Any, tag: str, value: Any) -> None:
        raise AssertionError("the producer never runs the body")

    with caplog.at_level(logging.WARNING, logger="celery_ledger"):
        echo.apply_async(("big", "x" * (16 * 1024 * 1024 + 16)))
    said = [r.getMessage() for r in caplog.records if "snapshot" in r.getMessage()]
    assert said, "nothing said about the snapshot that could not be kept"
    for message in said:
        assert "ledger_max_result_bytes" not in message, message


def test_nested_step_fails_the_task_clearly_and_does_not_block(tmp_path):
    """Fault 15. A step started inside an effect step is a programming error, reported
    clearly; it blocked the entry, and a release re-blocked it. It must fail the task with
    that message instead."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task("faults_app.nested_steps", args=("nest-1",))
        with pytest.raises(Exception, match="do not nest"):
            result.get(timeout=60)
    entry = LedgerStore(ledger).get_entry(key_of("faults_app.nested_steps", result.id))
    assert entry.status is EntryStatus.FAILED, f"{entry.status.value}: {entry.reason}"
    assert "do not nest" in (entry.error or "")
    assert effects_of(ledger, "nest-1") == {}


def test_beat_retries_its_first_sweep_when_the_ledger_is_unavailable(tmp_path, pg_url):
    """Fault 15. ``worker -B`` on SQLite: beat's first sweep failed with "locking protocol"
    and was never tried again. An unavailable ledger at beat's start (here PostgreSQL refusing
    connections) must be retried like any other unavailability; with a long sweep interval,
    only that retry finds the expired entry."""
    store = LedgerStore(pg_url)
    key = entry_key("tests_app.order", {"order_id": "bt-1"})
    store.claim(
        ClaimRequest(
            key=key,
            task_name="tests_app.order",
            task_id="bt-1",
            args_hash="task-id",
            snapshot='{"args":["bt-1",1],"kwargs":{},"queue":null,"ledger_key":null}',
            side_effect="non_idempotent",
            owner=Owner("dead@host", "b0", 1),
            lease_seconds=-1.0,  # expired on the database clock
        )
    )
    store.dispose()
    dbname = pg_url.rsplit("/", 1)[1]
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=pg_url,
        CELERY_LEDGER_SWEEP_INTERVAL="3600",
        CELERY_LEDGER_UNAVAILABLE_BACKOFF="0.5",
        CELERY_LEDGER_UNAVAILABLE_BACKOFF_MAX="2",
    )
    with pg_admin() as admin:
        admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
        end_sessions(admin, dbname)
        try:
            with processes(tmp_path, env) as procs:
                beat = procs.beat()
                beat.wait_log("first sweep", timeout=60)  # it tried, and failed
                admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
                check = LedgerStore(pg_url)
                try:
                    wait_for(
                        lambda: "interrupted" in event_names(check, key),
                        timeout=45,
                        what="beat to retry its first sweep once the ledger is back",
                    )
                finally:
                    check.dispose()
        finally:
            admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')


# == untested today: the ledger_key header, the heartbeat ======================================


def test_ledger_key_header_makes_two_task_ids_one_effect(tmp_path):
    """The ``ledger_key`` message header is a business key for a task without ``key_from``:
    two task ids with one header and the same arguments are one effect; other arguments under
    that header conflict; the snapshot keeps the header, so a resume is keyed the same."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    headers = {"ledger_key": "biz-1"}
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        first = app.send_task("tests_app.slow_effect", args=("hk-1", 0.5), headers=headers)
        second = app.send_task("tests_app.slow_effect", args=("hk-1", 0.5), headers=headers)
        assert first.get(timeout=60) == second.get(timeout=60) == "done:hk-1"
        other = app.send_task("tests_app.slow_effect", args=("hk-1", 0.7), headers=headers)
        with pytest.raises(Exception, match="different arguments"):
            other.get(timeout=60)
    assert first.id != second.id
    assert effects_of(ledger, "hk-1") == {"body": 1}
    store = LedgerStore(ledger)
    key = entry_key("tests_app.slow_effect", "biz-1")
    names = event_names(store, key)
    assert names.count("claimed") == 1 and "returned" in names and "conflict" in names, names
    assert decode(store.get_entry(key).snapshot)["ledger_key"] == "biz-1"


def test_heartbeat_keeps_a_long_attempt_alive(tmp_path):
    """The heartbeat thread alone keeps a body that outlives its lease: with a 1.5 s lease, a
    5 s body and beat sweeping every second, the lease is renewed again and again on the
    database clock, and the attempt is never interrupted or taken over."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=ledger,
        CELERY_LEDGER_LEASE_SECONDS="1.5",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    store = LedgerStore(ledger)
    leases: set[float] = set()
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        procs.beat()
        result = app.send_task("tests_app.steps_then_wait", args=("hb-1", 5.0))
        key = key_of("tests_app.steps_then_wait", result.id)
        deadline = time.monotonic() + 60
        while not result.ready():
            assert time.monotonic() < deadline, "the task did not finish in 60s"
            try:
                entry = store.get_entry(key)
            except KeyError:
                entry = None
            if entry is not None and entry.status is EntryStatus.RUNNING and entry.lease_until:
                leases.add(entry.lease_until)
            time.sleep(0.1)
        assert result.get(timeout=5) == ["a:hb-1", "b:hb-1"]
    assert len(leases) >= 3, f"lease renewed {len(leases) - 1} time(s) in a 5 s body"
    entry = store.get_entry(key)
    names = event_names(store, key)
    assert "interrupted" not in names and "takeover" not in names, names
    assert (entry.status, entry.fence, entry.executions) == (EntryStatus.COMPLETED, 1, 1)


# == guarantees that had no test (docs/guarantees.md) ===========================================


def test_irreversible_step_is_never_rerun_on_a_not_executed_verdict(tmp_path, redis, pg_url):
    """docs/contract.md §2: ``irreversible`` is never auto-retried on ambiguity. Killed between the
    ``started`` row and the call, the resumed attempt asks the reconciler, which answers
    ``not_executed``; an irreversible step still waits for an operator."""
    value, task_id, fired = crash_run(
        tmp_path,
        redis,
        pg_url,
        "step-started:charge",
        "faults_app.irreversible_charge",
        ("irr-1",),
    )
    entry = LedgerStore(pg_url).get_entry(key_of("faults_app.irreversible_charge", task_id))
    assert entry.status is EntryStatus.BLOCKED, entry.status
    assert "irreversible" in (entry.reason or ""), entry.reason
    assert effects_of(pg_url, "irr-1") == {}
    assert type(value).__name__ == "LedgerBlocked", value
    assert fired, "the crash point did not fire"


def test_declared_not_executed_exception_fails_the_task_without_blocking(tmp_path):
    """docs/contract.md §2: a step can declare exceptions that prove non-execution. Raised by
    the step, it records ``not_executed`` and the failure stands: ``failed``, never
    ``blocked``."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=FAULT_TASKS)
        result = app.send_task("faults_app.declared_refusal", args=("nx-1",))
        with pytest.raises(Exception, match="provider refused the connection"):
            result.get(timeout=60)
    store = LedgerStore(ledger)
    key = key_of("faults_app.declared_refusal", result.id)
    assert store.get_entry(key).status is EntryStatus.FAILED
    assert [(s.name, s.status.value) for s in store.load_steps(key)] == [("charge", "not_executed")]
