"""What recovery takes from outside: an app to publish with, and the ledger's queries it asks.

Recovery imports no Celery and nothing of the worker (``tests/test_layout.py``): it is handed a
Celery app and a ledger store, and these protocols say exactly what it uses of each.

``Publisher`` is the part of a Celery app that recovery's re-sends use (``recovery.publish``,
``recovery.resend``, ``recovery.outbox``, ``recovery.backlog``). A real ``Celery`` app has all
of it. A stand-in with only ``send_task`` (the tests' recording apps) still works: recovery
reads ``conf`` with ``getattr``, and a ``connection_for_write`` that fails counts as a broker
that needs no confirms and cannot say how deep a queue is.

The store protocols name the queries of each ledger query group that recovery calls
(``ledger/sweeps.py``, ``ledger/schedule.py``, ``ledger/operator.py``, ``ledger/outbox.py``),
with the ledger's own signatures; ``LedgerStore`` has them all. A function takes the
narrowest one that covers what it calls, so its signature says which queries it may run.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from celery_ledger.ledger import (
    CrashLoop,
    Entry,
    EntryStatus,
    Interrupted,
    OutboxMessage,
    Overdue,
    Resuming,
)
from celery_ledger.ledger.schedule import Due
from celery_ledger.ledger.slots import Granted


class Publisher(Protocol):
    """What recovery uses of a Celery app."""

    @property
    def conf(self) -> Any:
        """``broker_transport_options`` (a confirming connection's), ``task_default_queue``
        (whose depth ``recovery.backlog`` asks)."""

    @property
    def amqp(self) -> Any:
        """``amqp.Producer(connection, ...)``: a producer on a confirming connection."""

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        """Publish a task by name: every re-send goes through it."""

    def connection_for_write(self, *args: Any, **kwargs: Any) -> Any:
        """A broker connection: the transport's kind, its error tuples, a queue's depth, a
        confirming connection (``transport_options``)."""

    def producer_or_acquire(self, producer: Any = None) -> AbstractContextManager[Any]:
        """A producer from the app's pool, held for a whole sweep (``recovery.publish.Batch``;
        read with ``getattr``: without it, each ``send_task`` acquires its own)."""


class EntryReads(Protocol):
    """``OperatorQueries``: the reads recovery makes of one entry, and the database clock."""

    def get_entry(self, key: str) -> Entry: ...

    def now(self) -> float: ...


class ResumeQueries(Protocol):
    """``SweepQueries``: interrupt, list, resume, re-send, park and prune."""

    def interrupt_expired(self, *, limit: int = ..., actor: str = ...) -> list[Interrupted]: ...

    def interrupt_previous_boot(
        self, node: str, boot: str, *, limit: int = ..., actor: str | None = ...
    ) -> list[Interrupted]: ...

    def list_interrupted(self, *, limit: int = ..., resumable: bool = ...) -> list[Interrupted]: ...

    def count_unresumable(self, *, limit: int = ...) -> int: ...

    def begin_resume(
        self, key: str, fence: int, *, lease_seconds: float, actor: str = ...
    ) -> Resuming | None: ...

    def snapshots_at(
        self, keys: Sequence[str]
    ) -> dict[str, tuple[int, EntryStatus, str | None]]: ...

    def begin_resume_many(
        self,
        picks: Sequence[tuple[str, int]],
        *,
        lease_seconds: float,
        actor: str = ...,
        event: str = ...,
        detail: str | None = ...,
    ) -> dict[str, Resuming]: ...

    def list_overdue_retries(self, *, limit: int = ...) -> list[Overdue]: ...

    def begin_resend(
        self, key: str, fence: int, *, resend_after: float, actor: str = ...
    ) -> Resuming | None: ...

    def block(
        self,
        key: str,
        fence: int,
        reason: str,
        *,
        actor: str,
        from_status: EntryStatus = ...,
    ) -> bool: ...

    def block_crash_loop(
        self, entry: Interrupted, *, max_resumes: int, actor: str
    ) -> CrashLoop | None: ...

    def prune_settled(
        self, older_than_seconds: float, *, limit: int = ..., tombstone: str | None = ...
    ) -> int: ...


class TimeQueries(Protocol):
    """``ScheduleQueries``: what is due, its wake, cancellations, deadlines, tombstones."""

    def list_due(self, *, limit: int = ...) -> list[Due]: ...

    def begin_wake(
        self,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        lease_seconds: float,
        actor: str = ...,
        only_due: bool = ...,
    ) -> tuple[Resuming, float | None] | None: ...

    def finish_cancelled(self, error: str, *, limit: int = ..., actor: str = ...) -> int: ...

    def prune_tombstones(self, older_than_seconds: float, *, limit: int = ...) -> int: ...

    def expire_passed(self, keys: Sequence[str], error: str, *, actor: str = ...) -> set[str]: ...


class OutboxPublishing(Protocol):
    """``OutboxQueries``: the children to publish, and their marks."""

    def unpublished(self, *, limit: int = ..., older_than: float = ...) -> list[OutboxMessage]: ...

    def mark_published(self, child_ids: Sequence[str]) -> int: ...

    def note_publish_failures(self, failures: Sequence[tuple[str, str]]) -> int: ...

    def prune_outbox(self, *, limit: int = ...) -> int: ...


class SlotQueries(Protocol):
    """``SlotGates``: the handover of a concurrency key's free slots (docs/concurrency.md)."""

    def hand_over(
        self, concurrency_key: str, *, limit: int | None = ..., actor: str | None = ...
    ) -> list[Granted]: ...

    def hand_over_all(self, *, limit: int = ..., actor: str = ...) -> list[Granted]: ...


class ResumeStore(ResumeQueries, EntryReads, Protocol):
    """A resume and an overdue retry's re-send: read the entry, then resume or park it."""


class WakeStore(ResumeQueries, EntryReads, TimeQueries, Protocol):
    """The durable-time pass: wake what is due (parking an unreadable one), settle
    cancellations, retention."""


class SlotStore(ResumeQueries, EntryReads, TimeQueries, SlotQueries, Protocol):
    """A handover: serve the waiters of a key, then wake them (the durable-time pass's wake)."""


class SweepStore(ResumeQueries, EntryReads, TimeQueries, OutboxPublishing, SlotQueries, Protocol):
    """A whole sweep: every query above."""
