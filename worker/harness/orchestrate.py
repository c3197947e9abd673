"""Real ``celery worker`` and ``celery beat`` processes for ``demo`` and ``verify``, and the
sandbox they run in; every one of them is stopped, whatever happens.

- Each process runs in a session of its own (``start_new_session``): Ctrl-C in the terminal
  reaches only this command, and stopping a process by its process group reaches its pool
  processes too, and never anything this command did not start.
- ``Orchestra`` is a context manager: leaving it (normally, by an exception, by Ctrl-C or by
  SIGTERM, which it turns into ``SignalStop``) stops every process it started: SIGCONT (a
  stopped process cannot exit), SIGTERM, a bounded wait, then SIGKILL of the group.
- ``Sandbox`` is where a run lives: a data directory, a namespace, the broker, ledger and
  effects URLs, and the cleanup that removes exactly what the run created.
- ``Phases`` prints one live line per phase (rewritten in place on a terminal).

Every wait here is bounded in time.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, TypeVar

import click
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a worker may take to print "ready": importing Celery on 2 busy cores is slow.
READY_TIMEOUT = 90.0
#: Graceful stop (SIGTERM) before the group is SIGKILLed.
STOP_TIMEOUT = 8.0


class SignalStop(KeyboardInterrupt):
    """Raised in the main thread when SIGINT or SIGTERM arrives, so that cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def wait_until(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it is truthy; return its value, or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


class CeleryProcess:
    """One ``celery -A <app> ...`` process, started in a session of its own."""

    def __init__(
        self,
        name: str,
        args: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        app: str,
        ready_marker: str,
    ) -> None:
        self.name = name
        self.args = [sys.executable, "-m", "celery", "-A", app, *args]
        self.env = env
        self.log_path = log_path
        self.ready_marker = ready_marker
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.started_at = 0.0
        self.paused = False
        self._ready = False

    def start(self) -> CeleryProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args,
            cwd=self.log_path.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started_at = time.monotonic()
        log.debug("started %s pid=%s: %s", self.name, self.proc.pid, " ".join(self.args))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def is_ready(self) -> bool:
        """Whether the ready marker is in the log.

        Raises:
            click.ClickException: the process exited before it was ready.
        """
        if self._ready:
            return True
        if self.proc is not None and self.proc.poll() is not None:
            raise click.ClickException(
                f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                f"last lines of {self.log_path}:\n{self.log_text()[-2500:]}"
            )
        # Once seen, remembered: the log grows with every task and is not read again.
        self._ready = self.ready_marker in self.log_text()
        return self._ready

    def children(self) -> list[int]:
        """Pids of this process's direct children (its prefork pool processes)."""
        if not self.alive:
            return []
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
            return [int(p) for p in text.split()]
        except OSError:
            pass
        try:  # no /proc (macOS): pgrep knows
            out = subprocess.run(
                ["pgrep", "-P", str(self.pid)],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [int(p) for p in out.split()]

    def kill_child(self, pid: int) -> bool:
        """SIGKILL one pool process, only if it is a child of this process."""
        if pid not in self.children():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def kill(self) -> None:
        """SIGKILL the process and everything in its session (its pool processes)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP the whole group: the parent, its pool and its heartbeat threads."""
        if self.alive:
            os.killpg(self.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGCONT)
            self.paused = False

    def terminate(self) -> None:
        """Ask for a graceful stop (SIGCONT first: a stopped process cannot exit)."""
        if self.alive:
            try:
                os.killpg(self.pid, signal.SIGCONT)
                # The parent only: it shuts its pool down itself. SIGTERM to the whole group
                # would kill the pool processes under it, and the parent would fork new ones.
                os.kill(self.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        self.paused = False

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop gracefully if possible, then make sure nothing of the group is left."""
        if self.proc is None:
            return
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, timeout))
        # Also when the parent is gone: an orphaned pool process keeps the group alive.
        self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None


class Orchestra:
    """The processes of one command; all of them stopped on exit, Ctrl-C or SIGTERM."""

    def __init__(self, app: str, log_dir: Path) -> None:
        self.app = app
        self.log_dir = log_dir
        self.started: list[CeleryProcess] = []
        self._previous: dict[int, Any] = {}
        self._closed = False

    def worker(
        self,
        name: str,
        *,
        env: dict[str, str],
        queue: str,
        node: str,
        concurrency: int = 2,
        extra: Iterable[str] = (),
    ) -> CeleryProcess:
        """Start a prefork worker (not waiting for it to be ready)."""
        args = [
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            node,
            "-l",
            "info",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            *extra,
        ]
        return self._start(
            CeleryProcess(
                name,
                args,
                env=env,
                app=self.app,
                log_path=self.log_dir / f"{name}.log",
                ready_marker=" ready.",
            )
        )

    def beat(self, name: str, *, env: dict[str, str]) -> CeleryProcess:
        schedule = self.log_dir / f"{name}-schedule"
        args = ["beat", "-l", "info", "-s", str(schedule)]
        return self._start(
            CeleryProcess(
                name,
                args,
                env=env,
                app=self.app,
                log_path=self.log_dir / f"{name}.log",
                ready_marker="beat: Starting",
            )
        )

    def _start(self, proc: CeleryProcess) -> CeleryProcess:
        if self._closed:
            raise RuntimeError("the orchestra is stopped")
        self.started.append(proc)
        return proc.start()

    def wait_ready(self, procs: Iterable[CeleryProcess], timeout: float = READY_TIMEOUT) -> None:
        """Wait until every process printed its ready line.

        Raises:
            click.ClickException: one exited, or they were not ready within ``timeout``.
        """
        pending = list(procs)
        if (
            wait_until(lambda: all(p.is_ready() for p in pending), timeout=timeout, interval=0.2)
            is None
        ):
            late = [p for p in pending if not p.is_ready()]
            raise click.ClickException(
                f"{', '.join(p.name for p in late)} not ready after {timeout:.0f}s; last lines "
                f"of {late[0].log_path}:\n{late[0].log_text()[-2500:]}"
            )

    def stop_all(self) -> None:
        """Stop every process started, newest first. Safe to call twice."""
        # A second Ctrl-C (or SIGTERM) must not abandon the cleanup half way.
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {
                s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)
            }
        try:
            # All at once, then one shared deadline: stopping five workers one by one
            # would take five graceful timeouts.
            for proc in reversed(self.started):
                with contextlib.suppress(Exception):
                    proc.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT
            for proc in reversed(self.started):
                with contextlib.suppress(Exception):
                    proc.stop(timeout=deadline - time.monotonic())
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def __enter__(self) -> Orchestra:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, _raise_stop)
        atexit.register(self.stop_all)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop_all()
        finally:
            self._closed = True
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

    @classmethod
    def create(
        cls, *, prefix: str, broker: str | None, ledger: str | None, data_dir: Path | None = None
    ) -> Sandbox:
        """A fresh namespace, and a data directory (a new temporary one unless given).

        With no ``ledger`` the ledger and the effects tables are SQLite files in the data
        directory; with one, the effects tables live in the ledger database.
        """
        namespace = uuid.uuid4().hex[:8]
        temporary = data_dir is None
        path = Path(tempfile.mkdtemp(prefix=f"{prefix}-")) if data_dir is None else data_dir
        path.mkdir(parents=True, exist_ok=True)
        path = path.resolve()
        ledger_url = ledger or f"sqlite:///{path / 'ledger.sqlite3'}"
        effects_url = ledger or f"sqlite:///{path / 'effects.sqlite3'}"
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

    def env_for(self, queue: str, **extra: str) -> dict[str, str]:
        """The environment of a ``celery -A celery_ledger.harness.demo_app`` process for
        ``queue``."""
        from celery_ledger.harness import demo_app

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
        from celery_ledger.harness import demo_app

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
        """Remove what the run created: Redis keys always (they are only message
        bookkeeping); unless ``keep``, its ledger entries and effects tables, and a temporary
        data directory."""
        from celery_ledger.harness import demo_app

        if self.redis:
            assert self.broker_url is not None
            try:
                demo_app.purge_redis(self.broker_url, self.namespace)
            except Exception as exc:  # noqa: BLE001 - report, go on removing the rest
                log.warning("could not remove the Redis keys of %s: %s", self.namespace, exc)
        if keep:
            return
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
        from celery_ledger.harness import demo_app

        self.kind = kind
        self.box = box
        self.orch = orch
        self.concurrency = concurrency
        self.run = f"{box.namespace}-{kind.id}"
        self.queue = f"celery-ledger-demo-{self.run}"
        self.order_ids = [f"{self.run}-{i:04d}" for i in range(orders)]
        self.env = box.env_for(self.queue, **(env or {}))
        self.db = demo_app.EffectsDb(box.effects_url, box.namespace)
        self.workers: dict[str, CeleryProcess] = {}
        self._worker_env: dict[str, dict[str, str]] = {}
        self._generation: dict[str, int] = {}
        self.beat: CeleryProcess | None = None
        self.report = demo_app.RunReport(
            task=kind.task, title=f"{kind.title} {kind.subtitle}", ledgered=kind.ledgered
        )
        self.snapshot = demo_app.EffectsSnapshot({}, 0, None)
        self.enqueued_at = 0.0
        self.finished = False
        self.ledger_idle = ledger_idle
        self._rows = -1
        self._progress_at = time.monotonic()

    def node(self, name: str) -> str:
        return f"{name}-{self.run}@127.0.0.1"

    def start_worker(self, name: str, *, env: dict[str, str] | None = None) -> CeleryProcess:
        """Start worker ``name`` (not waiting for it to be ready)."""
        self._worker_env[name] = dict(env or {})
        return self.restart(name)

    def restart(self, name: str) -> CeleryProcess:
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

    def start_beat(self) -> CeleryProcess:
        self.beat = self.orch.beat(f"{self.kind.id}-beat", env=self.env)
        return self.beat

    def enqueue(self, gaps: Iterable[float]) -> None:
        """Send one order per id, with its gap (seconds between its effects)."""
        from celery_ledger.harness import demo_app

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
        from celery_ledger.harness import demo_app

        self.snapshot = demo_app.effect_counts(self.db, self.run)
        if self.snapshot.rows != self._rows:
            self._rows = self.snapshot.rows
            self.mark_progress()
        return self.snapshot

    def completed(self) -> int:
        return len(self.snapshot.with_effect("receipt") & set(self.order_ids))

    def settle_tick(self, ledger_engine: Any) -> bool:
        """Whether the run is over: every order accounted for, or nothing moves any more.

        A ledgered order that is running or interrupted is work the ledger still owns, so
        the run is not idle while one exists.
        """
        from celery_ledger.harness import demo_app
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
            if any(o.status not in final for o in outcomes.values()):
                self.mark_progress()
            idle = self.ledger_idle
        if done or time.monotonic() - self._progress_at > idle:
            self.finished = True
        return self.finished

    def tally(self, ledger_engine: Any) -> Any:
        from celery_ledger.harness import demo_app

        self.report.queued_at_end = self.box.queued(self.queue)
        return demo_app.tally(
            self.report,
            self.db,
            self.run,
            self.order_ids,
            ledger_engine if self.kind.ledgered else None,
            self.enqueued_at,
        )


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


def run_to_report(what: str, run: Callable[[], T]) -> T:
    """``run()`` with library logging quieted; on Ctrl-C or SIGTERM, exit the command the way
    a shell expects (128 + signal) once every process it started is stopped."""
    try:
        with quiet_logging():
            return run()
    except SignalStop as stop:
        click.echo(f"\ninterrupted ({stop}); every process {what} started is stopped", err=True)
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; every process {what} started is stopped", err=True)
        sys.exit(130)


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
