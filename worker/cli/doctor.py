"""``doctor``: read-only production checks of the ledger and the app's settings.

``doctor`` never opens the store before its schema check passed: the store would refuse an old
schema before doctor could say so. ``migrate``, the only command that creates or changes the
schema, is ``celery_ledger.cli.migrate``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any

import click
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from celery_ledger import watchdog
from celery_ledger.cli.common import (
    CHECK_COLOURS,
    emit_json,
    guarded,
    load_app,
    print_table,
    sqlite_file_problem,
    sqlite_path,
)
from celery_ledger.cli.doctor_budget import check_budget
from celery_ledger.cli.doctor_pooler import check_pooler
from celery_ledger.cli.doctor_slots import SLOT_WAIT_SECONDS, check_slot_waits
from celery_ledger.ledger import (
    RESUME_OWNER,
    LedgerStore,
    SchemaTooNew,
    SideEffect,
)
from celery_ledger.ledger.engine import is_sqlite, make_engine, normalize_url
from celery_ledger.ledger.errors import as_unavailable
from celery_ledger.ledger.migrate import (
    current_revision,
    head_revision,
    pending_revisions,
)
from celery_ledger.view import one_line

#: Brokers that hand an unacked message to another consumer after ``visibility_timeout``.
_VISIBILITY_BROKERS = ("redis", "rediss", "sentinel", "sqs")
_VISIBILITY_DEFAULT = 3600.0  # kombu's default for Redis and SQS


# -- doctor -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    reason: str


def _check_schema(url: str) -> Check:
    path = sqlite_path(url)
    if path is not None:
        # Read from the file's first bytes: connecting would write a header into an empty one.
        problem = sqlite_file_problem(path)
        if problem is not None:
            return Check("schema", "FAIL", problem)
    try:
        engine = make_engine(url)
    except (ValueError, sa_exc.ArgumentError) as exc:
        return Check("schema", "FAIL", one_line(exc))
    try:
        with engine.connect() as conn:
            current = current_revision(conn)
            pending = pending_revisions(conn)
    except SchemaTooNew as exc:
        return Check("schema", "FAIL", one_line(exc))
    except sa_exc.SQLAlchemyError as exc:
        cause = as_unavailable(exc) or getattr(exc, "orig", None) or exc
        return Check("schema", "FAIL", f"ledger unreachable: {one_line(cause)}")
    finally:
        engine.dispose()
    if pending and current is None:
        return Check(
            "schema", "FAIL", "no ledger schema in this database yet: run `celery-ledger migrate`"
        )
    if pending:
        return Check(
            "schema",
            "FAIL",
            f"schema at {current!r}, {len(pending)} revision(s) "
            f"pending ({', '.join(pending)}): run `celery-ledger "
            "migrate`",
        )
    return Check("schema", "PASS", f"schema current ({head_revision()})")


def _check_backend(url: str, app: Any, store: LedgerStore | None, schema: Check) -> Check:
    if schema.status != "PASS":
        # Durable or not, a database this code cannot use as its ledger is no backend to vouch
        # for: a file that is not a ledger fails; a schema to migrate or upgrade warns.
        path = sqlite_path(url)
        if path is not None and sqlite_file_problem(path) is not None:
            return Check("backend", "FAIL", f"no usable SQLite ledger at {path}: see schema")
        return Check("backend", "WARN", "not checked: the ledger's schema is not usable (schema)")
    if not is_sqlite(url):
        return Check("backend", "PASS", "PostgreSQL: durable and shared by every node")
    path = make_url(normalize_url(url)).database
    if not path or path == ":memory:":
        return Check("backend", "FAIL", "in-memory SQLite: the ledger dies with the process")
    broker = str(app.conf.broker_url or "")
    if not broker.startswith(("filesystem", "memory")):
        return Check(
            "backend",
            "WARN",
            f"SQLite ledger with broker {broker.split(':')[0]}://: "
            "workers on other hosts cannot share one SQLite file; "
            "use PostgreSQL for several nodes",
        )
    if store is not None:
        hosts = {
            e.owner.rsplit("@", 1)[-1]
            for e in store.list_entries(limit=500)
            if e.owner and e.owner != RESUME_OWNER
        }
        if len(hosts) > 1:
            return Check(
                "backend",
                "WARN",
                f"SQLite ledger written from {len(hosts)} hosts "
                f"({', '.join(sorted(hosts))}): use PostgreSQL",
            )
    return Check("backend", "PASS", f"SQLite (WAL) at {path}: durable on this one machine")


def _ledger_tasks(app: Any) -> list[Any]:
    from celery_ledger.task import LedgerTask

    return [t for name, t in sorted(app.tasks.items()) if isinstance(t, LedgerTask)]


_AMQP = ("amqp", "amqps", "pyamqp")
#: RabbitMQ's own default ``consumer_timeout`` (30 minutes), assumed unless configured.
_CONSUMER_TIMEOUT_DEFAULT = 1800.0


def _longest_lease(settings: Any, tasks: list[Any]) -> float:
    return max(
        [settings.lease_seconds] + [float(t.lease_seconds) for t in tasks if t.lease_seconds]
    )


def _scheme(app: Any) -> str:
    return str(app.conf.broker_url or "").split(":", 1)[0].split("+")[0]


def _queue_arguments(app: Any) -> list[tuple[str, dict[str, Any]]]:
    """(queue name, its declared arguments) of every queue the app declares."""
    return [(name, dict(q.queue_arguments or {})) for name, q in app.amqp.queues.items()]


def _seconds(value: Any, what: str) -> float:
    """A timeout in milliseconds (RabbitMQ's unit) as seconds.

    Raises:
        ValueError: not a positive number, naming ``what``.
    """
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number of milliseconds") from None
    if ms <= 0:
        raise ValueError(f"{what}={value!r} must be > 0 milliseconds")
    return ms / 1000.0


def _check_visibility(app: Any, settings: Any, tasks: list[Any]) -> Check:
    scheme = _scheme(app)
    lease = _longest_lease(settings, tasks)
    if scheme in _AMQP:
        return _check_consumer_timeout(app, settings, lease)
    if scheme not in _VISIBILITY_BROKERS:
        return Check(
            "visibility", "PASS", f"{scheme or 'default'} broker has no visibility timeout"
        )
    options = app.conf.broker_transport_options or {}
    vt = float(options.get("visibility_timeout", _VISIBILITY_DEFAULT))
    if lease > vt:
        return Check(
            "visibility",
            "WARN",
            f"lease {lease:.0f}s > visibility_timeout {vt:.0f}s: "
            f"{scheme} redelivers a task still holding its lease; "
            "the copy meets the WAIT gate and re-queues itself "
            "until the lease ends (no duplicate, extra traffic)",
        )
    return Check(
        "visibility",
        "PASS",
        f"visibility_timeout {vt:.0f}s >= lease {lease:.0f}s; a "
        "task running longer is redelivered and waits on its "
        "lease, never runs beside it",
    )


def _check_consumer_timeout(app: Any, settings: Any, lease: float) -> Check:
    """RabbitMQ closes a consumer's channel when a delivery stays unacked past
    ``consumer_timeout``: Celery then shuts the worker down and the broker requeues every
    message the channel held. The server's value is ``ledger_rabbitmq_consumer_timeout``
    (milliseconds, as in rabbitmq.conf; ``CELERY_LEDGER_RABBITMQ_CONSUMER_TIMEOUT``), else a
    queue's ``x-consumer-timeout``, else RabbitMQ's default (30 min)."""
    declared = [
        (name, args["x-consumer-timeout"])
        for name, args in _queue_arguments(app)
        if "x-consumer-timeout" in args
    ]
    configured = os.environ.get("CELERY_LEDGER_RABBITMQ_CONSUMER_TIMEOUT") or app.conf.get(
        "ledger_rabbitmq_consumer_timeout"
    )
    if configured is not None:
        timeout, source = _seconds(configured, "ledger_rabbitmq_consumer_timeout"), "server"
    elif declared:
        timeout = min(_seconds(v, f"x-consumer-timeout of queue {n}") for n, v in declared)
        source = "queue"
    else:
        timeout, source = _CONSUMER_TIMEOUT_DEFAULT, "RabbitMQ's default"
    if timeout < lease:
        return Check(
            "visibility",
            "WARN",
            f"consumer_timeout {timeout:.0f}s ({source}) < lease {lease:.0f}s: RabbitMQ "
            "closes the channel of a task still holding its lease, Celery shuts that worker "
            "down, and every message it held is redelivered; the copies meet WAIT or RETURN "
            "(no duplicate), but raise consumer_timeout above the longest task",
        )
    return Check(
        "visibility",
        "PASS",
        f"consumer_timeout {timeout:.0f}s ({source}) >= lease {lease:.0f}s; a task running "
        "longer is redelivered and meets WAIT or RETURN, never runs beside itself",
    )


def _check_hold(app: Any, settings: Any) -> Check:
    """design.md § "Durable time": countdowns up to ``ledger_hold_threshold_seconds`` wait unacked
    in a worker
    (Celery's ETA path); past the broker's visibility timeout (Redis, SQS) or RabbitMQ's
    ``consumer_timeout`` such a message is handed to another worker or kills the channel."""
    scheme = _scheme(app)
    threshold = float(settings.hold_threshold_seconds)
    if scheme in _AMQP:
        limit, what = _CONSUMER_TIMEOUT_DEFAULT, "RabbitMQ's default consumer_timeout"
        configured = os.environ.get("CELERY_LEDGER_RABBITMQ_CONSUMER_TIMEOUT") or app.conf.get(
            "ledger_rabbitmq_consumer_timeout"
        )
        if configured is not None:
            limit = _seconds(configured, "ledger_rabbitmq_consumer_timeout")
            what = "consumer_timeout"
    elif scheme in _VISIBILITY_BROKERS:
        options = app.conf.broker_transport_options or {}
        limit = float(options.get("visibility_timeout", _VISIBILITY_DEFAULT))
        what = "visibility_timeout"
    else:
        return Check("hold", "PASS", f"{scheme or 'default'} broker holds no ETA message in time")
    if threshold <= 0:
        return Check(
            "hold",
            "WARN",
            f"ledger_hold_threshold_seconds is 0: every countdown waits unacked in a worker; "
            f"one longer than {what} {limit:.0f}s is redelivered (the claim deduplicates it)",
        )
    if threshold >= limit:
        return Check(
            "hold",
            "WARN",
            f"ledger_hold_threshold_seconds {threshold:.0f}s >= {what} {limit:.0f}s: a "
            "countdown between the two waits unacked in a worker past it; lower the threshold",
        )
    return Check(
        "hold",
        "PASS",
        f"countdowns over {threshold:.0f}s are held by the ledger, under {what} {limit:.0f}s",
    )


def _check_rabbitmq(app: Any, settings: Any) -> Check:
    """Classic queues without publisher confirms, and a quorum queue's delivery limit
    against ``ledger_max_resumes`` (RabbitMQ only)."""
    if _scheme(app) not in _AMQP:
        return Check("rabbitmq", "PASS", "not a RabbitMQ broker")
    problems = []
    queues = _queue_arguments(app) or [(app.conf.task_default_queue, {})]
    confirm = bool((app.conf.broker_transport_options or {}).get("confirm_publish"))
    classic = [n for n, a in queues if a.get("x-queue-type", "classic") == "classic"]
    if classic and not confirm:
        problems.append(
            f"classic queue(s) {', '.join(classic)} without publisher confirms "
            "(broker_transport_options confirm_publish): a publish the broker drops is never "
            "reported to the caller; the publish intent and the sweep find it after "
            "ledger_publish_intent_seconds; use quorum queues, or confirm_publish"
        )
    for name, args in queues:
        if "x-delivery-limit" not in args:
            continue
        raw = args["x-delivery-limit"]
        try:
            limit = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"x-delivery-limit of queue {name} is {raw!r}, not a count") from None
        if limit <= settings.max_resumes:
            problems.append(
                f"queue {name}: x-delivery-limit {limit} <= ledger_max_resumes "
                f"{settings.max_resumes}: the broker dead-letters a crashing task before the "
                "ledger parks it; the entry stays interrupted and the sweep re-sends it from "
                "its snapshot until the crash-loop rule blocks it (dead-letter copies pile "
                "up meanwhile); set the limit above ledger_max_resumes"
            )
    if problems:
        return Check("rabbitmq", "WARN", "; ".join(problems))
    return Check(
        "rabbitmq",
        "PASS",
        "publishes confirmed (or quorum queues); delivery limits above ledger_max_resumes",
    )


def _check_acks(app: Any, tasks: list[Any]) -> Check:
    early = [t.name for t in tasks if not t.acks_late]
    lost = [t.name for t in tasks if not t.reject_on_worker_lost]
    prefetch = int(app.conf.worker_prefetch_multiplier or 0)
    problems = []
    if early:
        problems.append(
            f"acks_late off for {', '.join(early)} (a crash loses the message; only "
            "the sweep finds it)"
        )
    if lost:
        problems.append(
            f"reject_on_worker_lost off for {', '.join(lost)} (a killed pool process"
            " waits for the sweep)"
        )
    if prefetch != 1:
        problems.append(
            f"worker_prefetch_multiplier={prefetch} (prefetched messages wait where a"
            " crash strands them; 1 recommended)"
        )
    if problems:
        return Check("acks", "WARN", "; ".join(problems))
    return Check(
        "acks", "PASS", f"{len(tasks)} ledger task(s) ack late, requeue on worker loss, prefetch 1"
    )


def _check_chords(app: Any) -> Check:
    """Whether Celery counts a redelivered chord member once (docs/design.md, "Canvas")."""
    import celery

    backend = str(app.conf.result_backend or "")
    version = ".".join(str(p) for p in celery.VERSION[:3])
    if not backend.startswith(("redis://", "rediss://", "sentinel://")):
        return Check("chords", "PASS", "no Redis result backend: chord joins read results by id")
    if tuple(celery.VERSION[:2]) < (5, 7):
        return Check(
            "chords",
            "WARN",
            f"Celery {version} with a Redis result backend counts a chord member once per "
            "delivery: a member redelivered after it counted counts twice (Celery 5.7 records "
            "each member once)",
        )
    return Check("chords", "PASS", f"Celery {version}: a redelivered chord member counts once")


def _check_beat(app: Any, settings: Any, store: LedgerStore | None) -> Check:
    from celery_ledger.app import BEAT_ENTRY

    if BEAT_ENTRY not in (app.conf.beat_schedule or {}):
        return Check(
            "beat",
            "FAIL",
            f"no {BEAT_ENTRY!r} in beat_schedule: nothing finds work "
            "whose worker died (call celery_ledger.install(app))",
        )
    if store is not None:
        now = store.now()
        late = [
            e
            for e in store.list_entries(statuses=["running"], stuck=True, limit=100)
            if e.lease_until is not None and e.lease_until < now - 2 * settings.sweep_interval
        ]
        if late:
            return Check(
                "beat",
                "WARN",
                f"{BEAT_ENTRY} scheduled, but {len(late)} lease(s) "
                f"expired over {2 * settings.sweep_interval:.0f}s ago "
                "are unswept: is `celery beat` running?",
            )
    return Check("beat", "PASS", f"{BEAT_ENTRY} every {settings.sweep_interval:.0f}s")


def _check_backlog(settings: Any, store: LedgerStore | None) -> Check:
    """Published tasks no worker has claimed for longer than a publish intent's lease: a
    backlog (the sweep defers their re-sends while their queue holds messages), or a queue
    no worker consumes."""
    if store is None:
        return Check("backlog", "WARN", "not checked: the ledger's schema is not usable (schema)")
    stats = store.stats()
    if stats.unclaimed and stats.oldest_unclaimed_age > settings.publish_intent_seconds:
        return Check(
            "backlog",
            "WARN",
            f"{stats.unclaimed} published task(s) unclaimed, the oldest for "
            f"{stats.oldest_unclaimed_age:.0f}s ({stats.unclaimed_lapses} lease lapses, "
            "re-sent or deferred): is every queue consumed? (celery-ledger stats)",
        )
    return Check("backlog", "PASS", f"{stats.unclaimed} published task(s) waiting for a worker")


def _check_reconcilers(tasks: list[Any]) -> Check:
    risky = (SideEffect.NON_IDEMPOTENT.value, SideEffect.IRREVERSIBLE.value)
    bare = [t.name for t in tasks if t.side_effect in risky and t.reconciler is None]
    if bare:
        return Check(
            "reconcilers",
            "WARN",
            f"{len(bare)} non-idempotent task(s) without a "
            f"reconciler block on every ambiguous step: "
            f"{', '.join(bare)}",
        )
    return Check("reconcilers", "PASS", "every non-idempotent ledger task has a reconciler")


def _check_secrets(settings: Any, tasks: list[Any]) -> Check:
    """Declared secrets are stored in the argument snapshots (resume needs them): without
    ``ledger_snapshot_keys`` they sit in the ledger database as plain JSON."""
    from celery_ledger.redact import secret_names

    declared = sorted({name for t in tasks for name in secret_names((), t)} | set(settings.redact))
    if not declared:
        return Check("secrets", "PASS", "no secret_args or ledger_redact declared")
    if settings.snapshot_keys:
        return Check(
            "secrets",
            "PASS",
            f"argument snapshots sealed at rest (Fernet, {len(settings.snapshot_keys)} "
            f"key(s)); secret arguments: {', '.join(declared)}",
        )
    return Check(
        "secrets",
        "WARN",
        f"secret arguments ({', '.join(declared)}) are stored in plain JSON in the argument "
        "snapshots (resume needs them): set ledger_snapshot_keys to encrypt snapshots at rest",
    )


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.option("--strict", is_flag=True, help="Exit 1 on any WARN too (for CI and deploy gates).")
@click.option("--fleet", help="Check the connection budget of WORKERSxCONCURRENCY[+BEATS].")
@click.option(
    "--slot-wait",
    type=click.FloatRange(min=0),
    default=SLOT_WAIT_SECONDS,
    show_default=True,
    help="Warn when a concurrency key has waiters older than this many seconds.",
)
@click.pass_context
@guarded
def doctor_cmd(
    ctx: click.Context, as_json: bool, strict: bool, fleet: str | None, slot_wait: float
) -> None:
    """Read-only checks of the ledger and the app's settings; exit 1 on any FAIL (with
    --strict, on any WARN)."""
    from celery_ledger.runtime import settings_for

    app = load_app(ctx)
    url = ctx.obj.url
    settings = settings_for(app)
    with contextlib.suppress(Exception):  # doctor reports what it can see
        app.loader.import_default_modules()  # tasks listed in `imports`/`include`
    tasks = _ledger_tasks(app)
    schema = _check_schema(url)
    store = None
    if schema.status == "PASS":
        store = LedgerStore(url, migrate=False)
        ctx.call_on_close(store.dispose)
    checks = [
        schema,
        _check_backend(url, app, store, schema),
        Check(*check_pooler(url)),
        Check(*check_budget(url, app, fleet)),
        _check_visibility(app, settings, tasks),
        _check_hold(app, settings),
        _check_rabbitmq(app, settings),
        _check_acks(app, tasks),
        _check_chords(app),
        _check_beat(app, settings, store),
        _check_backlog(settings, store),
        Check(*check_slot_waits(store, slot_wait)),
        Check(*watchdog.doctor_check(settings)),
        _check_reconcilers(tasks),
        _check_secrets(settings, tasks),
    ]
    failed = any(c.status == "FAIL" or (strict and c.status == "WARN") for c in checks)
    if as_json:
        emit_json({"app": app.main, "ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        print_table(
            ctx,
            ["CHECK", "RESULT", "WHY"],
            [[c.name, c.status, c.reason] for c in checks],
            lambda i, v: CHECK_COLOURS.get(v) if i == 1 else None,
        )
    if failed:
        ctx.exit(1)


COMMANDS = [doctor_cmd]
