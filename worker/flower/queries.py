"""The Ledger page's read queries: plain SELECTs, each one bounded and index-driven.

The page reads the ledger through the store's public methods (``get_entry``, ``load_steps``,
``entry_events``, ``count_expired``, ``stats``, ``find_keys``) and, for what those do not
cover, through the statements below. None of them writes, and none reads a table: every one
is a range or equality on an index (the partial ``status = 'running'`` lease index, the
partial attention index on (status, updated_at), ``settled_at``, the task/status index) with
a ``LIMIT``, or a count over the rows such a range selects. The rows stuck entries occupy are
few; the settled history, which can be millions of rows, is never scanned per request.

Stuck kinds are data (``STUCK_KINDS``): each one is a status, the time it has been stuck
since (the sort key of the list, and the column its index is ordered by) and a predicate.
``overdue`` (a retry past its due time, on the due-time index) is one; the later ``scheduled``
kind is a new member of that tuple.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, case, func, or_, select
from sqlalchemy.sql import Select

from celery_ledger.ledger import Entry, EntryStatus, LedgerStore
from celery_ledger.ledger.dbclock import db_now, db_now_stable
from celery_ledger.ledger.engine import READ_ONLY
from celery_ledger.ledger.schema import entries

_RUNNING = EntryStatus.RUNNING.value


@contextmanager
def reading(store: LedgerStore) -> Iterator[Connection]:
    """One read-only transaction (a deferred BEGIN on SQLite: it never blocks a writer)."""
    with store.engine.connect() as conn:
        conn = conn.execution_options(**{READ_ONLY: True})
        with conn.begin():
            yield conn


# -- stuck kinds ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StuckKind:
    """One reason an entry waits for someone: how to find it and since when it waits."""

    #: The value of the page's ``kind`` filter.
    name: str
    #: What the page calls it.
    label: str
    #: The entry status it selects.
    status: EntryStatus
    #: ``updated_at`` (when it entered the status) or ``lease_until`` (when the lease ran out).
    since_column: str

    @property
    def since(self) -> ColumnElement[float]:
        return entries.c[self.since_column]

    def predicate(self) -> ColumnElement[bool]:
        cond = entries.c.status == self.status.value
        if self.since_column in ("lease_until", "due_at"):
            # Past its lease, or past its due time. db_now_stable, not db_now: a per-row
            # clock cannot bound the index range.
            cond = and_(cond, self.since < db_now_stable())
        return cond


#: In the order the overview lists them. ``scheduled`` (a later issue) joins here, on the same
#: due-time index as ``overdue``.
STUCK_KINDS: tuple[StuckKind, ...] = (
    StuckKind("blocked", "blocked", EntryStatus.BLOCKED, "updated_at"),
    StuckKind("interrupted", "interrupted", EntryStatus.INTERRUPTED, "updated_at"),
    StuckKind("expired", "running past its lease", EntryStatus.RUNNING, "lease_until"),
    StuckKind("overdue", "retry past its due time", EntryStatus.RETRYING, "due_at"),
)
KINDS_BY_NAME = {k.name: k for k in STUCK_KINDS}


@dataclass(frozen=True)
class StuckFilter:
    """The stuck list's filters. An empty ``kinds`` means every kind."""

    kinds: tuple[str, ...] = ()
    task: str | None = None
    #: Only entries stuck for at least this many seconds.
    min_age: float | None = None

    def selected(self) -> tuple[StuckKind, ...]:
        return tuple(k for k in STUCK_KINDS if not self.kinds or k.name in self.kinds)


@dataclass(frozen=True)
class Cursor:
    """A position in the stuck list: the (since, key) of a row, exclusive."""

    since: float
    key: str

    def token(self) -> str:
        return f"{self.since!r}~{self.key}"

    @classmethod
    def parse(cls, token: str) -> Cursor:
        """Raises ValueError for anything but a token ``token()`` made."""
        since, sep, key = token.partition("~")
        if not sep or not key or len(key) > 64 or not key.isalnum():
            raise ValueError(f"not a page position: {token!r}")
        return cls(float(since), key)


@dataclass(frozen=True)
class StuckRow:
    kind: StuckKind
    since: float
    entry: Entry


@dataclass(frozen=True)
class StuckPage:
    rows: tuple[StuckRow, ...]
    #: Cursor for the next (older → newer) page, None on the last page.
    next: Cursor | None
    #: Cursor for the previous page, None on the first page.
    prev: Cursor | None


def _kind_query(kind: StuckKind, flt: StuckFilter) -> Select[Any]:
    q = select(entries, kind.since.label("stuck_since")).where(kind.predicate())
    if flt.task:
        q = q.where(entries.c.task_name == flt.task)
    if flt.min_age is not None:
        q = q.where(kind.since <= db_now_stable() - flt.min_age)
    return q


def stuck_page(
    conn: Connection,
    flt: StuckFilter,
    *,
    limit: int,
    after: Cursor | None = None,
    before: Cursor | None = None,
) -> StuckPage:
    """One page of stuck entries, longest stuck first, keyset-paged on (since, key).

    Each kind is one index range read in order, ``LIMIT limit + 1``; the kinds are merged
    here. A page costs ``kinds * (limit + 1)`` index rows however deep it is.
    """
    backwards = before is not None
    found: list[list[StuckRow]] = []
    for kind in flt.selected():
        q = _kind_query(kind, flt)
        since = kind.since
        if after is not None:
            q = q.where(
                since >= after.since,
                or_(since > after.since, entries.c.key > after.key),
            )
        if before is not None:
            q = q.where(
                since <= before.since,
                or_(since < before.since, entries.c.key < before.key),
            )
        order = (since.desc(), entries.c.key.desc()) if backwards else (since, entries.c.key)
        rows = conn.execute(q.order_by(*order).limit(limit + 1)).all()
        found.append([_stuck_row(kind, r) for r in rows])
    merged = list(heapq.merge(*found, key=lambda r: (r.since, r.entry.key), reverse=backwards))
    more = len(merged) > limit
    page = merged[:limit]
    if backwards:
        page.reverse()
        prev = _cursor(page[0]) if more and page else None
        nxt = _cursor(page[-1]) if page else None
    else:
        prev = _cursor(page[0]) if after is not None and page else None
        nxt = _cursor(page[-1]) if more and page else None
    return StuckPage(tuple(page), nxt, prev)


def _cursor(row: StuckRow) -> Cursor:
    return Cursor(row.since, row.entry.key)


def _stuck_row(kind: StuckKind, row: Any) -> StuckRow:
    data = dict(row._mapping)
    since = float(data.pop("stuck_since"))
    return StuckRow(kind, since, Entry.from_row(_Row(data)))


class _Row:
    """A mapping with the ``_mapping`` attribute ``Entry.from_row`` reads."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._mapping = data


def stuck_counts(conn: Connection, flt: StuckFilter) -> dict[str, int]:
    """How many entries of each selected kind match the filter (index ranges, counted)."""
    out: dict[str, int] = {}
    for kind in flt.selected():
        q = select(func.count()).select_from(entries).where(kind.predicate())
        if flt.task:
            q = q.where(entries.c.task_name == flt.task)
        if flt.min_age is not None:
            q = q.where(kind.since <= db_now_stable() - flt.min_age)
        out[kind.name] = int(conn.execute(q).scalar_one())
    return out


def stuck_tasks(conn: Connection, *, limit: int = 200) -> list[tuple[str, int]]:
    """Task names with stuck entries and how many, most first (for the task filter)."""
    counts: dict[str, int] = {}
    for kind in STUCK_KINDS:
        q = (
            select(entries.c.task_name, func.count())
            .where(kind.predicate())
            .group_by(entries.c.task_name)
        )
        for name, n in conn.execute(q):
            counts[name] = counts.get(name, 0) + int(n)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


# -- overview ---------------------------------------------------------------------------------

#: The statuses an operator acts on: counted live on every view, from their partial indexes.
LIVE_STATUSES = (
    EntryStatus.RUNNING,
    EntryStatus.RETRYING,
    EntryStatus.INTERRUPTED,
    EntryStatus.BLOCKED,
)


def live_counts(conn: Connection) -> dict[str, int]:
    """Entries per unsettled status, now. One count per status, each on a partial index."""
    return {
        s.value: int(
            conn.execute(
                select(func.count()).select_from(entries).where(entries.c.status == s.value)
            ).scalar_one()
        )
        for s in LIVE_STATUSES
    }


def oldest_expired(conn: Connection) -> tuple[Entry, float] | None:
    """The running entry whose lease ran out first, and how long ago (seconds)."""
    row = conn.execute(
        select(entries, (db_now() - entries.c.lease_until).label("overdue"))
        .where(entries.c.status == _RUNNING, entries.c.lease_until < db_now_stable())
        .order_by(entries.c.lease_until)
        .limit(1)
    ).one_or_none()
    if row is None:
        return None
    data = dict(row._mapping)
    overdue = float(data.pop("overdue"))
    return Entry.from_row(_Row(data)), overdue


@dataclass(frozen=True)
class SweepPreview:
    """What the next sweep will do, if nothing changes before it runs."""

    #: Running entries with an expired lease it will interrupt (at most one batch).
    interrupt: int
    #: Interrupted entries it will look at (at most one batch, oldest first).
    candidates: int
    #: Of those, re-enqueued with their snapshot.
    resume: int
    #: Of those, past ``max_resumes``: blocked as crash loops.
    crash_loops: int
    #: Of those, without an argument snapshot: reported, left interrupted (up to a batch,
    #: on top of the batch it resumes: the sweep passes over them).
    no_snapshot: int
    #: Settled entries past retention it will prune (at most one batch).
    prune: int
    batch: int


def sweep_preview(
    conn: Connection,
    *,
    expired: int,
    batch: int,
    max_resumes: int,
    retention_days: float,
) -> SweepPreview:
    """Mirror ``recovery.run_sweep``'s three bounded steps as reads.

    The entries it interrupts join the interrupted ones in the same sweep (run_sweep lists
    interrupted entries after interrupting), so they count as candidates too.
    """
    # The sweep lists only interrupted entries it can resume (with a snapshot), and reports
    # the others (counted up to a batch) without letting them fill its batch.
    interrupted = entries.c.status == EntryStatus.INTERRUPTED.value
    loop = entries.c.interruptions > max_resumes
    picked = (
        select(case((loop, 1), else_=0).label("loop"))
        .where(interrupted, entries.c.snapshot.is_not(None))
        .order_by(entries.c.updated_at)
        .limit(batch)
        .subquery()
    )
    n, loops = conn.execute(
        select(func.count(), func.coalesce(func.sum(picked.c.loop), 0)).select_from(picked)
    ).one()
    bare = (
        select(entries.c.key)
        .where(interrupted, entries.c.snapshot.is_(None))
        .limit(batch)
        .subquery()
    )
    no_snapshot = conn.execute(select(func.count()).select_from(bare)).scalar_one()
    interrupt = min(expired, batch)
    # n <= batch, so the freshly interrupted ones fill what is left of the batch.
    resumable = min(int(n) + interrupt, batch)
    prunable = (
        select(entries.c.key)
        .where(
            entries.c.settled_at.is_not(None),
            entries.c.settled_at < db_now_stable() - retention_days * 86400.0,
        )
        .order_by(entries.c.settled_at)
        .limit(batch)
        .subquery()
    )
    prune = int(conn.execute(select(func.count()).select_from(prunable)).scalar_one())
    return SweepPreview(
        interrupt=interrupt,
        candidates=resumable + int(no_snapshot),
        # An entry the sweep interrupts has a snapshot unless its task could not make one;
        # it counts as a resume here (its own page says so when it has none).
        resume=resumable - int(loops),
        crash_loops=int(loops),
        no_snapshot=int(no_snapshot),
        prune=prune,
        batch=batch,
    )
