"""The Celery side's wiring: a ready app for the embedded default, and ``install`` for yours.

``install(app)`` is the one call that makes an existing Celery app ledger-aware: it registers
the sweep task, the beat entry ``celery-ledger-sweep``, and the worker/beat signal handlers
(boot id, boot sweep, beat's first sweep). ``create_app()`` builds an app on the embedded
default (SQLite ledger, ``filesystem://`` broker, SQLite results under one data directory) or
on whatever ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` / ``CELERY_LEDGER_URL`` name.

``celery -A celery_ledger.app worker`` works: ``app`` is built on first attribute access (PEP 562),
never at import time.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

from celery import Celery, Task, current_app, signals
from sqlalchemy.exc import ArgumentError

from celery_ledger import (
    canvas,
    envelope,
    fsbroker,
    intents,
    otel,
    pool,
    runtime,
    timing,
    unlock,
    watchdog,
)
from celery_ledger.backoff import retry_while_unavailable
from celery_ledger.ledger import LedgerError, LedgerUnavailable
from celery_ledger.ledger.engine import make_engine
from celery_ledger.recovery import SweepReport, boot_sweep, run_sweep
from celery_ledger.settings import DEFAULT_DATA_DIR, LedgerSettings
from celery_ledger.task import LedgerTask

log = logging.getLogger(__name__)

SWEEP_TASK = "celery_ledger.sweep"
#: Every sweep's task id starts with this, so that a monitor (Flower's task list,
#: ``celery_ledger.flower.states``) knows a sweep even from an event that carries only its id:
#: a sweep that expired in a backlog is revoked before any event names it.
SWEEP_ID_PREFIX = "celery-ledger-sweep-"
BEAT_ENTRY = "celery-ledger-sweep"

#: Ledger apps of this process (``install``), for the publish signal to find a task's class.
ledger_apps: weakref.WeakSet[Celery] = weakref.WeakSet()


def create_app(
    main: str = "celery_ledger",
    *,
    data_dir: str | os.PathLike[str] | None = None,
    broker_url: str | None = None,
    result_backend: str | None = None,
    ledger_url: str | None = None,
    make_dirs: bool = True,
    **conf: Any,
) -> Celery:
    """A ledger-aware Celery app; defaults to the embedded, server-less setup.

    ``make_dirs``: create the embedded data directory now (the filesystem broker's folders,
    the results database's). The CLI's default app (no ``-A``) passes False: it reads the
    settings, and must not leave ``./.celery-ledger`` wherever an operator runs it.
    """
    env = os.environ
    data = Path(data_dir or env.get("CELERY_LEDGER_DATA_DIR", DEFAULT_DATA_DIR)).resolve()
    broker = broker_url or env.get("CELERY_BROKER_URL") or "filesystem://"
    backend = (
        result_backend
        or env.get("CELERY_RESULT_BACKEND")
        or f"db+sqlite:///{data / 'results.sqlite3'}"
    )
    app = Celery(main, broker=broker, backend=backend)
    app.conf.update(
        ledger_url=ledger_url
        or env.get("CELERY_LEDGER_URL")
        or f"sqlite:///{data / 'ledger.sqlite3'}",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # One message at a time per pool process: a prefetched message is one a crash can
        # strand, and one Redis may redeliver while it waits (celery #4400).
        worker_prefetch_multiplier=1,
        result_extended=True,
        broker_connection_retry_on_startup=True,
    )
    if broker.startswith("filesystem"):
        # kombu's own filesystem transport lets a consumer read a message its producer has
        # created and not written yet, and the worker dies of it (``celery_ledger.fsbroker``).
        app.conf.broker_transport = fsbroker.TRANSPORT
        queue_dir = data / "broker"
        if make_dirs:
            queue_dir.mkdir(parents=True, exist_ok=True)
            (data / "broker-processed").mkdir(parents=True, exist_ok=True)
        app.conf.broker_transport_options = {
            "data_folder_in": str(queue_dir),
            "data_folder_out": str(queue_dir),
            "processed_folder": str(data / "broker-processed"),
            "store_processed": False,
            # Fanout/control exchanges; kombu's default is ./control in the current directory.
            "control_folder": str(data / "broker-control"),
        }
    if backend.startswith("db+sqlite") and make_dirs:
        data.mkdir(parents=True, exist_ok=True)
    if env.get("CELERY_TASK_DEFAULT_QUEUE_TYPE") == "quorum":
        # RabbitMQ quorum queues (Celery 5.5+), on a topic exchange: countdown messages (a
        # WAIT's re-queue, retries) then go through RabbitMQ's native delayed delivery rather
        # than waiting in a worker, whose prefetch quorum queues keep static.
        app.conf.update(task_default_queue_type="quorum", task_default_exchange_type="topic")
    app.conf.update(conf)
    install(app)
    return app


class _SweepTask(Task):
    """The sweep: every send (beat's, or ``delay()``) gets a ``celery-ledger-sweep-`` task id."""

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        return super().apply_async(
            args, kwargs, task_id=task_id or f"{SWEEP_ID_PREFIX}{uuid.uuid4()}", **options
        )


def install(app: Celery) -> Celery:
    """Make ``app`` ledger-aware: sweep task, beat entry, boot id, boot sweeps. Idempotent."""
    ledger = runtime.runtime_of(app)
    if ledger.installed:
        return app
    ledger.installed = True
    ledger_apps.add(app)
    _connect_signals()
    # revoke() is recorded in the ledger (design.md § "Durable time")
    timing.install_revoke_hooks(app)
    # chord_unlock is ledgered (design.md § "Canvas: chains, groups, chords, callbacks")
    unlock.register(app)

    @app.task(name=SWEEP_TASK, ignore_result=True, shared=False, base=_SweepTask)
    def celery_ledger_sweep() -> dict[str, Any]:
        return sweep_now(app).as_dict()

    @app.on_after_configure.connect(weak=False)
    def _add_beat_entry(sender: Celery, **_: Any) -> None:
        interval = runtime.settings_for(sender).sweep_interval
        sender.conf.beat_schedule = {
            **(sender.conf.beat_schedule or {}),
            BEAT_ENTRY: {
                "task": SWEEP_TASK,
                "schedule": interval,
                "options": {"expires": interval},
            },
        }

    return app


def sweep_now(app: Celery, *, actor: str = "sweep") -> SweepReport:
    """One sweep of ``app``'s ledger (``recovery.run_sweep``), as a span (``otel``)."""
    settings = runtime.settings_for(app)
    with otel.tracing(settings).sweep(actor) as span:
        report = run_sweep(
            runtime.store_for(app),
            app,
            lease_seconds=settings.lease_seconds,
            max_resumes=settings.max_resumes,
            retention_days=settings.retention_days,
            batch=settings.sweep_batch,
            tombstone_days=settings.tombstone_days,
            actor=actor,
            cipher=runtime.snapshot_cipher(app),
        )
        span.swept(report)
    return report


_connected = False


def _connect_signals() -> None:
    global _connected
    if _connected:
        return
    _connected = True
    signals.worker_init.connect(_on_worker_init, weak=False)
    signals.worker_before_create_process.connect(_on_before_fork, weak=False)
    signals.after_task_publish.connect(on_task_published, weak=False)
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.task_prerun.connect(canvas.on_task_prerun, weak=False)
    signals.beat_init.connect(_on_beat_init, weak=False)
    watchdog.install()  # design.md § "The consumer watchdog"


def on_task_published(
    sender: str | None = None,
    body: Any = None,
    headers: dict[str, Any] | None = None,
    routing_key: str | None = None,
    properties: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """``after_task_publish``: the publish intent of a ledgered task sent by name
    (``app.send_task``; ``celery_ledger.intents``), once the broker took it."""
    headers = headers or {}
    task_id = headers.get("id")
    if not sender or not task_id or intents.recorded_by_this_publish(task_id):
        return
    # Message protocol 2 (Celery's default since 4.0): body = (args, kwargs, embed).
    if not isinstance(body, (tuple, list)) or len(body) < 2:
        return
    task = _ledger_task(sender)
    if task is None or not intents.wanted(task, headers):
        return
    sent = envelope.of_message(
        tuple(body[0] or ()),
        dict(body[1] or {}),
        headers,
        routing_key=routing_key,
        properties=properties,
        canvas=canvas.message_placement(headers, body[2] if len(body) > 2 else None),
    )
    # The message's expires is absolute (Celery made it so on the producer's clock).
    deadline = envelope.deadline_of({"expires": headers.get("expires"), "headers": headers})
    intents.record(task, sent, task_id, deadline=deadline)


def _ledger_task(name: str) -> LedgerTask | None:
    """The ``LedgerTask`` that the publishing app registers under ``name``, if any.

    The signal does not say which app is publishing: it is the process's only ledger app, else
    the current app (the one created or ``set_current()`` last), else the one finalized app
    that registers the name.
    """
    found = []
    for app in _publishing_apps():
        try:
            tasks = app.tasks  # finalizes the app, as its own first use of tasks would
        except RuntimeError:  # autofinalize=False and not finalized yet
            continue
        task = tasks.get(name)
        if isinstance(task, LedgerTask):
            found.append(task)
    if len(found) > 1:
        log.debug("no publish intent for %s: %d ledger apps register it", name, len(found))
    return found[0] if len(found) == 1 else None


def _publishing_apps() -> list[Celery]:
    """The ledger apps that may be publishing: the only one, or the current one, or (several,
    none current) those already finalized. Another app is never finalized here: that would
    bind other apps' shared tasks to it as a side effect of a publish."""
    apps = list(ledger_apps)
    if len(apps) <= 1:
        return apps
    current = current_app._get_current_object()
    if any(app is current for app in apps):
        return [current]
    return [app for app in apps if app.finalized]


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    # Before the pool forks: the parent and every pool process share this boot id.
    global _freeze_before_fork
    if sender is not None and runtime.is_installed(sender.app):
        settings = _usable_settings(sender.app)
        runtime.new_boot()
        timing.install_worker_revoke_hook()
        _freeze_before_fork = settings.freeze_gc_before_fork
        canvas.keep_chord_unlock(sender.app)
        pool.use_kill_safe_pool(sender)  # design.md § "The embedded default's pool"
        if getattr(sender, "task_events", False):
            # `celery worker -E` sets the worker's attribute, not the app setting that the
            # pool processes read to decide whether to send task-ledger-* events.
            sender.app.conf.worker_send_task_events = True
        runtime.fix_events(sender.app)
        try:
            # Open the ledger here, before the pool forks: the schema is checked (or migrated)
            # once, an unreachable ledger is reported at start, and the database driver, the
            # engines and the hot path's statements are built once and shared copy-on-write
            # by every pool process.
            store = runtime.store_for(sender.app)
            store.ensure_ready()
            store.prepare_for_fork()
        except LedgerError as exc:
            log.error(
                "ledger not reachable at worker start (%s); tasks are redelivered until it is", exc
            )
        except Exception as exc:
            # Not classified by the ledger (a bad URL, a driver that does not import, ...):
            # starting anyway is safe, since every claim meets the same error and runs nothing.
            log.error(
                "ledger cannot be opened at worker start (%r); no ledgered task runs until it can",
                exc,
                exc_info=True,
            )


def _usable_settings(app: Celery) -> LedgerSettings:
    """The worker's ledger settings, every one checked (``LedgerSettings.validate``).

    A worker that started with one it cannot use (a snapshot key that is no Fernet key, a
    lease of NaN) would fail every task it took, and the sweep would re-run them later on a
    healthy worker: the caller sees FAILURE, then SUCCESS. So it does not start.

    Raises:
        SystemExit: one line naming the setting (Celery's signal dispatch logs and swallows
            an ``Exception`` from a receiver; a ``SystemExit`` ends the worker, non-zero).
    """
    try:
        settings = runtime.settings_for(app)
    except ValueError as exc:
        raise SystemExit(f"celery-ledger: cannot start the worker: {exc}") from None
    try:
        make_engine(settings.url).dispose()  # parses the URL; connects to nothing
    except (ValueError, ArgumentError) as exc:
        # The URL itself is not quoted: it may hold a password.
        raise SystemExit(f"celery-ledger: cannot start the worker: ledger_url: {exc}") from None
    return settings


#: Set by ``_on_worker_init`` when this process is a worker of a ledger app whose settings ask
#: for ``freeze_gc_before_fork``; read by ``_on_before_fork`` (its sender is the pool).
_freeze_before_fork = False


def _on_before_fork(**_: Any) -> None:
    """In the worker parent, just before a pool process is forked: the CPython idiom for
    copy-on-write friendly forking (``gc`` docs). Collect first (what is garbage now would
    otherwise be frozen with the rest), freeze, fork; the parent unfreezes on its event loop's
    next turn, after the fork, so its own collections are unchanged, while the child keeps
    its copy of the frozen generation, which its collections skip.

    Celery sends this signal from the event-loop pool only (Redis, RabbitMQ); a broker without
    an event loop (``filesystem://``) forks through billiard's blocking pool, unfrozen.
    """
    if not _freeze_before_fork:
        return
    from kombu.asynchronous import get_event_loop

    hub = get_event_loop()
    if hub is None:  # nothing would run after the fork to unfreeze the parent
        return
    gc.collect()
    gc.freeze()
    hub.call_soon(gc.unfreeze)


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not runtime.is_installed(app):
        return
    settings = runtime.settings_for(app)
    try:
        boot_sweep(
            runtime.store_for(app),
            app,
            node=sender.hostname,
            boot=runtime.boot_id(),
            lease_seconds=settings.lease_seconds,
            max_resumes=settings.max_resumes,
            cipher=runtime.snapshot_cipher(app),
        )
    except LedgerError as exc:
        log.error(
            "boot sweep of %s failed (%s); the beat sweep will find its entries once "
            "their leases expire",
            sender.hostname,
            exc,
        )


def _on_beat_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not runtime.is_installed(app):
        return
    try:
        sweep_now(app, actor="beat")
    except LedgerUnavailable as exc:
        # The ledger may be down at beat's start, or (``worker -B`` on SQLite) busy with the
        # worker's own start (SQLITE_PROTOCOL, "locking protocol"). The periodic sweep may be
        # an interval away (or never run, when no worker consumes it yet): retry this one like
        # any other unavailability, in the background, so beat starts scheduling meanwhile.
        settings = runtime.settings_for(app)
        log.error(
            "beat's first sweep failed (%s); retrying it in the background, backing off "
            "from %.1fs to %.1fs",
            exc,
            settings.unavailable_backoff,
            settings.unavailable_backoff_max,
        )
        threading.Thread(
            target=_retry_first_sweep, args=(app,), name="ledger-first-sweep", daemon=True
        ).start()
    except LedgerError as exc:
        log.error("beat's first sweep failed: %s", exc)


def _retry_first_sweep(app: Celery) -> None:
    """Beat's first sweep, retried while the ledger is unavailable (until it is not)."""
    settings = runtime.settings_for(app)

    def warn(exc: LedgerUnavailable, delay: float) -> None:
        log.warning(
            "beat's first sweep: ledger still unavailable (%s); next try in %.1fs", exc, delay
        )

    try:
        retry_while_unavailable(
            lambda: sweep_now(app, actor="beat"),
            seconds=float("inf"),
            first_delay=settings.unavailable_backoff,
            max_delay=settings.unavailable_backoff_max,
            on_retry=warn,
        )
    except Exception as exc:  # noqa: BLE001 - a daemon thread: report, never raise into nothing
        log.error("beat's first sweep failed: %r", exc)
        return
    log.info("beat's first sweep done once the ledger was back")


_default_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``celery -A celery_ledger.app``: the embedded default app, built on first access.

    It registers the sweep and nothing else; the README's example tasks live in
    ``celery_ledger.harness.examples`` (``celery -A celery_ledger.harness.examples``)."""
    global _default_app
    if name in ("app", "celery"):
        if _default_app is None:
            _default_app = create_app()
        return _default_app
    raise AttributeError(name)
