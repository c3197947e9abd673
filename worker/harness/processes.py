"""Real processes for ``demo``, ``verify``, the tests and the benchmarks: each started in a
session of its own, watched through its log file, and always stopped.

- ``Process``: one command (usually ``celery -A <app> ...``) started with
  ``start_new_session``, its output in a log file. Its process group is then exactly the
  command and what it forked (the prefork pool): signalling the group reaches the pool
  processes and never anything the caller did not start.
- ``ProcessGroup``: the processes of one run. Leaving it (normally or by an exception) stops
  every one of them against one shared deadline.
- ``wait_for``: poll a condition; every wait is bounded in time.

A stop is always the same four moves: SIGCONT to the group (a stopped process cannot exit),
SIGTERM to the parent only (a warm shutdown; SIGTERM to the whole group would kill the pool
processes, and a Celery parent would fork new ones and keep consuming), a bounded wait, then
SIGKILL of the group (also when the parent is gone: an orphaned pool process keeps the group
alive).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

#: What a Celery worker prints once it consumes.
WORKER_READY = " ready."
#: What ``celery beat`` prints once its scheduler runs.
BEAT_READY = "beat: Starting"
#: How long a worker may take to print "ready": importing Celery on 2 busy cores is slow.
READY_TIMEOUT = 90.0
#: Graceful stop (SIGTERM to the parent) before the group is SIGKILLed.
STOP_TIMEOUT = 8.0
#: How long a SIGKILLed parent may take to be reaped (it cannot refuse; this is scheduling).
KILL_WAIT = 10.0
#: How much of a log a failure message quotes.
LOG_TAIL = 2500


class WaitTimeout(TimeoutError):
    """Raised when a condition did not come true within its bound."""


class ProcessFailed(RuntimeError):
    """Raised when a process exited before it was ready, or was not ready in time."""


def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "condition",
    check: Callable[[], None] | None = None,
) -> Any:
    """Poll ``predicate`` until it is truthy and return its value.

    ``check`` runs between polls and may raise to end the wait early (a process that died).

    Raises:
        WaitTimeout: ``predicate`` was still falsy after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def child_env(
    overrides: Mapping[str, str],
    *,
    drop_prefixes: tuple[str, ...] = (),
    pythonpath: Iterable[Path | str] = (),
) -> dict[str, str]:
    """This process's environment for a child: the variables starting with ``drop_prefixes``
    left out, ``overrides`` applied, then ``pythonpath`` put first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    env.update(overrides)
    first = [str(p) for p in pythonpath]
    if first:
        env["PYTHONPATH"] = os.pathsep.join([*first, env.get("PYTHONPATH", "")])
    return env


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (a zombie is not). False without /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold ``signums`` back for the block, then deliver the first that came to the handler
    in place before. Only the main thread can install handlers: elsewhere, a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            # None: a handler not installed from Python, which cannot be put back.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


class Process:
    """One command started in a session of its own, its output in ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        cwd: Path | None = None,
        ready_marker: str | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.cwd = cwd or log_path.parent
        #: The log line that says the process is ready (None: ready once started).
        self.ready_marker = ready_marker
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self._log: IO[bytes] | None = None
        self._ready = False

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # A Ctrl-C raised inside Popen, after the fork, would leave a child that nothing
        # holds: it waits until the child is held here, so that stopping reaches it.
        with signals_deferred():
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        log.debug("started %s pid=%s: %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- the log ---------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL) -> str:
        return self.log_text()[-chars:]

    def _logged(self, text: str, *, count: int = 1, before: str) -> bool:
        """Whether ``text`` is in the log ``count`` times.

        Raises:
            ProcessFailed: it is not, and the process has exited (naming ``before``).
        """
        # Whether it exited is asked first: once it has, the log holds all it will ever say.
        exited = self.proc is not None and self.proc.poll() is not None
        if self.log_text().count(text) >= count:
            return True
        if exited:
            assert self.proc is not None
            raise ProcessFailed(
                f"{self.name} exited with status {self.proc.returncode} before {before}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )
        return False

    def is_ready(self) -> bool:
        """Whether the ready marker is in the log.

        Raises:
            ProcessFailed: the process exited before it was ready.
        """
        if not self._ready and self.ready_marker is not None:
            # Once seen, remembered: the log grows with every task and is not read again.
            self._ready = self._logged(self.ready_marker, before="it was ready")
        return self._ready or self.ready_marker is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> Process:
        """Raises: ProcessFailed: it exited, or was not ready within ``timeout``."""
        wait_ready([self], timeout)
        return self

    def wait_log(self, text: str, *, timeout: float, count: int = 1) -> None:
        """Wait until ``text`` is in the log ``count`` times.

        Raises:
            ProcessFailed: the process exited first.
            WaitTimeout: not within ``timeout``; the message quotes the log.
        """

        def seen() -> bool:
            return self._logged(text, count=count, before=f"{text!r} was in its log")

        try:
            wait_for(seen, timeout=timeout, what=f"{text!r} in {self.log_path.name}")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; last lines:\n{self.log_tail()}") from None

    # -- its children and signals ----------------------------------------------------------

    def children(self) -> list[int]:
        """Pids of this process's direct children (a worker's prefork pool processes)."""
        if not self.alive:
            return []
        try:
            # Every thread's list: billiard re-forks a lost pool process from its supervisor
            # thread, and /proc lists a child under the thread that forked it.
            pids: list[int] = []
            for thread in Path(f"/proc/{self.pid}/task").iterdir():
                pids += [int(p) for p in (thread / "children").read_text().split()]
            return sorted(set(pids))
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

    def kill(self) -> None:
        """SIGKILL the process and everything in its session (its pool processes)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=KILL_WAIT)
        # The pool processes die with their parent's group, but not always before it is
        # reaped: one still exiting is a process the caller was told is gone.
        while group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.paused = False

    def terminate(self) -> None:
        """Ask for a warm shutdown: SIGCONT to the group, then SIGTERM to the parent only."""
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
        """Stop warmly if the process does within ``timeout``, then SIGKILL whatever is left
        of the group. Safe to call twice, and on a process that never started."""
        try:
            if self.proc is not None:
                self.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=max(0.0, timeout))
                # Also when the parent is gone: an orphaned pool process keeps the group alive.
                self.kill()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


def wait_ready(procs: Iterable[Process], timeout: float = READY_TIMEOUT) -> None:
    """Wait until every process printed its ready line.

    Raises:
        ProcessFailed: one exited, or they were not all ready within ``timeout``.
    """
    pending = list(procs)
    try:
        wait_for(
            lambda: all(p.is_ready() for p in pending),
            timeout=timeout,
            interval=0.2,
            what="ready",
        )
    except WaitTimeout:
        late = [p for p in pending if not p.is_ready()]
        raise ProcessFailed(
            f"{', '.join(p.name for p in late)} not ready after {timeout:.0f}s; last lines "
            f"of {late[0].log_path}:\n{late[0].log_tail()}"
        ) from None


class ProcessGroup:
    """The processes of one run, each logging to ``log_dir/<name>.log``; leaving the group
    stops every one of them, however it is left.

    ``app`` is the Celery app of ``celery``, ``worker`` and ``beat``; ``env`` is what every
    process gets on top of this one's environment (see ``child_env`` for ``drop_prefixes``
    and ``pythonpath``); ``cwd`` defaults to ``log_dir``.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        app: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        drop_prefixes: tuple[str, ...] = (),
        pythonpath: Iterable[Path | str] = (),
        stop_timeout: float = STOP_TIMEOUT,
    ) -> None:
        self.log_dir = log_dir
        self.app = app
        self.env = dict(env or {})
        self.cwd = cwd or log_dir
        self.drop_prefixes = drop_prefixes
        self.pythonpath = list(pythonpath)
        self.stop_timeout = stop_timeout
        self.started: list[Process] = []
        self._closed = False

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_marker: str | None = None,
    ) -> Process:
        """Start ``argv`` (not waiting for it to be ready).

        Raises:
            RuntimeError: the group is already stopped.
        """
        if self._closed:
            raise RuntimeError("the process group is stopped")
        proc = Process(
            name,
            argv,
            env=child_env(
                {**self.env, **(env or {})},
                drop_prefixes=self.drop_prefixes,
                pythonpath=self.pythonpath,
            ),
            log_path=self.log_dir / f"{name}.log",
            cwd=self.cwd,
            ready_marker=ready_marker,
        )
        # Listed before it starts: a start that fails half way is still stopped.
        self.started.append(proc)
        return proc.start()

    def celery(
        self,
        name: str,
        args: list[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_marker: str | None = None,
    ) -> Process:
        """Start ``celery -A <app> <args>`` with this interpreter (the virtualenv's Celery)."""
        if self.app is None:
            raise ValueError("this process group has no Celery app")
        argv = [sys.executable, "-m", "celery", "-A", self.app, *args]
        return self.spawn(name, argv, env=env, ready_marker=ready_marker)

    def worker(
        self,
        name: str,
        *,
        queue: str,
        node: str,
        concurrency: int = 2,
        env: Mapping[str, str] | None = None,
        loglevel: str = "info",
        heartbeat: bool = False,
        extra: Iterable[str] = (),
    ) -> Process:
        """Start a prefork worker on ``queue`` as ``node`` (not waiting for it to be ready).

        No mingle and no gossip: a run's workers need nothing from each other, and both cost
        seconds at start-up. ``heartbeat`` keeps worker heartbeats (Flower needs them).
        """
        args = ["worker", "-P", "prefork", "-c", str(concurrency), "-Q", queue, "-n", node]
        args += ["-l", loglevel, "--without-mingle", "--without-gossip"]
        if not heartbeat:
            args.append("--without-heartbeat")
        return self.celery(name, [*args, *extra], env=env, ready_marker=WORKER_READY)

    def beat(self, name: str, *, env: Mapping[str, str] | None = None) -> Process:
        """Start ``celery beat`` with its schedule file next to its log."""
        schedule = self.log_dir / f"{name}-schedule"
        args = ["beat", "-l", "info", "-s", str(schedule)]
        return self.celery(name, args, env=env, ready_marker=BEAT_READY)

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
            deadline = time.monotonic() + self.stop_timeout
            for proc in reversed(self.started):
                with contextlib.suppress(Exception):
                    proc.stop(timeout=deadline - time.monotonic())
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop_all()
        finally:
            self._closed = True
