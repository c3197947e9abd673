"""Concurrency keys (docs/concurrency.md), checked by a model: a Hypothesis state machine over
the store (SQLite and PostgreSQL, the ``ledger_url`` fixture), in random interleavings of what
workers, the sweep and the waker do to the entries of one key.

Simulated workers deliver entries of one concurrency key (limit 2) and run them: an attempt
settles (completed, or retrying, which delivers again later) with its handover in the settle's
own transaction (``settle_in_slot``), is stopped without a settle of its own (then hands over
afterwards, as ``celery_ledger.concurrency.after_run`` does), or crashes (it stops writing).
Time passes on a fake clock (every stored time moves back), the sweep interrupts expired
leases, hands over every key's free slots and resumes what it interrupted, and the waker sends
the due waiters. In the second variant the task has a rate limit too (docs/concurrency.md
§ "With a rate limit"): a claim may be held for its token (its delivery comes back once time
passes, and the worker hands over, as ``concurrency.after_hold`` does), also a waiter a
handover served.

Invariants:

- **never over the limit**: at most 2 entries hold a slot, and at most 2 attempts that the
  ledger still lets write (their fence is the entry's, the entry is running) exist at once;
- **no free slot beside a waiter** after a handover (the settle's, a stopped run's, the
  sweep's): either every slot is held or nobody waits (a cancelled waiter aside: none here);
- **first come, first served**: whoever a handover serves waited longer than everyone it left
  waiting;
- **every entry gets done**: at the end, with the clock run on and the sweep, the waker and
  deliveries driven to quiescence, every entry delivered is completed.

``CELERY_LEDGER_MODEL_EXAMPLES`` raises the number of examples for a long run.
"""

from __future__ import annotations

import os
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
from sqlalchemy import func, select, text

from celery_ledger.ledger import (
    ClaimRequest,
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    Owner,
    SlotAsk,
    TokenAsk,
)
from celery_ledger.ledger.schema import entries
from celery_ledger.ledger.slots import Granted, holding, waiting
from helpers import time_passes

pytestmark = pytest.mark.model

EXAMPLES = int(os.environ.get("CELERY_LEDGER_MODEL_EXAMPLES", "40"))
STEPS_PER_EXAMPLE = int(os.environ.get("CELERY_LEDGER_MODEL_STEPS", "40"))

CKEY = "model.charge:customer=c-1"
LIMIT = 2
SLOT = SlotAsk(CKEY, LIMIT)
#: The rate variant's bucket: a token every 5 s of the fake clock.
RATE = TokenAsk("model.charge", 5.0, "12/m")
#: The rate variant's examples (each step of it costs a little more).
RATE_EXAMPLES = max(1, EXAMPLES * 2 // 3)
KEYS = tuple(f"e{i}" for i in range(5))
LEASE = 10.0
WORKERS = (Owner("w0@host", "boot-0", 100), Owner("w1@host", "boot-1", 101))


def _request(key: str, owner: Owner, rate: TokenAsk | None = None) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="model.charge",
        task_id=f"t-{key}",
        args_hash=f"args-{key}",
        snapshot='{"args":[1],"kwargs":{}}',
        side_effect="idempotent",
        owner=owner,
        lease_seconds=LEASE,
        max_interruptions=1000,
        slot=SLOT,
        rate=rate,
    )


class SlotModel(RuleBasedStateMachine):
    url: str = ""
    rate: TokenAsk | None = None

    def __init__(self) -> None:
        super().__init__()
        self.store = LedgerStore(self.url)
        with self.store.engine.begin() as conn:
            for table in (
                "ledger_events",
                "ledger_entries",
                "ledger_concurrency_keys",
                "ledger_rate_buckets",
                "ledger_rate_holds",
            ):
                conn.execute(text(f"DELETE FROM {table}"))
        #: The attempts the simulated workers run: key -> fence.
        self.attempts: dict[str, int] = {}
        #: Entries with a message in flight (published, redelivered, resumed, woken).
        self.inbox: set[str] = set()
        self.delivered: set[str] = set()
        #: Deliveries held for a token: each sends itself again for its due time.
        self.held: set[str] = set()

    def teardown(self) -> None:
        self.store.dispose()

    # -- reading the store ------------------------------------------------------------------

    def entry(self, key: str) -> Any:
        try:
            return self.store.get_entry(key)
        except EntryNotFound:
            return None

    def count(self, where: Any) -> int:
        with self.store.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(where)).scalar_one())

    def waiters_in_order(self) -> list[str]:
        with self.store.engine.connect() as conn:
            return list(
                conn.execute(
                    select(entries.c.key)
                    .where(waiting(CKEY))
                    .order_by(entries.c.waiting_since, entries.c.key)
                ).scalars()
            )

    def served(self, before: list[str], granted: list[Granted]) -> None:
        """A handover served ``granted``: the oldest of those who waited, and each is sent."""
        keys = [g.key for g in granted]  # one grant serves them at once, in no order
        assert sorted(keys) == sorted(before[: len(keys)]), (
            f"served {keys} out of order; waited {before}"
        )
        self.inbox.update(keys)
        self.no_free_slot_beside_a_waiter()

    def no_free_slot_beside_a_waiter(self) -> None:
        held, waiters = self.count(holding(CKEY)), self.count(waiting(CKEY))
        assert held >= LIMIT or waiters == 0, f"{held} of {LIMIT} held while {waiters} wait"

    # -- the rules ----------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def publish(self, key: str) -> None:
        if self.entry(key) is None:
            self.inbox.add(key)

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data(), worker=st.sampled_from(WORKERS))
    def deliver(self, data: st.DataObject, worker: Owner) -> None:
        """A worker takes one message in flight and claims it."""
        key = data.draw(st.sampled_from(sorted(self.inbox)))
        self.inbox.discard(key)
        self.delivered.add(key)
        self.claim(key, worker)

    def claim(self, key: str, worker: Owner) -> None:
        claim = self.store.claim(_request(key, worker, self.rate))
        if claim.gate in (Gate.RUN, Gate.TAKEOVER):
            self.attempts[key] = claim.fence
        elif claim.gate is Gate.HOLD and claim.token_due_in is not None:
            self.held.add(key)  # sent again for its token's due time
            before = self.waiters_in_order()
            self.served(before, self.store.hand_over(CKEY, limit=LIMIT, actor="worker"))

    @precondition(lambda self: bool(self.attempts))
    @rule(data=st.data(), retry=st.booleans())
    def settle(self, data: st.DataObject, retry: bool) -> None:
        """An attempt settles, its handover in the settle's transaction."""
        key = data.draw(st.sampled_from(sorted(self.attempts)))
        fence = self.attempts.pop(key)
        before = self.waiters_in_order()
        if retry:
            served = self.store.settle_in_slot(
                SLOT, key, fence, EntryStatus.RETRYING, error="later", due_in=5.0
            )
        else:
            served = self.store.settle_in_slot(SLOT, key, fence, EntryStatus.COMPLETED)
        if served is None:
            return  # superseded: it wrote nothing, handed nothing over
        if retry:
            self.inbox.add(key)  # its retry is published (a countdown the model skips)
        self.served(before, served)

    @precondition(lambda self: bool(self.attempts))
    @rule(data=st.data())
    def stopped(self, data: st.DataObject) -> None:
        """An attempt ends without a settle of its own (a stop, a wait for a signal): its
        entry is left running until its lease is interrupted; the run hands over after."""
        key = data.draw(st.sampled_from(sorted(self.attempts)))
        del self.attempts[key]
        before = self.waiters_in_order()
        self.served(before, self.store.hand_over(CKEY, limit=LIMIT, actor="worker"))

    @precondition(lambda self: bool(self.attempts))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """An attempt's worker dies: it writes nothing more, its message is lost with it."""
        del self.attempts[data.draw(st.sampled_from(sorted(self.attempts)))]

    @rule(seconds=st.sampled_from([1.0, 6.0, 12.0]))
    def time_passes(self, seconds: float) -> None:
        time_passes(self.store, seconds)  # every stored moment, in every ledger table
        self.inbox.update(self.held)  # their countdowns ran (or ran early: held again)
        self.held.clear()

    @rule()
    def sweep(self) -> None:
        """The sweep: interrupt expired leases, hand over every key's free slots, resume."""
        self.store.interrupt_expired()
        before = self.waiters_in_order()
        self.served(before, self.store.hand_over_all())
        for entry in self.store.list_interrupted(resumable=True):
            if self.store.begin_resume(entry.key, entry.fence, lease_seconds=LEASE):
                self.inbox.add(entry.key)
        for overdue in self.store.list_overdue_retries():
            if self.store.begin_resend(overdue.key, overdue.fence, resend_after=60.0):
                self.inbox.add(overdue.key)

    @rule()
    def wake(self) -> None:
        """The waker sends the due waiters (served by a handover) and due retries."""
        for due in self.store.list_due():
            if self.store.begin_wake(due.key, due.fence, due.status, lease_seconds=LEASE):
                self.inbox.add(due.key)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def never_over_the_limit(self) -> None:
        assert self.count(holding(CKEY)) <= LIMIT
        live = 0
        for key, fence in self.attempts.items():
            row = self.entry(key)
            live += row.status is EntryStatus.RUNNING and row.fence == fence
        assert live <= LIMIT, f"{live} attempts may write at once: {self.attempts}"

    def finish(self) -> None:
        """Run the clock on and drive every message to its end: every entry completes."""
        for _ in range(60):
            for key, fence in sorted(self.attempts.items()):
                del self.attempts[key]
                before = self.waiters_in_order()
                served = self.store.settle_in_slot(SLOT, key, fence, EntryStatus.COMPLETED)
                if served is not None:
                    self.served(before, served)
            while self.inbox:
                key = sorted(self.inbox)[0]
                self.inbox.discard(key)
                self.claim(key, WORKERS[0])
            if not self.attempts:
                self.time_passes(12.0)
                self.sweep()
                self.wake()
            statuses = {k: self.entry(k).status for k in self.delivered}
            if all(s is EntryStatus.COMPLETED for s in statuses.values()):
                return
        left = {
            k: (e.status.value, e.reason, e.owner, e.lease_until, e.due_at, e.fence)
            for k in sorted(self.delivered)
            if (e := self.entry(k)).status is not EntryStatus.COMPLETED
        }
        raise AssertionError(
            f"not every entry completed: {left}; now {self.store.now()}, inbox {self.inbox}, "
            f"held {self.held}, attempts {self.attempts}; {self.rate_rows()}"
        )

    def rate_rows(self) -> str:
        with self.store.engine.connect() as conn:
            buckets = conn.execute(text("SELECT * FROM ledger_rate_buckets")).all()
            holds = conn.execute(text("SELECT * FROM ledger_rate_holds")).all()
        return f"buckets {buckets}, holds {holds}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rate", [None, RATE], ids=["slot", "slot-and-rate"])
def test_slots_model(ledger_url: str, rate: TokenAsk | None) -> None:
    """Random interleavings keep every invariant, and every entry completes in the end."""
    variant = rate

    class Run(SlotModel):
        url = ledger_url
        rate = variant

        def teardown(self) -> None:
            try:
                self.finish()
            finally:
                super().teardown()

    run_state_machine_as_test(
        Run,
        settings=settings(
            max_examples=EXAMPLES if rate is None else RATE_EXAMPLES,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_the_model_sees_a_handover_that_skips_the_oldest_waiter(ledger_url: str) -> None:
    """The model can fail: a handover that served a younger waiter first is caught."""
    model = type("Probe", (SlotModel,), {"url": ledger_url})()
    try:
        for key in ("e0", "e1", "e2", "e3"):
            model.inbox.add(key)
            model.deliver(_Draw(key), WORKERS[0])
        assert sorted(model.attempts) == ["e0", "e1"]
        waited = model.waiters_in_order()
        assert waited == ["e2", "e3"]
        younger = Granted("e3", "t-e3", 1, None)
        with pytest.raises(AssertionError, match="out of order"):
            model.served(waited, [younger])
    finally:
        model.teardown()


def test_the_model_sees_a_settle_that_hands_nothing_over(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model can fail: a settle that frees its slot and serves nobody (the handover
    forgotten) leaves a free slot beside a waiter, and the check after it says so."""

    def forgetful(self: LedgerStore, ask: SlotAsk, key: str, fence: int, status: Any, **kw: Any):
        kw.pop("links", None)
        return [] if self.settle(key, fence, status, **kw) else None

    monkeypatch.setattr(LedgerStore, "settle_in_slot", forgetful)
    model = type("Probe", (SlotModel,), {"url": ledger_url})()
    try:
        for key in ("e0", "e1", "e2"):
            model.inbox.add(key)
            model.deliver(_Draw(key), WORKERS[0])
        with pytest.raises(AssertionError, match="1 of 2 held while 1 wait"):
            model.settle(_Draw("e0"), False)
    finally:
        model.teardown()


class _Draw:
    """A stand-in for Hypothesis's ``data`` that draws a fixed value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def draw(self, _strategy: Any) -> Any:
        return self.value
