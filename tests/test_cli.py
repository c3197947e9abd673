"""The operator CLI (docs/operations.md § "Commands"): click's runner, real subprocesses, and the
full story.

Runner tests drive ``celery_ledger.cli.main.main`` in-process against SQLite and PostgreSQL,
with the ledger's state built through the store the way a worker builds it (claim, started step,
external ref, settle). Subprocess tests run the installed ``celery-ledger`` console script and
``celery -A tests_app ledger``. The full story runs a real worker on the embedded default
(filesystem broker): a pool process is SIGKILLed after the ``started`` row of ``charge``; the
redelivery meets a reconciler that answers "unknown" and blocks; an operator finds, reads and
releases it; the charge happens exactly once.

Every "bad input" test checks three things: exit status 1, one line on stderr, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from test_time_store import failed_tombstone

from celery_ledger.cli.main import main
from celery_ledger.codec import decode, encode
from celery_ledger.ledger import (
    RESUME_OWNER,
    Child,
    ClaimRequest,
    EntryStatus,
    LedgerStore,
    Owner,
    StepStatus,
    child_task_id,
    entry_key,
)
from celery_ledger.ledger.engine import make_engine
from helpers import effect_counts
from procs import TESTS, processes, test_env, wait_for

BIN = Path(sys.executable).parent
NODE = "celery@host-a"
ENTRY_ROWS = (
    "SELECT key, status, fence, released_by, result FROM ledger_entries",
    "SELECT key, name, status, fence, authorized FROM ledger_steps",
    "SELECT COUNT(*) FROM ledger_events",
)


# -- building ledger state the way a worker does ----------------------------------------------


def claim(
    store: LedgerStore,
    task: str = "shop.charge",
    *,
    lease: float = 60.0,
    snapshot: bool = True,
    node: str = NODE,
) -> Any:
    task_id = str(uuid.uuid4())
    snap = (
        encode(
            {"args": ["o1"], "kwargs": {}, "queue": None, "ledger_key": None},
            limit=10_000,
            what="snapshot",
        )
        if snapshot
        else None
    )
    return store.claim(
        ClaimRequest(
            key=entry_key(task, task_id),
            task_name=task,
            task_id=task_id,
            args_hash="task-id",
            snapshot=snap,
            side_effect="non_idempotent",
            owner=Owner(node, "boot-1", 4242),
            lease_seconds=lease,
        )
    )


def blocked(store: LedgerStore, *, snapshot: bool = True) -> str:
    """An entry parked on an ambiguous ``charge`` step with external ref ``ch_1``."""
    c = claim(store, snapshot=snapshot)
    ident = ("charge", "h0", 0)
    assert store.write_step(c.key, c.fence, ident, seq=0, status=StepStatus.STARTED)
    assert store.record_external_ref(c.key, c.fence, ident, "ch_1")
    assert store.settle(
        c.key,
        c.fence,
        EntryStatus.BLOCKED,
        actor=NODE,
        reason="step 'charge' may have executed (external ref: ch_1)",
    )
    return str(c.key)


def interrupted(store: LedgerStore, *, snapshot: bool = True) -> str:
    c = claim(store, snapshot=snapshot)
    assert store.interrupt_owner(
        c.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
    )
    return str(c.key)


def expired(store: LedgerStore) -> str:
    return str(claim(store, lease=-1.0).key)  # a negative lease is expired on the db clock


def completed(store: LedgerStore) -> str:
    c = claim(store)
    assert store.settle(c.key, c.fence, EntryStatus.COMPLETED, result='"ok"', actor=NODE)
    return str(c.key)


def rows(url: str) -> list[Any]:
    """Everything the ledger holds, to prove that a refused command wrote nothing."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [sorted(map(tuple, conn.execute(text(q)).all())) for q in ENTRY_ROWS]
    finally:
        engine.dispose()


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def store(ledger_url: str) -> Any:
    s = LedgerStore(ledger_url)
    s.now()  # opening migrates: the ledger a worker would have created
    yield s
    s.dispose()


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger_url: str) -> Any:
    """Invoke ``celery-ledger`` in-process; the default app lives in tmp_path (filesystem
    broker), so a re-enqueue is a file in ``data/broker``."""
    monkeypatch.setenv("CELERY_LEDGER_URL", ledger_url)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    for name in (
        "CELERY_BROKER_URL",
        "CELERY_RESULT_BACKEND",
        "CELERY_LEDGER_OPERATOR_TOKENS",
        "NO_COLOR",
    ):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> Any:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, (result.exit_code, result.output)
        return result

    return invoke


def queued(tmp_path: Path) -> int:
    folder = tmp_path / "data" / "broker"
    return len(list(folder.iterdir())) if folder.exists() else 0


def one_line_error(result: Any, *words: str) -> None:
    err = result.stderr.strip()
    assert err.startswith("Error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err


# -- list / show --------------------------------------------------------------------------------


def test_list_stuck_shows_each_kind_with_its_next_action(cli: Any, store: LedgerStore) -> None:
    keys = {"blocked": blocked(store), "interrupted": interrupted(store), "sweep": expired(store)}
    live, done = str(claim(store).key), completed(store)
    data = json.loads(cli("list", "--stuck", "--json").stdout)
    got = {e["key"]: e for e in data["entries"]}
    assert set(got) == set(keys.values())
    assert got[keys["blocked"]]["next_action"] == "release"
    assert got[keys["interrupted"]]["next_action"] == "resume"
    assert got[keys["sweep"]]["next_action"] == "sweep"
    assert got[keys["sweep"]]["lease_remaining_seconds"] < 0
    for e in got.values():
        assert {"key", "task", "status", "age_seconds", "fence", "owner", "next_command"} <= set(e)
        assert e["next_command"].startswith("celery-ledger ")
    assert got[keys["blocked"]]["owner"] == NODE

    table = cli("list").stdout.splitlines()
    assert table[0].split() == ["KEY", "TASK", "STATUS", "AGE", "FENCE", "OWNER", "NEXT"]
    assert len(table) == 1 + 5 and "\x1b[" not in "".join(table)  # no colour off a TTY
    line = next(t for t in table if t.startswith(keys["blocked"][:12]))
    assert "blocked" in line and "release" in line

    only = json.loads(cli("list", "--status", "completed,running", "--json").stdout)
    assert {e["key"] for e in only["entries"]} == {live, done, keys["sweep"]}
    assert json.loads(cli("list", "--task", "nope", "--json").stdout)["entries"] == []
    assert len(json.loads(cli("list", "--since", "1h", "--json").stdout)["entries"]) == 5
    assert len(json.loads(cli("list", "--limit", "2", "--json").stdout)["entries"]) == 2


def test_show_names_the_ambiguous_step_its_ref_and_the_fix(cli: Any, store: LedgerStore) -> None:
    key = blocked(store)
    out = cli("show", key[:10]).stdout
    assert key in out and "shop.charge" in out and '"args": ["o1"]' in out
    assert "charge" in out and "ch_1" in out and "started (ambiguous)" in out
    assert "claimed" in out and "settled" in out  # the events
    assert f"celery-ledger release {key} --verified not-executed|completed" in out

    entry = store.get_entry(key)
    data = json.loads(cli("show", entry.task_id, "--json").stdout)  # by task id
    assert data["key"] == key and data["snapshot"]["args"] == ["o1"]
    assert data["steps"] == [
        {
            "name": "charge",
            "occurrence": 0,
            "status": "started",
            "external_ref": "ch_1",
            "fence": 1,
            "attempts": 1,
            "authorized": 0,
            "ambiguous": True,
            "started_at": data["steps"][0]["started_at"],
            "completed_at": None,
            "duration_seconds": None,
        }
    ]
    assert [e["event"] for e in data["events"]] == ["claimed", "settled"]


def test_show_redacts_the_canvas_placement_as_the_arguments(
    cli: Any, store: LedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's ``canvas`` (the rest of a chain, callbacks, errbacks) holds other tasks'
    arguments: their secret names are hidden at any depth, and their values scrubbed, in the
    text and in ``--json``."""
    from celery import Celery, signature

    from celery_ledger.codec import encode_snapshot

    monkeypatch.setenv("CELERY_LEDGER_REDACT", "password")
    app = Celery("client", set_as_current=False)
    secrets = ["hunter2-second", "hunter2-callback", "hunter2-third", "hunter2-errback"]
    second = signature(
        "shop.notify", kwargs={"password": secrets[0], "note": "plain-note"}, app=app
    )
    second.link(signature("shop.audit", kwargs={"password": secrets[1]}, app=app))
    third = signature("shop.ship", kwargs={"api": {"password": secrets[2]}}, app=app)
    placement = {
        "chain": [dict(third), dict(second)],  # Celery keeps the chain reversed
        "link_error": [dict(signature("shop.alert", kwargs={"password": secrets[3]}, app=app))],
        "parent_id": "p-1",
        "root_id": "r-1",
    }
    task_id = str(uuid.uuid4())
    snapshot = encode_snapshot(
        ("o1",), {}, queue=None, ledger_key=None, limit=100_000, canvas=placement
    )
    c = store.claim(
        ClaimRequest(
            key=entry_key("shop.charge", task_id),
            task_name="shop.charge",
            task_id=task_id,
            args_hash="task-id",
            snapshot=snapshot,
            side_effect="non_idempotent",
            owner=Owner(NODE, "boot-1", 4242),
            lease_seconds=60.0,
        )
    )
    out = cli("show", c.key).stdout
    raw = cli("show", c.key, "--json").stdout
    for secret in secrets:
        assert secret not in out and secret not in raw, secret
    data = json.loads(raw)
    chain = data["snapshot"]["canvas"]["chain"]
    assert chain[1]["task"] == "shop.notify" and chain[1]["kwargs"]["password"] == "[redacted]"
    assert chain[1]["kwargs"]["note"] == "plain-note"  # only what is secret is hidden
    assert chain[1]["options"]["link"][0]["kwargs"] == {"password": "[redacted]"}
    assert chain[0]["kwargs"] == {"api": {"password": "[redacted]"}}
    assert "shop.notify" in out and "plain-note" in out and "[redacted]" in out


# -- release --------------------------------------------------------------------------------------


def test_release_not_executed_reenqueues_and_is_stamped(
    cli: Any, store: LedgerStore, tmp_path: Path
) -> None:
    key = blocked(store)
    out = cli(
        "release",
        key,
        "--verified",
        "not-executed",
        "--by",
        "alice",
        "--reason",
        "provider has no ch_1",
    ).stdout
    assert "blocked -> interrupted" in out and "re-enqueued" in out and "charge" in out
    entry = store.get_entry(key)
    # The resume CAS took it: running under the resume marker until a worker claims it.
    assert entry.status is EntryStatus.RUNNING and entry.owner == RESUME_OWNER
    assert (entry.released_by, entry.released_reason, entry.released_from) == (
        "alice",
        "provider has no ch_1",
        "blocked",
    )
    assert entry.released_at is not None
    [step] = store.load_steps(key)
    assert step.status is StepStatus.NOT_EXECUTED and step.authorized == 1
    released = [e for e in store.entry_events(key) if e.event == "released"]
    assert len(released) == 1 and released[0].actor == "alice"
    assert queued(tmp_path) == 1


def test_release_is_one_shot(cli: Any, store: LedgerStore, ledger_url: str, tmp_path: Path) -> None:
    key = blocked(store, snapshot=False)  # stays interrupted after the release: no snapshot
    out = cli("release", key, "--verified", "not-executed", "--by", "alice", "--reason", "r1")
    assert "no argument snapshot" in out.stdout
    assert store.get_entry(key).status is EntryStatus.INTERRUPTED
    before = rows(ledger_url)
    again = cli(
        "release", key, "--verified", "not-executed", "--by", "bob", "--reason", "r2", code=1
    )
    one_line_error(again, "released already by alice", "one-shot")
    assert rows(ledger_url) == before and queued(tmp_path) == 0


def test_release_completed_makes_later_deliveries_return_the_result(
    cli: Any, store: LedgerStore, ledger_url: str
) -> None:
    key = blocked(store)
    data = json.loads(
        cli(
            "release",
            key,
            "--verified",
            "completed",
            "--result-json",
            '{"charged": true, "id": "ch_1"}',
            "--by",
            "alice",
            "--reason",
            "provider shows ch_1 captured",
            "--json",
        ).stdout
    )
    assert data["to_status"] == "completed" and data["resume"] is None
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.COMPLETED
    assert decode(entry.result) == {"charged": True, "id": "ch_1"}
    assert [s.status for s in store.load_steps(key)] == [StepStatus.COMPLETED]
    # A later delivery of the same task id returns the stored result.
    again = claim_same(store, key)
    assert again.gate.value == "return" and decode(again.result)["id"] == "ch_1"
    before = rows(ledger_url)
    one_line_error(
        cli(
            "release",
            key,
            "--verified",
            "completed",
            "--result-json",
            "1",
            "--by",
            "bob",
            "--reason",
            "x",
            code=1,
        ),
        "completed",
    )
    assert rows(ledger_url) == before


def claim_same(store: LedgerStore, key: str) -> Any:
    entry = store.get_entry(key)
    return store.claim(
        ClaimRequest(
            key=key,
            task_name=entry.task_name,
            task_id=entry.task_id,
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner("celery@b", "b", 1),
            lease_seconds=60,
        )
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["release", "ffff0000", "--verified", "not-executed", "--by", "a", "--reason", "r"],
            ["no ledger entry matches 'ffff0000'"],
        ),
        (
            [
                "release",
                "{key}",
                "--verified",
                "completed",
                "--result-json",
                "{not json",
                "--by",
                "a",
                "--reason",
                "r",
            ],
            ["--result-json is not valid JSON"],
        ),
        (
            [
                "release",
                "{key}",
                "--verified",
                "completed",
                "--result-json",
                "NaN",
                "--by",
                "a",
                "--reason",
                "r",
            ],
            ["--result-json is not valid JSON"],
        ),
        (
            ["release", "{key}", "--verified", "maybe", "--by", "a", "--reason", "r"],
            ["--verified must be 'completed' or 'not-executed', not 'maybe'"],
        ),
        (["release", "{key}", "--verified", "not-executed", "--reason", "r"], ["--by WHO"]),
        (["release", "{key}", "--verified", "not-executed", "--by", "a"], ["--reason WHY"]),
        (
            ["release", "{key}", "--verified", "completed", "--by", "a", "--reason", "r"],
            ["needs --result-json"],
        ),
        (
            ["release", "{live}", "--verified", "not-executed", "--by", "a", "--reason", "r"],
            ["live lease"],
        ),
        (
            [
                "release",
                "{done}",
                "--verified",
                "completed",
                "--result-json",
                "1",
                "--by",
                "a",
                "--reason",
                "r",
            ],
            ["is completed"],
        ),
        (["show", "nope-nope"], ["no ledger entry matches"]),
        (["resume", "{key}"], ["is blocked, not interrupted", "release"]),
        (["list", "--status", "stuck"], ["unknown status 'stuck'"]),
        (["list", "--since", "yesterday"], ["--since 'yesterday'"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    cli: Any, store: LedgerStore, ledger_url: str, tmp_path: Path, args: list[str], words: list[str]
) -> None:
    names = {"key": blocked(store), "live": str(claim(store).key), "done": completed(store)}
    before = rows(ledger_url)
    result = cli(*[names.get(a.strip("{}"), a) for a in args], code=1)
    one_line_error(result, *words)
    assert rows(ledger_url) == before and queued(tmp_path) == 0


def test_operator_tokens_gate_release_before_any_write(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_OPERATOR_TOKENS", "tok-alice, tok-bob")
    key = blocked(store)
    before = rows(ledger_url)
    for by in ("mallory", "tok-alice2", "tok"):
        one_line_error(
            cli("release", key, "--verified", "not-executed", "--by", by, "--reason", "r", code=1),
            "does not match any operator token",
        )
    one_line_error(
        cli("release", key, "--verified", "not-executed", "--reason", "r", code=1), "--by WHO"
    )
    assert rows(ledger_url) == before
    cli("release", key, "--verified", "not-executed", "--by", "tok-bob", "--reason", "ok")
    assert store.get_entry(key).released_by == "tok-bob"


# -- resume / sweep / stats -------------------------------------------------------------------


def test_resume_reenqueues_an_interrupted_entry(
    cli: Any, store: LedgerStore, tmp_path: Path
) -> None:
    key = interrupted(store)
    out = cli("resume", key[:12]).stdout
    assert f"re-enqueued {key}" in out
    assert store.get_entry(key).owner == RESUME_OWNER and queued(tmp_path) == 1
    one_line_error(cli("resume", key, code=1), "is running, not interrupted")
    bare = interrupted(store, snapshot=False)
    one_line_error(cli("resume", bare, code=1), "no argument snapshot")
    assert queued(tmp_path) == 1


def test_sweep_interrupts_expired_leases_and_resumes_them(
    cli: Any, store: LedgerStore, tmp_path: Path
) -> None:
    key = expired(store)
    report = json.loads(cli("sweep", "--json").stdout)
    assert report["interrupted"] == 1 and report["resumed"] == 1
    assert report["resumed_keys"] == [key] and queued(tmp_path) == 1
    assert "interrupted" in cli("sweep").stdout  # human report, nothing left to do
    assert store.get_entry(key).owner == RESUME_OWNER


def test_stats_counts_and_duplicate_rate(cli: Any, store: LedgerStore) -> None:
    blocked(store), interrupted(store), completed(store), completed(store)
    data = json.loads(cli("stats", "--json").stdout)
    assert data["by_status"]["completed"] == 2 and data["blocked"] == 1
    assert data["by_status"]["interrupted"] == 1
    assert data["duplicate_execution_rate"] == 0.0 and data["entries"] == 4
    assert {"task": "shop.charge", "status": "blocked", "count": 1} in data["by_task"]
    out = cli("stats").stdout
    assert "duplicate rate  0.0000 (target 0.0)" in out


# -- doctor / migrate / schema / connection ----------------------------------------------------


def test_doctor_passes_on_the_embedded_default(
    cli: Any, store: LedgerStore, ledger_url: str
) -> None:
    data = json.loads(cli("doctor", "--json").stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert set(checks) == {
        "schema",
        "backend",
        "pooler",
        "connections",
        "visibility",
        "hold",
        "rabbitmq",
        "acks",
        "chords",
        "beat",
        "backlog",
        "slot waits",
        "consumer",
        "reconcilers",
        "secrets",
    }
    assert data["ok"] is True and checks["schema"]["status"] == "PASS"
    assert checks["backlog"]["status"] == "PASS", checks["backlog"]
    assert checks["slot waits"]["status"] == "PASS", checks["slot waits"]
    assert checks["beat"]["status"] == "PASS" and "celery-ledger-sweep" in checks["beat"]["reason"]
    out = cli("doctor").stdout
    assert out.splitlines()[0].split() == ["CHECK", "RESULT", "WHY"]


def test_doctor_warns_about_redis_visibility_and_sqlite_with_a_network_broker(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read-only: doctor never connects to this broker.
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
    monkeypatch.setenv("CELERY_LEDGER_LEASE_SECONDS", "7200")
    monkeypatch.setenv("CELERY_RESULT_BACKEND", "cache+memory://")
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json").stdout)["checks"]}
    assert checks["visibility"]["status"] == "WARN"
    assert "lease 7200s > visibility_timeout 3600s" in checks["visibility"]["reason"]
    assert "WAIT gate" in checks["visibility"]["reason"]
    assert checks["hold"]["status"] == "PASS", checks["hold"]
    expected = "WARN" if ledger_url.startswith("sqlite") else "PASS"
    assert checks["backend"]["status"] == expected


def test_doctor_warns_about_chord_counting_before_celery_5_7(
    cli: Any, store: LedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import celery

    monkeypatch.setenv("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/15")  # never connected
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json").stdout)["checks"]}
    assert checks["chords"]["status"] == "PASS"
    assert checks["chords"]["reason"].startswith(f"Celery {celery.__version__}")
    monkeypatch.setattr(celery, "VERSION", (5, 5, 3, "", ""))
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json").stdout)["checks"]}
    assert checks["chords"]["status"] == "WARN"
    assert "counts a chord member once per delivery" in checks["chords"]["reason"]


def test_doctor_warns_when_the_hold_threshold_reaches_the_visibility_timeout(
    cli: Any, store: LedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """design.md § "Durable time": a countdown below the hold threshold waits unacked in a
    worker."""
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
    monkeypatch.setenv("CELERY_RESULT_BACKEND", "cache+memory://")
    monkeypatch.setenv("CELERY_LEDGER_HOLD_THRESHOLD_SECONDS", "7200")
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json").stdout)["checks"]}
    assert checks["hold"]["status"] == "WARN"
    assert "7200s >= visibility_timeout 3600s" in checks["hold"]["reason"]


def test_schema_newer_than_the_code_is_refused_everywhere(
    cli: Any, store: LedgerStore, ledger_url: str
) -> None:
    engine = make_engine(ledger_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE ledger_alembic_version SET version_num = 'f00d'"))
    engine.dispose()
    store.dispose()
    before = rows(ledger_url)
    for args in (
        ["list"],
        ["show", "abc"],
        ["migrate"],
        ["migrate", "--plan"],
        ["release", "abc", "--verified", "not-executed", "--by", "a", "--reason", "r"],
    ):
        one_line_error(cli(*args, code=1), "'f00d' is newer than this celery-ledger")
    doctor = json.loads(cli("doctor", "--json", code=1).stdout)
    assert doctor["ok"] is False and doctor["checks"][0]["status"] == "FAIL"
    assert rows(ledger_url) == before


def test_a_url_that_does_not_connect_is_one_line(cli: Any, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ledger.sqlite3"
    for url, words in (
        (f"sqlite:///{missing}", ["no ledger database at"]),
        ("postgresql://postgres@127.0.0.1:1/none", ["unavailable", "Connection refused"]),
    ):
        for args in (["list"], ["stats"], ["migrate", "--plan"]):
            one_line_error(cli("--url", url, *args, code=1), *words)
    assert not missing.exists() and not missing.parent.exists()  # nothing created


def test_migrate_plan_changes_nothing_then_migrate_applies(cli: Any, pg_url: str) -> None:
    plan = json.loads(cli("--url", pg_url, "migrate", "--plan", "--json").stdout)
    assert plan["current"] is None and plan["pending"][-1] == plan["head"] == "0012_rate_limits"
    said = cli("--url", pg_url, "migrate", "--plan").stdout
    assert "no ledger schema yet" in said
    assert (
        "12 pending: 0001, 0002, 0003_operators, 0004_time, 0005_outbox, 0006_canvas, "
        "0007_events_index, 0008_renewed_at, 0009_outbox_errors, 0010_signals, "
        "0011_concurrency, 0012_rate_limits" in said
    )
    engine = make_engine(pg_url)
    with engine.connect() as conn:
        assert not conn.dialect.has_table(conn, "ledger_entries")
    engine.dispose()
    one_line_error(cli("--url", pg_url, "list", code=1), "celery-ledger migrate")
    assert "applied" in cli("--url", pg_url, "migrate").stdout
    assert "nothing to do" in cli("--url", pg_url, "migrate", "--plan").stdout
    assert cli("--url", pg_url, "list").stdout.strip() == "no entries"


# -- real subprocesses -------------------------------------------------------------------------


def run(args: list[str], env: dict[str, str], *, code: int = 0) -> subprocess.CompletedProcess:
    """``celery-ledger ...`` or ``celery -A tests_app ledger ...`` as a real process."""
    full = {**os.environ, **env, "PYTHONPATH": str(TESTS)}
    proc = subprocess.run(args, env=full, cwd=TESTS, capture_output=True, text=True, timeout=90)
    assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def ledger_cli(*args: str) -> list[str]:
    return [str(BIN / "celery-ledger"), *args]


def celery_cli(*args: str) -> list[str]:
    return [str(BIN / "celery"), "-A", "tests_app", "ledger", *args]


def test_both_installations_share_the_commands(
    tmp_path: Path, store: LedgerStore, ledger_url: str
) -> None:
    key = blocked(store)
    env = test_env(tmp_path, broker=None, ledger_url=ledger_url)
    for cmd in (ledger_cli, celery_cli):
        helptext = run(cmd("--help"), env).stdout
        for name in ("list", "show", "release", "resume", "sweep", "stats", "doctor", "migrate"):
            assert f"  {name}" in helptext
        stuck = json.loads(run(cmd("list", "--stuck", "--json"), env).stdout)
        assert [e["key"] for e in stuck["entries"]] == [key]
    shown = run(celery_cli("show", key[:12]), env).stdout
    assert f"celery -A tests_app ledger release {key}" in shown
    err = run(ledger_cli("show", "zzzz"), env, code=1).stderr
    assert err.strip() == "Error: no ledger entry matches 'zzzz' (a key, a key prefix or a task id)"
    doctor = json.loads(run(celery_cli("doctor", "--json"), env).stdout)
    rec = next(c for c in doctor["checks"] if c["name"] == "reconcilers")
    # tests_app.order charges without a reconciler; tests_app.reconciled has one.
    assert rec["status"] == "WARN" and "tests_app.order" in rec["reason"]
    assert "tests_app.reconciled" not in rec["reason"]


def test_release_of_a_tombstone_is_refused_in_one_line(
    tmp_path: Path, store: LedgerStore, ledger_url: str
) -> None:
    """guarantees.md § "The seams", fault 10: ``celery-ledger release`` of a failed entry retention
    pruned to a tombstone
    (its completed step forgotten) exits 1 with one line that says why, no traceback, and
    writes nothing: a re-run could repeat the forgotten step's effect."""
    failed_tombstone(store, "k-tomb")
    env = test_env(tmp_path, broker=None, ledger_url=ledger_url)
    before = rows(ledger_url)
    for verdict in (["not-executed"], ["completed", "--result-json", "1"]):
        proc = run(
            ledger_cli("release", "k-tomb", "--verified", *verdict, "--by", "al", "--reason", "r"),
            env,
            code=1,
        )
        err = proc.stderr.strip()
        assert "Traceback" not in proc.stderr, proc.stderr
        assert err.startswith("Error: ") and "\n" not in err, err
        assert "tombstone" in err and "completed effect" in err, err
    assert rows(ledger_url) == before and queued(tmp_path) == 0


@pytest.mark.processes
def test_full_story_blocked_found_shown_released_runs_once(tmp_path: Path, ledger_url: str) -> None:
    """A real worker dies after `charge` started; the operator resolves it; charge runs once."""
    order = f"o-{uuid.uuid4().hex[:6]}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger_url)
    crash = {
        "CELERY_LEDGER_CRASH_AT": "step-started:charge",
        "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash"),
    }
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, env=crash)
        sent = run(
            [
                str(BIN / "celery"),
                "-A",
                "tests_app",
                "call",
                "tests_app.reconciled",
                "--kwargs",
                json.dumps({"order_id": order, "answer": "unknown"}),
            ],
            env,
        )
        task_id = sent.stdout.strip().splitlines()[-1]
        key = entry_key("tests_app.reconciled", task_id)
        store = LedgerStore(ledger_url, migrate=False)
        try:

            def status() -> EntryStatus | None:
                try:
                    return store.get_entry(key).status
                except Exception:  # noqa: BLE001 - not claimed yet
                    return None

            # Pool process SIGKILLed -> interrupted (worker-lost fast path) -> redelivered ->
            # takeover -> the reconciler answers unknown -> blocked.
            wait_for(lambda: status() is EntryStatus.BLOCKED, timeout=90, what="blocked entry")
            # The crash point fired: its once-marker is made just before the SIGKILL, and the
            # worker's parent saw its pool process die of that signal ("lost" alone would
            # match any log line that says so).
            marker = tmp_path / "crash.step-started_charge"
            assert marker.exists(), "the crash point step-started:charge was never reached"
            assert "SIGKILL" in worker.log_text(), "no pool process died of SIGKILL"
            events = [e.event for e in store.entry_events(key)]
            assert "interrupted" in events and "takeover" in events
            assert effect_counts(ledger_url, order) == {}

            stuck = json.loads(run(ledger_cli("list", "--stuck", "--json"), env).stdout)
            [row] = stuck["entries"]
            assert (row["key"], row["status"], row["next_action"]) == (key, "blocked", "release")

            shown = run(celery_cli("show", task_id), env).stdout
            # The crash point fires after the `started` row and before the body, so the body
            # never reached record_external_ref: the step has no ref, and show says so.
            assert "started (ambiguous)" in shown and "external ref: none" in shown
            data = json.loads(run(celery_cli("show", task_id, "--json"), env).stdout)
            assert [(s["name"], s["status"], s["external_ref"]) for s in data["steps"]] == [
                ("charge", "started", None)
            ]
            assert "provider cannot tell" in shown
            assert f"celery -A tests_app ledger release {key}" in shown

            out = run(
                ledger_cli(
                    "release",
                    key[:16],
                    "--verified",
                    "not-executed",
                    "--by",
                    "alice",
                    "--reason",
                    f"no charge {order} at the provider",
                ),
                env,
            ).stdout
            assert "re-enqueued" in out
            wait_for(
                lambda: status() is EntryStatus.COMPLETED,
                timeout=90,
                what="completed after release",
            )
            assert effect_counts(ledger_url, order) == {(order, "charge"): 1, (order, "receipt"): 1}
            stats = json.loads(run(celery_cli("stats", "--json"), env).stdout)
            assert stats["duplicate_execution_rate"] == 0.0
            assert stats["duplicate_executions"] == 0 and stats["by_status"]["completed"] == 1
            err = run(
                ledger_cli(
                    "release", key, "--verified", "not-executed", "--by", "bob", "--reason", "again"
                ),
                env,
                code=1,
            ).stderr
            assert "is completed" in err and err.count("\n") == 1
        finally:
            store.dispose()
    assert effect_counts(ledger_url, order) == {(order, "charge"): 1, (order, "receipt"): 1}


def test_show_lists_children_and_the_child_names_its_parent(cli: Any, store: LedgerStore) -> None:
    """The outbox in ``show``: a parent's children (sent / pending), navigable by
    their task ids, and a child's parent."""
    parent = claim(store, "shop.parent")
    sent, pending = (
        Child(child_task_id(parent.key, "notify", 0, n), "shop.child", '{"args": []}', n)
        for n in (0, 1)
    )
    assert store.complete_step(
        parent.key, parent.fence, ("notify", "h", 0), seq=1, output="1", children=[sent, pending]
    )
    store.mark_published([sent.child_id])
    out = cli("show", parent.key).stdout
    assert "children" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "sent" in lines[sent.child_id] and "pending" in lines[pending.child_id]
    data = json.loads(cli("show", parent.key, "--json").stdout)
    assert [(c["child_id"], c["state"]) for c in data["children"]] == [
        (sent.child_id, "sent"),
        (pending.child_id, "pending"),
    ]
    assert data["parent"] is None
    # The child's own entry (keyed by its task id) names its parent.
    store.claim(
        ClaimRequest(
            key=entry_key("shop.child", sent.child_id),
            task_name="shop.child",
            task_id=sent.child_id,
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner(NODE, "boot-1", 4242),
            lease_seconds=60.0,
        )
    )
    shown = cli("show", sent.child_id).stdout
    assert "parent" in shown and parent.key in shown and "notify #0" in shown
    as_json = json.loads(cli("show", sent.child_id, "--json").stdout)
    assert as_json["parent"] == {"key": parent.key, "step": "notify", "occurrence": 0}
