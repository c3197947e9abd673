"""The run ``demo`` and ``verify`` share: their processes, the sandbox they run in, one
workload under crashes, the live progress lines and the side-by-side report.

- ``Orchestra``: the command's ``ProcessGroup`` (``processes``) of ``celery -A demo_app``
  processes, with none of the caller's ``CELERY_*`` variables. Leaving it (normally, by an
  exception, by Ctrl-C or by SIGTERM, which it turns into ``SignalStop``) stops every
  process it started.
- ``Sandbox`` is where a run lives: a data directory, a namespace, the broker, ledger and
  effects URLs, and the cleanup that removes exactly what the run created.
- ``Workload`` is one run kind's queue, workers, orders and progress.
- ``Phases`` prints one live line per phase (rewritten in place on a terminal).

Every wait here is bounded in time.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TextIO

import click
from sqlalchemy.engine import make_url

from celery_ledger.harness import canvas_load, demo_app
from celery_ledger.harness.processes import Process, ProcessFailed, ProcessGroup
from celery_ledger.ledger.engine import make_engine

log = logging.getLogger(__name__)


class SignalStop(KeyboardInterrupt):
    """Raised in the main thread when SIGINT or SIGTERM arrives, so that cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Orchestra(ProcessGroup):
    """The processes of one command; all of them stopped on exit, Ctrl-C or SIGTERM.

    The caller's ``CELERY_*`` variables are not passed on: every process is configured by
    the sandbox alone, whatever the shell that runs the command has exported.
    """

    def __init__(self, app: str, log_dir: Path) -> None:
        super().__init__(log_dir, app=app, drop_prefixes=("CELERY_",))
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Orchestra:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, _raise_stop)
        atexit.register(self.stop_all)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            atexit.unregister(self.stop_all)
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous.clear()


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise SignalStop(signum)


# -- the sandbox ------------------------------------------------------------------------------


@dataclass
class Sandbox:
    """Where one command's run lives, and what it must remove afterwards."""

    data_dir: Path
    namespace: str
    #: None: the embedded ``filesystem://`` broker in ``data_dir``.
    broker_url: str | None
    ledger_url: str
    effects_url: str
    #: Whether ``data_dir`` was made for this run (and so may be deleted).
    temporary: bool
    #: The queues the run's workloads consume (RabbitMQ: deleted with the run).
    queues: list[str] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        *,
        prefix: str,
        broker: str | None,
        ledger: str | None,
        data_dir: Path | None = None,
        effects_apart: bool = False,
    ) -> Sandbox:
        """A fresh namespace, and a data directory (a new temporary one unless given).

        With no ``ledger`` the ledger and the effects tables are SQLite files in the data
        directory; with one, the effects tables live in the ledger database, unless
        ``effects_apart`` (the ledger's server is crashed on purpose: the effects, the outside
        world the count is made from, must not be crashed with it).
        """
        namespace = uuid.uuid4().hex[:8]
        temporary = data_dir is None
        path = Path(tempfile.mkdtemp(prefix=f"{prefix}-")) if data_dir is None else data_dir
        path.mkdir(parents=True, exist_ok=True)
        path = path.resolve()
        ledger_url = ledger or f"sqlite:///{path / 'ledger.sqlite3'}"
        effects_url = (None if effects_apart else ledger) or f"sqlite:///{path / 'effects.sqlite3'}"
        return cls(path, namespace, broker or None, ledger_url, effects_url, temporary)

    @property
    def owns_ledger(self) -> bool:
        """Whether the ledger is this run's own file, which nobody else uses."""
        own = f"sqlite:///{self.data_dir / 'ledger.sqlite3'}"
        return self.temporary and self.ledger_url == own

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    @property
    def redis(self) -> bool:
        return bool(self.broker_url and self.broker_url.startswith(("redis://", "rediss://")))

    @property
    def amqp(self) -> bool:
        return bool(self.broker_url and self.broker_url.startswith(("amqp", "pyamqp")))

    def env_for(self, queue: str, **extra: str) -> dict[str, str]:
        """The environment of a ``celery -A celery_ledger.harness.demo_app`` process for
        ``queue``."""
        env = {
            "CELERY_LEDGER_DATA_DIR": str(self.data_dir),
            "CELERY_LEDGER_URL": self.ledger_url,
            "CELERY_RESULT_BACKEND": f"db+sqlite:///{self.data_dir / 'results.sqlite3'}",
            demo_app.ENV_QUEUE: queue,
            demo_app.ENV_NAMESPACE: self.namespace,
            demo_app.ENV_EFFECTS_URL: self.effects_url,
        }
        if self.broker_url:
            env["CELERY_BROKER_URL"] = self.broker_url
        env.update(extra)
        return env

    def queued(self, queue: str) -> int:
        """Messages waiting in ``queue`` now (best effort; -1 if the broker cannot tell)."""
        try:
            if self.embedded:
                return sum(1 for _ in (self.data_dir / "broker").glob(f"*.{queue}.msg"))
            if self.redis:
                import redis

                assert self.broker_url is not None
                client = redis.Redis.from_url(self.broker_url, socket_timeout=5)
                try:
                    return int(client.llen(demo_app.redis_keyprefix(self.namespace, queue) + queue))
                finally:
                    client.close()
            if self.amqp:
                from kombu import Connection

                with Connection(self.broker_url, connect_timeout=5) as conn:
                    channel = conn.channel()
                    try:
                        return int(channel.queue_declare(queue, passive=True).message_count)
                    finally:
                        channel.close()
        except Exception as exc:  # noqa: BLE001 - a count for the report, nothing depends on it
            log.debug("could not count %s: %s", queue, exc)
        return -1

    def describe(self) -> str:
        broker = "filesystem:// broker" if self.embedded else f"broker {safe_url(self.broker_url)}"
        ledger = (
            "SQLite ledger"
            if self.ledger_url.startswith("sqlite")
            else f"ledger {safe_url(self.ledger_url)}"
        )
        return f"{ledger}, {broker}"

    def ledger_commands(self, show: Iterable[str] = ()) -> list[str]:
        """How to look at the ledger this run used with the operator CLI."""
        url = safe_url(self.ledger_url)
        return [
            f"celery-ledger --url '{url}' list",
            f"celery-ledger --url '{url}' stats",
            *(f"celery-ledger --url '{url}' show {key}" for key in show),
        ]

    def remove(self, keep: bool, order_ids: Iterable[str], ledger_engine: Any) -> None:
        """Remove what the run created, unless ``keep``: its Redis keys or RabbitMQ queues
        (message bookkeeping, but what a kept run's queues and unacked hashes still hold is
        the evidence of a failure), its ledger entries and effects tables, and a temporary
        data directory."""
        if keep:
            return
        if self.redis:
            assert self.broker_url is not None
            try:
                demo_app.purge_redis(self.broker_url, self.namespace)
            except Exception as exc:  # noqa: BLE001 - report, go on removing the rest
                log.warning("could not remove the Redis keys of %s: %s", self.namespace, exc)
        if self.amqp:
            assert self.broker_url is not None
            try:
                demo_app.purge_amqp(self.broker_url, self.queues)
            except Exception as exc:  # noqa: BLE001 - report, go on removing the rest
                log.warning("could not remove the queues of %s: %s", self.namespace, exc)
        db = demo_app.EffectsDb(self.effects_url, self.namespace)
        try:
            if not self.owns_ledger:
                demo_app.drop_namespace(ledger_engine, order_ids, db)
        finally:
            db.dispose()
        if self.temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def safe_url(url: str | None) -> str:
    """``url`` with its password hidden."""
    if not url:
        return ""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not an SQLAlchemy URL (redis://)
        from kombu.utils.url import maybe_sanitize_url

        return str(maybe_sanitize_url(url))


# -- one workload under crashes ---------------------------------------------------------------


@dataclass(frozen=True)
class RunKind:
    """Which task a workload runs, and how its column is titled."""

    id: str
    task: str
    title: str
    subtitle: str
    ledgered: bool = False


class Workload:
    """One run: a queue, its workers (and beat), its orders, and how far they got.

    ``demo`` and ``verify`` differ only in what they do to the processes meanwhile.
    """

    #: With no new effect for this long, a plain run is over (a lost order never returns).
    PLAIN_IDLE = 3.0

    def __init__(
        self,
        kind: RunKind,
        box: Sandbox,
        orch: Orchestra,
        *,
        orders: int,
        concurrency: int,
        env: dict[str, str] | None = None,
        ledger_idle: float = 10.0,
    ) -> None:
        self.kind = kind
        self.box = box
        self.orch = orch
        self.concurrency = concurrency
        self.run = f"{box.namespace}-{kind.id}"
        self.queue = f"celery-ledger-demo-{self.run}"
        box.queues.append(self.queue)
        self.order_ids = [f"{self.run}-{i:04d}" for i in range(orders)]
        self.env = box.env_for(self.queue, **(env or {}))
        self.db = demo_app.EffectsDb(box.effects_url, box.namespace)
        self.workers: dict[str, Process] = {}
        self._worker_env: dict[str, dict[str, str]] = {}
        self._generation: dict[str, int] = {}
        self.beat: Process | None = None
        self.report = demo_app.RunReport(
            task=kind.task, title=f"{kind.title} {kind.subtitle}", ledgered=kind.ledgered
        )
        self.snapshot = demo_app.EffectsSnapshot({}, 0, None)
        #: Chains sent beside the orders (with a chord: ``verify``'s canvas workload), or
        #: None: the run is over only once the canvas is complete too (or nothing moves).
        self.canvas_chains: int | None = None
        #: The canvas's ledger keys, each with its chain's or the chord's id
        #: (``canvas_load.enqueue``): a chain stopped at a blocked task is over.
        self.canvas_keys: dict[str, str] = {}
        #: ``verify``'s time-and-cancellation workload (``time_load.TimeLoad``), or None: the
        #: run is over only once each of its tasks is terminal too.
        self.time_load: Any = None
        self.enqueued_at = 0.0
        self.finished = False
        self.ledger_idle = ledger_idle
        self._rows = -1
        self._progress_at = time.monotonic()
        #: When the effects table last changed (``mark_progress`` also counts entries that
        #: are not final yet: a ledgered run never goes idle while the ledger owns work).
        self._rows_at = time.monotonic()
        #: When the effects table last changed, and nothing else (``restart_stalled`` moves
        #: ``_rows_at`` on, so that the restarted workers get their time).
        self._effect_at = time.monotonic()
        #: Workers restarted because the run stalled (``restart_stalled``).
        self.unstuck = 0

    def node(self, name: str) -> str:
        return f"{name}-{self.run}@127.0.0.1"

    def start_worker(self, name: str, *, env: dict[str, str] | None = None) -> Process:
        """Start worker ``name`` (not waiting for it to be ready)."""
        if not self.workers:
            self.declare_queue()
        self._worker_env[name] = dict(env or {})
        return self.restart(name)

    def declare_queue(self) -> None:
        """Declare the run's queue once, from here, before any of its workers starts.

        kombu's ``filesystem://`` transport creates an exchange's binding file without holding
        its lock from the start: two workers binding the same exchange for the first time at
        once can read the file empty and die at start-up (``JSONDecodeError`` in
        ``_queue_bind``). Once the file exists, every later bind takes the lock first.
        """
        if not self.box.embedded:
            return
        app = demo_app.build_app(self.env)
        try:
            with app.connection_for_write() as conn:
                app.amqp.queues[self.queue].bind(conn.default_channel).declare()
        finally:
            app.close()

    def restart(self, name: str) -> Process:
        """Start worker ``name`` again, under the same node name (its boot sweep runs)."""
        self._generation[name] = self._generation.get(name, 0) + 1
        proc = self.orch.worker(
            f"{self.kind.id}-{name}-{self._generation[name]}",
            env={**self.env, **self._worker_env[name]},
            queue=self.queue,
            node=self.node(name),
            concurrency=self.concurrency,
        )
        self.workers[name] = proc
        return proc

    def start_beat(self) -> Process:
        self.beat = self.orch.beat(f"{self.kind.id}-beat", env=self.env)
        return self.beat

    def enqueue(self, gaps: Iterable[float]) -> None:
        """Send one order per id, with its gap (seconds between its effects)."""
        app = demo_app.build_app(self.env)
        try:
            self.enqueued_at = time.time()
            with app.producer_or_acquire() as producer:
                for i, (order_id, gap) in enumerate(zip(self.order_ids, gaps, strict=True)):
                    app.send_task(
                        self.kind.task, args=(self.run, order_id, 10 + i, gap), producer=producer
                    )
        finally:
            app.close()
        self.mark_progress()

    def mark_progress(self) -> None:
        self._progress_at = time.monotonic()

    def refresh(self) -> Any:
        """Count the effects now; any new row is progress."""
        self.snapshot = demo_app.effect_counts(self.db, self.run)
        if self.snapshot.rows != self._rows:
            self._rows = self.snapshot.rows
            self._rows_at = self._effect_at = time.monotonic()
            self.mark_progress()
        return self.snapshot

    def completed(self) -> int:
        return len(self.snapshot.with_effect("receipt") & set(self.order_ids))

    def moving(self, within: float) -> bool:
        """Whether the run is unfinished and recorded an effect in the last ``within`` s."""
        return not self.finished and time.monotonic() - self._effect_at < within

    def restart_stalled(self, after: float) -> list[str]:
        """Restart every worker of this run if no effect was recorded for ``after`` seconds
        while work is left (the names restarted; at most once per stall).

        After a broker connection is cut, kombu 5.x can leave a Redis worker alive and
        connected that never consumes again ("Couldn't ack ... ConnectionError"): a
        supervisor that restarts a stuck worker is what a deployment has, and what
        ``tests/test_broker_faults.py`` does after a Redis restart.
        """
        if self.finished or time.monotonic() - self._rows_at < after:
            return []
        names = list(self.workers)
        for name in names:
            self.workers[name].kill()
            self.restart(name)
        self._rows_at = time.monotonic()
        self.mark_progress()  # idle counts from here: the new workers, and the sweep, get time
        self.unstuck += 1
        return names

    def settle_tick(self, ledger_engine: Any) -> bool:
        """Whether the run is over: every order accounted for, or nothing moves any more.

        A ledgered order that is running or interrupted is work the ledger still owns, so
        the run is not idle while one exists.
        """
        from celery_ledger.ledger import EntryStatus

        self.refresh()
        done = self.completed() == len(self.order_ids)
        idle = self.PLAIN_IDLE
        if self.kind.ledgered:
            final = {EntryStatus.COMPLETED, EntryStatus.FAILED, EntryStatus.BLOCKED}
            outcomes = demo_app.ledger_outcomes(ledger_engine, self.order_ids)
            done = len(outcomes) == len(self.order_ids) and all(
                o.status in final for o in outcomes.values()
            )
            if done:
                # The children the completed orders sent (through the outbox) are work the
                # ledger owns too: the run is over once each of them settled or parked.
                sent = [
                    o
                    for o, out in outcomes.items()
                    if out.status is EntryStatus.COMPLETED and demo_app.sends_child(o)
                ]
                children = demo_app.child_statuses(ledger_engine, sent)
                done = all(children.get(o) in final for o in sent)
                if not done:
                    # Not idle either: a child whose message was lost waits for its
                    # intent's re-send or a sweep, longer than the idle time.
                    self.mark_progress()
            if self.canvas_chains is not None:
                # A chord's callback is published after its last member settles: the orders
                # can all be done while it is still queued.
                parked = canvas_load.blocked(ledger_engine, self.canvas_keys)
                canvas = canvas_load.tally(
                    self.snapshot, self.run, self.canvas_chains, parked=parked
                )
                # A chain or the chord stopped at a task parked ``blocked`` waits for an
                # operator, as a blocked order does: it is over for this run.
                done = done and not canvas.lost
                if canvas.lost and not self.box.embedded:
                    # A link, member or callback still to run is work the ledger owns (a
                    # member whose worker was killed waits for its lease and a sweep): on a
                    # loaded machine that takes longer than the idle time, and going idle
                    # would end the run with the chord unsettled. ``settle``'s bound still
                    # ends a run that never completes. Not on ``filesystem://``, which may
                    # drop a member before any claim (``canvas_load.CanvasReport.strict``).
                    self.mark_progress()
                if (
                    canvas.chord_members_done == canvas.chord_members
                    and not canvas.chord_callbacks
                    and canvas.chord_id not in canvas.blocked
                ):
                    # Every member done and no callback fails the run on any broker (the
                    # join's publish intent is the ledger's): on ``filesystem://`` a callback a
                    # killed worker had fetched comes back with that intent's re-send, after
                    # ``ledger_publish_intent_seconds``, longer than the idle time.
                    self.mark_progress()
            if any(o.status not in final for o in outcomes.values()):
                self.mark_progress()
            if self.time_load is not None and self.time_load.pending(ledger_engine):
                # A held task waits for its due time, a lost intent for its re-send: work
                # the ledger owns, so the run is neither done nor idle.
                done = False
                self.mark_progress()
            idle = self.ledger_idle
        if done or time.monotonic() - self._progress_at > idle:
            self.finished = True
        return self.finished

    def tally(self, ledger_engine: Any) -> Any:
        self.report.queued_at_end = self.box.queued(self.queue)
        return demo_app.tally(
            self.report,
            self.db,
            self.run,
            self.order_ids,
            ledger_engine if self.kind.ledgered else None,
            self.enqueued_at,
        )


# -- one command's run ------------------------------------------------------------------------

#: A short lease and sweep: a cut order is found within seconds, not minutes.
LEASE_SECONDS = 3.0
SWEEP_INTERVAL = 1.0
#: An order whose message the broker lost before any claim (a connection cut mid-fetch, a
#: worker killed with it prefetched) is re-sent this long after it was published. A queue
#: backlog longer than this costs a duplicate message, which the claim deduplicates.
PUBLISH_INTENT_SECONDS = 20.0
#: The death grace (``ledger_death_grace_seconds``): how long a takeover whose reconciler says
#: ``not_executed`` waits for the attempt that may have run the step to stay silent. Its
#: default, 120 s, is two default leases; with the runs' short lease it is four of theirs,
#: still longer than a ``pause`` (the lease and 1.5 s) and the renewal that follows it.
DEATH_GRACE_SECONDS = 4 * LEASE_SECONDS
#: The ledgered run is idle only after a lease could expire and a sweep pass.
LEDGER_IDLE_SECONDS = LEASE_SECONDS + 3 * SWEEP_INTERVAL + 2.0
#: The demo app every process of a run is.
APP = "celery_ledger.harness.demo_app"


class Stage:
    """One command's run: its sandbox, its processes, the ledger engine it counts with and
    its workloads (one per run kind, side by side)."""

    def __init__(self, box: Sandbox, orch: Orchestra, ledger_engine: Any) -> None:
        self.box = box
        self.orch = orch
        self.ledger_engine = ledger_engine
        self.works: list[Workload] = []
        #: Run once every process is stopped, before the sandbox is removed.
        self.cleanups: list[Callable[[], None]] = []

    def workload(
        self, kind: RunKind, *, orders: int, concurrency: int, env: dict[str, str] | None = None
    ) -> Workload:
        """A run of ``kind``, its processes on the short lease and sweep."""
        settings = {
            "CELERY_LEDGER_LEASE_SECONDS": str(LEASE_SECONDS),
            "CELERY_LEDGER_SWEEP_INTERVAL": str(SWEEP_INTERVAL),
            "CELERY_LEDGER_PUBLISH_INTENT_SECONDS": str(PUBLISH_INTENT_SECONDS),
            "CELERY_LEDGER_DEATH_GRACE_SECONDS": str(DEATH_GRACE_SECONDS),
        }
        work = Workload(
            kind,
            self.box,
            self.orch,
            orders=orders,
            concurrency=concurrency,
            env={**settings, **(env or {})},
            ledger_idle=LEDGER_IDLE_SECONDS,
        )
        self.works.append(work)
        return work

    def settle(
        self,
        seconds: float,
        *,
        interval: float,
        update: Callable[[], None],
        restart_stalled: float | None = None,
        restarted: Callable[[Workload, list[str]], None] | None = None,
        while_moving: float | None = None,
        cap: float | None = None,
    ) -> None:
        """Tick every run until each is finished (or idle), for at most ``seconds``.

        With ``restart_stalled``, restart the workers of a ledgered run that recorded no
        effect for that long while the ledger still owns work (``Workload.restart_stalled``).
        With ``while_moving``, the bound stretches, up to ``cap`` seconds in all, while an
        unfinished ledgered run recorded an effect within the last ``while_moving`` seconds: a
        run that is slow on a loaded machine is not a run that lost work, and what is counted
        at the end is what was lost, not how fast the rest went. Not for a plain run, whose
        redeliveries can keep it recording duplicates for as long as it is given.
        """
        started = time.monotonic()
        limit = seconds if cap is None else max(seconds, cap)

        def over() -> bool:
            spent = time.monotonic() - started
            if spent < seconds:
                return False
            if while_moving is None or spent >= limit:
                return True
            return not any(w.kind.ledgered and w.moving(while_moving) for w in self.works)

        while not over() and not all(w.finished for w in self.works):
            for w in self.works:
                if not w.finished:
                    w.settle_tick(self.ledger_engine)
                if restart_stalled is not None and w.kind.ledgered and not w.finished:
                    names = w.restart_stalled(restart_stalled)
                    if names and restarted is not None:
                        restarted(w, names)
            update()
            time.sleep(interval)

    def tally(self) -> dict[str, demo_app.RunReport]:
        """Count every run's effects (and ledger entries): run kind -> its report."""
        return {w.kind.id: w.tally(self.ledger_engine) for w in self.works}


@contextlib.contextmanager
def staged(
    prefix: str,
    *,
    broker: str | None,
    ledger: str | None,
    keep: bool,
    phases: Phases,
    note: str = "",
    effects_apart: bool = False,
) -> Iterator[Stage]:
    """A fresh sandbox with the ledger schema and the effects tables made, and an orchestra.

    On the way out, however it is left: every process is stopped, then the stage's cleanups
    run, then what the run created is removed (``Sandbox.remove``).
    """
    box = Sandbox.create(prefix=prefix, broker=broker, ledger=ledger, effects_apart=effects_apart)
    phases.note(f"data: {box.data_dir} ({box.describe()}){note}")
    ledger_engine = make_engine(box.ledger_url)
    stage: Stage | None = None
    try:
        with Orchestra(APP, box.data_dir / "logs") as orch:
            stage = Stage(box, orch, ledger_engine)
            prepare(box)
            yield stage
    finally:
        works = stage.works if stage is not None else []
        try:
            for cleanup in reversed(stage.cleanups if stage is not None else []):
                cleanup()
        finally:
            order_ids = [o for w in works if w.kind.ledgered for o in w.order_ids]
            for w in works:
                w.db.dispose()
            try:
                box.remove(keep, order_ids, ledger_engine)
            finally:
                ledger_engine.dispose()


def prepare(box: Sandbox) -> None:
    """Create the ledger schema and the effects tables before any process starts."""
    from celery_ledger.ledger import LedgerStore

    store = LedgerStore(box.ledger_url)
    try:
        store.ensure_ready()
    finally:
        store.dispose()
    db = demo_app.EffectsDb(box.effects_url, box.namespace)
    try:
        db.create()
    finally:
        db.dispose()


# -- live progress ----------------------------------------------------------------------------


class Phases:
    """One line per phase; on a terminal the line is rewritten as the phase progresses."""

    def __init__(self, total: int, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.live = not quiet and self.stream.isatty()
        self._n = 0
        self._name = ""
        self._started = 0.0
        self._last = 0.0

    def note(self, text: str) -> None:
        """A line of its own, outside any phase."""
        if not self.quiet:
            self.stream.write(f"{text}\n")
            self.stream.flush()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phases]:
        self._n += 1
        self._name = name
        self._started = time.monotonic()
        self.update("")
        yield self

    def update(self, text: str) -> None:
        """Rewrite the live line (at most 10 times a second)."""
        now = time.monotonic()
        if not self.live or (text and now - self._last < 0.1):
            return
        self._last = now
        line = f"{self._head()} {text}"
        self.stream.write("\r\033[K" + line[: shutil.get_terminal_size().columns - 1])
        self.stream.flush()

    def done(self, text: str) -> None:
        """End the phase with its summary line."""
        if self.quiet:
            return
        took = time.monotonic() - self._started
        prefix = "\r\033[K" if self.live else ""
        self.stream.write(f"{prefix}{self._head()} {text} ({took:.1f}s)\n")
        self.stream.flush()

    def _head(self) -> str:
        return f"[{self._n}/{self.total}] {self._name:<8}"


@contextlib.contextmanager
def quiet_logging() -> Iterator[None]:
    """Keep library warnings (an unreachable ledger during the run, ...) off the summary."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)


def run_command(
    what: str,
    *,
    header: str,
    as_json: bool,
    run: Callable[[Phases], Any],
    render: Callable[[Any], str],
) -> NoReturn:
    """The body of ``demo`` and ``verify``: ``run(phases)`` with library logging quieted, then
    its report (a dataclass with ``ok``) as one JSON document on stdout (the phases on
    stderr) or as ``render`` makes it; exit 0 if it is ok, else 1.

    On Ctrl-C or SIGTERM, exit the way a shell expects (128 + signal) once every process
    the command started is stopped.

    Raises:
        click.ClickException: a process exited before it was ready, or was not ready in time.
    """
    phases = Phases(4, stream=sys.stderr if as_json else sys.stdout)
    if not as_json:
        click.echo(header)
    try:
        with quiet_logging():
            report = run(phases)
    except ProcessFailed as exc:
        raise click.ClickException(str(exc)) from None
    except SignalStop as stop:
        click.echo(f"\ninterrupted ({stop}); every process {what} started is stopped", err=True)
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; every process {what} started is stopped", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2, sort_keys=True))
    else:
        click.echo(render(report))
    sys.exit(0 if report.ok else 1)


def side_by_side(
    kinds: Iterable[RunKind],
    runs: list[Any],
    rows: list[tuple[str, Any]],
    total: int,
    *,
    width: int = 16,
) -> list[str]:
    """The comparison table: one column per run kind, one line per ``(label, cell)`` row."""
    kinds = list(kinds)
    lines = [
        "",
        " " * 20 + "".join(f"{k.title:>{width}}" for k in kinds),
        " " * 20 + "".join(f"{k.subtitle:>{width}}" for k in kinds),
    ]
    for label, cell in rows:
        lines.append(f"{label:<20}" + "".join(f"{cell(r, total):>{width}}" for r in runs))
    return lines


#: ``--json`` and ``--concurrency``, the same in ``demo`` and ``verify``.
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
concurrency_option = click.option(
    "--concurrency",
    type=click.IntRange(1, 8),
    default=2,
    show_default=True,
    help="Pool processes per worker.",
)
