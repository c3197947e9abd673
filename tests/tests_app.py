"""The Celery app the process tests run: ``celery -A tests_app worker``.

Configured from the environment ``procs.test_env`` builds. Every effect a task performs is
appended to ``test_effects`` (no unique constraint), so a duplicate shows up as a second row.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery import chain
from celery.exceptions import Reject
from celery.result import AsyncResult, GroupResult
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.exc import DBAPIError

from celery_ledger import LedgerTask, Reconciled, create_app
from celery_ledger.ledger.engine import make_engine
from helpers import configure_queue

app = create_app("tests_app")
app.conf.task_default_queue = os.environ.get("TEST_QUEUE", "celery")
# How long the pool's parent waits for a SIGKILLed pool process's result before it declares
# WorkerLostError (Celery's default: 10 s), as ``celery-ledger demo`` does
# (harness/demo_app.py): only then do acks_late requeue and the ledger's worker-lost fast path
# run, so every test that kills a pool process waited 10 s for nothing. It changes when, not
# what.
app.conf.worker_lost_wait = 1.0
if os.environ.get("TEST_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "visibility_timeout": float(os.environ["TEST_VISIBILITY_TIMEOUT"]),
        # kombu scans for expired unacked messages every interval * throttle seconds
        # (100 s by default); once a second makes Redis's redelivery happen within the test.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

if str(app.conf.broker_url or "").startswith("filesystem"):
    # kombu polls a filesystem queue once a second by default: a worker at -c 2 (prefetch 1)
    # then takes two messages a second, and a test of a few hundred waits minutes on the
    # poll. Ten polls a second, as ``celery-ledger demo`` does (harness/demo_app.py).
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "polling_interval": 0.1,
    }

configure_queue(app, os.environ)


meta = MetaData()
effects = Table(
    "test_effects",
    meta,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tag", String(128), nullable=False),
    Column("effect", String(64), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("at", Float, nullable=False),
)
_engine: dict[int, Any] = {}


def effects_engine() -> Any:
    pid = os.getpid()
    if pid not in _engine:
        engine = make_engine(os.environ["TEST_EFFECTS_URL"])
        try:
            meta.create_all(engine)
        except DBAPIError:
            # Two pool processes created it at the same moment (PostgreSQL's catalog race).
            meta.create_all(engine)
        _engine[pid] = engine
    return _engine[pid]


def effect(tag: str, name: str) -> str:
    with effects_engine().begin() as conn:
        conn.execute(insert(effects).values(tag=tag, effect=name, pid=os.getpid(), at=time.time()))
    return f"{name}:{tag}"


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.slow_effect")
def slow_effect(self: LedgerTask, tag: str, seconds: float) -> str:
    """Stepless: the body is the effect."""
    effect(tag, "body")
    time.sleep(seconds)
    return f"done:{tag}"


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.order", key_from=("order_id",))
def order(self: LedgerTask, order_id: str, amount: int, pause: float = 0.0) -> dict[str, Any]:
    reserved = self.step("reserve", effect, order_id, "reserve")
    time.sleep(pause)
    charged = self.step("charge", effect, order_id, "charge")
    receipt = self.step("receipt", effect, order_id, "receipt")
    return {"order_id": order_id, "amount": amount, "steps": [reserved, charged, receipt]}


def _answer(step: Any) -> Reconciled:
    answer = step.kwargs.get("answer") or (step.args[1] if len(step.args) > 1 else "unknown")
    if answer == "completed":
        return Reconciled.completed(
            f"charge:{step.kwargs.get('order_id', step.args[0])}", note="provider says charged"
        )
    if answer == "not_executed":
        return Reconciled.not_executed("provider has no such charge")
    if answer == "raise":
        raise RuntimeError("provider API down")
    return Reconciled.unknown("provider cannot tell")


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.reconciled", reconciler=_answer)
def reconciled(self: LedgerTask, order_id: str, answer: str) -> list[str]:
    def charge() -> str:
        self.record_external_ref(f"ch_{order_id}")
        return effect(order_id, "charge")

    return [self.step("charge", charge), self.step("receipt", effect, order_id, "receipt")]


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.retry_once", max_retries=3)
def retry_once(self: LedgerTask, order_id: str) -> list[str]:
    charged = self.step("charge", effect, order_id, "charge")
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    return [charged, self.step("email", effect, order_id, "email")]


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.loop")
def loop(self: LedgerTask, order_id: str, pause: float = 0.0) -> list[str]:
    out = []
    for _ in range(3):
        out.append(self.step("tick", effect, order_id, "tick"))
        time.sleep(pause)
    return out


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.crash_always")
def crash_always(self: LedgerTask, tag: str) -> None:
    self.step("prepare", effect, tag, "prepare", effect=False)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.big_result")
def big_result(self: LedgerTask, size: int) -> str:
    effect("big", "body")
    return "x" * size


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.unserializable_output")
def unserializable_output(self: LedgerTask, tag: str) -> Any:
    return self.step("make", lambda: object())


@app.task(
    shared=False, base=LedgerTask, bind=True, name="tests_app.keyed_charge", side_effect="keyed"
)
def keyed_charge(self: LedgerTask, order_id: str) -> str:
    # The provider deduplicates on the key it receives: record which key each call sent.
    return self.step("charge", lambda: effect(order_id, f"charge:{self.provider_key}"))


@app.task(shared=False, name="tests_app.plain_add")
def plain_add(x: int, y: int) -> int:
    return x + y


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.steps_then_wait")
def steps_then_wait(self: LedgerTask, tag: str, seconds: float) -> list[str]:
    out = [self.step("a", effect, tag, "a"), self.step("b", effect, tag, "b")]
    time.sleep(seconds)
    return out


@app.task(shared=False, name="tests_app.gc_frozen")
def gc_frozen() -> int:
    """How many objects this pool process inherited frozen (``ledger_freeze_gc_before_fork``)."""
    import gc

    return gc.get_freeze_count()


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.modules_loaded")
def modules_loaded(self: LedgerTask, prefix: str) -> list[str]:
    """The modules under ``prefix`` this pool process has loaded, after a ledgered task with a
    step ran in it (this one: claimed, a step, then the answer)."""
    import sys

    self.step("touch", effect, f"modules-{self.request.id}", "touch")
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))


@app.task(
    shared=False, base=LedgerTask, bind=True, name="tests_app.slow_charge", key_from=("order_id",)
)
def slow_charge(self: LedgerTask, order_id: str, seconds: float) -> str:
    """One effect step whose provider call takes ``seconds``: a pause in it leaves the call in
    flight (the death-signal gate's zombie, ``test_death_signal``)."""

    def charge() -> str:
        time.sleep(seconds)
        return effect(order_id, "charge")

    return self.step("charge", charge)


# -- canvas (design.md § "Canvas: chains, groups, chords, callbacks") -----------------------


def _effect_seen(tag: str, name: str) -> Reconciled:
    """The canvas tasks' reconciler: the effects table is the provider. A row for the step's
    (tag, effect) means the effect happened; none means it did not."""
    with effects_engine().connect() as conn:
        seen = conn.execute(
            select(func.count())
            .select_from(effects)
            .where(effects.c.tag == tag, effects.c.effect == name)
        ).scalar_one()
    if seen:
        return Reconciled.completed(f"{name}:{tag}", note="effect row found")
    return Reconciled.not_executed("no effect row")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.link",
    reconciler=lambda step: _effect_seen(step.args[2], f"link{step.args[1]}"),
)
def link(self: LedgerTask, acc: list[int], n: int, tag: str) -> list[int]:
    """A chain link: its effect, then the accumulated list with ``n`` appended."""
    self.step("effect", effect, tag, f"link{n}")
    return [*acc, n]


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.member",
    reconciler=lambda step: _effect_seen(step.args[1], f"member{step.args[0]}"),
)
def member(self: LedgerTask, n: int, tag: str, pause: float = 0.0) -> int:
    """A group/chord member: one effect, then ``n * n``."""
    self.step("effect", effect, tag, f"member{n}")
    time.sleep(pause)
    return n * n


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.collect",
    reconciler=lambda step: _effect_seen(step.args[1], "callback"),
)
def collect(self: LedgerTask, results: list[int], tag: str) -> list[int]:
    """A chord callback: one effect, the members' results sorted."""
    self.step("effect", effect, tag, "callback")
    return sorted(results)


# -- design.md § "Transaction steps and the transactional outbox" ---------------------------


def _row(tag: str, name: str) -> dict[str, Any]:
    return {"tag": tag, "effect": name, "pid": os.getpid(), "at": time.time()}


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.transfer", key_from=("tag",))
def transfer(self: LedgerTask, tag: str) -> list[str]:
    """Two transaction steps writing to ``test_effects`` in the ledger's database: Core on a
    connection (``transaction_step``), then the ORM session form (``with``)."""
    effects_engine()  # the table exists before the first transaction writes to it

    def credit(conn: Any) -> str:
        conn.execute(insert(effects).values(**_row(tag, "credit")))
        return f"credit:{tag}"

    credited = self.transaction_step("credit", credit)
    tx = self.transaction("debit", session=True)
    with tx as session:
        session.execute(insert(effects).values(**_row(tag, "debit")))
        tx.output = f"debit:{tag}"
    return [credited, tx.output]


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.child_effect")
def child_effect(self: LedgerTask, tag: str, n: int) -> str:
    """A ledgered child (keyed by its task id): its body is the effect."""
    return effect(tag, f"child-{n}")


def _charged_with_notice(step: Any) -> Reconciled:
    """``charge_and_notify``'s reconciler: the effects table is the provider. A charge found
    means the step completed, and the notice it sent goes with the verdict."""
    tag = step.args[0]
    answer = _effect_seen(tag, "charge")
    if answer.verdict.value != "completed":
        return answer
    return Reconciled.completed(
        f"charge:{tag}", note="charge found", children=[child_effect.s(tag, 0)]
    )


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.charge_and_notify",
    key_from=("tag",),
    reconciler=_charged_with_notice,
)
def charge_and_notify(self: LedgerTask, tag: str) -> str:
    """One effect step that sends a notice (a ledgered child) through the outbox and charges."""

    def charge() -> str:
        self.send(child_effect.s(tag, 0))
        return effect(tag, "charge")

    return self.step("charge", charge)


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.fanout", key_from=("tag",))
def fanout(self: LedgerTask, tag: str, children: int = 2) -> list[str]:
    """A plain step that sends ``children`` children, then a transaction step that sends one
    more with its write."""

    def notify() -> list[str]:
        return [self.send(child_effect.s(tag, n)) for n in range(children)]

    sent = self.step("notify", notify)

    def book(conn: Any) -> str:
        conn.execute(insert(effects).values(**_row(tag, "book")))
        return self.send(child_effect.s(tag, children))

    effects_engine()
    sent.append(self.transaction_step("book", book))
    return sent


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.replacer",
    reconciler=lambda step: _effect_seen(step.args[0], "replacer"),
)
def replacer(self: LedgerTask, tag: str) -> Any:
    """One effect, then ``self.replace`` by a member (7 -> 49) under this task's id."""
    self.step("effect", effect, tag, "replacer")
    raise self.replace(member.s(7, tag))


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.fail_slowly")
def fail_slowly(self: LedgerTask, tag: str, seconds: float) -> None:
    """One effect, a pause (past a short visibility timeout), then a failure."""
    self.step("effect", effect, tag, "failing")
    time.sleep(seconds)
    raise ValueError(f"{tag} failed")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="tests_app.on_failure",
    key_from=lambda failed_id, tag: failed_id,
)
def on_failure(self: LedgerTask, failed_id: str, tag: str) -> str:
    """A ``link_error`` errback keyed by the failed task's id: once per failed task."""
    self.step("effect", effect, tag, "errback")
    return failed_id


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.fail_while")
def fail_while(self: LedgerTask, tag: str, marker: str) -> str:
    """Fails while the file ``marker`` exists (the fault an operator fixes before a release),
    then one effect."""
    if os.path.exists(marker):
        raise ValueError(f"{tag} failed")
    self.step("effect", effect, tag, "succeeding")
    return tag


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.on_success")
def on_success(self: LedgerTask, result: Any, tag: str) -> Any:
    """A ``link`` callback: one effect per callback task id."""
    self.step("effect", effect, tag, "callback")
    return result


def _key_or_raise(tag: str, fail: bool = False) -> str:
    """A ``key_from`` callable (user code the worker's parent runs too) that raises."""
    if fail:
        raise RuntimeError(f"no key for {tag}")
    return tag


@app.task(
    shared=False, base=LedgerTask, bind=True, name="tests_app.keyed_by_code", key_from=_key_or_raise
)
def keyed_by_code(self: LedgerTask, tag: str, fail: bool = False) -> str:
    return self.step("effect", effect, tag, "keyed")


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.reject_once")
def reject_once(self: LedgerTask, tag: str, requeue: bool = True) -> str:
    """guarantees.md § "Bad input", item 20: ``Reject`` on the first run of the body, return on the
    second."""
    effect(tag, "body")
    with effects_engine().connect() as conn:
        runs = conn.execute(
            select(func.count()).select_from(effects).where(effects.c.tag == tag)
        ).scalar_one()
    if runs == 1:
        raise Reject(f"first delivery of {tag}", requeue=requeue)
    return f"done:{tag}"


@app.task(
    shared=False, base=LedgerTask, bind=True, name="tests_app.kw_order", key_from=("order_id",)
)
def kw_order(self: LedgerTask, tag: str, **kwargs: Any) -> dict[str, Any]:
    """guarantees.md § "Bad input", item 12: ``key_from`` names an argument only ``**kwargs`` can
    bring."""
    effect(tag, "body")
    return {"tag": tag, **kwargs}


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.replace_self")
def replace_self(self: LedgerTask, tag: str, depth: int, via_chain: bool = False) -> str:
    """guarantees.md § "Bad input", item 21: ``self.replace()`` with this same task (or a chain
    ending in it), ``depth`` times; each replacement inherits the task id, with other arguments."""
    effect(tag, f"body-{depth}")
    if depth == 0:
        return f"done:{tag}"
    sig = replace_self.si(tag, depth - 1, via_chain)
    if via_chain:
        sig = chain(replace_self.si(f"{tag}-head-{depth}", 0), sig)
    return self.replace(sig)


@app.task(shared=False, base=LedgerTask, bind=True, name="tests_app.returns_result")
def returns_result(self: LedgerTask, tag: str, kind: str) -> Any:
    """guarantees.md § "Bad input", item 22: a body that returns a result object, as Celery's canvas
    tests do."""
    effect(tag, "body")
    one = AsyncResult(f"{tag}-one", app=self.app)
    if kind == "group":
        return GroupResult(f"{tag}-group", [one], app=self.app)
    return one
