"""What the Ledger page keeps per Flower process: settings, store, cached aggregates.

Totals over the whole ledger (completed and failed counts, the duplicate-execution rate)
come from ``LedgerStore.stats()``, the query ``celery-ledger stats`` and ``/metrics`` run. Its
``GROUP BY task_name, status`` reads the whole task/status index (about 0.8 s at 1,000,000
entries on PostgreSQL, measured by ``benchmarks/flower_page.py``), so the page never waits
for it on a request once it has a first result: ``AggregateCache`` serves the last result
and refreshes it off the request, in Flower's executor, at most once per ``ttl``. The
numbers an operator acts on (running, interrupted, blocked, expired) are counted live on
every view, from their partial indexes (``celery_ledger.flower.queries``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_ledger.ledger import LedgerStats, LedgerStore, cipher_from
from celery_ledger.settings import LedgerSettings

log = logging.getLogger(__name__)

#: How long a computation of the totals is served before a view refreshes it (in the
#: background). Totals of settled entries move slowly, and at a million entries each
#: computation costs the database most of a second; 30 s keeps that under 3% of a core
#: however many operators keep the page open.
STATS_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class Aggregates:
    """The last computation of ``store.stats()``, or why there is none."""

    stats: LedgerStats | None
    #: Seconds since it was computed (None before the first computation).
    age: float | None
    error: str | None = None


class AggregateCache:
    """``store.stats()``, computed at most once per ``ttl`` and served stale meanwhile."""

    def __init__(
        self,
        store: LedgerStore,
        *,
        ttl: float = STATS_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._stats: LedgerStats | None = None
        self._error: str | None = None
        self._at: float | None = None
        self._refreshing = False

    @property
    def empty(self) -> bool:
        return self._at is None

    def current(self) -> Aggregates:
        if self._at is None:
            return Aggregates(None, None)
        return Aggregates(self._stats, max(self._clock() - self._at, 0.0), self._error)

    def claim_refresh(self) -> bool:
        """True if the caller should refresh now (stale, and nobody else is refreshing)."""
        with self._lock:
            if self._refreshing:
                return False
            if self._at is not None and self._clock() - self._at < self.ttl:
                return False
            self._refreshing = True
            return True

    def refresh(self) -> None:
        """Compute the aggregates (blocking: run it in an executor). Never raises."""
        try:
            stats, error = self._store.stats(), None
        except Exception as exc:  # noqa: BLE001 - a failed total must not fail the page
            log.warning("celery-ledger page: cannot compute the ledger aggregates: %s", exc)
            stats, error = None, " ".join(str(exc).split()) or type(exc).__name__
        with self._lock:
            if stats is not None or self._stats is None:
                self._stats = stats
            self._error = error
            self._at = self._clock()
            self._refreshing = False


#: How long the navbar's blocked count is served before a page view refreshes it (in the
#: background): one count on the partial ``attention`` index, so cheap, but made on Flower
#: pages that otherwise never touch the ledger.
NAV_TTL_SECONDS = 10.0


class BlockedCount:
    """The navbar's "needs an operator" count: entries ``blocked`` now, from the last count.

    ``value()`` never queries on the caller's thread (Flower renders its navbar on its event
    loop): it serves the last count and, when that is older than ``ttl``, starts one refresh
    in ``executor``. None until a first count exists, or while the ledger cannot be read.
    """

    def __init__(
        self,
        store: LedgerStore,
        ttl: float = NAV_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._value: int | None = None
        self._at: float | None = None
        self._refreshing = False

    def value(self, executor: Any) -> int | None:
        with self._lock:
            stale = self._at is None or self._clock() - self._at >= self.ttl
            start = stale and not self._refreshing
            if start:
                self._refreshing = True
        if start:
            try:
                executor.submit(self.refresh)
            except RuntimeError:  # executor shut down: Flower is stopping
                with self._lock:
                    self._refreshing = False
        return self._value

    def refresh(self) -> None:
        from sqlalchemy import func, select

        from celery_ledger.flower.queries import reading
        from celery_ledger.ledger import EntryStatus
        from celery_ledger.ledger.schema import entries

        value: int | None
        try:
            with reading(self.store) as conn:
                value = int(
                    conn.execute(
                        select(func.count())
                        .select_from(entries)
                        .where(entries.c.status == EntryStatus.BLOCKED.value)
                    ).scalar_one()
                )
        except Exception as exc:  # noqa: BLE001 - a navbar never breaks a page
            log.debug("celery-ledger navbar count failed: %r", exc)
            value = None
        with self._lock:
            self._value, self._at, self._refreshing = value, self._clock(), False


def blocked_for_nav(handler: Any) -> int | None:
    """The navbar's blocked count for any Flower page (None: not known yet, or no ledger)."""
    try:
        application = handler.application
        page = page_for(application)
        return page.blocked.value(application.executor)
    except Exception as exc:  # noqa: BLE001 - a navbar never breaks a page
        log.debug("celery-ledger navbar count unavailable: %r", exc)
        return None


class LedgerPage:
    """Per Flower app: its Celery app, the ledger settings and store, the aggregate cache."""

    def __init__(self, capp: Any, *, cli_prefix: str) -> None:
        from celery_ledger.runtime import settings_for

        self.capp = capp
        self.settings: LedgerSettings = settings_for(capp)
        # A monitor never migrates: an old schema is reported, not upgraded from Flower.
        self.store = LedgerStore(self.settings.url, migrate=False)
        self.aggregates = AggregateCache(self.store)
        self.blocked = BlockedCount(self.store)
        self.cli_prefix = cli_prefix
        #: Opens sealed argument snapshots (``ledger_snapshot_keys``); None without a key.
        self.cipher = cipher_from(self.settings.snapshot_keys)

    def task(self, name: str) -> Any | None:
        """The registered task object, or None when this Flower's app does not know it."""
        try:
            return self.capp.tasks.get(name)
        except Exception as exc:  # noqa: BLE001 - a registry that fails to finalize knows nothing
            log.debug("celery-ledger page: task registry unavailable: %r", exc)
            return None


_pages_lock = threading.Lock()
#: The command an operator would type, set by ``install_in_flower`` from Flower's own
#: command line (``celery -A proj flower`` -> ``celery -A proj ledger``).
cli_prefix = "celery-ledger"


def page_for(application: Any) -> LedgerPage:
    """The ``LedgerPage`` of a Flower application, made on first use and kept on it.

    Raises:
        ValueError: the app's ledger settings do not parse.
    """
    page: LedgerPage | None = getattr(application, "_celery_ledger_page", None)
    if page is None:
        with _pages_lock:
            page = getattr(application, "_celery_ledger_page", None)
            if page is None:
                page = LedgerPage(application.capp, cli_prefix=cli_prefix)
                application._celery_ledger_page = page
    return page
