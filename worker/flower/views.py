"""What each Ledger page shows, as plain values for its template. Blocking: runs in an executor.

Every argument value, result, step output, error and audit detail that reaches a template
goes through ``celery_ledger.redact`` first (``_entry_redaction``), so that a secret
argument never appears in the page's HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kombu.utils.json import loads

from celery_ledger.flower import queries as q
from celery_ledger.flower.context import Aggregates, LedgerPage
from celery_ledger.ledger import RESUME_OWNER, Entry, EntryStatus, EventRecord
from celery_ledger.redact import Redaction, entry_redaction, secret_names
from celery_ledger.view import (
    NextAction,
    StepDetail,
    decode_stored,
    duration,
    entry_detail,
    next_action,
    slot_key_view,
    token_hold_hint,
)

#: Longest JSON shown for one value (a result, an output); the rest is cut with a note.
MAX_SHOWN_CHARS = 4000


# -- reasons, in words --------------------------------------------------------------------------


def stuck_reason(kind: q.StuckKind, entry: Entry, now: float, page: LedgerPage) -> str:
    """Why this entry waits and what moves it on, in one sentence."""
    s = page.settings
    if kind.status is EntryStatus.BLOCKED:
        why = entry.reason or "blocked (no reason recorded)"
        alive = ""
        if entry.seen_alive_at is not None and now - entry.seen_alive_at < s.death_grace_seconds:
            # The death-signal gate's warning, where the operator looks first.
            alive = (
                f" Its old worker ({entry.seen_alive_owner or 'unknown'}) was seen alive "
                f"{duration(now - entry.seen_alive_at)} ago: check whether its call landed."
            )
        return f"Needs an operator: {why}{alive}"
    if kind.status is EntryStatus.INTERRUPTED:
        why = entry.reason or "interrupted"
        if entry.snapshot is None:
            return (
                f"{why}; it has no argument snapshot, so it cannot be re-enqueued: re-send "
                f"task id {entry.task_id} by hand, or release it"
            )
        if entry.interruptions > s.max_resumes:
            return (
                f"{why}; interrupted {entry.interruptions} times, over ledger_max_resumes="
                f"{s.max_resumes}: the next sweep blocks it as a crash loop"
            )
        return f"{why}; the next sweep re-enqueues it (or resume it now)"
    if kind.status is EntryStatus.RETRYING:
        late = duration(now - entry.due_at) if entry.due_at is not None else "-"
        why = f"retry past its due time by {late}: no worker claimed it (its message may be lost)"
        if entry.snapshot is None:
            return (
                f"{why}; it has no argument snapshot, so it cannot be re-sent: re-send task id "
                f"{entry.task_id} by hand, or release it"
            )
        return f"{why}; the next sweep re-sends it with its task id"
    ago = duration(now - entry.lease_until) if entry.lease_until is not None else "-"
    if entry.owner == RESUME_OWNER:
        return (
            f"re-enqueued by recovery, but no worker claimed it within the lease (expired "
            f"{ago} ago): the next sweep interrupts and re-enqueues it again"
        )
    pid = f", pid {entry.owner_pid}" if entry.owner_pid else ""
    return (
        f"lease expired {ago} ago: its owner ({entry.owner or 'unknown'}{pid}) stopped "
        "renewing it; the next sweep interrupts and resumes it"
    )


# -- overview ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusCount:
    status: str
    count: int | None
    #: "live" (counted now) or "cached" (from the aggregates).
    source: str


def overview(page: LedgerPage, aggregates: Aggregates) -> dict[str, Any]:
    store, s = page.store, page.settings
    expired = store.count_expired()
    with q.reading(store) as conn:
        live = q.live_counts(conn)
        oldest = q.oldest_expired(conn)
        preview = q.sweep_preview(
            conn,
            expired=expired,
            batch=s.sweep_batch,
            max_resumes=s.max_resumes,
            retention_days=s.retention_days,
        )
    now = store.now()
    stats = aggregates.stats
    counts = []
    for status in EntryStatus:
        if status.value in live:
            counts.append(StatusCount(status.value, live[status.value], "live"))
        else:
            cached = stats.by_status.get(status.value, 0) if stats is not None else None
            counts.append(StatusCount(status.value, cached, "cached"))
    stuck = {
        "blocked": live[EntryStatus.BLOCKED.value],
        "interrupted": live[EntryStatus.INTERRUPTED.value],
        "expired": expired,
    }
    return {
        "now": now,
        "counts": counts,
        "stuck": stuck,
        "stuck_total": sum(stuck.values()),
        "expired": expired,
        "oldest": oldest,
        "preview": preview,
        "aggregates": aggregates,
        "settings": s,
        # docs/concurrency.md: waiting per concurrency key, longest wait first.
        "slot_keys": [slot_key_view(k, now) for k in store.slot_keys()],
        # design.md § "Fleet-wide rate limits": what waits for a token, per bucket, and the
        # longest held, each with why (``token_hold_hint``) and since when.
        "token_buckets": store.held_for_tokens_by_bucket(),
        "token_holds": [(h, token_hold_hint(h, now)) for h in store.held_for_tokens(limit=10)],
    }


# -- stuck list --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StuckView:
    key: str
    task_name: str
    task_id: str
    kind: str
    kind_label: str
    status: str
    since: float
    age: str
    fence: int
    reason: str
    action: NextAction


def stuck(
    page: LedgerPage,
    flt: q.StuckFilter,
    *,
    limit: int,
    after: q.Cursor | None,
    before: q.Cursor | None,
) -> dict[str, Any]:
    store = page.store
    with q.reading(store) as conn:
        found = q.stuck_page(conn, flt, limit=limit, after=after, before=before)
        counts = q.stuck_counts(conn, flt)
        tasks = q.stuck_tasks(conn)
    now = store.now()
    rows = [
        StuckView(
            key=r.entry.key,
            task_name=r.entry.task_name,
            task_id=r.entry.task_id,
            kind=r.kind.name,
            kind_label=r.kind.label,
            status=r.entry.status.value,
            since=r.since,
            age=duration(now - r.since),
            fence=r.entry.fence,
            reason=scrubbed(page, r.entry).text(stuck_reason(r.kind, r.entry, now, page)) or "",
            action=next_action(r.entry, now, page.cli_prefix),
        )
        for r in found.rows
    ]
    return {
        "rows": rows,
        "next": found.next,
        "prev": found.prev,
        "counts": counts,
        "total": sum(counts.values()),
        "tasks": tasks,
        "kinds": q.STUCK_KINDS,
    }


def scrubbed(page: LedgerPage, e: Entry) -> Redaction:
    """What to scrub from an entry's text shown in a list: its reason may quote a secret (an
    external ref built from a card number)."""
    snapshot, _ = decode_stored(e.snapshot, page.cipher)
    task = page.task(e.task_name)
    return entry_redaction(snapshot, redact=page.settings.redact, task=task, task_of=page.task)[1]


# -- entry -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepView:
    name: str
    occurrence: int
    status: str
    #: completed | ambiguous | running | not-executed
    state: str
    label: str
    external_ref: str | None
    output: str | None
    error: str | None
    fence: int
    attempts: int
    authorized: int
    started_at: float | None
    completed_at: float | None
    took: str | None


@dataclass(frozen=True)
class EventView:
    at: float
    event: str
    status: str | None
    fence: int | None
    actor: str | None
    detail: str | None
    task_id: str | None


@dataclass
class EntryView:
    entry: Entry
    now: float
    arguments: str | None
    queue: str | None
    redacted: tuple[str, ...]
    blind: bool
    result: str | None
    error: str | None
    reason: str | None
    #: The operator's why of a release and of a mark-dead, scrubbed as the reason is.
    released_reason: str | None
    dead_reason: str | None
    steps: list[StepView]
    events: list[EventView]
    action: NextAction
    lease_left: float | None
    can_release: bool
    can_resume: bool
    #: Why release is not offered, when it is not.
    release_blocked: str | None
    released_pending: bool
    notes: list[str] = field(default_factory=list)
    #: Said beside the release form: a not-executed release would run a step that returned.
    release_warning: str | None = None
    #: The children this entry's steps sent through the outbox (``OutboxMessage``), in order.
    children: list[Any] = field(default_factory=list)
    #: Its durable signals (``view.SignalShown``), payloads redacted as in ``show``.
    signals: list[Any] = field(default_factory=list)


def entry(
    page: LedgerPage,
    key: str,
    *,
    where: str = "Flower",
    fix: str = "Start Flower with -A of the app that defines it.",
) -> EntryView:
    """The entry page's values; ``where`` and ``fix`` name the front end in its notes.

    Raises:
        EntryNotFound: no entry has that key.
    """
    # Decoded defensively: an entry whose snapshot no process can read is shown (and released).
    # The page shows the arguments only, but the placement's secrets (a chain link's, a
    # callback's) are scrubbed from the result, errors and events shown with them.
    d = entry_detail(
        page.store,
        key,
        prefix=page.cli_prefix,
        cipher=lambda: page.cipher,
        redact=page.settings.redact,
        task_of=page.task,
        events=500,
    )
    e, redaction, snapshot = d.entry, d.redaction, d.snapshot
    arguments = None
    if d.shown is not None:
        arguments = _json({"args": d.shown["args"], "kwargs": d.shown["kwargs"]})
    view = EntryView(
        entry=e,
        now=d.now,
        arguments=arguments,
        queue=(snapshot or {}).get("queue"),
        redacted=tuple(sorted(secret_names(page.settings.redact, page.task(e.task_name)))),
        blind=redaction.blind,
        result=_shown(e.result, redaction),
        error=_shown(e.error, redaction),
        reason=redaction.text(e.reason),
        released_reason=redaction.text(e.released_reason),
        dead_reason=redaction.text(e.dead_reason),
        steps=[_step_view(s, redaction) for s in d.steps],
        events=[_event(ev, redaction) for ev in d.events],
        signals=list(d.signals),
        action=d.action,
        lease_left=d.lease_left,
        can_release=d.release_refused is None,
        can_resume=d.can_resume,
        release_blocked=d.release_refused,
        released_pending=e.released_pending,
        release_warning=d.release_warning,
        children=list(d.children),
    )
    if redaction.blind:
        view.notes.append(
            f"Argument values are hidden: task {e.task_name} is not registered in this "
            f"{where}'s Celery app, so its secret_args are unknown here. {fix}"
        )
    if "snapshot" in d.unreadable:
        view.notes.append(
            f"The argument snapshot cannot be read ({d.unreadable['snapshot']}): this entry "
            "cannot be re-enqueued; release it once you know what it was."
        )
    elif snapshot is None:
        view.notes.append("No argument snapshot: this entry cannot be re-enqueued.")
    return view


def _step_view(d: StepDetail, redaction: Redaction) -> StepView:
    s = d.record
    took = None
    if s.completed_at is not None and s.started_at is not None:
        took = f"{max(s.completed_at - s.started_at, 0.0):.3f}s"
    return StepView(
        name=s.name,
        occurrence=s.occurrence,
        status=s.status.value,
        state=d.state.value,
        label=d.label,
        external_ref=redaction.text(s.external_ref),
        output=_shown(s.output, redaction),
        error=redaction.text(s.error),
        fence=s.fence,
        attempts=s.attempts,
        authorized=s.authorized,
        started_at=s.started_at,
        completed_at=s.completed_at,
        took=took,
    )


def _event(ev: EventRecord, redaction: Redaction) -> EventView:
    return EventView(
        at=ev.at,
        event=ev.event,
        status=ev.status,
        fence=ev.fence,
        actor=ev.actor,
        detail=redaction.text(ev.detail),
        task_id=ev.task_id,
    )


def _shown(stored: str | None, redaction: Redaction) -> str | None:
    """A stored JSON value, decoded, redacted and pretty-printed (cut when very long)."""
    if stored is None:
        return None
    try:
        value = loads(stored)
    except RecursionError:
        return f"(cannot be shown: nested too deeply to decode, {len(stored)} characters)"
    except ValueError:
        return redaction.text(stored)
    try:
        return _json(redaction.value(value))
    except RecursionError:
        return f"(cannot be shown: nested too deeply, {len(stored)} characters)"


def _json(value: Any) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS] + f"\n… ({len(text) - MAX_SHOWN_CHARS} more characters)"
    return text
