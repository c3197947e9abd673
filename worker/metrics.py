"""Prometheus metrics over the ledger's aggregates: one collector, served by Flower or alone.

``LedgerCollector`` turns ``store.stats()`` (``ledger.LedgerStats``) into ``celery_ledger_*``
gauges. Two ways to serve it:

- inside Flower: ``worker/flowerconfig.py`` (``celery flower --conf=...``) calls
  ``install_in_flower()``, which registers the collector in prometheus_client's default
  ``REGISTRY``; Flower's ``/metrics`` renders that registry, so its page carries the ledger's
  gauges next to ``flower_events_total``;
- alone: ``celery-ledger metrics --port 9808`` (``celery_ledger.cli.metrics``) serves only the
  ledger's gauges.

A scrape never loads the database: the aggregates are computed by a handful of indexed
queries at most once per ``ttl`` seconds (one computation at a time, however many scrapers),
and every other scrape is served from memory. A ledger that cannot be read makes
``celery_ledger_up`` 0 and drops the aggregates (stale numbers would lie); it never makes the
page fail, because Flower's own metrics are on the same page.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import click
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric

from celery_ledger import watchdog_metrics
from celery_ledger.ledger import EntryStatus, LedgerStats, OperatorQueries

log = logging.getLogger(__name__)

#: How long one computation of the aggregates is served. Prometheus scrapes every 15-60 s and
#: Flower's page may be scraped by several servers; 5 s keeps the ledger's load at one set of
#: aggregate queries per 5 s whatever the scrape rate, and the numbers still fresh.
DEFAULT_TTL_SECONDS = 5.0

#: Port of the standalone endpoint (next to node_exporter's 9100 range; any free port works).
DEFAULT_PORT = 9808

PREFIX = "celery_ledger"

StoreFactory = Callable[[], OperatorQueries]


class LedgerCollector:
    """A prometheus_client collector of ledger aggregates, cached for ``ttl`` seconds."""

    def __init__(
        self,
        store: StoreFactory | OperatorQueries,
        *,
        ttl: float = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory: StoreFactory | None = None
        self._store: OperatorQueries | None = None
        if isinstance(store, OperatorQueries):
            self._store = store
        else:
            self._factory = store
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._stats: LedgerStats | None = None
        self._computed_at = float("-inf")
        self._query_seconds = 0.0
        #: How many times the aggregates were computed (tests and the benchmark read it).
        self.computations = 0

    # -- prometheus_client's collector protocol -------------------------------------------

    def describe(self) -> list[Metric]:
        """The metric families, without samples.

        ``REGISTRY.register`` calls this instead of ``collect()``, so registering (at Flower's
        start) does not touch the database.
        """
        return list(_families(None, 0.0, 0.0, failed=False))

    def collect(self) -> Iterator[Metric]:
        stats, age, query_seconds = self.stats()
        yield from _families(stats, age, query_seconds, failed=stats is None)

    # -- the cache ------------------------------------------------------------------------

    def stats(self) -> tuple[LedgerStats | None, float, float]:
        """(aggregates or None if the ledger could not be read, their age, query seconds)."""
        # One computation at a time: concurrent scrapes wait for it and share its result.
        with self._lock:
            now = self._clock()
            if now - self._computed_at >= self.ttl:
                self._refresh(now)
            return self._stats, max(self._clock() - self._computed_at, 0.0), self._query_seconds

    def _refresh(self, now: float) -> None:
        started = time.perf_counter()
        try:
            if self._store is None:
                assert self._factory is not None
                self._store = self._factory()
            self._stats = self._store.stats()
        except Exception as exc:  # noqa: BLE001 - monitoring must not break Flower's page
            # A failure is cached for ttl too: a ledger that is down is not hammered by every
            # scrape, and the warning is logged at most once per ttl.
            log.warning("celery-ledger metrics: cannot read the ledger aggregates: %s", exc)
            self._stats = None
        self.computations += 1
        self._query_seconds = time.perf_counter() - started
        self._computed_at = now


#: The gauges with one sample each, read off the aggregates, in the order the page lists them:
#: (name after the prefix, help, the value).
_GAUGES: tuple[tuple[str, str, Callable[[LedgerStats], float]], ...] = (
    (
        "expired_leases",
        "Entries still running whose lease expired (the sweep will interrupt them)",
        lambda s: float(s.expired_running),
    ),
    (
        "blocked_entries",
        "Entries parked blocked until an operator releases them",
        lambda s: float(s.by_status.get(EntryStatus.BLOCKED.value, 0)),
    ),
    (
        "oldest_running_age_seconds",
        "Seconds since the oldest running entry last changed state",
        lambda s: s.oldest_running_age,
    ),
    (
        "unsettled_interruptions",
        "Interruptions (each one a resume) recorded on entries not yet settled",
        lambda s: float(s.interruptions),
    ),
    (
        "duplicate_executions",
        "Step executions beyond the first that no operator or reconciler authorized",
        lambda s: float(s.duplicate_executions),
    ),
    (
        "duplicate_execution_ratio",
        "duplicate_executions per ledger entry; the ledger's promise is 0",
        lambda s: s.duplicate_execution_rate,
    ),
    (
        "unclaimed_entries",
        "Published tasks no worker has claimed yet (the backlog)",
        lambda s: float(s.unclaimed),
    ),
    (
        "oldest_unclaimed_age_seconds",
        "Seconds since the oldest unclaimed task was published",
        lambda s: s.oldest_unclaimed_age,
    ),
    (
        "unclaimed_lapses",
        "Lease lapses of unclaimed tasks (re-sends, or re-sends deferred while their queue "
        "held messages): growing with unclaimed steady is a backlog",
        lambda s: float(s.unclaimed_lapses),
    ),
)


def _families(
    stats: LedgerStats | None, age: float, query_seconds: float, *, failed: bool
) -> Iterator[Metric]:
    """The families; with samples when ``stats`` is given, only ``up`` 0 when ``failed``."""
    up = GaugeMetricFamily(
        f"{PREFIX}_up",
        "1 if the last computation of the ledger "
        "aggregates succeeded, 0 if the ledger could not be read",
    )
    timing = GaugeMetricFamily(
        f"{PREFIX}_stats_query_seconds", "Time the last computation of the aggregates took"
    )
    cache_age = GaugeMetricFamily(
        f"{PREFIX}_stats_age_seconds", "Age of the aggregates this scrape serves (cached)"
    )
    by_status = GaugeMetricFamily(
        f"{PREFIX}_entries", "Ledger entries by status", labels=["status"]
    )
    by_task = GaugeMetricFamily(
        f"{PREFIX}_task_entries", "Ledger entries by task and status", labels=["task", "status"]
    )
    gauges = [GaugeMetricFamily(f"{PREFIX}_{name}", doc) for name, doc, _ in _GAUGES]
    if stats is not None:
        up.add_metric([], 1.0)
        timing.add_metric([], query_seconds)
        cache_age.add_metric([], age)
        for entry_status in EntryStatus:
            by_status.add_metric(
                [entry_status.value], float(stats.by_status.get(entry_status.value, 0))
            )
        for (task, status), n in sorted(stats.by_task_status.items()):
            by_task.add_metric([task, status], float(n))
        for family, (_, _, value) in zip(gauges, _GAUGES, strict=True):
            family.add_metric([], value(stats))
    elif failed:
        up.add_metric([], 0.0)
        timing.add_metric([], query_seconds)
    yield from (up, timing, cache_age, by_status, by_task, *gauges)


# -- Flower ------------------------------------------------------------------------------

_flower_collector: LedgerCollector | None = None


def install_in_flower(
    app: Any = None, *, ttl: float = DEFAULT_TTL_SECONDS, registry: CollectorRegistry = REGISTRY
) -> LedgerCollector:
    """Register the ledger collector into the registry Flower's ``/metrics`` renders.

    ``app`` defaults to the Celery app ``celery -A ... flower`` loaded. The ledger URL comes from
    that app's settings (``ledger_url`` / ``CELERY_LEDGER_URL``) on the first scrape, and the
    store is opened read-only: a monitor never migrates the schema. Idempotent.
    """
    global _flower_collector
    if _flower_collector is not None:
        registry.unregister(_flower_collector)

    def store() -> OperatorQueries:
        from celery_ledger.ledger import LedgerStore
        from celery_ledger.runtime import settings_for

        return LedgerStore(settings_for(app or _current_celery_app()).url, migrate=False)

    collector = LedgerCollector(store, ttl=ttl)
    registry.register(collector)
    _flower_collector = collector
    # The consumer watchdog's gauges come from the workers (design.md § "The consumer watchdog").
    watchdog_metrics.register(registry, lambda: app or _current_celery_app(), ttl=ttl)
    log.info("celery-ledger metrics registered in Flower's /metrics (ttl %.1fs)", ttl)
    return collector


def _current_celery_app() -> Any:
    """The app of the running ``celery -A ...`` command (Flower's), else Celery's current app."""
    ctx = click.get_current_context(silent=True)
    app = getattr(ctx.find_root().obj, "app", None) if ctx is not None else None
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()
    return app


# -- standalone endpoint -----------------------------------------------------------------


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s", format % args)


def serve(collector: LedgerCollector, *, address: str, port: int) -> WSGIServer:
    """A threaded HTTP server for ``/metrics`` of a registry holding only ``collector``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    return make_server(address, port, make_wsgi_app(registry), _Server, handler_class=_QuietHandler)
