"""One operator view of a ledger entry, for the CLI's ``show`` and list and the Flower page.

``entry_detail`` reads an entry once (its steps with their state, events, outbox children,
canvas links, decoded snapshot, the redaction of its secrets, the next action, what a release
would be refused for and warned of) and each front end only renders it: ``celery-ledger
show`` as text or JSON, Flower as HTML. The rules themselves are the ledger's
(``StepRecord.ambiguous`` and ``state``, ``Entry.lease_left``, ``release_refused``,
``release_warning``); what is here are the words an operator reads and the one thing that moves
an entry on (``next_action``). Nothing here imports click or Flower.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kombu.utils.json import loads

from celery_ledger.ledger import (
    RESUME_OWNER,
    Entry,
    EntryStatus,
    EventRecord,
    HeldForToken,
    LedgerStore,
    Member,
    OutboxMessage,
    SnapshotSealError,
    StepRecord,
    StepState,
    is_sealed,
    open_snapshot,
)
from celery_ledger.ledger.signals import wait_reason
from celery_ledger.ledger.slots import SlotKey
from celery_ledger.redact import HIDDEN, Redaction, entry_redaction

# -- words --------------------------------------------------------------------------------------


#: SQLAlchemy's pointer to its error pages, which it appends to every error's text.
_SA_LINK = re.compile(r"\s*\(Background on this error at: \S+\)")


def one_line(exc: BaseException) -> str:
    text = _SA_LINK.sub("", " ".join(str(exc).split()))
    return text or type(exc).__name__


def duration(seconds: float | None) -> str:
    """``seconds`` in words; any stored value renders (an infinite one is "never")."""
    if seconds is None:
        return "-"
    if math.isnan(seconds):
        return "nan"
    if seconds > _LONGEST:
        return "never"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


#: Longer than any date: a duration past it is shown as "never".
_LONGEST = 10_000 * 366 * 86400


def timestamp(ts: float | None) -> str:
    """``ts`` as UTC; any stored value renders: one past what a date holds is "never" (its
    raw number when it is not infinite), never an ``OverflowError``."""
    if ts is None:
        return "-"
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return "never" if ts == math.inf else repr(ts)


def parse_duration(text: str, what: str = "--since") -> float:
    """Seconds, or a duration like 30s, 10m, 2h, 1d, as seconds.

    Raises:
        ValueError: not a finite, non-negative duration; the message names ``what``.
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw[-1:] in units else float(raw)
    except ValueError:
        raise ValueError(
            f"{what} {text!r}: give seconds or a duration like 30s, 10m, 2h, 1d"
        ) from None
    if not math.isfinite(value):
        raise ValueError(
            f"{what} {text!r} is not a finite time: give seconds or a duration like 30s, 10m"
        )
    if value < 0:
        raise ValueError(f"{what} {text!r} must not be negative")
    return value


def decode_stored(text: str | None, cipher: Any = None) -> tuple[Any, str | None]:
    """A stored JSON value (snapshot, result, error) decoded, and None; or None and why it
    cannot be decoded. A sealed snapshot is opened with ``cipher`` (``ledger_snapshot_keys``).
    Never raises: an entry whose values no process can read must still be shown, and
    released."""
    if text is None:
        return None, None
    if is_sealed(text):
        try:
            text = open_snapshot(text, cipher)
        except SnapshotSealError as exc:
            return None, one_line(exc)
    try:
        value = loads(text)
        # Printed (indented JSON) needs more stack per level than decoding: a value that
        # decodes but cannot be printed is unreadable here too.
        json.dumps(value, indent=1, default=str)
    except RecursionError:
        return None, f"nested too deeply to decode ({len(text)} characters stored)"
    except Exception as exc:  # noqa: BLE001 - whatever the decoder says, it is unreadable
        return None, f"cannot be decoded: {one_line(exc)[:200]} ({len(text)} characters stored)"
    return value, None


# -- what an operator should do next ---------------------------------------------------------


@dataclass(frozen=True)
class NextAction:
    #: release | resume | resend | sweep | wait | none
    action: str
    hint: str
    command: str | None = None


def token_hold_hint(hold: HeldForToken, now: float) -> str:
    """Why and since when an entry is held for a rate limit's token (design.md §
    "Fleet-wide rate limits")."""
    left = hold.due_at - now
    due = "due now" if left <= 0 else f"due in {duration(left)}"
    return (
        f"held for a token: rate limit {hold.rate} ({hold.bucket}) since "
        f"{duration(now - hold.held_since)} ago, {due}"
    )


def token_hold_view(hold: HeldForToken | None, now: float) -> dict[str, Any] | None:
    """An entry's hold for a token as ``list --json``, ``show --json`` and Flower show it."""
    if hold is None:
        return None
    return {
        "bucket": hold.bucket,
        "rate": hold.rate,
        "held_since": hold.held_since,
        "held_seconds": round(now - hold.held_since, 3),
        "due_at": hold.due_at,
        "holds": hold.holds,
        "why": token_hold_hint(hold, now),
    }


def next_action(
    entry: Entry, now: float, prefix: str, hold: HeldForToken | None = None
) -> NextAction:
    """The one thing that moves this entry on, and the command that does it (``hold``: the
    entry's hold for a rate limit's token, if it has one)."""
    key = entry.key
    if hold is not None and entry.status is EntryStatus.SCHEDULED:
        return NextAction("wait", token_hold_hint(hold, now), f"{prefix} resume {key}")
    if entry.release_warning is not None:
        return NextAction(
            "release",
            entry.release_warning,
            f"{prefix} release {key} --verified completed --by WHO --reason WHY",
        )
    if entry.status is EntryStatus.BLOCKED:
        return NextAction(
            "release",
            "release after checking the step",
            f"{prefix} release {key} --verified not-executed|completed --by WHO --reason WHY",
        )
    if entry.status is EntryStatus.INTERRUPTED:
        if entry.snapshot is None:
            return NextAction(
                "resend",
                f"no argument snapshot: re-send task id {entry.task_id} by hand",
                f"{prefix} release {key} --verified completed --result-json JSON --by WHO "
                "--reason WHY",
            )
        return NextAction("resume", "resume now (or wait for the sweep)", f"{prefix} resume {key}")
    if entry.status is EntryStatus.RUNNING:
        left = entry.lease_left(now)
        if left is None or left <= 0:
            return NextAction(
                "sweep", "lease expired: sweep interrupts and resumes it", f"{prefix} sweep"
            )
        if entry.owner == RESUME_OWNER:
            return NextAction("wait", f"re-enqueued, waiting for a worker ({duration(left)})")
        return NextAction("wait", f"running (lease {duration(left)} left)")
    if entry.status is EntryStatus.RETRYING:
        if entry.due_at is not None and entry.due_at < now:
            late = duration(now - entry.due_at)
            if entry.snapshot is None:
                return NextAction(
                    "resend",
                    f"retry overdue by {late}, no argument snapshot: re-send task id "
                    f"{entry.task_id} by hand",
                    f"{prefix} release {key} --verified completed --result-json JSON --by WHO "
                    "--reason WHY",
                )
            return NextAction(
                "sweep", f"retry overdue by {late}: the sweep re-sends it", f"{prefix} sweep"
            )
        return NextAction("wait", "Celery retry pending")
    waited = slot_wait_seconds(entry, now)
    if waited is not None:  # docs/concurrency.md: the ledger sends it when a slot is free
        return NextAction(
            "wait",
            f"waiting {duration(waited)} for a slot of {entry.concurrency_key}: sent when one "
            "is free",
        )
    signal = signal_waited_for(entry)
    if signal is not None:  # design.md § "Durable signals": sent when the signal comes
        left = None if entry.due_at is None else entry.due_at - now
        timeout = "times out now" if left is None or left <= 0 else f"times out in {duration(left)}"
        return NextAction(
            "signal",
            f"waiting {duration(now - entry.updated_at)} for signal {signal!r}; {timeout}",
            f"{prefix} signal {key} {signal} --payload JSON",
        )
    if entry.status.waits_for_time:  # design.md § "Durable time": held by the ledger until due
        left = None if entry.due_at is None else entry.due_at - now
        when = (
            "due now: the sweep sends it"
            if left is None or left <= 0
            else f"due in {duration(left)}"
        )
        return NextAction("wait", when, f"{prefix} resume {key}")
    return NextAction("none", "-")


def signal_waited_for(entry: Entry) -> str | None:
    """The signal ``entry`` waits for in ``wait_for`` (None: it waits for none)."""
    if entry.status is not EntryStatus.SLEEPING or not entry.reason:
        return None
    prefix = wait_reason("")
    return entry.reason[len(prefix) :] if entry.reason.startswith(prefix) else None


def slot_wait_seconds(entry: Entry, now: float) -> float | None:
    """How long ``entry`` has waited for a slot of its concurrency key (None: it does not)."""
    if entry.status is not EntryStatus.SLEEPING or entry.waiting_since is None:
        return None
    return None if entry.slot_at is not None else max(now - entry.waiting_since, 0.0)


def slot_key_view(found: SlotKey, now: float) -> dict[str, Any]:
    """One concurrency key with waiters, as ``stats``, Flower and ``doctor`` show it."""
    oldest = None if found.oldest_since is None else round(now - found.oldest_since, 3)
    return {
        "concurrency_key": found.key,
        "limit": found.limit,
        "holding": found.holding,
        "waiting": found.waiting,
        "oldest_wait_seconds": oldest,
    }


def entry_view(entry: Entry, now: float, nxt: NextAction) -> dict[str, Any]:
    """One entry as ``list --json`` and ``show --json`` print it, with its next action."""
    released = None
    if entry.released_at is not None:
        released = {
            "by": entry.released_by,
            "reason": entry.released_reason,
            "at": entry.released_at,
            "from_status": entry.released_from,
        }
    return {
        "key": entry.key,
        "task": entry.task_name,
        "task_id": entry.task_id,
        "status": entry.status.value,
        "fence": entry.fence,
        "owner": entry.owner,
        "side_effect": entry.side_effect,
        "age_seconds": round(now - entry.updated_at, 3),
        "lease_remaining_seconds": (
            None if entry.lease_until is None else round(entry.lease_until - now, 3)
        ),
        "created_at": entry.created_at,
        "updated_at": entry.updated_at,
        "settled_at": entry.settled_at,
        "due_at": entry.due_at,
        "executions": entry.executions,
        "interruptions": entry.interruptions,
        "reason": entry.reason,
        "concurrency_key": entry.concurrency_key,
        "waiting_for_slot_seconds": slot_wait_seconds(entry, now),
        "has_snapshot": entry.snapshot is not None,
        "released": released,
        "marked_dead": (
            None
            if entry.dead_at is None
            else {
                "fence": entry.dead_fence,
                "by": entry.dead_by,
                "reason": entry.dead_reason,
                "at": entry.dead_at,
            }
        ),
        "seen_alive": (
            None
            if entry.seen_alive_at is None
            else {
                "at": entry.seen_alive_at,
                "ago_seconds": round(now - entry.seen_alive_at, 3),
                "fence": entry.seen_alive_fence,
                "owner": entry.seen_alive_owner,
            }
        ),
        "next_action": nxt.action,
        "hint": nxt.hint,
        "next_command": nxt.command,
    }


# -- one entry, read once -------------------------------------------------------------------------


#: How each step state reads, and how a transaction step's marker reads instead.
_STEP_LABELS = {
    StepState.COMPLETED: ("completed", "completed"),
    StepState.NOT_EXECUTED: (
        "proven not executed: one re-run authorized",
        "transaction step, nothing committed: it runs again",
    ),
    StepState.RUNNING: ("started, running now", "transaction step, running now"),
    StepState.AMBIGUOUS: ("started, no completion recorded: ambiguous",) * 2,
}


@dataclass(frozen=True)
class StepDetail:
    """One replay row and what an operator is told of it."""

    record: StepRecord
    state: StepState
    label: str


def step_detail(record: StepRecord, live_lease: bool) -> StepDetail:
    state = record.state(live_lease)
    plain, marker = _STEP_LABELS[state]
    return StepDetail(record, state, marker if record.transaction_marker else plain)


@dataclass(frozen=True)
class EntryDetail:
    """Everything ``show`` and the Flower entry page say about one entry, read once."""

    entry: Entry
    #: The database clock when it was read.
    now: float
    steps: tuple[StepDetail, ...]
    events: tuple[EventRecord, ...]
    #: The children this entry's steps sent through the outbox, in order, and the step that
    #: sent this entry (None when no step did).
    children: tuple[OutboxMessage, ...]
    parent: OutboxMessage | None
    #: The entries this task published (the next link of a chain, a group it sent).
    members: tuple[Member, ...]
    #: The snapshot, result and error decoded (``decode_stored``), and why any cannot be.
    values: dict[str, Any]
    unreadable: dict[str, str]
    #: The snapshot safe to show (None without one that reads), and what else to scrub.
    shown: dict[str, Any] | None
    redaction: Redaction
    action: NextAction
    lease_left: float | None
    live_lease: bool
    #: Why a release is refused for the entry's state (None: it is offered).
    release_refused: str | None
    #: Said beside a release: a not-executed release would run a step that returned.
    release_warning: str | None
    #: Its durable signals (design.md § "Durable signals"), payloads redacted.
    signals: tuple[SignalShown, ...] = ()
    #: Its hold for a rate limit's token (design.md § "Fleet-wide rate limits"), if held.
    token_hold: HeldForToken | None = None

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The decoded argument snapshot, when there is one that reads as one."""
        value = self.values["snapshot"]
        return value if isinstance(value, dict) else None

    @property
    def can_resume(self) -> bool:
        return self.entry.status is EntryStatus.INTERRUPTED and self.snapshot is not None


@dataclass(frozen=True)
class SignalShown:
    """One signal of an entry as an operator sees it: its payload decoded and redacted like
    the arguments (secret names hidden at any depth, secret values scrubbed), or, when it
    cannot be read here, why (``unreadable``)."""

    name: str
    payload: Any
    unreadable: str | None
    sent_by: str | None
    sent_at: float
    #: The wait that took it (1 = the first ``wait_for`` of its name), None while pending.
    wait: int | None
    taken_at: float | None
    #: A row a wait wrote when it timed out (no payload).
    timed_out: bool


def signal_shown(record: Any, cipher: Callable[[], Any], redaction: Redaction) -> SignalShown:
    """``record`` (a ``SignalRecord``) for ``show`` and the Ledger page."""
    payload: Any = None
    problem = None
    if record.payload is not None:
        key_ring = cipher() if is_sealed(record.payload) else None
        payload, problem = decode_stored(record.payload, key_ring)
        if problem is not None:
            payload = None
        elif redaction.blind:
            payload = HIDDEN  # its task's secret names are unknown here: fail closed
        else:
            payload = redaction.value(payload)
    return SignalShown(
        record.name,
        payload,
        problem,
        record.sent_by,
        record.sent_at,
        record.wait,
        record.taken_at,
        record.timed_out,
    )


def entry_detail(
    store: LedgerStore,
    key: str,
    *,
    prefix: str,
    cipher: Callable[[], Any],
    redact: Iterable[str],
    task_of: Callable[[str], Any],
    events: int,
) -> EntryDetail:
    """Read entry ``key`` once and derive what an operator is shown of it.

    ``cipher`` is asked only when the snapshot is sealed; ``task_of`` names a task's
    ``secret_args`` (Flower answers None for a task it does not know, which hides every
    value); ``events`` bounds the audit lines read.

    Raises:
        EntryNotFound: no entry has that key.
    """
    entry = store.get_entry(key)
    steps = store.load_steps(key)
    found = store.entry_events(key, limit=events)
    now = store.now()
    key_ring = cipher() if is_sealed(entry.snapshot) else None
    values: dict[str, Any] = {}
    unreadable: dict[str, str] = {}
    for name in ("snapshot", "result", "error"):
        values[name], problem = decode_stored(getattr(entry, name), key_ring)
        if problem is not None:
            unreadable[name] = problem
    shown, redaction = entry_redaction(
        values["snapshot"], redact=redact, task=task_of(entry.task_name), task_of=task_of
    )
    live = entry.live_lease(now)
    held = entry.status is EntryStatus.SCHEDULED
    hold = store.token_holds([key]).get(key) if held else None
    return EntryDetail(
        entry=entry,
        now=now,
        steps=tuple(step_detail(s, live) for s in steps),
        events=tuple(found),
        children=tuple(store.children_of(key)),
        parent=store.parent_of(entry.task_id),
        members=tuple(store.members(entry.task_id)),
        values=values,
        unreadable=unreadable,
        shown=shown,
        redaction=redaction,
        action=next_action(entry, now, prefix, hold),
        lease_left=entry.lease_left(now),
        live_lease=live,
        release_refused=entry.release_refused(now),
        release_warning=entry.release_warning,
        signals=tuple(signal_shown(r, cipher, redaction) for r in store.signals_of(key)),
        token_hold=hold,
    )
