"""The ledger store: one object, one database core, three query groups.

Contract of every public method:
- it is one transaction (on PostgreSQL a single-statement method runs in autocommit, which is
  one round trip; the audit event rides in the same statement as a data-modifying CTE);
- every write after the claim is fenced: ``WHERE key = :k AND fence = :f`` checked by the
  rowcount (or, in the claim and ``release``, by the entry's row lock). A lost race (another
  attempt took over, another sweeper moved first) returns ``False``/``None``/a gate; it never
  raises;
- ``LedgerUnavailable`` is raised when the database cannot be reached.
Each method's docstring says what it makes atomic, what fences it, and what a lost race
returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_ledger.ledger.cancellation import CancellationQueries
from celery_ledger.ledger.death import DeathSignals
from celery_ledger.ledger.hotpath import HotPath
from celery_ledger.ledger.links import LinkQueries
from celery_ledger.ledger.operator import OperatorQueries
from celery_ledger.ledger.outbox import Child, OutboxQueries
from celery_ledger.ledger.rate_limits import RateLimitQueries
from celery_ledger.ledger.schedule import ScheduleQueries
from celery_ledger.ledger.signals import SignalQueries
from celery_ledger.ledger.slots import Granted
from celery_ledger.ledger.states import EntryStatus
from celery_ledger.ledger.sweeps import SweepQueries
from celery_ledger.ledger.transactions import TransactionSteps
from celery_ledger.ledger.values import SlotAsk


class LedgerStore(
    HotPath,
    SweepQueries,
    OperatorQueries,
    DeathSignals,
    ScheduleQueries,
    CancellationQueries,
    TransactionSteps,
    OutboxQueries,
    LinkQueries,
    SignalQueries,
    RateLimitQueries,
):
    """The ledger store: hot path, sweeps and operator queries over one engine per process.

    The structure::

        StoreCore (core.py)          engine per process, fork safety, transactions, the hot
        │                            path's cursors, the event writer, error translation
        ├── HotPath (hotpath.py)     claim, renew_lease, write_step, settle, ...
        │   └── SlotGates            its base: concurrency keys (docs/concurrency.md): the
        │       (slots.py)           claim under the key's lock, hand_over, slot_keys
        │       └── ClaimGates       its base: the claim of a key that has an entry,
        │           (claim_gates.py) every gate decided under the entry's row lock
        ├── SweepQueries (sweeps.py) interrupt_*, begin_resume, block, prune_settled, ...
        ├── OperatorQueries          get_entry, list_entries, release, stats, ...
        │   (operator.py)
        ├── DeathSignals (death.py)  mark_dead, record_seen_alive (the release gate)
        ├── ScheduleQueries          schedule, list_due, begin_wake, prune_tombstones, ...
        │   (schedule.py)            durable time (design.md § "Durable time")
        ├── CancellationQueries      request_cancel, finish_cancelled, set_deadline,
        │   (cancellation.py)        expire_passed: the admission gate outside a claim
        ├── TransactionSteps         a step's completed row in a transaction: transaction
        │   (transactions.py)        steps, and a step's children (complete_step)
        ├── OutboxQueries            the children steps recorded: unpublished,
        │   (outbox.py)              mark_published, children_of, parent_of
        ├── LinkQueries (links.py)   a settle that records the next chain link and the
        │                            callbacks as outbox children; group members
        ├── SignalQueries            send_signal, take_signal: durable signals
        │   (signals.py)             (design.md § "Durable signals")
        └── RateLimitQueries         held_for_tokens: the entries a rate limit holds (the
            (rate_limits.py)         claim takes tokens with its helpers)

    The store's one method of its own, ``settle_attempt``, picks among the groups' settles
    (with a slot, with links, or neither) for the runtime's attempt.

    Each query group is a mixin over ``StoreCore`` alone: none calls another group, and none
    tests which database it runs on (``StoreCore.dialect`` and ``statements`` hold the
    differences). Mixins rather than composition (``store.sweeps.block(...)``) because every
    caller (the runtime, recovery, the CLI, the metrics collector, the tests) holds one store
    and calls its methods flat, and all groups share one per-process state (engine, fast path,
    pid): composition would need either a delegating wrapper per public method or a change at
    every call site, and would buy no isolation the mixins do not already have.
    """

    def settle_attempt(
        self,
        slot: SlotAsk | None,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        links: Sequence[Child] = (),
        actor: str | None = None,
        **fields: Any,
    ) -> tuple[bool, list[Granted] | None]:
        """The settle an attempt makes: with a concurrency key's ``slot``, ``settle_in_slot``
        (its handover in the same transaction); else with ``links``, ``settle_with_links``;
        else ``settle``. Returns whether it wrote (False: superseded), and the waiters its
        handover served (None: it made no handover)."""
        if slot is not None:
            served = self.settle_in_slot(
                slot, key, fence, status, links=links, actor=actor, **fields
            )
            return served is not None, served
        if links:
            result, error = fields.get("result"), fields.get("error")
            wrote = self.settle_with_links(
                key, fence, result=result, error=error, status=status, links=links, actor=actor
            )
            return wrote, None
        return self.settle(key, fence, status, actor=actor, **fields), None
