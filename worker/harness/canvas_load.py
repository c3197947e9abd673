"""The canvas workload of ``verify`` (design.md § "Canvas: chains, groups, chords, callbacks"):
chains and a chord of ledgered tasks.

Sent into the ledgered run beside its orders, so the same chaos hits it: ``CHAINS`` chains of
three links (each link one effect, the chain's result the list of the links' numbers) and one
chord of ``CHORD_SIZE`` members with a callback (each member one effect, the callback one).
Counted from the effects table at the end: every link, member and callback effect exactly
once, every chain and the chord complete, or stopped at a task the ledger parked ``blocked``
(a crash inside its effect step that its reconciler cannot prove): counted as a blocked order
is, what a crash cost, not a loss (``blocked``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import chain, chord
from sqlalchemy import delete, select

from celery_ledger.ledger import BODY_STEP, EntryStatus, entry_key
from celery_ledger.ledger.schema import entries, events, outbox, steps
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled
from celery_ledger.unlock import CHORD_UNLOCK, unlock_id

#: A chain link, a chord member too (ledgered, one effect).
LINK = "celery_ledger.demo.canvas_link"
#: The chord's callback (ledgered, one effect).
JOIN = "celery_ledger.demo.canvas_join"
#: Links per chain.
CHAIN_LENGTH = 3
#: Members of the chord.
CHORD_SIZE = 10


def chains_for(tasks: int) -> int:
    """One chain per 50 orders, at least one, at most 20: the orders stay the main load."""
    return max(1, min(20, tasks // 50))


def register(app: Any, db: Any) -> None:
    """Register the canvas tasks on ``app`` (``shared=False``, like the orders)."""
    from celery_ledger.task import LedgerTask

    # Results are stored for these two (the demo app ignores results): a chord's join on a
    # database result backend polls its members' results.
    @app.task(
        base=LedgerTask,
        bind=True,
        name=LINK,
        shared=False,
        ignore_result=False,
        reconciler=_reconciler(db, lambda step: (step.args[2], f"link{step.args[3]}")),
    )
    def canvas_link(self: Any, acc: list[int], run: str, order_id: str, n: int) -> list[int]:
        self.step("effect", db.record, run, order_id, f"link{n}")
        return [*acc, n]

    @app.task(
        base=LedgerTask,
        bind=True,
        name=JOIN,
        shared=False,
        ignore_result=False,
        reconciler=_reconciler(db, lambda step: (step.args[2], "join")),
    )
    def canvas_join(self: Any, results: list[list[int]], run: str, order_id: str) -> list[int]:
        self.step("effect", db.record, run, order_id, "join")
        return sorted(n for r in results for n in r)


def _reconciler(
    db: Any, effect_of: Callable[[AmbiguousStep], tuple[str, str]]
) -> Callable[[AmbiguousStep], Reconciled]:
    """The orders' argument (``demo_app.make_reconciler``): a row is the effect; no row is
    unknown (a paused attempt may still write it); no step row at all is not executed."""

    def reconcile(step: AmbiguousStep) -> Reconciled:
        if step.step == BODY_STEP:
            return Reconciled.not_executed("every effect is a fenced step, and no step row exists")
        order_id, effect = effect_of(step)
        if db.count(order_id, effect) >= 1:
            return Reconciled.completed(f"{effect}:{order_id}", note="the effect row exists")
        return Reconciled.unknown("no effect row yet; a paused attempt may still write it")

    return reconcile


def chain_id(run: str, i: int) -> str:
    return f"{run}-chain-{i:03d}"


def chord_id(run: str) -> str:
    return f"{run}-chord"


def enqueue(app: Any, run: str, chains: int) -> dict[str, str]:
    """Apply ``chains`` chains and the chord through ``app`` (the run's own). Returns the
    ledger keys their tasks will have, each with its chain's or the chord's id (for the
    cleanup, and for ``blocked``)."""
    keys: dict[str, str] = {}
    for i in range(chains):
        cid = chain_id(run, i)
        res = chain(
            app.signature(LINK, args=([], run, cid, 1)),
            *(app.signature(LINK, args=(run, cid, n)) for n in range(2, CHAIN_LENGTH + 1)),
        ).apply_async()
        while res is not None:
            keys[entry_key(LINK, res.id)] = cid
            res = res.parent
    hid = chord_id(run)
    res = chord(
        [app.signature(LINK, args=([], run, hid, n)) for n in range(CHORD_SIZE)],
        app.signature(JOIN, args=(run, hid)),
    ).apply_async()
    keys[entry_key(JOIN, res.id)] = hid
    keys.update((entry_key(LINK, r.id), hid) for r in res.parent.results)
    # The join of database result backends is a ledgered task too (design.md § "Canvas:
    # chains, groups, chords, callbacks").
    keys[entry_key(CHORD_UNLOCK, unlock_id(res.parent.id))] = hid
    return keys


def drop(ledger_engine: Any, keys: Iterable[str]) -> None:
    """Remove the canvas's ledger entries, their steps, events and recorded links."""
    keys = list(keys)
    with ledger_engine.begin() as conn:
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            conn.execute(delete(outbox).where(outbox.c.parent_key.in_(chunk)))
            conn.execute(delete(steps).where(steps.c.key.in_(chunk)))
            conn.execute(delete(events).where(events.c.key.in_(chunk)))
            conn.execute(delete(entries).where(entries.c.key.in_(chunk)))


def blocked(ledger_engine: Any, keys: Mapping[str, str]) -> dict[str, str]:
    """The chains and the chord (``keys``, from ``enqueue``) one of whose tasks the ledger
    parked ``blocked`` for an operator, each with that task's reason: a crash inside a step
    whose effect the reconciler cannot prove (as a blocked order), not a loss."""
    found: dict[str, str] = {}
    parked = entries.c.status == EntryStatus.BLOCKED.value
    cols = (entries.c.key, entries.c.reason)
    for key, reason in _entries_of(ledger_engine, keys, *cols, where=parked):
        found.setdefault(keys[key], reason or "")
    return found


def unfinished(ledger_engine: Any, keys: Iterable[str]) -> list[dict[str, Any]]:
    """The canvas's entries (``keys``, from ``enqueue``) that are not ``completed``, with
    what the ledger knows of them; a key without an entry is reported as never claimed."""
    cols = (
        entries.c.key,
        entries.c.task_name,
        entries.c.status,
        entries.c.reason,
        entries.c.fence,
        entries.c.executions,
        entries.c.interruptions,
        entries.c.group_id,
        entries.c.due_at,
        entries.c.lease_until,
    )
    keys = list(keys)
    found = {row.key: dict(row._mapping) for row in _entries_of(ledger_engine, keys, *cols)}
    out = [e for e in found.values() if e["status"] != "completed"]
    out += [{"key": k, "status": "no entry (never claimed)"} for k in keys if k not in found]
    return out


def _entries_of(
    ledger_engine: Any, keys: Iterable[str], *cols: Any, where: Any = None
) -> list[Any]:
    """``cols`` of the entries of ``keys`` (those matching ``where``), 500 keys a query."""
    keys = list(keys)
    rows: list[Any] = []
    with ledger_engine.connect() as conn:
        for i in range(0, len(keys), 500):
            stmt = select(*cols).where(entries.c.key.in_(keys[i : i + 500]))
            rows += conn.execute(stmt if where is None else stmt.where(where)).all()
    return rows


@dataclass
class CanvasReport:
    chains: int = 0
    chains_complete: int = 0
    chord_members: int = CHORD_SIZE
    chord_members_done: int = 0
    chord_callbacks: int = 0
    duplicate_effects: int = 0
    incomplete: list[str] = field(default_factory=list)
    #: The incomplete chains and chord that stopped at a task the ledger parked ``blocked``
    #: (``blocked``), with its reason: counted as blocked orders are, not as lost.
    blocked: dict[str, str] = field(default_factory=dict)
    #: For an incomplete canvas: each of its tasks' ledger entries that is not ``completed``
    #: (``unfinished``), or that has no entry at all: where a lost link or member stopped.
    unfinished: list[dict[str, Any]] = field(default_factory=list)
    chord_id: str = ""
    #: Whether an incomplete chain or chord fails the run. Not on ``filesystem://``, which
    #: forgets what a SIGKILLed worker had fetched: a link or member it dropped before any
    #: claim is the orders' "never claimed" (its publish intent is re-sent by the sweep
    #: after ``ledger_publish_intent_seconds``), not a loss the ledger made.
    strict: bool = True

    @property
    def ok(self) -> bool:
        if self.duplicate_effects or self.chord_callbacks > 1:
            return False
        if (
            self.chord_members_done == self.chord_members
            and self.chord_callbacks == 0
            and self.chord_id not in self.blocked
        ):
            return False  # every member done and no callback, and no blocked join: it was lost
        return not (self.strict and self.lost)

    @property
    def lost(self) -> list[str]:
        """The incomplete chains and chord that no blocked task explains."""
        return [i for i in self.incomplete if i not in self.blocked]

    def line(self) -> str:
        line = (
            f"canvas: {self.chains_complete}/{self.chains} chains of {CHAIN_LENGTH} complete, "
            f"chord {self.chord_members_done}/{self.chord_members} members and "
            f"{self.chord_callbacks} callback(s), {self.duplicate_effects} duplicated effect(s)"
        )
        if self.blocked:
            line += f"; {len(self.blocked)} stopped at a task parked blocked"
        if self.incomplete and not self.strict:
            line += (
                " (on filesystem:// a link or member the broker dropped before any claim is "
                "never claimed, like an order: not counted as lost)"
            )
        return line


def tally(
    snapshot: Any,
    run: str,
    chains: int,
    *,
    strict: bool = True,
    parked: Mapping[str, str] | None = None,
) -> CanvasReport:
    """Count the canvas from an ``EffectsSnapshot`` of the run; ``parked``: ``blocked``'s
    answer (the chains and the chord stopped at a blocked task)."""
    r = CanvasReport(chains=chains, strict=strict, chord_id=chord_id(run))
    links = [f"link{n}" for n in range(1, CHAIN_LENGTH + 1)]
    for i in range(chains):
        cid = chain_id(run, i)
        counts = snapshot.orders[cid].counts if cid in snapshot.orders else {}
        r.duplicate_effects += sum(max(0, n - 1) for n in counts.values())
        if all(counts.get(e, 0) >= 1 for e in links):
            r.chains_complete += 1
        else:
            r.incomplete.append(cid)
    hid = chord_id(run)
    counts = snapshot.orders[hid].counts if hid in snapshot.orders else {}
    r.duplicate_effects += sum(max(0, n - 1) for n in counts.values())
    r.chord_members_done = sum(1 for n in range(CHORD_SIZE) if counts.get(f"link{n}", 0) >= 1)
    r.chord_callbacks = counts.get("join", 0)
    if r.chord_callbacks != 1 or r.chord_members_done != CHORD_SIZE:
        r.incomplete.append(hid)
    r.blocked = {i: why for i, why in (parked or {}).items() if i in r.incomplete}
    return r
