"""The consumer watchdog: a worker that holds nothing while its queue holds work.

After its broker connection is cut, a Celery worker can stay alive and connected and never
consume again (design.md § "The consumer watchdog"): Celery and kombu see nothing wrong, so
nothing in them reconnects. The ledger owns the work it leaves waiting, so the worker's
parent watches for it. A thread asks, every ``bound / 4`` seconds:

- does this worker have room for a message (it holds fewer than its prefetch limit)?
- does a queue it consumes from hold messages (``recovery.backlog.QueueDepths``: the passive
  declare the sweep uses, ``LLEN`` on Redis, the ready count on RabbitMQ)?
- has no task message reached this worker (Celery's ``task_received``) for longer than the
  bound, counted from the consumer's last (re)connection?

All three true is a **stall**. An idle worker on an empty queue is not one, and neither is a
busy worker (its prefetch is full, so the broker rightly sends it nothing). The room is what
is asked, not "holds nothing": a request whose ack failed with the connection can stay in
Celery's bookkeeping of a stalled worker for good. A stall is logged
once when it starts and once when it ends, counted, and reported to ``doctor`` and the
metrics (``celery_ledger_consumer_stalled``) through the worker's ``ledger_consumer``
inspect command. With ``ledger_consumer_watchdog = "restart"`` it also restarts the
consumer: the watchdog puts a callback on the consumer's event loop (kombu's ``Hub.call_soon``
takes callbacks from other threads and wakes the loop) that raises ``ConsumerStalled``, a
connection error. Celery's consumer then does what it does for a lost connection: closes the
connection, restarts its bootsteps, connects and consumes again. Pool processes and the tasks
they run are not touched; messages the worker held unacked are the broker's to give back, as
after any connection loss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kombu.exceptions import ConnectionError as KombuConnectionError

log = logging.getLogger(__name__)

#: ``ledger_consumer_watchdog`` values: ``off`` (no thread), ``log`` (log, count, report),
#: ``restart`` (also restart the consumer once per stall).
MODES = ("off", "log", "restart")


class ConsumerStalled(KombuConnectionError, OSError):
    """Raised on the consumer's event loop to make Celery reconnect a stalled consumer.

    Both a kombu ``ConnectionError`` (what the Redis transport counts as a connection error)
    and an ``OSError`` (what py-amqp counts), so Celery's consumer treats it as a lost
    connection on either broker.
    """


@dataclass
class WatchState:
    """What the watchdog last saw, as the inspect command and the metrics report it."""

    mode: str
    bound_seconds: float
    #: Seconds since a task message last reached this worker (or its consumer reconnected).
    idle_seconds: float = 0.0
    #: Messages waiting in the worker's queues at the last check (None: the broker cannot say).
    waiting: int | None = None
    stalled: bool = False
    #: Stalls seen since the worker started, and consumer restarts the watchdog asked for.
    stalls: int = 0
    restarts: int = 0


class ConsumerWatchdog:
    """The watching thread of one worker's parent (one per consumer)."""

    def __init__(
        self,
        consumer: Any,
        *,
        mode: str,
        bound_seconds: float,
        depth_of: Callable[[str], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consumer = consumer
        self.clock = clock
        self.state = WatchState(mode=mode, bound_seconds=bound_seconds)
        self._depth_of = depth_of or _depth_asker(consumer.app)
        self._last = clock()
        self._restart_count = getattr(consumer, "restart_count", 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the consumer's side: cheap, called on its thread -------------------------------------

    def received(self) -> None:
        """A task message reached the worker (``task_received``)."""
        self._last = self.clock()

    # -- the watching thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="celery-ledger-consumer-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = max(0.25, self.state.bound_seconds / 4)
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:
                log.exception("consumer watchdog check failed")

    def check(self) -> WatchState:
        """One look: update the state, log a stall's start and end, restart if asked."""
        now = self.clock()
        restarts = getattr(self.consumer, "restart_count", 0)
        reconnected = restarts != self._restart_count
        if reconnected:  # the consumer reconnected: its bound starts now
            self._restart_count = restarts
            self._last = now
        state = self.state
        state.idle_seconds = now - self._last
        full = _prefetch_full(self.consumer)
        state.waiting = None if full else self._waiting()
        stalled = not full and bool(state.waiting) and state.idle_seconds > state.bound_seconds
        if stalled and not state.stalled:
            state.stalls += 1
            log.warning(
                "consumer stalled: %s message(s) wait in %s and none reached this worker for "
                "%.0fs (bound %.0fs)%s",
                state.waiting,
                ", ".join(_queues(self.consumer)),
                state.idle_seconds,
                state.bound_seconds,
                "; restarting the consumer" if state.mode == "restart" else "",
            )
            if state.mode == "restart":
                self.restart_consumer()
        elif state.stalled and not stalled:
            log.warning(
                "consumer stall over: %s",
                "the consumer reconnected" if reconnected else "the worker receives messages",
            )
        state.stalled = stalled
        return state

    def _waiting(self) -> int | None:
        counts = [self._depth_of(q) for q in _queues(self.consumer)]
        known = [c for c in counts if c is not None]
        return sum(known) if known else None

    def restart_consumer(self) -> None:
        """Make Celery's consumer reconnect, on its own thread (see the module docstring)."""
        hub = getattr(self.consumer, "hub", None)
        if hub is None:
            log.warning("the consumer has no event loop (a solo/threads pool): not restarted")
            return
        self.state.restarts += 1
        hub.call_soon(_raise_stalled)


def _raise_stalled() -> None:
    raise ConsumerStalled("celery-ledger consumer watchdog: no delivery with messages waiting")


def _prefetch_full(consumer: Any) -> bool:
    """Whether the worker holds as many messages as it may (the broker then sends none)."""
    from celery.worker import state

    limit = getattr(getattr(consumer, "qos", None), "value", 0) or 0
    return bool(limit) and len(state.reserved_requests) >= limit


def _queues(consumer: Any) -> list[str]:
    task_consumer = getattr(consumer, "task_consumer", None)
    queues = getattr(task_consumer, "queues", None) or []
    return [q.name for q in queues if getattr(q, "name", None)]


def _depth_asker(app: Any) -> Callable[[str], int | None]:
    from celery_ledger.recovery.backlog import QueueDepths

    def ask(queue: str) -> int | None:
        # A new QueueDepths per question: it remembers its answers, the watchdog wants
        # fresh ones.
        depth = QueueDepths(app).of(queue)
        return depth if depth is not None else _channel_size(app, queue)

    return ask


def _channel_size(app: Any, queue: str) -> int | None:
    """The queue's size as kombu's virtual channel counts it (Redis: ``LLEN``), or None.

    kombu 5.7's Redis transport asks whether a queue exists with an ``EXISTS`` that it does
    not prefix with ``global_keyprefix``: under a key prefix the passive declare answers
    "no queue" for a queue that holds messages. The channel's own count is prefixed.
    """
    try:
        with app.connection_for_write() as conn:
            size = getattr(conn.default_channel, "_size", None)
            return None if size is None else int(size(queue))
    except Exception as exc:  # noqa: BLE001 - no evidence: no stall is reported
        log.debug("queue size of %s unknown: %r", queue, exc)
        return None


# -- wiring: signals and the inspect command ---------------------------------------------------

_watchdog: ConsumerWatchdog | None = None


def report() -> dict[str, Any] | None:
    """This worker's watchdog state (None: no watchdog runs here)."""
    return None if _watchdog is None else asdict(_watchdog.state)


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Start the watchdog of this worker's consumer (``worker_ready``; the parent only)."""
    global _watchdog
    from celery_ledger import runtime

    if _watchdog is not None or not runtime.is_installed(sender.app):
        return
    settings = runtime.settings_for(sender.app)
    if settings.consumer_watchdog == "off":
        return
    _watchdog = ConsumerWatchdog(
        sender, mode=settings.consumer_watchdog, bound_seconds=settings.consumer_watchdog_seconds
    )
    _watchdog.start()


def on_task_received(**_: Any) -> None:
    if _watchdog is not None:
        _watchdog.received()


def on_worker_shutdown(**_: Any) -> None:
    if _watchdog is not None:
        _watchdog.stop()


def install() -> None:
    """Connect the signals and register the ``ledger_consumer`` inspect command."""
    from celery import signals
    from celery.worker.control import inspect_command

    signals.worker_ready.connect(on_worker_ready, weak=False)
    signals.task_received.connect(on_task_received, weak=False)
    signals.worker_shutdown.connect(on_worker_shutdown, weak=False)

    @inspect_command(name="ledger_consumer")
    def ledger_consumer(state: Any) -> dict[str, Any]:
        """The consumer watchdog's last look (celery-ledger doctor, metrics)."""
        return {"watchdog": report()}


def doctor_check(settings: Any) -> tuple[str, str, str]:
    """``doctor``'s ``consumer`` check (name, PASS | WARN, why), from the settings alone:
    ``doctor`` never opens the broker, so a live stall is the workers' to report (their log,
    ``celery inspect ledger_consumer``, Flower's ``celery_ledger_consumer_*`` gauges)."""
    mode, bound = settings.consumer_watchdog, settings.consumer_watchdog_seconds
    if mode == "off":
        return (
            "consumer",
            "WARN",
            "ledger_consumer_watchdog=off: a worker that stops consuming after a broker cut "
            "goes unnoticed beside a queue that holds work",
        )
    if mode == "log":
        return (
            "consumer",
            "PASS",
            f"a worker with messages waiting and none received for {bound:.0f}s is logged "
            "(ledger_consumer_watchdog=restart also reconnects it)",
        )
    return (
        "consumer",
        "PASS",
        f"a worker with messages waiting and none received for {bound:.0f}s reconnects its "
        "consumer",
    )
