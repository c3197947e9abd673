"""``celery-ledger verify``: prove, on your own broker and ledger, that nothing is lost or
duplicated under chaos; and show what plain Celery does under the same chaos.

Two runs side by side, each with two workers on a queue of its own (the ledgered run also has
beat): N synthetic orders of three effect steps each, through ``LedgerTask`` and through a
plain Celery task with ``acks_late`` + ``reject_on_worker_lost`` (the plain configuration that
loses least). While they run, a chaos loop, bounded in actions and in time, picks at random
intervals (``--seed`` makes the choices repeatable; the timing is the machine's):

- ``kill-child``: SIGKILL one pool process;
- ``kill-worker``: SIGKILL a whole worker (parent and pool), restart it under the same name;
- ``pause``: SIGSTOP a worker past the lease, then SIGCONT: a zombie that wakes up fenced;
- ``ledger-outage``: PostgreSQL: cut the ledgered processes' connections for a few seconds
  (they reach the ledger through a TCP proxy on 127.0.0.1 that this command owns); SQLite:
  hold the write lock of verify's own ledger file for longer than the lease;
- ``broker-restart`` (Redis, RabbitMQ): every process of both runs reaches the broker through
  a TCP proxy on 127.0.0.1 that this command owns; it is cut for a few seconds, which is what
  a broker restart looks like from the workers (every connection drops, RabbitMQ requeues
  what they held unacked, kombu reconnects). Verify never restarts your server: what a real
  restart also loses on the server side (a Redis without persistence) is proven by the test
  suite against servers of its own (``tests/test_broker_faults.py``).

With ``--crash-ledger`` (design.md § "Durability follows effects") the chaos is something else:
verify starts a PostgreSQL
server of its own (``initdb`` into a temporary directory, on a free port of 127.0.0.1; see
``celery_ledger.harness.pgserver``) as the ledger, keeps the effects tables apart from it (an
SQLite file), and crashes it ``--crashes`` times (3) with ``pg_ctl stop -m immediate``,
restarting it after a moment each time. ``--durability`` sets the ledgered workers'
``ledger_durability`` (effects, every-write), so both modes can be proven the same way: no
duplicate, nothing lost; what a crash cost is counted as ``blocked``.

On Redis the second worker of each run has a 1 s visibility timeout, so the broker redelivers
tasks that are still running (celery #4400). (RabbitMQ does that only past its server-wide
``consumer_timeout``, which verify does not change on your server.) Each action hits both
runs at the same moment, the same way (the ledger outage has nothing to cut in the plain run).
Everything verify creates lives in a namespace of its own (queues, Redis key prefix, effects
tables, ledger keys) and is removed afterwards unless ``--keep``.

Counted at the end: **lost** (claimed by the ledger, never settled nor parked), **never
claimed** (sent, but no ledger entry: the broker dropped the message before any worker claimed
it, which no task-side ledger can see; ``filesystem://`` does this to what a SIGKILLed worker
had fetched), failed, blocked (with the ambiguous step), duplicated effects and the duplicate
rate (effect rows beyond one per order and effect), the ledger's own count of unauthorized
step re-runs, resumed entries and replayed steps. Every fifth ledgered order ends by sending a
child task through the transactional outbox (design.md § "Transaction steps and the transactional
outbox"), and with a ledger of its own database
(``--ledger``) its receipt is a transaction step (the effects tables live in the ledger's
database then): children that never ran to an end are counted as lost children. Beside them
runs the time-and-cancellation workload (``time_load``: a backlog with short ``expires``, held
countdowns, cancels mid-run, retries), counted on the ledger's database clock. The exit status
is 1 if the ledgered run lost or duplicated anything, its children and its timed tasks
included, or if an effect of a timed task started after its deadline or its cancellation.
"""

from __future__ import annotations

import logging
import math
import random
import sqlite3
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import click
from sqlalchemy.engine import make_url

from celery_ledger.harness import canvas_load, demo_app, time_load
from celery_ledger.harness.canvas_load import CanvasReport
from celery_ledger.harness.demo_app import RunReport
from celery_ledger.harness.orchestrate import (
    LEASE_SECONDS,
    PUBLISH_INTENT_SECONDS,
    Phases,
    RunKind,
    Sandbox,
    Workload,
    concurrency_option,
    json_option,
    run_command,
    safe_url,
    side_by_side,
    staged,
)
from celery_ledger.harness.processes import wait_ready
from celery_ledger.harness.tcpproxy import TcpProxy
from celery_ledger.harness.time_load import TimeLoad, TimeReport
from celery_ledger.ledger import LedgerStore
from celery_ledger.ledger.engine import is_sqlite

log = logging.getLogger(__name__)

#: Redis only: the second worker's visibility timeout; shorter than the long orders below.
VISIBILITY_TIMEOUT = 1.0
#: Seconds of work between an order's effects, drawn per order. Most orders are short; the
#: long ones outlive the visibility timeout, and give crashes something to land in.
GAPS = (0.02, 0.05, 0.1, 0.1, 0.2, 0.3, 1.2)
#: Seconds between chaos actions (uniform).
CHAOS_INTERVAL = (0.7, 2.5)
#: At most this many actions, whatever the duration.
MAX_ACTIONS = 400
#: How long a ledger outage lasts (PostgreSQL) or the SQLite write lock is held.
OUTAGE_SECONDS = {"postgresql": 2.5, "sqlite": LEASE_SECONDS + 1.0}
#: ``--crash-ledger``: seconds between crashes (uniform), and how long the server stays down.
CRASH_INTERVAL = (1.5, 3.0)
CRASH_DOWN_SECONDS = 1.5
#: How long a broker restart keeps the broker unreachable.
BROKER_RESTART_SECONDS = 3.0
#: Default ports of the brokers verify can proxy, when the URL names none.
BROKER_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "pyamqp": 5672}
#: After the chaos, how long the runs get to finish; stretched, up to ``SETTLE_CAP_SECONDS``
#: in all, while a run that is not finished still records effects (``Stage.settle``): on two
#: loaded cores 500 orders, their children and the canvas can need more than the bound after
#: a minute of chaos, and verify counts what was lost, not how fast the rest was done.
SETTLE_SECONDS = 120.0
SETTLE_MOVING_SECONDS = 30.0
SETTLE_CAP_SECONDS = 480.0
#: A ledgered run that records no effect for this long while the ledger owns work has a
#: worker that stopped consuming (kombu, after a broker cut): its workers are restarted.
STALL_SECONDS = 20.0

#: The ledgered workers' consumer watchdog (``celery_ledger.watchdog``): a worker that stops
#: consuming after a broker cut (kombu 5.x on Redis, "Couldn't ack ... ConnectionError")
#: reconnects within seconds, as a deployment that sets ``ledger_consumer_watchdog =
#: "restart"`` does; the settle phase's restart of a stalled run stays as the backstop.
WATCHDOG_SETTINGS = {
    "CELERY_LEDGER_CONSUMER_WATCHDOG": "restart",
    "CELERY_LEDGER_CONSUMER_WATCHDOG_SECONDS": "10",
}
#: The ledgered run's settings for the time-and-cancellation workload: a hold threshold short
#: enough that held countdowns are woken within the run, and a retry whose message the broker
#: dropped re-sent as soon as a lost publish is (the default, 300 s, would outlast the run).
TIME_SETTINGS = {
    "CELERY_LEDGER_HOLD_THRESHOLD_SECONDS": str(time_load.HOLD_THRESHOLD),
    "CELERY_LEDGER_RETRY_GRACE_SECONDS": str(PUBLISH_INTENT_SECONDS),
}
#: The timed tasks published before any worker is up.
BACKLOG_GROUPS = ("expire-backlog", "run-backlog")

KINDS = (
    RunKind("ledgered", demo_app.LEDGERED, "celery-ledger", "(LedgerTask)", ledgered=True),
    RunKind("plain", demo_app.PLAIN_ACKS_LATE, "plain Celery", "(acks_late)"),
)


# -- the ledger outage ------------------------------------------------------------------------


class LedgerOutage:
    """Cut the ledger for the ledgered run's processes, then restore it."""

    #: Why this broker/ledger pair cannot have an outage (None: it can).
    unavailable: str | None = None
    seconds = 0.0

    def worker_url(self, url: str) -> str:
        """The ledger URL the ledgered processes use."""
        return url

    def begin(self) -> str:
        raise NotImplementedError

    def end(self) -> None:
        """Restore the ledger. Safe to call when it is not cut."""

    def close(self) -> None:
        self.end()


class NoOutage(LedgerOutage):
    def __init__(self, why: str) -> None:
        self.unavailable = why


class ProxyOutage(LedgerOutage):
    """PostgreSQL: the ledgered processes connect through a proxy on 127.0.0.1; cut it."""

    seconds = OUTAGE_SECONDS["postgresql"]

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self.proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 5432).start()
        self._cut = False

    def worker_url(self, url: str) -> str:
        return (
            make_url(url)
            .set(host="127.0.0.1", port=self.proxy.port)
            .render_as_string(hide_password=False)
        )

    def begin(self) -> str:
        self.proxy.stop()
        self._cut = True
        return f"ledger connections cut for {self.seconds:.1f}s (TCP proxy stopped)"

    def end(self) -> None:
        if self._cut:
            self.proxy.start()
            self._cut = False

    def close(self) -> None:
        self.end()
        self.proxy.stop()


class SqliteStall(LedgerOutage):
    """SQLite has no connection to cut: hold its write lock past the lease instead.

    Every ledger write (claim, heartbeat, step, settle, sweep) waits; leases run out while
    their owners are alive, so the sweep that follows takes over live attempts, which must
    then find themselves fenced.
    """

    seconds = OUTAGE_SECONDS["sqlite"]

    def __init__(self, url: str) -> None:
        self.path = make_url(url).database or ""
        self._release = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> str:
        self._release.clear()
        locked = threading.Event()
        self._thread = threading.Thread(
            target=self._hold, args=(locked,), daemon=True, name="verify-sqlite-stall"
        )
        self._thread.start()
        locked.wait(timeout=35)
        return f"ledger write lock held for {self.seconds:.1f}s (SQLite)"

    def _hold(self, locked: threading.Event) -> None:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            conn.execute("BEGIN EXCLUSIVE")
            locked.set()
            # Bounded even if nobody calls end(): never hold a ledger hostage.
            self._release.wait(timeout=self.seconds + 10)
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.warning("could not hold the SQLite write lock: %s", exc)
        finally:
            locked.set()
            conn.close()

    def end(self) -> None:
        self._release.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def outage_for(box: Sandbox) -> LedgerOutage:
    if not is_sqlite(box.ledger_url):
        return ProxyOutage(box.ledger_url)
    if not box.owns_ledger:
        return NoOutage(
            "the SQLite ledger is not verify's own file; its write lock would "
            "stall every other process that uses it"
        )
    return SqliteStall(box.ledger_url)


class LedgerCrash(LedgerOutage):
    """``--crash-ledger``: the ledger is a PostgreSQL server of verify's own; ``begin`` crashes
    it (``pg_ctl stop -m immediate``), ``end`` starts it again (it recovers from its WAL)."""

    seconds = CRASH_DOWN_SECONDS

    def __init__(self, server: Any, after_restart: Any) -> None:
        self.unavailable = None
        self.server = server
        self.after_restart = after_restart
        self.down = False

    def begin(self) -> str:
        self.server.crash()
        self.down = True
        return (
            f"ledger PostgreSQL crashed (pg_ctl stop -m immediate, crash "
            f"{self.server.crashes}); restarted after {self.seconds:.1f}s"
        )

    def end(self) -> None:
        if self.down:
            self.server.start()
            self.down = False
            self.after_restart()


class BrokerRestart:
    """Every process of both runs reaches the broker through a proxy on 127.0.0.1 that this
    command owns; ``begin`` cuts every connection and refuses new ones, ``end`` listens again.
    """

    def __init__(self, broker_url: str | None) -> None:
        self.unavailable: str | None = None
        self.proxy: TcpProxy | None = None
        self._cut = False
        if broker_url is None:
            self.unavailable = "filesystem:// has no connection to cut"
            return
        parts = urllib.parse.urlsplit(broker_url)
        scheme = parts.scheme.split("+")[0]
        if scheme not in BROKER_PORTS or parts.scheme.startswith(("rediss", "amqps")):
            self.unavailable = f"{parts.scheme}:// is not proxied by verify"
            return
        self.proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or BROKER_PORTS[scheme])
        self.proxy.start()
        userinfo = parts.netloc.rpartition("@")[0]
        address = f"127.0.0.1:{self.proxy.port}"
        netloc = f"{userinfo}@{address}" if userinfo else address
        self.url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def begin(self) -> str:
        assert self.proxy is not None
        self.proxy.stop()
        self._cut = True
        return f"broker unreachable for {BROKER_RESTART_SECONDS:.1f}s (every connection cut)"

    def end(self) -> None:
        if self._cut and self.proxy is not None:
            self.proxy.start()
            self._cut = False

    def close(self) -> None:
        self.end()
        if self.proxy is not None:
            self.proxy.stop()


# -- the chaos loop ---------------------------------------------------------------------------


@dataclass
class ChaosLog:
    actions: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: Workers restarted in the settle phase because their run stalled (not chaos: the
    #: supervisor's answer to a worker that stopped consuming).
    settle_restarts: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(a["action"] for a in self.actions))

    def settle_restart(self, run: str, names: list[str]) -> None:
        stalled = f"no effect for {STALL_SECONDS:.0f}s with work left"
        self.settle_restarts.append(f"{run}: {stalled}; restarted {', '.join(names)}")


class Chaos:
    """Random actions at random intervals against every run alike; every timer it sets
    (SIGCONT, restoring the ledger) fires by ``finish`` at the latest."""

    def __init__(
        self,
        works: list[Workload],
        rng: random.Random,
        outage: LedgerOutage,
        chaos_log: ChaosLog,
        broker: BrokerRestart | None = None,
        crash: LedgerCrash | None = None,
        crashes: int = 0,
    ) -> None:
        self.works = works
        self.crash = crash
        self.max_actions = crashes if crash is not None else MAX_ACTIONS
        self.interval = CRASH_INTERVAL if crash is not None else CHAOS_INTERVAL
        self.rng = rng
        self.outage = outage
        self.broker = broker
        self.broker_down = False
        self.log = chaos_log
        self.started = time.monotonic()
        self.next_at = self.started + rng.uniform(*self.interval)
        self.timers: list[tuple[float, str, Any]] = []
        #: A drawn worker action no run could take yet (no worker ready: one still starting
        #: after a kill, on a loaded machine), with its draw: tried again at every tick until
        #: one run takes it, before anything new is drawn. Dropped, it would make the
        #: actions taken depend on the machine's speed, not on ``--seed``.
        self.pending: tuple[str, float] | None = None
        #: The end of the chaos window (``time.monotonic()``); the command sets it.
        self.until = math.inf
        self.outage_on = False
        weights = {
            "kill-child": 4,
            "kill-worker": 2,
            "pause": 2,
            "ledger-outage": 2,
            "broker-restart": 1,
        }
        if outage.unavailable:
            del weights["ledger-outage"]
        if broker is None or broker.unavailable:
            del weights["broker-restart"]
        if crash is not None:  # the ledger's crashes, and nothing else, so each is counted
            weights = {"ledger-crash": 1}
        self.actions = list(weights)
        self.weights = list(weights.values())

    def tick(self) -> None:
        now = time.monotonic()
        for timer in [t for t in self.timers if t[0] <= now]:
            self.timers.remove(timer)
            timer[2]()
        # A timer (a worker's restart) can take seconds on a loaded machine: no action is
        # taken, and none stays pending, once the chaos window is over.
        now = time.monotonic()
        if now >= self.until:
            self.pending = None
            return
        if self.pending is not None:
            action, pick = self.pending
            if self._act_on_runs(action, pick):
                self.pending = None
                self.next_at = now + self.rng.uniform(*self.interval)
            return
        if now >= self.next_at and len(self.log.actions) < self.max_actions:
            self.next_at = now + self.rng.uniform(*self.interval)
            self.act(self.rng.choices(self.actions, self.weights)[0])

    def act(self, action: str) -> None:
        # One draw decides the victim for every run: same schedule, same choices.
        pick = self.rng.random()
        at = round(time.monotonic() - self.started, 1)
        if action == "broker-restart":
            assert self.broker is not None
            if self.broker_down:
                return
            self.broker_down = True
            detail = self.broker.begin()
            self.timers.append(
                (time.monotonic() + BROKER_RESTART_SECONDS, "broker", self._end_broker)
            )
            self.log.actions.append({"t": at, "action": action, "run": "all", "detail": detail})
            return
        if action == "ledger-crash":
            assert self.crash is not None
            if self.crash.down:
                return
            detail = self.crash.begin()
            self.timers.append((time.monotonic() + self.crash.seconds, "restart", self.crash.end))
            self.log.actions.append(
                {"t": at, "action": action, "run": "ledgered", "detail": detail}
            )
            return
        if action == "ledger-outage":
            if self.outage_on:
                return
            self.outage_on = True
            detail = self.outage.begin()
            self.timers.append((time.monotonic() + self.outage.seconds, "outage", self._end_outage))
            self.log.actions.append(
                {"t": at, "action": action, "run": "ledgered", "detail": detail}
            )
            return
        if not self._act_on_runs(action, pick):
            self.pending = (action, pick)

    def _act_on_runs(self, action: str, pick: float) -> bool:
        """Take a worker action on every run that can; whether one could."""
        at = round(time.monotonic() - self.started, 1)
        taken = False
        for work in self.works:
            done = self._act_on(work, action, pick)
            if done:
                taken = True
                self.log.actions.append(
                    {"t": at, "action": action, "run": work.kind.id, "detail": done}
                )
        return taken

    def _act_on(self, work: Workload, action: str, pick: float) -> str | None:
        ready = [
            (n, p)
            for n, p in sorted(work.workers.items())
            if p.alive and not p.paused and p.is_ready()
        ]
        if not ready:
            return None
        name, proc = ready[int(pick * len(ready))]
        if action == "kill-child":
            children = proc.children()
            if not children:
                return None
            pid = children[int(pick * len(children)) % len(children)]
            return f"SIGKILL pool process {pid} of {name}" if proc.kill_child(pid) else None
        if action == "kill-worker":
            if len(ready) < 2:
                return None  # keep one worker consuming, or the run only ever restarts
            proc.kill()
            work.restart(name)
            return f"SIGKILL worker {name} (pid {proc.pid} and its pool), restarted"
        if action == "pause":
            if len(ready) < 2:
                return None
            proc.pause()
            seconds = LEASE_SECONDS + 1.5
            self.timers.append((time.monotonic() + seconds, "resume", proc.resume))
            return f"SIGSTOP worker {name} (pid {proc.pid}) for {seconds:.1f}s, then SIGCONT"
        raise ValueError(action)

    def all_done(self) -> bool:
        """Whether every crash ``--crash-ledger`` asked for happened (and the server is up
        again): the run does not end before, even if its orders are done."""
        if self.crash is None:
            return True
        return len(self.log.actions) >= self.max_actions and not self.crash.down

    def _end_outage(self) -> None:
        self.outage.end()
        self.outage_on = False

    def _end_broker(self) -> None:
        if self.broker is not None:
            self.broker.end()
        self.broker_down = False

    def finish(self) -> None:
        """Fire every pending timer now: resume paused workers, restore the ledger."""
        for _, _, fn in sorted(self.timers, key=lambda t: t[0]):
            fn()
        self.timers.clear()
        self.outage.end()
        self.outage_on = False
        self._end_broker()
        if self.crash is not None:
            self.crash.end()


# -- the command ------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    ok: bool
    seed: int
    tasks: int
    duration: float
    concurrency: int
    broker: str
    ledger: str
    seconds: float
    runs: dict[str, RunReport]
    chaos: dict[str, Any]
    #: The ledgered run's chains and chord (``canvas_load``).
    canvas: CanvasReport | None = None
    #: The ledgered run's time-and-cancellation workload (``time_load``).
    time: TimeReport | None = None
    kept: bool = False
    data_dir: str = ""
    #: The ledgered workers' ``ledger_durability`` ("" : their default).
    durability: str = ""
    #: ``--crash-ledger``: how often the ledger's own PostgreSQL was crashed.
    ledger_crashes: int = 0


def run_verify(
    *,
    tasks: int,
    duration: float,
    seed: int,
    concurrency: int,
    broker: str | None,
    ledger: str | None,
    keep: bool,
    phases: Phases,
    crash_ledger: bool = False,
    crashes: int = 3,
    durability: str | None = None,
) -> VerifyReport:
    if not crash_ledger:
        return _run_verify(
            tasks,
            duration,
            seed,
            concurrency,
            broker,
            ledger,
            keep,
            phases,
            None,
            crashes,
            durability,
        )
    from celery_ledger.harness.pgserver import OwnPostgres

    server = OwnPostgres()
    try:
        server.start()
        return _run_verify(
            tasks,
            duration,
            seed,
            concurrency,
            broker,
            server.url,
            keep,
            phases,
            server,
            crashes,
            durability,
        )
    finally:
        server.close()


def _run_verify(
    tasks: int,
    duration: float,
    seed: int,
    concurrency: int,
    broker: str | None,
    ledger: str | None,
    keep: bool,
    phases: Phases,
    server: Any,
    crashes: int,
    durability: str | None,
) -> VerifyReport:
    started = time.monotonic()
    rng = random.Random(seed)
    chaos_log = ChaosLog()
    gaps = [rng.choice(GAPS) for _ in range(tasks)]
    with staged(
        "celery-ledger-verify",
        broker=broker,
        ledger=ledger,
        keep=keep,
        phases=phases,
        note=f"; seed {seed}",
        effects_apart=server is not None,
    ) as stage:
        box = stage.box
        crash: LedgerCrash | None = None
        if server is not None:
            outage: LedgerOutage = NoOutage("--crash-ledger crashes the ledger instead")
            # The counting engine's connections die with the server: drop them after each
            # restart (the workers' own reconnect, which is what is under test).
            crash = LedgerCrash(server, stage.ledger_engine.dispose)
        else:
            outage = outage_for(box)
        stage.cleanups.append(outage.close)
        if outage.unavailable:
            chaos_log.skipped.append(f"ledger-outage: {outage.unavailable}")
        broker_restart = BrokerRestart(box.broker_url)
        stage.cleanups.append(broker_restart.close)
        if broker_restart.unavailable:
            chaos_log.skipped.append(f"broker-restart: {broker_restart.unavailable}")
        second: dict[str, str] = {}
        if box.redis:
            second = {demo_app.ENV_VISIBILITY: str(VISIBILITY_TIMEOUT)}
        elif box.amqp:
            chaos_log.skipped.append(
                "visibility-timeout redelivery: RabbitMQ redelivers a running task only past "
                "its server-wide consumer_timeout, which verify does not change on your server"
            )
        else:
            chaos_log.skipped.append(
                "visibility-timeout redelivery: Redis only (filesystem:// never "
                "redelivers a message a worker holds)"
            )
        for kind in KINDS:
            env = {}
            if kind.ledgered:
                env["CELERY_LEDGER_URL"] = outage.worker_url(box.ledger_url)
                env.update(TIME_SETTINGS)
                env.update(WATCHDOG_SETTINGS)
                if durability:
                    env["CELERY_LEDGER_DURABILITY"] = durability
            if not broker_restart.unavailable:
                env["CELERY_BROKER_URL"] = broker_restart.url
            stage.workload(kind, orders=tasks, concurrency=concurrency, env=env)
        works = stage.works
        ledgered = next(w for w in works if w.kind.ledgered)
        load = TimeLoad(ledgered.run, tasks, random.Random(f"{seed}-time"))
        ledgered.time_load = load
        # verify's own app and store for the workload: the ledger reached directly, never
        # through the outage's proxy (a cancellation is the operator's, not a worker's).
        load_app = demo_app.build_app({**ledgered.env, "CELERY_LEDGER_URL": box.ledger_url})
        load_store = LedgerStore(box.ledger_url)
        stage.cleanups.append(load_app.close)
        stage.cleanups.append(load_store.dispose)
        if not keep and not box.owns_ledger:
            stage.cleanups.append(lambda: canvas_load.drop(stage.ledger_engine, load.keys()))
        with phases.phase("start"):
            # A backlog: published while no worker is up (the short ``expires`` pass in it).
            ledgered.declare_queue()
            backlog = load.publish(load_app, BACKLOG_GROUPS)
            procs = []
            for w in works:
                procs += [w.start_worker("w1"), w.start_worker("w2", env=second)]
                if w.kind.ledgered:
                    procs.append(w.start_beat())
            phases.update(f"starting {len(procs)} processes ...")
            wait_ready(procs)
            chains = canvas_load.chains_for(tasks)
            canvas_keys: dict[str, str] = {}
            for w in works:
                w.enqueue(gaps)
                if w.kind.ledgered:
                    canvas_keys = _enqueue_canvas(w, chains)
                    w.canvas_chains = chains
                    w.canvas_keys = canvas_keys
                    if not keep and not box.owns_ledger:

                        def drop_canvas(keys: dict[str, str] = canvas_keys) -> None:
                            canvas_load.drop(stage.ledger_engine, keys)

                        stage.cleanups.append(drop_canvas)
            rest = load.publish(
                load_app, tuple(g for g in time_load.GROUPS if g not in BACKLOG_GROUPS)
            )
            phases.done(
                f"{len(procs)} processes up; {tasks} orders sent to each run, "
                f"{chains} chain(s) and a chord of {canvas_load.CHORD_SIZE} to the ledgered "
                f"one, and {backlog + rest} timed tasks ({backlog} before any worker was up)"
            )
        with phases.phase("chaos"):
            chaos = Chaos(works, rng, outage, chaos_log, broker_restart, crash, crashes)
            deadline = chaos.until = time.monotonic() + duration

            def cancel_due() -> None:
                # Not while verify's own SQLite stall holds the write lock (the loop that
                # ends it would wait behind it), nor while the ledger's server is down.
                if not chaos.outage_on and not (crash is not None and crash.down):
                    load.tick(load_app, load_store, ledgered.snapshot)

            try:
                while time.monotonic() < deadline and not (
                    chaos.all_done() and _drained(works, stage.ledger_engine)
                ):
                    chaos.tick()
                    cancel_due()
                    phases.update(_status(works, chaos_log))
                    time.sleep(0.1)
            finally:
                chaos.finish()
            counts = chaos_log.counts()
            phases.done(
                ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "no action was due"
            )
        with phases.phase("settle"):
            for w in works:  # a worker killed last is still starting: let it come up
                w.finished = False
                w.mark_progress()

            def settle_update() -> None:
                cancel_due()
                phases.update(_status(works, chaos_log))

            stage.settle(
                SETTLE_SECONDS,
                interval=0.25,
                update=settle_update,
                restart_stalled=STALL_SECONDS,
                restarted=lambda w, names: chaos_log.settle_restart(w.kind.id, names),
                while_moving=SETTLE_MOVING_SECONDS,
                cap=SETTLE_CAP_SECONDS,
            )
            phases.done("every run finished or went idle")
        stage.orch.stop_all()
        with phases.phase("count"):
            reports = stage.tally()
            timed = load.tally(ledgered.db, stage.ledger_engine)
            canvas = canvas_load.tally(
                demo_app.effect_counts(ledgered.db, ledgered.run),
                ledgered.run,
                chains,
                strict=box.broker_url is not None and not box.broker_url.startswith("filesystem"),
                parked=canvas_load.blocked(stage.ledger_engine, canvas_keys),
            )
            if canvas.lost:
                canvas.unfinished = canvas_load.unfinished(stage.ledger_engine, canvas_keys)
            phases.done("effects and ledger entries counted")
    led = reports["ledgered"]
    ok = (
        led.lost == 0
        and led.duplicate_effects == 0
        and led.charged_twice == 0
        and led.ledger_duplicate_executions == 0
        and led.children_lost == 0
        and canvas.ok
        and timed.ok
    )
    return VerifyReport(
        ok=ok,
        seed=seed,
        tasks=tasks,
        duration=duration,
        concurrency=concurrency,
        broker=safe_url(box.broker_url) or "filesystem://",
        ledger=safe_url(box.ledger_url),
        seconds=round(time.monotonic() - started, 1),
        runs=reports,
        canvas=canvas,
        time=timed,
        chaos={
            "actions": chaos_log.actions,
            "counts": chaos_log.counts(),
            "skipped": chaos_log.skipped,
            "settle_restarts": chaos_log.settle_restarts,
        },
        kept=keep,
        data_dir=str(box.data_dir),
        durability=durability or "",
        ledger_crashes=server.crashes if server is not None else 0,
    )


def _enqueue_canvas(work: Workload, chains: int) -> dict[str, str]:
    app = demo_app.build_app(work.env)
    try:
        return canvas_load.enqueue(app, work.run, chains)
    finally:
        app.close()


def _drained(works: list[Workload], ledger_engine: Any) -> bool:
    """Whether the chaos can stop early: every run accounted for everything, or went idle
    (a plain run's lost orders never come back; neither does a message the broker lost).
    Not while the ledger cannot be read (``--crash-ledger`` crashed it)."""
    from sqlalchemy.exc import DBAPIError

    try:
        return all([w.finished or w.settle_tick(ledger_engine) for w in works])
    except DBAPIError:
        return False


def _status(works: list[Workload], chaos_log: ChaosLog) -> str:
    done = " · ".join(f"{w.kind.id} {w.completed()}/{len(w.order_ids)}" for w in works)
    return f"{done} · {len(chaos_log.actions)} actions"


# -- output -----------------------------------------------------------------------------------


def _rate(r: RunReport) -> str:
    return f"{100 * r.duplicate_rate:.2f}%"


ROWS = [
    ("orders completed", lambda r, n: f"{r.completed}/{n}"),
    ("lost", lambda r, n: str(r.lost)),
    ("never claimed", lambda r, n: str(r.never_claimed) if r.ledgered else "-"),
    ("failed", lambda r, n: str(r.failed) if r.ledgered else "-"),
    ("blocked (parked)", lambda r, n: str(r.blocked) if r.ledgered else "-"),
    ("duplicate effects", lambda r, n: str(r.duplicate_effects)),
    ("charged twice", lambda r, n: str(r.charged_twice)),
    ("duplicate rate", lambda r, n: _rate(r)),
    ("ledger re-runs", lambda r, n: str(r.ledger_duplicate_executions) if r.ledgered else "-"),
    (
        "children run / lost",
        lambda r, n: f"{r.children_completed} / {r.children_lost}" if r.ledgered else "-",
    ),
    ("resumed", lambda r, n: str(r.resumed) if r.ledgered else "-"),
    ("steps replayed", lambda r, n: str(r.steps_replayed) if r.ledgered else "-"),
    ("time taken", lambda r, n: f"{r.seconds:.1f}s"),
]


def render(report: VerifyReport) -> str:
    runs = [report.runs[k.id] for k in KINDS]
    lines = side_by_side(KINDS, runs, ROWS, report.tasks)
    lines.append("")
    counts = report.chaos["counts"]
    if report.durability:
        lines.append(f"ledgered workers: ledger_durability = {report.durability}")
    lines.append("chaos: " + (", ".join(f"{n} × {a}" for a, n in sorted(counts.items())) or "none"))
    for skipped in report.chaos["skipped"]:
        lines.append(f"  skipped {skipped}")
    led = report.runs["ledgered"]
    if led.reconciler:
        answers = ", ".join(f"{v} {n}" for v, n in sorted(led.reconciler.items()))
        lines.append(f"reconciler answers: {answers}")
    for b in led.blocked_orders:
        steps = ", ".join(b["ambiguous_steps"]) or "(none started)"
        lines.append(f"blocked {b['order_id']}: ambiguous step {steps}: {b['reason']}")
    for f in led.failed_orders:
        lines.append(f"failed  {f['order_id']}: {f['error']}")
    if led.never_claimed:
        lines.append(
            f"never claimed: {led.never_claimed} ledgered order(s) were never claimed "
            f"by a worker ({led.queued_at_end} message(s) still queued): the broker dropped "
            "them first (filesystem:// forgets what a SIGKILLed worker had fetched). "
            f"{led.never_claimed_with_intent} of them have a publish intent in the ledger, "
            "which the sweep re-sends once ledger_publish_intent_seconds pass (after this "
            "run); the others have no entry, which no task-side ledger can see"
        )
    if report.canvas is not None:
        lines.append(report.canvas.line())
        if report.canvas.incomplete:
            lines.append("  incomplete: " + ", ".join(report.canvas.incomplete[:10]))
            for item, why in report.canvas.blocked.items():
                lines.append(f"  blocked {item}: {why}")
            for e in report.canvas.unfinished[:10]:
                why = e.get("reason") or ""
                lines.append(f"  unfinished {e['key'][:16]}…: {e['status']} {why}")
    if report.time is not None:
        lines.append(report.time.line())
        for violation in report.time.violations:
            lines.append(f"  {violation}")
        for b in report.time.blocked_items:
            lines.append(f"  blocked {b['item']}: {b['reason']}")
        if report.time.lost_items:
            lines.append("  lost: " + ", ".join(report.time.lost_items))
    lines.append("")
    verdict = (
        click.style("PASS", fg="green", bold=True)
        if report.ok
        else click.style("FAIL", fg="red", bold=True)
    )
    lines.append(
        f"{verdict}: ledgered run: {led.lost} lost after a claim, "
        f"{led.duplicate_effects} duplicated effect(s), {led.blocked} blocked, "
        f"{led.failed} failed, {led.never_claimed} never claimed, {led.resumed} resumed."
        f" Seed {report.seed}; {report.seconds:.0f}s on {report.broker} with ledger "
        f"{report.ledger}."
    )
    if report.time is not None and not report.time.ok:
        t = report.time
        lines.append(
            f"timed tasks: {t.effects_after_deadline} effect(s) started after a deadline, "
            f"{t.effects_after_cancel} after a cancellation, {t.ungated_effects} with no gate, "
            f"{t.lost} lost, {t.duplicate_effects} duplicated."
        )
    if report.kept:
        lines.append(f"Data kept in {report.data_dir}.")
    return "\n".join(lines)


def _finite(param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param=param)
    return value


@click.command("verify")
@click.option(
    "--tasks",
    type=click.IntRange(1, 100_000),
    default=500,
    show_default=True,
    help="Orders per run (three effect steps each).",
)
@click.option(
    "--duration",
    # FloatRange alone lets NaN through: every comparison with NaN is false.
    type=click.FloatRange(1, 3600),
    callback=lambda ctx, param, value: _finite(param, value),
    default=60.0,
    show_default=True,
    help="Longest the chaos loop runs, in seconds.",
)
@click.option("--seed", type=int, help="Seed of the random choices (printed when not given).")
@json_option
@click.option(
    "--broker",
    envvar="CELERY_BROKER_URL",
    metavar="URL",
    help="Broker URL (redis://..., amqp://...); default: filesystem:// in a temporary directory.",
)
@click.option(
    "--ledger",
    "ledger_url",
    metavar="URL",
    help="Ledger URL; default: the group's --url / CELERY_LEDGER_URL, else SQLite "
    "in a temporary directory.",
)
@concurrency_option
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the data directory, the ledger rows and the broker's keys or queues.",
)
@click.option(
    "--crash-ledger",
    is_flag=True,
    help="Run the ledger on a PostgreSQL server of verify's own (initdb, a free port) and "
    "crash it (pg_ctl stop -m immediate) instead of the usual chaos.",
)
@click.option(
    "--crashes",
    type=click.IntRange(1, 20),
    default=3,
    show_default=True,
    help="With --crash-ledger: how many times the ledger's server is crashed and restarted.",
)
@click.option(
    "--durability",
    type=click.Choice(["effects", "every-write"]),
    help="The ledgered workers' ledger_durability (default: theirs).",
)
@click.pass_context
def verify(
    ctx: click.Context,
    tasks: int,
    duration: float,
    seed: int | None,
    as_json: bool,
    broker: str | None,
    ledger_url: str | None,
    concurrency: int,
    keep: bool,
    crash_ledger: bool,
    crashes: int,
    durability: str | None,
) -> None:
    """Run synthetic orders under chaos; fail if the ledgered run lost or duplicated any."""
    if crash_ledger and ledger_url is not None:
        raise click.UsageError(
            "--crash-ledger runs a PostgreSQL server of its own: give no --ledger"
        )
    if crash_ledger:
        from celery_ledger.harness.pgserver import PostgresUnavailable, find_bindir

        try:
            find_bindir()
        except PostgresUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    if ledger_url is None and ctx.parent is not None and not crash_ledger:
        ledger_url = ctx.parent.params.get("url")
    if seed is None:
        seed = random.SystemRandom().randrange(1, 2**31)
    run_command(
        "verify",
        header=f"celery-ledger verify: {tasks} orders per run under chaos for at most "
        f"{duration:.0f}s (reproduce the choices with --seed {seed})",
        as_json=as_json,
        run=lambda phases: run_verify(
            tasks=tasks,
            duration=duration,
            seed=seed,
            concurrency=concurrency,
            broker=broker,
            ledger=ledger_url,
            keep=keep,
            phases=phases,
            crash_ledger=crash_ledger,
            crashes=crashes,
            durability=durability,
        ),
        render=render,
    )


COMMANDS = [verify]
