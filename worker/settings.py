"""One frozen settings object, read once from Celery config and ``CELERY_LEDGER_*`` env.

Nothing here runs at import time: ``LedgerSettings.from_app(app)`` reads the environment when a
worker, a beat or the CLI first needs the ledger, and the app's ``LedgerRuntime`` keeps the
result (``celery_ledger.runtime.settings_for``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from celery_ledger.otel import available as otel_installed

#: ``ledger_durability`` values (the store checks the same: ``celery_ledger.ledger.core``).
DURABILITY = ("effects", "every-write")

#: Where the embedded default keeps its files (ledger, broker folders, results).
DEFAULT_DATA_DIR = ".celery-ledger"


@dataclass(frozen=True)
class LedgerSettings:
    """Every tunable of the Celery side, with why it has its default."""

    #: SQLAlchemy URL of the ledger database (sqlite:///... or postgresql://...).
    url: str
    #: When a ledger write waits for the database's flush to disk (design.md § "Durability follows
    #: effects"
    #: "Durability follows effects"). ``effects``: only the writes that let an effect begin
    #: (a step's ``started`` row; the claim of a non_idempotent or irreversible task, which is
    #: the intent of a body without steps; a block); the others commit without waiting, and a
    #: database crash that loses one ends in a replay, a takeover or a block, never in a
    #: second run of an effect. ``every-write``: every commit waits.
    durability: str = "effects"
    #: Lease length. Long enough that a heartbeat every lease/3 survives a slow database;
    #: short enough that a dead worker's task is found within a minute plus the sweep interval.
    lease_seconds: float = 60.0
    #: How often beat runs the stale-lease sweep; interrupted work is found within
    #: lease_seconds + sweep_interval.
    sweep_interval: float = 30.0
    #: Interruptions after which an entry is parked as a crash loop instead of resumed again.
    max_resumes: int = 5
    #: Settled entries are pruned after this many days, to a tombstone (design.md § "Durable time")
    #: ...
    retention_days: float = 7.0
    #: ... which keeps the key, its final status and settled time this many days longer: a
    #: duplicate delivered meanwhile finds it and does not run (a completed one returns None,
    #: any other raises ``KeyPruned``). 0: no tombstones; a duplicate of a pruned key runs
    #: again. 90 days covers the longest redelivery windows of the brokers and of the usual
    #: provider idempotency windows (Stripe: 24 h) many times over, at one small row per key.
    tombstone_days: float = 90.0
    #: A result or step output larger than this (serialized) is an error, never truncated.
    max_result_bytes: int = 1024 * 1024
    #: A task's argument snapshot larger than this is not stored: the task still runs, but an
    #: interruption is reported for an operator instead of resumed. Every snapshot is one more
    #: copy of the message in the ledger's row; past a size no broker carries comfortably
    #: either, the ledger stops paying for it.
    max_snapshot_bytes: int = 16 * 1024 * 1024
    #: A stored failure larger than this is replaced by its type and a short repr. It is read
    #: back on every duplicate delivery (RETURN raises it again) and by operators; a huge
    #: exception message (a whole request body) must not bloat the entry row.
    max_exception_bytes: int = 64 * 1024
    #: A delivery that finds a live lease polls this long before re-queueing itself.
    wait_poll_seconds: float = 1.0
    #: Upper bound for the countdown of a WAIT re-queue.
    wait_countdown_max: float = 30.0
    #: First and largest backoff when the ledger is unreachable at claim (doubling).
    unavailable_backoff: float = 1.0
    unavailable_backoff_max: float = 60.0
    #: How long settle keeps retrying an unreachable ledger before leaving the entry running
    #: for recovery (the body's result is not lost: replay rows and the lease remain).
    #: Every fenced write of an attempt (step rows, settle) retries for this long.
    settle_retry_seconds: float = 10.0
    #: First pause between those retries, doubled after each one: short enough that a
    #: failover of a second or two costs the task little more than the failover itself ...
    write_retry_delay: float = 0.1
    #: ... and the largest pause, so that a ledger that is back is seen within this much
    #: (the retries themselves are cheap: each is one statement).
    write_retry_delay_max: float = 2.0
    #: Rows a sweep touches per query; bounds each transaction on a large backlog.
    sweep_batch: int = 500
    #: A reconciler that takes longer than this answers ``unknown``.
    reconcile_timeout: float = 10.0
    #: Send task-ledger-* events (None: follow worker_send_task_events / ``-E``).
    send_events: bool | None = None
    #: Named crash points, test-only (CELERY_LEDGER_CRASH_AT), e.g. "step-started:charge".
    crash_points: frozenset[str] = frozenset()
    #: Marker file that makes each crash point fire once (CELERY_LEDGER_CRASH_ONCE).
    crash_once_file: str | None = None
    #: Record each task in the ledger when it is published (``LedgerTask.apply_async``), so a
    #: message lost before any claim (a killed worker's prefetch, a broker restart without
    #: persistence, ``filesystem://``) is re-sent by the sweep. None: on, on every broker.
    publish_intent: bool | None = None
    #: How long a published task may wait in the queue before the sweep re-sends it. A longer
    #: backlog only costs a duplicate message (the claim deduplicates), never a duplicate run.
    #: Once a worker has received the message it holds the intent to the task's lease instead
    #: (``celery_ledger.receipts``), so a worker's death is found within lease + sweep interval.
    publish_intent_seconds: float = 300.0
    #: How long past its ETA a ``self.retry()`` may stay unclaimed before the sweep re-sends
    #: it (its message may be lost: ``filesystem://`` after a worker kill, a Redis restart
    #: without persistence). Like ``publish_intent_seconds``: it covers a queue backlog and a
    #: worker that holds the ETA message; a retry that was only late costs a duplicate
    #: message (the claim deduplicates it), never a duplicate run. Shorter finds lost retries
    #: sooner, longer sends fewer needless duplicates.
    retry_grace_seconds: float = 300.0
    #: A countdown or ETA further away than this (``apply_async(countdown=...)``, ``eta=``,
    #: ``self.retry(countdown=...)``) is held by the ledger, not by the broker: the entry is
    #: ``scheduled`` and the sweep publishes it when due (design.md § "Durable time"). Shorter ones
    #: keep Celery's
    #: behaviour. 600 s is a tenth of Redis's default visibility timeout (one hour) and well
    #: under RabbitMQ's default ``consumer_timeout`` (30 min): a message held longer than that
    #: in a worker is handed to another worker or kills the channel. 0 turns holding off.
    hold_threshold_seconds: float = 600.0
    #: Freeze the worker's objects out of the garbage collector before each pool process is
    #: forked (``gc.freeze``; the parent unfreezes them again right after). A pool process's
    #: collections then never write to the pages it shares with the parent, so the modules the
    #: ledger adds (SQLAlchemy, psycopg) stay shared instead of being copied into every pool
    #: process; Airflow and Sentry do the same for their Celery workers. Prefork only.
    freeze_gc_before_fork: bool = True
    #: Operator tokens: when set, ``release --by`` must name one of them.
    operator_tokens: frozenset[str] = frozenset()
    #: Actions (release, resume) on the Ledger page in Flower. Off, the page is read-only and
    #: refuses every POST: a monitoring page must not gain write power by being installed.
    flower_actions: bool = False
    #: Who may act (CLI and Flower page): ``"package.module:function"`` (or the callable itself)
    #: called with (operator, action, entry); see ``celery_ledger.authorize``. None: the
    #: default rule (operator tokens for the CLI's self-declared ``--by``).
    authorizer: Any = None
    #: Argument names whose values are never shown (``celery_ledger.redact``), for every task,
    #: on top of each task's own ``secret_args``.
    redact: frozenset[str] = frozenset()
    #: Refuse a ``not-executed`` release of an ambiguous step until ``mark-dead`` asserted the
    #: attempt that started it dead (``celery_ledger.ledger.death``). Off by default: it adds a
    #: step to every such release, and only the operator can know the old worker is gone.
    release_requires_death_signal: bool = False
    #: ``mark-dead`` refuses while the old owner renewed its lease, or tried to write, this
    #: recently (two default leases: a paused attempt that wakes tries to renew within a
    #: third of its lease, so a sign of life this old means it is awake or was).
    death_grace_seconds: float = 120.0
    #: Fernet keys that seal argument snapshots at rest (``celery_ledger.ledger.sealing``):
    #: the first seals, every one opens (rotation: new key first, old ones after). Empty: the
    #: snapshots are stored as plain JSON. Kept out of ``repr``: a key must not reach a log.
    snapshot_keys: tuple[str, ...] = field(default=(), repr=False)
    #: The consumer watchdog (``celery_ledger.watchdog``): ``log`` reports a worker that holds
    #: nothing while its queue holds messages, ``restart`` also reconnects its consumer,
    #: ``off`` runs no watchdog. A stall is this many seconds with no message received.
    consumer_watchdog: str = "log"
    consumer_watchdog_seconds: float = 120.0
    #: The most connections one process keeps to the ledger (ledger/budget.py); unset: a pool
    #: of 2 plus 4 overflow, and 2 hot-path connections (docs/operations.md § "Deploying").
    max_connections: int | None = None
    #: OpenTelemetry spans for the claim, the steps, the settle and the sweep
    #: (``celery_ledger.otel``). None: on when the ``otel`` extra is installed (recorded once
    #: the application sets a tracer provider); False: off; True: as None, and a process
    #: without the extra refuses to start rather than trace nothing unnoticed.
    otel: bool | None = None

    @classmethod
    def from_mapping(
        cls, conf: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> LedgerSettings:
        """Build from Celery-style ``ledger_*`` keys, then ``CELERY_LEDGER_*`` overrides.

        Raises:
            ValueError: a value that does not parse, naming the setting.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"CELERY_LEDGER_{f.name.upper()}")
            if raw is None:
                raw = conf.get(f"ledger_{f.name}")
            if raw is not None:
                values[f.name] = _parse(f.name, raw)
        if "crash_points" not in values and env.get("CELERY_LEDGER_CRASH_AT"):
            values["crash_points"] = _parse("crash_points", env["CELERY_LEDGER_CRASH_AT"])
        if "crash_once_file" not in values and env.get("CELERY_LEDGER_CRASH_ONCE"):
            values["crash_once_file"] = env["CELERY_LEDGER_CRASH_ONCE"]
        if "url" not in values:
            data_dir = Path(env.get("CELERY_LEDGER_DATA_DIR", DEFAULT_DATA_DIR))
            values["url"] = f"sqlite:///{data_dir.resolve() / 'ledger.sqlite3'}"
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def from_app(cls, app: Any) -> LedgerSettings:
        """The settings of a Celery app's configuration, read now. The app's runtime reads
        them once and keeps them: ask ``celery_ledger.runtime.settings_for(app)``.

        Raises:
            ValueError: a value that does not parse, naming the setting.
        """
        return cls.from_mapping(app.conf)

    def validate(self) -> None:
        """Raises ValueError naming the first setting that cannot be used."""
        for name in sorted(_FLOATS):
            # NaN passes every comparison below as "not too small"; inf makes a lease that
            # never expires or a wait that never ends.
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"ledger_{name} must be a finite number, not {value}")
        if self.durability not in DURABILITY:
            raise ValueError(
                f"ledger_durability must be one of {', '.join(DURABILITY)}, not {self.durability!r}"
            )
        if self.lease_seconds <= 0:
            raise ValueError("ledger_lease_seconds must be > 0")
        if self.sweep_interval <= 0:
            raise ValueError("ledger_sweep_interval must be > 0")
        if self.max_connections is not None and self.max_connections < 2:
            raise ValueError("ledger_max_connections must be >= 2 (one hot-path, one pooled)")
        if self.max_resumes < 0:
            raise ValueError("ledger_max_resumes must be >= 0")
        if self.tombstone_days < 0:
            raise ValueError("ledger_tombstone_days must be >= 0 (0: no tombstones)")
        if self.hold_threshold_seconds < 0:
            raise ValueError("ledger_hold_threshold_seconds must be >= 0 (0: never hold)")
        if self.retry_grace_seconds < 0:
            raise ValueError("ledger_retry_grace_seconds must be >= 0")
        if self.death_grace_seconds < 0:
            raise ValueError("ledger_death_grace_seconds must be >= 0")
        if self.consumer_watchdog not in ("off", "log", "restart"):
            raise ValueError("ledger_consumer_watchdog must be one of off, log, restart")
        if self.consumer_watchdog_seconds <= 0:
            raise ValueError("ledger_consumer_watchdog_seconds must be > 0")
        if self.snapshot_keys:
            from celery_ledger.ledger import SnapshotCipher

            SnapshotCipher(self.snapshot_keys)  # raises SnapshotSealError (a ValueError)
        for name in ("max_result_bytes", "max_snapshot_bytes", "max_exception_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ledger_{name} must be > 0")
        if self.write_retry_delay <= 0 or self.write_retry_delay_max < self.write_retry_delay:
            raise ValueError(
                "ledger_write_retry_delay must be > 0 and <= ledger_write_retry_delay_max"
            )
        if self.otel and not otel_installed():
            raise ValueError(
                "ledger_otel is on but opentelemetry-api is not installed "
                "(pip install 'celery-ledger[otel]')"
            )
        if isinstance(self.authorizer, str) and not _looks_like_import_path(self.authorizer):
            raise ValueError(
                f"ledger_authorizer={self.authorizer!r} must be 'package.module:function'"
            )
        if not (self.authorizer is None or isinstance(self.authorizer, str)) and not callable(
            self.authorizer
        ):
            raise ValueError("ledger_authorizer must be 'package.module:function' or a callable")


_FLOATS = {
    "consumer_watchdog_seconds",
    "death_grace_seconds",
    "tombstone_days",
    "hold_threshold_seconds",
    "publish_intent_seconds",
    "retry_grace_seconds",
    "lease_seconds",
    "sweep_interval",
    "retention_days",
    "wait_poll_seconds",
    "wait_countdown_max",
    "unavailable_backoff",
    "unavailable_backoff_max",
    "settle_retry_seconds",
    "write_retry_delay",
    "write_retry_delay_max",
    "reconcile_timeout",
}
_INTS = {
    "max_resumes",
    "max_result_bytes",
    "max_snapshot_bytes",
    "max_exception_bytes",
    "sweep_batch",
    "max_connections",
}
_SETS = {"crash_points", "operator_tokens", "redact"}
#: Order matters (the first snapshot key seals).
_LISTS = {"snapshot_keys"}
_BOOLS = {
    "send_events",
    "publish_intent",
    "freeze_gc_before_fork",
    "flower_actions",
    "release_requires_death_signal",
    "otel",
}


def _parse(name: str, raw: Any) -> Any:
    try:
        if name in _FLOATS:
            return float(raw)
        if name in _INTS:
            return int(raw)
        if name in _LISTS:
            items = raw.split(",") if isinstance(raw, str) else raw
            return tuple(str(i).strip() for i in items if str(i).strip())
        if name in _SETS:
            items = raw.split(",") if isinstance(raw, str) else raw
            return frozenset(i.strip() for i in items if str(i).strip())
        if name in _BOOLS:
            if isinstance(raw, bool) or raw is None:
                return raw
            return str(raw).strip().lower() in ("1", "true", "yes", "on")
    except (TypeError, ValueError):
        kind = "a number" if name in _FLOATS else "a whole number" if name in _INTS else "a list"
        raise ValueError(f"ledger_{name}={raw!r} is not {kind}") from None
    if name in ("durability", "consumer_watchdog") and isinstance(raw, str):
        return raw.strip().lower()
    if name == "authorizer" and isinstance(raw, str):
        return raw.strip() or None
    return raw


def _looks_like_import_path(text: str) -> bool:
    """``package.module:function`` or ``package.module.function``."""
    module, sep, attr = text.partition(":")
    parts = module.split(".") + (attr.split(".") if sep else [])
    return (bool(sep) or len(parts) > 1) and all(p.isidentifier() for p in parts)
