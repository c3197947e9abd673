"""What Flower's own task list shows for a ledger task: the ledger's events read as states.

Flower keeps its task list in ``flower.events.EventsState`` (Celery's ``events.state.State``),
which turns an unknown ``task-*`` event into the state ``type.upper()`` and ranks every such
custom state below ``SUCCESS``/``FAILURE`` and above ``STARTED``/``RECEIVED``/``REJECTED``
(``celery.states.PRECEDENCE``). Read with the ledger's events, that ranking misleads in several ways
(design.md § "Operators", "What an operator sees today"); ``LedgerEventsState`` corrects each after
Celery's
own merge, for ledger tasks only:

- **blocked** -- the BLOCK gate raises ``LedgerBlocked``, so ``task-ledger-blocked`` is followed
  by ``task-failed``: the task shows ``LEDGER-BLOCKED`` (not a red ``FAILURE`` that looks like
  a ``KeyConflict``), and that ``task-failed`` is not counted as a failure on the workers page;
- **interrupted** -- a pool process lost mid-body ends in ``task-rejected`` (re-queued) or
  ``task-failed`` with ``WorkerLostError``; the first ranks below the running ledger state and
  was ignored. Both show ``LEDGER-INTERRUPTED`` until the redelivery runs, as does a running
  ledger task of a worker that went offline, or whose heartbeats stopped (a worker killed
  whole sends nothing: ``check_workers`` runs every few seconds on Flower's event loop);
- **a release** (``task-ledger-released``, which the CLI's or Flower's process sends about the
  task id: ``celery_ledger.announce``) shows ``LEDGER-RELEASED`` until a new attempt runs;
- **a new attempt** (``claimed``/``resumed``, e.g. after a release) starts afresh: the previous
  attempt's exception, traceback, result and Failed/Succeeded times are cleared;
- **resumes, replays, zombies** -- what happened to a task stays on it after ``SUCCESS``, in a
  ``ledger`` field (``["claimed", "fenced", "resumed", "replayed"]``) that Flower's task page,
  ``/api/tasks`` and (through the hook's script) the task list's state badge show;
- **the sweep** -- ``celery_ledger.sweep`` runs every ``ledger_sweep_interval`` and would fill
  the list at rest; its events (recognised by name, or by its ``celery-ledger-sweep-`` task id
  when a backlog expired it before any named event) never become tasks. They are counted on
  the workers page and in ``flower_events_total{task="celery_ledger.sweep"}`` (never as a
  nameless row or a ``task=""`` series), and the last one is kept for the Ledger overview.

The transient events (``settled``, ``replayed``, ``reconciled``, ``marked-dead``) no longer
replace the running state for the last milliseconds of an attempt; they are recorded in
``ledger``.

``install()`` points ``flower.events.EventsState`` (the name ``Events.__init__`` looks up when
Flower builds its state) at this subclass; ``install_in_flower()`` calls it from the ``--conf``
file, before Flower starts. It is the one place the page replaces a Flower class, because
Flower offers no hook between an event and its task list (see docs/design.md).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from celery.events.state import Task
from flower.events import EventsState

from celery_ledger.app import SWEEP_ID_PREFIX, SWEEP_TASK

log = logging.getLogger(__name__)

LEDGER_EVENT = "task-ledger-"
BLOCKED = "LEDGER-BLOCKED"
INTERRUPTED = "LEDGER-INTERRUPTED"
#: An operator released it (``task-ledger-released``, sent by the CLI's or Flower's process).
RELEASED = "LEDGER-RELEASED"
#: Ledger events that begin an attempt's body.
STARTS = frozenset({"claimed", "resumed"})
#: Ledger events that describe the last moments of an attempt, not a state worth showing.
TRANSIENT = frozenset({"settled", "replayed", "reconciled", "marked-dead"})
#: Fields a new attempt clears: they describe the attempt before it.
PREVIOUS_ATTEMPT = ("exception", "traceback", "failed", "succeeded", "result", "runtime")
#: Sweep task ids Flower remembers (a sweep's later events carry only its id).
SWEEP_IDS_KEPT = 256
#: How often running ledger tasks are checked against their worker's heartbeats (ms).
WORKER_CHECK_MS = 5000


class LedgerTaskState(Task):
    """Celery's task state plus ``ledger``: the ledger events this task went through, in order."""

    _fields = (*Task._fields, "ledger")
    ledger: list[str] | None = None


def _is_running_ledger_state(state: str | None) -> bool:
    return state in ("LEDGER-CLAIMED", "LEDGER-RESUMED")


def _mark(task: Any, kind: str) -> None:
    marks = list(task.ledger or ())
    if not marks or marks[-1] != kind:
        marks.append(kind)
    task.ledger = marks


class LedgerEventsState(EventsState):
    """Flower's ``EventsState`` with the ledger's reading of task events (module docstring)."""

    Task = LedgerTaskState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_ledger()

    def _init_ledger(self) -> None:
        self.sweep_ids: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: the last sweep Flower saw: ``{"uuid", "type", "timestamp", "expired"}``.
        self.last_sweep: dict[str, Any] | None = None
        self.sweeps_seen = 0
        #: Task ids in a running ledger state, checked against their worker's heartbeats.
        self.running_ledger: set[str] = set()
        self._watch: Any = None

    def event(self, event: dict[str, Any]) -> Any:
        if self._watch is None:
            self._start_watch()
        type_ = str(event.get("type") or "")
        if not type_.startswith("task-"):
            result = super().event(event)
            if type_ == "worker-offline":
                self._worker_gone(event.get("hostname"))
            return result
        uuid = str(event.get("uuid") or "")
        if self._is_sweep(uuid, event):
            self._sweep_event(type_, uuid, event)
            return None
        task = self.tasks.data.get(uuid) if uuid else None
        before = task.state if task is not None else None
        result = super().event(event)
        task = self.tasks.data.get(uuid) if uuid else None
        if task is not None:
            state, ledger = task.state, task.ledger
            self._read(task, type_, event, before)
            if (state, ledger) != (task.state, task.ledger):
                self._reindex(task)
            if _is_running_ledger_state(task.state):
                self.running_ledger.add(uuid)
            else:
                self.running_ledger.discard(uuid)
        return result

    # -- a worker that died whole ---------------------------------------------------------

    def _start_watch(self) -> None:
        """Check running ledger tasks every few seconds, on Flower's event loop (``event``
        runs there); nothing when no loop runs (a state used outside Flower)."""
        import asyncio

        from tornado.ioloop import PeriodicCallback

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._watch = False
            return
        self._watch = PeriodicCallback(self._check_workers_soon, WORKER_CHECK_MS)
        self._watch.start()

    def _check_workers_soon(self) -> None:
        self.check_workers()

    def check_workers(self) -> int:
        """Mark ``LEDGER-INTERRUPTED`` the running ledger tasks whose worker stopped sending
        heartbeats (a worker killed whole sends no event at all). Returns how many. Celery
        counts every event of a worker as a heartbeat, so a worker run
        ``--without-heartbeat`` is judged by its task events (twice its freq, 60 s by
        default); Flower needs heartbeats to show workers anyway."""
        marked = 0
        for uuid in list(self.running_ledger):
            task = self.tasks.data.get(uuid)
            if task is None or not _is_running_ledger_state(task.state):
                self.running_ledger.discard(uuid)
                continue
            worker = getattr(task, "worker", None)
            if worker is not None and worker.heartbeats and not worker.alive:
                task.state = INTERRUPTED
                _mark(task, "interrupted")
                self._reindex(task)
                self.running_ledger.discard(uuid)
                marked += 1
        return marked

    def _reindex(self, task: Any) -> None:
        # Flower's search (``state:LEDGER-BLOCKED``, the state filter buttons) reads its own
        # index, which ``EventsState.event`` updated before this reading changed the task.
        engine = getattr(self, "search_engine", None)
        if engine is not None:
            engine.upsert(task)

    # -- the sweep ------------------------------------------------------------------

    def _is_sweep(self, uuid: str, event: dict[str, Any]) -> bool:
        if uuid.startswith(SWEEP_ID_PREFIX) or uuid in self.sweep_ids:
            return True
        if event.get("name") == SWEEP_TASK:
            self.sweep_ids[uuid] = SWEEP_TASK
            while len(self.sweep_ids) > SWEEP_IDS_KEPT:
                self.sweep_ids.popitem(last=False)
            return True
        return False

    def _sweep_event(self, type_: str, uuid: str, event: dict[str, Any]) -> None:
        worker = event.get("hostname") or ""
        self.event_count += 1
        self.counter[worker][type_] += 1
        self.metrics.events.labels(worker, type_, SWEEP_TASK).inc()
        if type_ in ("task-received", "task-started", "task-revoked", "task-succeeded"):
            if self.last_sweep is None or self.last_sweep.get("uuid") != uuid:
                self.sweeps_seen += 1
            self.last_sweep = {
                "uuid": uuid,
                "type": type_,
                "timestamp": event.get("timestamp"),
                "expired": bool(event.get("expired")),
            }

    # -- ledger tasks -----------------------------------------------------------------

    def _read(self, task: Any, type_: str, event: dict[str, Any], before: str | None) -> None:
        if type_.startswith(LEDGER_EVENT):
            kind = type_[len(LEDGER_EVENT) :]
            if kind in STARTS:
                for name in PREVIOUS_ATTEMPT:
                    setattr(task, name, None)
                task.state = f"LEDGER-{kind.upper()}"
            elif kind == "released":
                task.state = RELEASED
            elif kind in TRANSIENT and before is not None:
                # Celery set the transient state (or merged under a terminal one):
                # the task keeps the state it had.
                task.state = before
            _mark(task, kind)
            return
        if not task.ledger:
            return  # not a ledger task (or none of its events reached Flower)
        last = task.ledger[-1]
        exception = str(getattr(task, "exception", None) or "")
        if type_ == "task-failed" and (last == "blocked" or exception.startswith("LedgerBlocked(")):
            task.state = BLOCKED
            # Not a failure: an operator decides (the workers page counts failures).
            self.counter[event.get("hostname") or ""]["task-failed"] -= 1
        elif type_ == "task-rejected" or (
            type_ == "task-failed" and "WorkerLostError" in exception
        ):
            task.state = INTERRUPTED
            _mark(task, "interrupted")

    def _worker_gone(self, hostname: Any) -> None:
        for _, task in list(self.tasks.items()):
            worker = getattr(task, "worker", None)
            if (
                _is_running_ledger_state(task.state)
                and worker is not None
                and worker.hostname == hostname
            ):
                task.state = INTERRUPTED
                _mark(task, "interrupted")
                self._reindex(task)


def install() -> None:
    """Make Flower build its event state as ``LedgerEventsState``. Idempotent."""
    from flower import events

    events.EventsState = LedgerEventsState
    log.debug("celery-ledger: Flower's task list reads the ledger's events")


__all__ = ["BLOCKED", "INTERRUPTED", "RELEASED", "LedgerEventsState", "LedgerTaskState", "install"]
