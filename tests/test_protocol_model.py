"""The protocol, checked by a model: a Hypothesis state machine over the store (SQLite and
PostgreSQL, the ``ledger_url`` fixture: one fresh database per backend, emptied per example).

Simulated workers (each a distinct ``Owner``) drive random interleavings of what the runtime,
recovery and operators do to a few keys: publish (``record_intent``), schedule, deliveries and
their claims, an attempt's effect steps (``started`` then ``completed``, fenced), crashes (an
attempt simply stops writing), lease renewals, retries, the sweep (``interrupt_expired``, the
crash-loop screen, ``begin_resume``, ``begin_resend``), the waker (``list_due`` +
``begin_wake``), cancellation (``request_cancel`` + ``finish_cancelled``), deadlines,
operator ``release`` and ``mark_dead``, and retention's prune to a tombstone.

Where a decision lives in the runtime (``worker/``, which imports Celery), the model's worker
follows the same rule, written down in ``_Attempt``: the ambiguity rule of
``worker/ambiguity.py`` (a non-idempotent step that started and never completed is decided by a
reconciler's verdict, else the entry blocks) and the explanation of a refused start
(``timing.explain_refusal``). The recovery decoder (``recovery.handoff.read_snapshot``) is
called as it is: it needs no Celery.

Time is a fake clock. The store reads the database clock, so "d seconds pass" is every stored
time of the model's rows moved back by d (``_shift``): exactly what the clock advancing looks
like to the store. Absolute times held outside the database (a message's deadline header) move
back with them.

``CELERY_LEDGER_MODEL_EXAMPLES`` raises the number of examples for a long run, and
``CELERY_LEDGER_MODEL_TIMEOUT`` its timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from celery_ledger.ledger import (
    ArgumentSnapshot,
    ClaimRequest,
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    Owner,
    ReleaseRefused,
    StepStatus,
    Verdict,
)
from celery_ledger.ledger.errors import DeathSignalRequired, MarkDeadRefused
from celery_ledger.ledger.operator import BODY_STEP
from celery_ledger.ledger.schedule import PRUNED_FAILURE, cancelled_failure
from celery_ledger.recovery.handoff import read_snapshot

pytestmark = pytest.mark.model

#: Examples per backend: bounded for CI (well under a minute each); the environment variable
#: raises it for a long run.
EXAMPLES = int(os.environ.get("CELERY_LEDGER_MODEL_EXAMPLES", "60"))
#: The test's own timeout (seconds): room to shrink a counterexample; a long run raises it.
TIMEOUT = int(os.environ.get("CELERY_LEDGER_MODEL_TIMEOUT", "900"))
STEPS_PER_EXAMPLE = int(os.environ.get("CELERY_LEDGER_MODEL_STEPS", "40"))

KEYS = ("k0", "k1", "k2")
#: The task's deadline option (``deadline``: seconds after the entry was created), per key.
TASK_DEADLINE = {"k0": 40.0, "k1": None, "k2": None}
WORKERS = (
    Owner("w0@host", "boot-0", 100),
    Owner("w1@host", "boot-1", 101),
    Owner("w2@host", "boot-2", 102),
)
#: The task's effect steps, in body order (non_idempotent: each writes ``started`` first).
STEPS = (("charge", "ih-charge", 0), ("ship", "ih-ship", 0))
BODY_IDENT = (BODY_STEP, "", 0)
SIDE_EFFECT = "non_idempotent"
LEASE = 10.0
RETRY_DUE = 5.0
MAX_RESUMES = 2
CANCEL_ERROR = cancelled_failure("cancelled by the model")

#: Every time column of the model's rows: what the database clock advancing moves relative to.
ENTRY_TIMES = (
    "lease_until",
    "created_at",
    "updated_at",
    "settled_at",
    "released_at",
    "due_at",
    "dead_at",
    "seen_alive_at",
    "cancel_requested_at",
    "deadline_at",
    "tombstone_at",
)


def _shift(store: LedgerStore, seconds: float) -> None:
    """``seconds`` pass on the database clock: every stored time moves back by that much."""
    sets = ", ".join(f"{c} = {c} - :d" for c in ENTRY_TIMES)
    with store.engine.begin() as conn:
        conn.execute(text(f"UPDATE ledger_entries SET {sets}"), {"d": seconds})
        conn.execute(
            text(
                "UPDATE ledger_steps SET started_at = started_at - :d, "
                "completed_at = completed_at - :d"
            ),
            {"d": seconds},
        )
        conn.execute(text("UPDATE ledger_events SET at = at - :d"), {"d": seconds})


def _empty(store: LedgerStore) -> None:
    with store.engine.begin() as conn:
        for table in ("ledger_outbox", "ledger_steps", "ledger_events", "ledger_entries"):
            conn.execute(text(f"DELETE FROM {table}"))


def _snapshot(key: str) -> str:
    return json.dumps(ArgumentSnapshot(args=(key,), queue="q").as_data())


def _request(key: str, owner: Owner, task_id: str) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="model.charge",
        task_id=task_id,
        args_hash=f"args-{key}",
        snapshot=_snapshot(key),
        side_effect=SIDE_EFFECT,
        owner=owner,
        lease_seconds=LEASE,
        max_interruptions=MAX_RESUMES,
    )


@dataclass
class _Attempt:
    """One attempt a simulated worker runs: its fence, where its body is, what it replays."""

    key: str
    fence: int
    owner: Owner
    replay: dict[tuple[str, str, int], StepStatus]
    #: Index into ``STEPS`` of the next step; ``in_step``: its ``started`` row is written and
    #: its effect may be running.
    index: int = 0
    in_step: bool = False


@dataclass
class _History:
    """What the model saw of one key (its identity's whole life: nothing here is deleted)."""

    #: (step identity) -> ``started`` writes that succeeded (an attempt may then run it).
    starts: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    #: (step identity) -> authorizing verdicts recorded (reconciler or release not_executed).
    authorized: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    fence: int = 0
    deadline: float | None = None
    #: The absolute deadline its messages carry (``expires``/``ledger_deadline`` header), held
    #: outside the database: it moves with the fake clock too.
    header_deadline: float | None = None


class ProtocolModel(RuleBasedStateMachine):
    url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.store = LedgerStore(self.url)
        _empty(self.store)
        self.history = {k: _History() for k in KEYS}
        self.attempts: list[_Attempt] = []
        self.deliveries = 0

    def teardown(self) -> None:
        RUNS["examples"] += 1
        RUNS["deliveries"] += self.deliveries
        self.store.dispose()

    # -- reading the store ------------------------------------------------------------------

    def entry(self, key: str) -> Any:
        try:
            return self.store.get_entry(key)
        except EntryNotFound:
            return None

    def deadline_passed(self, row: Any) -> bool:
        return row is not None and row.deadline_at is not None and row.deadline_at <= self.now()

    def now(self) -> float:
        return self.store.now()

    # -- publish, schedule, deliver ---------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), header=st.sampled_from([None, 8.0, 60.0]))
    def publish(self, key: str, header: float | None) -> None:
        """A producer's publish: the intent is recorded before the message is sent."""
        if self.store.record_intent(_request(key, WORKERS[0], f"t-{key}")) and header:
            self.history[key].header_deadline = self.now() + header

    @rule(
        key=st.sampled_from(KEYS),
        due_in=st.sampled_from([3.0, 20.0]),
        deadline=st.sampled_from([None, 10.0, 50.0]),
    )
    def schedule(self, key: str, due_in: float, deadline: float | None) -> None:
        """A long countdown held by the ledger, maybe with an absolute deadline."""
        at = None if deadline is None else self.now() + deadline
        if self.store.schedule(
            _request(key, WORKERS[0], f"t-{key}"), due_in=due_in, deadline_at=at
        ):
            self.history[key].header_deadline = at

    @rule(
        worker=st.sampled_from(WORKERS),
        key=st.sampled_from(KEYS),
        carries_header=st.booleans(),
        data=st.data(),
    )
    def deliver(self, worker: Owner, key: str, carries_header: bool, data: st.DataObject) -> None:
        """A delivery of ``key`` reaches ``worker`` (the first message, a redelivery, a retry's,
        a re-send: the claim tells them apart) and the runtime acts on its claim."""
        before = self.entry(key)
        cancel_recorded = before is not None and before.cancel_requested_at is not None
        deadline_passed = self.deadline_passed(before)
        self.deliveries += 1
        # The claim is the admission gate (``ledger.admission``): it carries the delivery's
        # deadline (the header, the task's option) and refuses a cancelled or expired one.
        hist = self.history[key]
        request = dataclasses.replace(
            _request(key, worker, f"t-{key}"),
            deadline_at=hist.header_deadline if carries_header else None,
            deadline_after=TASK_DEADLINE[key],
        )
        claim = self.store.claim(request)
        if claim.gate not in (Gate.RUN, Gate.TAKEOVER):
            return
        # Invariant: nothing starts after a recorded cancellation. A claim that answers RUN or
        # TAKEOVER lets a body start, so it may not answer so once ``cancel_requested_at`` is
        # set (the retry of an attempt that was asked to cancel must not run).
        assert not cancel_recorded, (
            f"{key}: claim answered {claim.gate.value} at fence {claim.fence} after a recorded "
            f"cancellation (found {claim.found})"
        )
        attempt = _Attempt(key, claim.fence, worker, {r.ident: r.status for r in claim.steps})
        if not self._before_body(attempt, claim, data):
            return
        # Invariant: nothing starts after a passed deadline. The claim is where an attempt
        # decides to start its body: a deadline that had passed before this claim must stop
        # it there.
        assert not deadline_passed, (
            f"{key}: attempt at fence {claim.fence} went into its body although the stored "
            f"deadline had passed before its claim (deadline now "
            f"{self.entry(key).deadline_at}, previously {before.deadline_at})"
        )
        self.attempts.append(attempt)

    def _before_body(self, attempt: _Attempt, claim: Any, data: st.DataObject) -> bool:
        """``Ambiguity.before_body``: every started, never completed step of a non-idempotent
        task is decided by its reconciler (completed / not_executed / unknown); unknown blocks.
        A takeover of a body that recorded no steps treats the body itself as ambiguous.
        Returns whether the body runs."""
        if claim.gate is not Gate.TAKEOVER and not claim.steps:
            return True
        real = [r for r in claim.steps if r.name != BODY_STEP]
        for row in real:
            if row.status is StepStatus.STARTED and not self._resolve(attempt, row.ident, data):
                return False
        if real:
            return True
        body = attempt.replay.get(BODY_IDENT)
        if (
            claim.gate is Gate.TAKEOVER
            and claim.executions >= 1
            and body in (None, StepStatus.STARTED)
        ):
            if not self._resolve(attempt, BODY_IDENT, data):
                return False
            body = attempt.replay.get(BODY_IDENT)
        if body is StepStatus.NOT_EXECUTED:
            # The one authorized re-run of the body records its intent (``start_body``).
            return self._start(attempt, BODY_IDENT)
        return True

    def _resolve(self, attempt: _Attempt, ident: tuple[str, str, int], data: st.DataObject) -> bool:
        verdict = data.draw(st.sampled_from(list(Verdict)), label=f"reconciler {ident[0]}")
        key, fence = attempt.key, attempt.fence
        if verdict is Verdict.COMPLETED:
            ok = self.store.write_step(
                key, fence, ident, seq=0, status=StepStatus.COMPLETED, output="1"
            )
        elif verdict is Verdict.NOT_EXECUTED:
            ok = self.store.write_step(key, fence, ident, seq=0, status=StepStatus.NOT_EXECUTED)
            if ok:
                self.history[key].authorized[ident] += 1
        else:
            reason = (
                f"step {ident[0]!r} may have executed (reconciler: unknown); reconcile or "
                f"release: celery-ledger show {key}"
            )
            self.store.settle(key, fence, EntryStatus.BLOCKED, reason=reason)
            return False
        if not ok:
            return False  # fenced: this attempt stops
        attempt.replay[ident] = StepStatus(verdict.value)
        return True

    # -- an attempt's body ------------------------------------------------------------------

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """The attempt's next move in its body: start the next effect step (replayed if its
        row completed), or complete the one it started, or settle when none is left."""
        attempt = data.draw(st.sampled_from(self.attempts), label="attempt")
        if attempt.in_step:
            ident = STEPS[attempt.index]
            ok = self.store.write_step(
                attempt.key,
                attempt.fence,
                ident,
                seq=attempt.index,
                status=StepStatus.COMPLETED,
                output="1",
            )
            if not ok:
                self.attempts.remove(attempt)  # fenced: the effect ran, the record is refused
                return
            attempt.in_step = False
            attempt.index += 1
            return
        while (
            attempt.index < len(STEPS)
            and attempt.replay.get(STEPS[attempt.index]) is StepStatus.COMPLETED
        ):
            attempt.index += 1  # replayed
        if attempt.index == len(STEPS):
            self.store.settle(attempt.key, attempt.fence, EntryStatus.COMPLETED, result="1")
            self.attempts.remove(attempt)
            return
        if not self._start(attempt, STEPS[attempt.index]):
            self.attempts.remove(attempt)
            return
        attempt.in_step = True

    def _start(self, attempt: _Attempt, ident: tuple[str, str, int]) -> bool:
        """Write the ``started`` row of ``ident``; on a refusal, explain it
        (``timing.explain_refusal``) and settle cancelled/expired. Returns whether it runs."""
        key, hist = attempt.key, self.history[attempt.key]
        before = self.entry(key)
        ok = self.store.write_step(
            key, attempt.fence, ident, seq=attempt.index, status=StepStatus.STARTED
        )
        if ok:
            hist.starts[ident] += 1
            # Invariant: an effect identity starts at most once, unless an authorizing verdict
            # (a reconciler's or a release's not_executed, recorded in the store) says it did
            # not run.
            assert hist.starts[ident] <= 1 + hist.authorized[ident], (
                f"{key}: step {ident} started {hist.starts[ident]} times with "
                f"{hist.authorized[ident]} authorizing verdict(s)"
            )
            # Invariant: no step starts after a recorded cancellation or a passed deadline.
            assert before.cancel_requested_at is None, f"{key}: {ident} started after a cancel"
            assert not self.deadline_passed(before), f"{key}: {ident} started past its deadline"
            return True
        why = self.store.stop_reason(key, attempt.fence)
        if why is not None:
            status = EntryStatus(why)
            self.store.settle(key, attempt.fence, status, error=f"stopped: {why}")
        return False

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """The attempt's process dies: it simply stops writing (its lease runs out)."""
        self.attempts.remove(data.draw(st.sampled_from(self.attempts), label="attempt"))

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """The heartbeat renews the attempt's lease; a refused renewal stops the attempt."""
        attempt = data.draw(st.sampled_from(self.attempts), label="attempt")
        if not self.store.renew_lease(attempt.key, attempt.fence, LEASE):
            self.attempts.remove(attempt)

    @precondition(lambda self: self.attempts)
    @rule(data=st.data(), failed=st.booleans())
    def retry_or_fail(self, data: st.DataObject, failed: bool) -> None:
        """The body raises outside an effect step: ``self.retry()`` (settle retrying with its
        due time and snapshot; the retry's message is a later delivery) or a failure."""
        attempt = data.draw(
            st.sampled_from([a for a in self.attempts if not a.in_step] or self.attempts),
            label="attempt",
        )
        if attempt.in_step:
            return  # an exception inside a started step is the ambiguous window: a crash
        self.attempts.remove(attempt)
        if failed:
            self.store.settle(attempt.key, attempt.fence, EntryStatus.FAILED, error="boom")
        else:
            self.store.settle(
                attempt.key,
                attempt.fence,
                EntryStatus.RETRYING,
                due_in=RETRY_DUE,
                snapshot=_snapshot(attempt.key),
            )

    # -- time, sweeps, operators ------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 4.0, 12.0, 45.0]))
    def time_passes(self, seconds: float) -> None:
        """The database clock moves on (leases lapse, due times and deadlines pass)."""
        _shift(self.store, seconds)
        for hist in self.history.values():
            if hist.deadline is not None:
                hist.deadline -= seconds
            if hist.header_deadline is not None:
                hist.header_deadline -= seconds

    @rule()
    def sweep(self) -> None:
        """The stale-lease sweep: interrupt expired leases, screen crash loops, resume the rest
        (snapshot decoded first), and re-send overdue retries."""
        self.store.interrupt_expired()
        for entry in self.store.list_interrupted(resumable=True):
            loop = self.store.block_crash_loop(entry, max_resumes=MAX_RESUMES, actor="sweep")
            if loop is not None:
                continue
            read_snapshot(self.store.get_entry(entry.key).snapshot)
            self.store.begin_resume(entry.key, entry.fence, lease_seconds=LEASE)
        for overdue in self.store.list_overdue_retries():
            self.store.begin_resend(overdue.key, overdue.fence, resend_after=RETRY_DUE)

    @rule()
    def wake(self) -> None:
        """The waker: due scheduled/sleeping entries are re-sent (their deadline rides along)."""
        for due in self.store.list_due():
            woke = self.store.begin_wake(due.key, due.fence, due.status, lease_seconds=LEASE)
            if woke is not None and woke[1] is not None:
                self.history[due.key].header_deadline = woke[1]

    @rule(key=st.sampled_from(KEYS))
    def cancel(self, key: str) -> None:
        """``celery-ledger cancel`` / ``revoke()``, then the sweep's ``finish_cancelled``."""
        try:
            self.store.request_cancel(key, by="ops", reason="model", error=CANCEL_ERROR)
        except EntryNotFound:
            return
        self.store.finish_cancelled(CANCEL_ERROR)

    @rule()
    def finish_cancelled(self) -> None:
        self.store.finish_cancelled(CANCEL_ERROR)

    @rule(
        key=st.sampled_from(KEYS),
        verdict=st.sampled_from([Verdict.COMPLETED, Verdict.NOT_EXECUTED]),
        gated=st.booleans(),
    )
    def release(self, key: str, verdict: Verdict, gated: bool) -> None:
        """An operator's ``release --verified``; a not-executed one authorizes one more run of
        every ambiguous step (or of the body, when it recorded none)."""
        rows = self.store.load_steps(key)
        try:
            self.store.release(key, verdict, by="ops", reason="model", require_death_signal=gated)
        except (EntryNotFound, ReleaseRefused, DeathSignalRequired):
            return
        if verdict is Verdict.NOT_EXECUTED:
            hist = self.history[key]
            started = [r.ident for r in rows if r.status is StepStatus.STARTED]
            for ident in started or ([] if rows else [BODY_IDENT]):
                hist.authorized[ident] += 1

    @rule(key=st.sampled_from(KEYS), override=st.booleans())
    def mark_dead(self, key: str, override: bool) -> None:
        with contextlib.suppress(EntryNotFound, MarkDeadRefused):
            self.store.mark_dead(
                key,
                by="ops",
                reason="model",
                grace_seconds=LEASE,
                lease_seconds=LEASE,
                override_heartbeat=override,
            )

    @rule(window=st.sampled_from([0.0, 30.0]))
    def prune(self, window: float) -> None:
        """Retention: settled entries older than the window become tombstones."""
        self.store.prune_settled(window, tombstone=PRUNED_FAILURE)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def entries_hold_their_promises(self) -> None:
        for key in KEYS:
            row = self.entry(key)
            if row is None:
                continue
            hist = self.history[key]
            # Invariant: the fence of an entry never goes back.
            assert row.fence >= hist.fence, f"{key}: fence went back {hist.fence} -> {row.fence}"
            hist.fence = row.fence
            # Invariant: a stored deadline never moves later (nor is dropped).
            if hist.deadline is not None:
                assert row.deadline_at is not None, f"{key}: stored deadline dropped"
                assert row.deadline_at <= hist.deadline + 1e-6, (
                    f"{key}: stored deadline moved later by {row.deadline_at - hist.deadline:.3f}s"
                )
            hist.deadline = row.deadline_at
            # Invariant: every entry is terminal, or carries what resolves it: a running one a
            # lease (the sweep), an interrupted one a reason or a release (resume), a waiting
            # one a due time (wake/resend), a blocked one a reason naming the command.
            status = row.status
            if status is EntryStatus.RUNNING:
                assert row.lease_until is not None, f"{key}: running without a lease"
            elif status is EntryStatus.INTERRUPTED:
                assert row.reason or row.released_by, f"{key}: interrupted without a reason"
            elif status in (EntryStatus.RETRYING, EntryStatus.SCHEDULED, EntryStatus.SLEEPING):
                assert row.due_at is not None, f"{key}: {status.value} without a due time"
            elif status is EntryStatus.BLOCKED:
                assert row.reason, f"{key}: blocked without a reason"
                assert "celery-ledger" in row.reason or "ledger_max_resumes" in row.reason, (
                    f"{key}: blocked reason names no way out: {row.reason!r}"
                )
            else:
                assert status.settled, status
            # Invariant: every entry with a snapshot can be sent again (it decodes).
            if row.snapshot is not None:
                read_snapshot(row.snapshot)

    @invariant()
    def no_unauthorized_duplicate(self) -> None:
        # The store's own count agrees: no effect step ran beyond 1 + its authorized re-runs.
        assert self.store.stats().duplicate_executions == 0


# Passing, a backend takes well under a minute; failing, Hypothesis shrinks the counterexample
# for up to five minutes before it reports it: the timeout leaves it the time to.
#: What the runs of this process did, printed after each (``pytest -s``: a long run's record).
RUNS: Counter[str] = Counter()


@pytest.mark.timeout(TIMEOUT)
def test_protocol_model(ledger_url: str) -> None:
    """Random interleavings of the protocol keep every invariant (see the module docstring)."""
    machine = type("ProtocolModelRun", (ProtocolModel,), {"url": ledger_url})
    RUNS.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            database=None,
            # No "explain" phase: it traces every line of SQLAlchemy and takes minutes.
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(
        f"protocol model on {ledger_url.split(':')[0]}: {RUNS['examples']} examples, "
        f"{RUNS['deliveries']} deliveries, 0 counterexamples"
    )
