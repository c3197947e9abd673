"""The consumer watchdog's gauges, per worker, in Flower's ``/metrics``.

A stall is known only in the worker's parent (``celery_ledger.watchdog``), not in the ledger,
so these gauges come from the workers themselves: one ``ledger_consumer`` inspect broadcast
per ``ttl`` seconds (Flower talks to the broker anyway), however often the page is scraped. A
worker that does not answer within the timeout is left out: its consumer may be the stalled
one, and then it cannot answer (its control channel is on the same connection), which is
why a stall is also logged by the worker and counted by the broker's queue depth.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

PREFIX = "celery_ledger_consumer"

#: How long one broadcast waits for the workers' replies (seconds).
REPLY_TIMEOUT = 1.0


class ConsumerCollector:
    """Prometheus collector of every answering worker's watchdog state."""

    def __init__(self, app: Callable[[], Any], *, ttl: float) -> None:
        self._app = app
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._replies: dict[str, dict[str, Any]] = {}

    def describe(self) -> list[Metric]:
        return list(families({}))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl:
                self._replies = self._ask()
                self._at = now
            replies = dict(self._replies)
        yield from families(replies)

    def _ask(self) -> dict[str, dict[str, Any]]:
        try:
            answers = ask_workers(self._app(), timeout=REPLY_TIMEOUT)
        except Exception:  # noqa: BLE001 - a broker that cannot be asked shows no workers
            return {}
        return {w: a["watchdog"] for w, a in answers.items() if (a or {}).get("watchdog")}


def ask_workers(app: Any, *, timeout: float) -> dict[str, Any]:
    """Every answering worker's ``ledger_consumer`` reply (worker name -> reply)."""
    replies = app.control.broadcast("ledger_consumer", reply=True, timeout=timeout) or []
    return {name: answer for reply in replies for name, answer in reply.items()}


def families(replies: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The gauges of ``replies`` (worker -> ``watchdog.report()``)."""
    stalled = GaugeMetricFamily(
        f"{PREFIX}_stalled",
        "1 while the worker holds room for messages, its queue holds some and none arrives",
        labels=["worker"],
    )
    idle = GaugeMetricFamily(
        f"{PREFIX}_idle_seconds",
        "Seconds since a task message last reached the worker (or its consumer reconnected)",
        labels=["worker"],
    )
    stalls = GaugeMetricFamily(
        f"{PREFIX}_stalls", "Stalls the worker's watchdog saw since it started", labels=["worker"]
    )
    restarts = GaugeMetricFamily(
        f"{PREFIX}_restarts",
        "Consumer restarts the worker's watchdog asked for since it started",
        labels=["worker"],
    )
    for worker, state in sorted(replies.items()):
        stalled.add_metric([worker], 1.0 if state.get("stalled") else 0.0)
        idle.add_metric([worker], float(state.get("idle_seconds", 0.0)))
        stalls.add_metric([worker], float(state.get("stalls", 0)))
        restarts.add_metric([worker], float(state.get("restarts", 0)))
    yield from (stalled, idle, stalls, restarts)


_registered: tuple[Any, ConsumerCollector] | None = None


def register(registry: Any, app: Callable[[], Any], *, ttl: float) -> ConsumerCollector:
    """Register the collector in ``registry`` (again: the previous one is replaced)."""
    global _registered
    if _registered is not None:
        _registered[0].unregister(_registered[1])
    collector = ConsumerCollector(app, ttl=ttl)
    registry.register(collector)
    _registered = (registry, collector)
    return collector
