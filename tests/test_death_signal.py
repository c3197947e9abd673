"""The death-signal gate (design.md § "The death-signal gate"): ``mark-dead``, "seen alive at", and
the release gate.

Store and CLI cases run on SQLite and PostgreSQL, with the ledger built through the store the
way a worker builds it (``test_cli``'s helpers). The SIGSTOP/SIGCONT zombie with real workers
is ``test_a_sigstopped_zombie_blocks_mark_dead_and_the_gate_blocks_a_rerun``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli import NODE, blocked, claim, completed, one_line_error, rows

from celery_ledger.cli.main import main
from celery_ledger.ledger import (
    DeathSignalRequired,
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    MarkDeadRefused,
    OperatorTextError,
    StepStatus,
    Verdict,
)

GRACE = 120.0
LEASE = 60.0


@pytest.fixture
def store(ledger_url: str) -> Iterator[LedgerStore]:
    s = LedgerStore(ledger_url)
    s.now()  # opening migrates: the ledger a worker would have created
    yield s
    s.dispose()


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger_url: str) -> Any:
    """``celery-ledger`` in-process (as in ``test_cli``); the default app in tmp_path."""
    monkeypatch.setenv("CELERY_LEDGER_URL", ledger_url)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CELERY_LEDGER_OPERATOR_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> Any:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, (result.exit_code, result.output)
        return result

    return invoke


def mark(store: LedgerStore, key: str, **kw: Any) -> Any:
    return store.mark_dead(
        key,
        by=kw.pop("by", "ann"),
        reason=kw.pop("reason", "VM destroyed"),
        grace_seconds=kw.pop("grace", GRACE),
        lease_seconds=LEASE,
        **kw,
    )


def zombie_seen(store: LedgerStore, key: str) -> None:
    """The attempt of fence 1 (superseded by a release's bump or a takeover) tried to write."""
    assert store.record_seen_alive(key, 1, owner="celery@zombie", what="heartbeat refused")


# -- the gate -----------------------------------------------------------------------------------


def test_gate_refuses_a_not_executed_release_until_mark_dead(store: LedgerStore) -> None:
    key = blocked(store)
    before = store.get_entry(key)
    with pytest.raises(DeathSignalRequired, match="mark-dead"):
        store.release(key, Verdict.NOT_EXECUTED, by="ann", reason="r", require_death_signal=True)
    assert store.get_entry(key) == before, "a refused release writes nothing"
    # Without the setting, or for a `completed` verdict, there is no gate.
    signal = mark(store, key)
    assert signal.fence == before.fence and signal.overridden == ()
    rel = store.release(key, Verdict.NOT_EXECUTED, by="ann", reason="r", require_death_signal=True)
    assert rel.to_status is EntryStatus.INTERRUPTED and rel.steps_released == ("charge",)
    events = [e.event for e in store.entry_events(key)]
    assert events[-2:] == ["marked-dead", "released"], events


def test_gate_does_not_apply_to_completed_or_to_entries_without_an_ambiguous_step(
    store: LedgerStore,
) -> None:
    key = blocked(store)
    store.release(
        key, Verdict.COMPLETED, by="ann", reason="r", result='"ok"', require_death_signal=True
    )
    # A failed entry whose steps all completed: nothing can run twice.
    c = claim(store)
    ident = ("charge", "h0", 0)
    store.write_step(c.key, c.fence, ident, seq=0, status=StepStatus.STARTED)
    store.write_step(c.key, c.fence, ident, seq=0, status=StepStatus.COMPLETED, output='"x"')
    store.settle(c.key, c.fence, EntryStatus.FAILED, error='"boom"', actor=NODE)
    store.release(c.key, Verdict.NOT_EXECUTED, by="ann", reason="r", require_death_signal=True)


def test_a_mark_dead_older_than_the_ambiguous_step_does_not_open_the_gate(
    store: LedgerStore,
) -> None:
    key = blocked(store)
    mark(store, key)  # covers fence 1
    store.release(key, Verdict.NOT_EXECUTED, by="ann", reason="r", require_death_signal=True)
    # The re-run (fence 2+) starts `charge` again and is lost in its turn: blocked again.
    entry = store.get_entry(key)
    from celery_ledger.ledger import ClaimRequest, Owner

    c = store.claim(
        ClaimRequest(
            key=key,
            task_name=entry.task_name,
            task_id=entry.task_id,
            args_hash="task-id",
            snapshot=entry.snapshot,
            side_effect="non_idempotent",
            owner=Owner(NODE, "boot-2", 4343),
            lease_seconds=60.0,
        )
    )
    ident = ("charge", "h0", 0)
    assert store.write_step(key, c.fence, ident, seq=0, status=StepStatus.STARTED)
    assert store.settle(key, c.fence, EntryStatus.BLOCKED, actor=NODE, reason="again")
    with pytest.raises(DeathSignalRequired, match="covers fences up to 1 only"):
        store.release(key, Verdict.NOT_EXECUTED, by="ann", reason="r", require_death_signal=True)


# -- mark-dead and signs of life ----------------------------------------------------------------


def test_mark_dead_refuses_a_recent_sign_of_life_unless_overridden(store: LedgerStore) -> None:
    key = blocked(store)
    store.release(key, Verdict.COMPLETED, by="x", reason="r", result='"ok"')  # fence moves
    key = blocked(store)
    entry = store.get_entry(key)
    # The current attempt never marks itself seen alive.
    assert not store.record_seen_alive(key, entry.fence, owner="celery@a", what="w")
    # Bump the fence as a takeover would, then the old attempt tries to write.
    store.mark_dead(key, by="x", reason="r", grace_seconds=GRACE, lease_seconds=LEASE)
    store.release(key, Verdict.NOT_EXECUTED, by="x", reason="r")
    zombie_seen(store, key)
    seen = store.get_entry(key)
    assert seen.seen_alive_fence == 1 and seen.seen_alive_owner == "celery@zombie"
    assert seen.seen_alive_at is not None
    with pytest.raises(MarkDeadRefused, match="tried to write 0s ago"):
        mark(store, key)
    assert store.get_entry(key).dead_at == seen.dead_at, "refused: nothing written"
    signal = mark(store, key, override_heartbeat=True)
    assert signal.overridden and "celery@zombie" in signal.overridden[0]
    # Outside the grace window the sign of life no longer refuses.
    mark(store, key, grace=0.0)
    assert "seen-alive" in [e.event for e in store.entry_events(key)]


def test_mark_dead_refuses_while_the_owner_renews(store: LedgerStore) -> None:
    c = claim(store, lease=LEASE)
    with pytest.raises(MarkDeadRefused, match="renewed the lease 0s ago"):
        mark(store, c.key)
    mark(store, c.key, override_heartbeat=True)


def test_mark_dead_bad_input(store: LedgerStore) -> None:
    with pytest.raises(EntryNotFound):
        mark(store, "0" * 64)
    key = blocked(store)
    with pytest.raises(OperatorTextError, match="mark-dead by is required"):
        mark(store, key, by=" ")
    with pytest.raises(OperatorTextError, match="mark-dead reason"):
        mark(store, key, reason="\x1b[2J")
    with pytest.raises(MarkDeadRefused, match="completed"):
        mark(store, completed(store))


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_mark_dead_then_release_under_the_gate(
    cli: Any,
    store: LedgerStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_RELEASE_REQUIRES_DEATH_SIGNAL", "1")
    key = blocked(store)
    refused = cli(
        "release", key, "--verified", "not-executed", "--by", "ann", "--reason", "r", code=1
    )
    one_line_error(refused, "needs a death signal", "mark-dead")
    out = cli("mark-dead", key, "--by", "ann", "--reason", "VM gone", "--json").output
    assert json.loads(out)["dead_fence"] == store.get_entry(key).fence
    shown = cli("show", key).output
    assert "marked dead" in shown and "VM gone" in shown
    out = cli("release", key, "--verified", "not-executed", "--by", "ann", "--reason", "r").output
    assert "re-enqueued" in out, out
    assert store.get_entry(key).released_by == "ann"


@pytest.mark.parametrize(
    "args, words",
    [
        (["0" * 64, "--by", "ann", "--reason", "r"], ["no ledger entry"]),
        (["{key}", "--reason", "r"], ["--by WHO is required"]),
        (["{key}", "--by", "ann"], ["--reason WHY is required"]),
        (["{key}", "--by", "ann", "--reason", "a\x07b"], ["control character"]),
    ],
    ids=["unknown-key", "missing-by", "missing-reason", "control-character"],
)
def test_cli_mark_dead_bad_input_is_one_line_and_writes_nothing(
    cli: Any,
    store: LedgerStore,
    ledger_url: str,
    args: list[str],
    words: list[str],
) -> None:
    key = blocked(store)
    before = rows(ledger_url)
    result = cli("mark-dead", *[a.format(key=key) for a in args], code=1)
    one_line_error(result, *words)
    assert "Traceback" not in result.output
    assert rows(ledger_url) == before


def test_cli_mark_dead_refused_on_a_sign_of_life(cli: Any, store: LedgerStore) -> None:
    key = blocked(store)
    store.mark_dead(key, by="x", reason="r", grace_seconds=GRACE, lease_seconds=LEASE)
    store.release(key, Verdict.NOT_EXECUTED, by="x", reason="r")
    zombie_seen(store, key)
    shown = cli("show", key).output
    assert "seen alive" in shown and "celery@zombie" in shown
    one_line_error(
        cli("mark-dead", key, "--by", "ann", "--reason", "r", code=1),
        "tried to write",
        "--override-heartbeat",
    )
    out = cli("mark-dead", key, "--by", "ann", "--reason", "r", "--override-heartbeat").output
    assert "overridden:" in out


# -- a real zombie ------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.redis
@pytest.mark.postgres
def test_a_sigstopped_zombie_blocks_mark_dead_and_the_gate_blocks_a_rerun(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    """w1 is SIGSTOPped inside ``charge``'s provider call; its lease runs out, the sweep
    interrupts the entry, a resume on w2 finds ``charge`` ambiguous and blocks it. Under
    ``ledger_release_requires_death_signal`` a not-executed release is refused. SIGCONT: w1's
    call lands (the charge happens), its writes are refused, and it leaves "seen alive at";
    ``show`` says so and ``mark-dead`` refuses. Had the release gone through before SIGCONT,
    w2 would have charged a second time."""
    from celery import Celery

    from celery_ledger.ledger import entry_key
    from helpers import effect_counts
    from procs import processes, test_env, wait_for

    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_RELEASE_REQUIRES_DEATH_SIGNAL=1,
    )
    client = Celery("client", broker=redis, backend=redis)
    key = entry_key("tests_app.slow_charge", {"order_id": "z-1"})
    store = LedgerStore(pg_url)
    try:
        with processes(tmp_path, env) as procs:
            w1 = procs.worker("w1", concurrency=1, env={"CELERY_LEDGER_LEASE_SECONDS": "3"})
            client.send_task(
                "tests_app.slow_charge",
                kwargs={"order_id": "z-1", "seconds": 5},
                queue=env["TEST_QUEUE"],
            )

            def charge_started() -> bool:
                try:
                    return any(s.status is StepStatus.STARTED for s in store.load_steps(key))
                except Exception:  # noqa: BLE001 - not claimed yet
                    return False

            wait_for(charge_started, timeout=60, interval=0.1, what="charge started on w1")
            w1.pause()
            wait_for(
                lambda: store.interrupt_expired(actor="sweep"),
                timeout=30,
                interval=0.5,
                what="w1's lease to run out and the sweep to interrupt the entry",
            )
            procs.worker("w2", concurrency=1)

            def ledger(*args: str) -> Any:
                proc = procs.celery(
                    f"ledger-{args[0]}-{len(procs.group.started)}", ["ledger", *args]
                )
                wait_for(lambda: proc.proc.poll() is not None, timeout=60, what=f"ledger {args[0]}")
                return proc

            assert ledger("resume", key).proc.returncode == 0
            wait_for(
                lambda: store.get_entry(key).status is EntryStatus.BLOCKED,
                timeout=60,
                interval=0.3,
                what="w2 to find charge ambiguous and block the entry",
            )
            assert effect_counts(pg_url, "z-1").get(("z-1", "charge"), 0) == 0

            release = ledger(
                "release", key, "--verified", "not-executed", "--by", "ops", "--reason", "r"
            )
            assert release.proc.returncode == 1
            assert "needs a death signal" in release.log_text()
            assert "Traceback" not in release.log_text()

            w1.resume()
            wait_for(
                lambda: store.get_entry(key).seen_alive_at is not None,
                timeout=60,
                interval=0.3,
                what="the woken zombie's refused write recorded as a sign of life",
            )
            entry = store.get_entry(key)
            assert entry.status is EntryStatus.BLOCKED
            assert entry.seen_alive_fence is not None and entry.seen_alive_fence < entry.fence
            assert entry.seen_alive_owner and entry.seen_alive_owner.startswith("w1-")
            wait_for(
                lambda: effect_counts(pg_url, "z-1").get(("z-1", "charge"), 0) == 1,
                timeout=30,
                what="the zombie's provider call to land",
            )
            shown = ledger("show", key)
            assert "seen alive" in shown.log_text() and "w1-" in shown.log_text()
            refused = ledger("mark-dead", key, "--by", "ops", "--reason", "looks dead")
            assert refused.proc.returncode == 1
            assert "tried to write" in refused.log_text()
            assert store.get_entry(key).dead_at is None
            # The operator saw the charge land: the right verdict is `completed`.
            done = ledger(
                "release",
                key,
                "--verified",
                "completed",
                "--result-json",
                '"charge:z-1"',
                "--by",
                "ops",
                "--reason",
                "provider shows the charge",
            )
            assert done.proc.returncode == 0, done.log_tail()
            assert effect_counts(pg_url, "z-1") == {("z-1", "charge"): 1}
    finally:
        store.dispose()


def test_cli_mark_dead_is_gated_by_operator_tokens_like_a_release(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_OPERATOR_TOKENS", "ann-token")
    key = blocked(store)
    before = rows(ledger_url)
    refused = cli("mark-dead", key, "--by", "bob", "--reason", "r", code=1)
    one_line_error(refused, "does not match any operator token", "nothing was marked")
    assert rows(ledger_url) == before and store.get_entry(key).dead_at is None
    cli("mark-dead", key, "--by", "ann-token", "--reason", "r")
    assert store.get_entry(key).dead_by == "ann-token"


# -- the seams' fault 7: a sign of life an interrupt cannot erase, judged by the task's lease ---


def _wait_lease_over(store: LedgerStore, key: str, timeout: float = 10.0) -> None:
    """Poll the database clock until ``key``'s lease ran out (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        found = store.peek_status(key)
        assert found is not None
        if found[1] is None or found[1] < 0:
            return
        assert time.monotonic() < deadline, f"the lease of {key} did not run out in {timeout}s"
        time.sleep(min(max(found[1], 0.01), 0.1))


def test_mark_dead_refuses_a_recent_renewal_after_the_sweep_interrupted_the_entry(
    store: LedgerStore,
) -> None:
    """guarantees.md § "The seams", fault 7. The owner renewed its lease a moment ago; the lease
    then ran out
    and the sweep interrupted the entry (which clears the lease). The renewal is still a sign
    of life inside the grace window: ``mark-dead`` refuses, and writes nothing."""
    c = claim(store, lease=0.3)
    assert store.renew_lease(c.key, c.fence, 0.3)
    _wait_lease_over(store, c.key)
    assert [i.key for i in store.interrupt_expired(actor="sweep")] == [c.key]
    assert store.get_entry(c.key).status is EntryStatus.INTERRUPTED
    with pytest.raises(MarkDeadRefused, match="renewed the lease"):
        mark(store, c.key)
    assert store.get_entry(c.key).dead_at is None, "refused: nothing written"
    signal = mark(store, c.key, override_heartbeat=True)
    assert signal.overridden and "renewed the lease" in signal.overridden[0]


def test_mark_dead_judges_the_grace_by_the_tasks_own_lease(store: LedgerStore) -> None:
    """guarantees.md § "The seams", fault 7. The grace is two leases (``ledger_death_grace_seconds``
    for the global ``ledger_lease_seconds``), and a task may take its own lease. A task with a lease
    six times the global one renews six times less often: a renewal 1.3 s old is recent for
    it under a 1 s grace made for a 0.5 s lease. Its worker's process is gone (the fast path
    interrupted it); ``mark-dead`` still refuses on the renewal, judged by the task's lease."""
    c = claim(store, lease=3.0)
    assert store.renew_lease(c.key, c.fence, 3.0)
    renewed = time.monotonic()
    assert store.interrupt_owner(
        c.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
    )
    while time.monotonic() < renewed + 1.3:  # past the global grace, inside the task's own
        time.sleep(0.05)
    with pytest.raises(MarkDeadRefused, match="renewed the lease"):
        store.mark_dead(c.key, by="ann", reason="r", grace_seconds=1.0, lease_seconds=0.5)
    # Nothing of ann's was written; the death signal is the fast path's own (the worker's
    # parent saw the pool process exit: ``sweeps._death_signal``).
    entry = store.get_entry(c.key)
    assert entry.dead_by == NODE and entry.dead_reason == "pool process lost"
    assert entry.dead_fence == c.fence


def test_mark_dead_does_not_age_a_short_lease_by_the_global_one(store: LedgerStore) -> None:
    """guarantees.md § "The seams", fault 7. A task with a 1 s lease renewed just now, and runs.
    Reading its
    renewal as ``lease_until`` minus the global 60 s lease puts it 59 s in the past, outside a
    30 s grace: ``mark-dead`` must refuse a renewal made this instant."""
    c = claim(store, lease=1.0)
    assert store.renew_lease(c.key, c.fence, 1.0)
    with pytest.raises(MarkDeadRefused, match="renewed the lease 0s ago"):
        store.mark_dead(c.key, by="ann", reason="r", grace_seconds=30.0, lease_seconds=LEASE)


def test_a_lost_attempts_renewal_outlives_the_takeover_that_blocked_the_entry(
    store: LedgerStore,
) -> None:
    """guarantees.md § "The seams", fault 7. Attempt A renewed, then its process was lost
    (interrupted); attempt
    B took the entry over and blocked it at once on A's ambiguous step. A may be paused mid
    call: its renewal still refuses ``mark-dead`` inside the grace. (An attempt that settles
    an entry no attempt lost before, as ``blocked()`` does, leaves no sign: it has ended.)"""
    a = claim(store, lease=LEASE)
    ident = ("charge", "h0", 0)
    assert store.write_step(a.key, a.fence, ident, seq=0, status=StepStatus.STARTED)
    assert store.renew_lease(a.key, a.fence, LEASE)
    assert store.interrupt_owner(
        a.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
    )
    entry = store.get_entry(a.key)
    from celery_ledger.ledger import ClaimRequest, Gate, Owner

    b = store.claim(
        ClaimRequest(
            key=a.key,
            task_name=entry.task_name,
            task_id=entry.task_id,
            args_hash="task-id",
            snapshot=entry.snapshot,
            side_effect="non_idempotent",
            owner=Owner("celery@host-b", "boot-b", 77),
            lease_seconds=LEASE,
        )
    )
    assert b.gate is Gate.TAKEOVER
    assert store.settle(a.key, b.fence, EntryStatus.BLOCKED, actor="celery@host-b", reason="r")
    with pytest.raises(MarkDeadRefused, match="renewed the lease"):
        mark(store, a.key)
    clean = blocked(store)
    assert mark(store, clean).overridden == ()


def test_body_starter_skips_the_takeovers_that_only_waited(store: LedgerStore) -> None:
    """``body_starter``: the last claim that ran a step-less body at once (the first one
    here), and, as its last sign of life, the moment the first takeover after it claimed."""
    from test_cli import claim_same

    first = claim(store, lease=60.0)
    assert store.body_starter(first.key, first.fence) is None  # nothing before it
    store.interrupt_owner(first.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="gone")
    second = claim_same(store, first.key)
    assert second.gate is Gate.TAKEOVER
    # Only the attempt that ran the body came before this one: nothing to skip.
    assert store.body_starter(first.key, second.fence) is None
    store.interrupt_owner(
        first.key, node="celery@b", boot="b", pid=1, actor="celery@b", why="killed waiting"
    )
    third = claim_same(store, first.key)
    starter = store.body_starter(first.key, third.fence)
    assert starter is not None and starter.fence == first.fence
    takeover_at = next(
        e.at
        for e in store.entry_events(first.key)
        if e.event == "takeover" and e.fence == second.fence
    )
    assert starter.last_alive == pytest.approx(takeover_at)
