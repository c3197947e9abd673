"""``show``: one entry (or one Celery group) as text or JSON.

The entry is read once by ``celery_ledger.view.entry_detail``, the same detail the Flower
entry page renders; this module only prints it, and hides secret values the CLI's way
(``_redaction``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from celery_ledger.cli.common import (
    command_prefix,
    echo,
    emit_json,
    guarded,
    load_app,
    load_settings,
    open_store,
    print_table,
    printable,
    resolve_key,
    status_colour,
)
from celery_ledger.ledger import EntryNotFound, EntryStatus, Member, cipher_from
from celery_ledger.redact import Redaction, entry_redaction
from celery_ledger.view import (
    EntryDetail,
    duration,
    entry_detail,
    entry_view,
    timestamp,
    token_hold_view,
)

#: Longest stored text ``show`` prints for one field (reasons written before their bound).
SHOWN_CHARS = 2000


@click.command("show")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def show_cmd(ctx: click.Context, ref: str, as_json: bool) -> None:
    """One entry (REF: key, key prefix or task id): snapshot, steps, events, the fix; or a
    Celery group (REF: group id): its members and their states."""
    store = open_store(ctx)
    try:
        key = resolve_key(store, ref)
    except EntryNotFound:
        group = store.members(ref.strip())
        if not group:
            raise
        _show_members(ctx, ref.strip(), group, as_json)
        return
    # Decoded defensively: an entry whose snapshot, result or error no process can read (a
    # hostile sender's argument nested 5,000 deep) is shown with why, and can be released.
    detail = entry_detail(
        store,
        key,
        prefix=command_prefix(ctx),
        cipher=lambda: cipher_from(load_settings(ctx).snapshot_keys),
        redact=load_settings(ctx).redact,
        task_of=_task_of(ctx),
        events=1000,
    )
    view = _entry_json(detail)
    if as_json:
        view["now"] = detail.now
        emit_json(view)
        return
    _print_fields(ctx, detail, view)
    _print_steps(ctx, view["steps"])
    _print_children(ctx, view["children"])
    _print_signals(ctx, view["signals"])
    if view["members"]:
        echo(ctx)
        echo(ctx, click.style("members", bold=True) + "  (the entries this task published)")
        _print_members(ctx, view["members"])
    _print_events(ctx, view["events"])
    echo(ctx)
    echo(ctx, f"next: {printable(view['hint'])}")
    if view["next_command"]:
        echo(ctx, f"  {printable(view['next_command'])}")


def _signal_json(g: Any) -> dict[str, Any]:
    """One signal of ``show --json``'s ``signals`` (``view.signal_shown``: payload redacted)."""
    return {
        "name": g.name,
        "payload": g.payload,
        "unreadable": g.unreadable,
        "sent_by": g.sent_by,
        "sent_at": g.sent_at,
        "wait": g.wait,
        "taken_at": g.taken_at,
        "timed_out": g.timed_out,
    }


def _entry_json(d: EntryDetail) -> dict[str, Any]:
    """``show --json``'s document (without ``now``), its secrets hidden (``_redact_view``)."""
    entry = d.entry
    view = entry_view(entry, d.now, d.action)
    view["held_for_token"] = token_hold_view(d.token_hold, d.now)
    view.update(d.values)
    view["unreadable"] = dict(d.unreadable)
    view["steps"] = [
        {
            "name": s.record.name,
            "occurrence": s.record.occurrence,
            "status": s.record.status.value,
            "external_ref": s.record.external_ref,
            "fence": s.record.fence,
            "attempts": s.record.attempts,
            "authorized": s.record.authorized,
            "started_at": s.record.started_at,
            "completed_at": s.record.completed_at,
            "duration_seconds": (
                None
                if s.record.completed_at is None or s.record.started_at is None
                else round(s.record.completed_at - s.record.started_at, 6)
            ),
            "ambiguous": s.record.ambiguous,
        }
        for s in d.steps
    ]
    # Durable signals (design.md § "Durable signals"), payloads redacted (``signal_shown``).
    view["signals"] = [_signal_json(g) for g in d.signals]
    # The outbox: the children this entry's steps sent, and the step that sent this one.
    view["children"] = [
        {
            "child_id": c.child_id,
            "task": c.task_name,
            "step": c.step,
            "occurrence": c.occurrence,
            "n": c.n,
            "state": c.state,
            "published_at": c.published_at,
            # A child no publish could send (``celery-ledger outbox drop|repair``).
            "publish_errors": c.publish_errors,
            "last_error": c.last_error,
            "dropped": c.dropped_reason,
        }
        for c in d.children
    ]
    p = d.parent
    view["parent"] = (
        None if p is None else {"key": p.parent_key, "step": p.step, "occurrence": p.occurrence}
    )
    # Celery's canvas: the group this entry was published in, and the entries it published
    # (the next link of a chain, a group it sent) with their states.
    view["group_id"] = entry.group_id
    view["parent_id"] = entry.parent_id
    view["members"] = [_member_view(m) for m in d.members]
    view["events"] = [
        {
            "id": e.id,
            "event": e.event,
            "status": e.status,
            "fence": e.fence,
            "actor": e.actor,
            "detail": e.detail,
            "at": e.at,
            "task_id": e.task_id,
        }
        for e in d.events
    ]
    view["redacted"] = _redact_view(view, d.shown, d.redaction)
    return view


def _dumped(value: Any) -> str:
    """A decoded value as compact JSON, or why it cannot be printed (never raises)."""
    try:
        return json.dumps(value, default=str)
    except (RecursionError, ValueError) as exc:
        return f"(cannot be printed: {type(exc).__name__})"


def _print_fields(ctx: click.Context, d: EntryDetail, view: dict[str, Any]) -> None:
    entry, unreadable = d.entry, d.unreadable
    if "snapshot" in unreadable:
        arguments = f"cannot be read: {unreadable['snapshot']}"
    elif view["snapshot"]:
        arguments = _dumped(view["snapshot"])
    else:
        arguments = "no snapshot (cannot be re-enqueued)"
    left = view["lease_remaining_seconds"]
    fields = [
        ("key", view["key"]),
        ("task", f"{view['task']}  (task id {view['task_id']})"),
        ("status", view["status"]),
        ("reason", view["reason"] or "-"),
        ("fence", str(view["fence"])),
        ("owner", view["owner"] or "-"),
        ("lease", duration(left) + " left" if left is not None else "-"),
        ("side effect", view["side_effect"]),
        ("runs", f"{view['executions']} execution(s), {view['interruptions']} interruption(s)"),
        ("created", timestamp(entry.created_at)),
        ("updated", timestamp(entry.updated_at)),
        ("arguments", arguments),
    ]
    if entry.due_at is not None and entry.status is EntryStatus.RETRYING:
        fields.append(("retry due", f"{timestamp(entry.due_at)} (re-sent by the sweep after)"))
    if entry.result is not None:
        fields.append(("result", unreadable.get("result") or _dumped(view["result"])[:200]))
    if entry.error is not None:
        fields.append(("error", unreadable.get("error") or _dumped(view["error"])[:200]))
    if entry.group_id is not None:
        fields.append(("group", f"{entry.group_id}  (celery-ledger show {entry.group_id})"))
    if entry.parent_id is not None and view["parent"] is None:
        fields.append(("published by", f"task {entry.parent_id}"))
    fields += _stamps(view)
    formatter = click.HelpFormatter(width=120)
    # Stored free text (reasons, names, ids) is printed escaped and bounded, never raw.
    formatter.write_dl([(k, printable(v, limit=SHOWN_CHARS)) for k, v in fields], col_max=14)
    echo(ctx, formatter.getvalue().rstrip())


def _stamps(view: dict[str, Any]) -> list[tuple[str, str]]:
    """The parent that sent the entry, and what operators and superseded attempts did to it."""
    fields = []
    if view["parent"]:
        p = view["parent"]
        fields.append(("parent", f"{p['key']}  (sent by step {p['step']} #{p['occurrence']})"))
    if view["released"]:
        r = view["released"]
        fields.append(
            (
                "released",
                f"by {r['by']} at {timestamp(r['at'])} from {r['from_status']}: {r['reason']}",
            )
        )
    if view["seen_alive"]:
        a = view["seen_alive"]
        fields.append(
            (
                "seen alive",
                f"at {timestamp(a['at'])} ({duration(a['ago_seconds'])} ago): the superseded "
                f"attempt of fence {a['fence']} on {a['owner'] or 'an unknown worker'} tried to "
                "write; its worker is still running",
            )
        )
    if view["marked_dead"]:
        d = view["marked_dead"]
        fields.append(
            (
                "marked dead",
                f"attempts up to fence {d['fence']}, by {d['by']} at {timestamp(d['at'])}: "
                f"{d['reason']}",
            )
        )
    return fields


def _print_steps(ctx: click.Context, steps: list[dict[str, Any]]) -> None:
    echo(ctx)
    echo(ctx, click.style("steps", bold=True))
    if not steps:
        echo(ctx, "  (none recorded)")
        return
    print_table(
        ctx,
        ["NAME", "OCC", "STATUS", "EXTERNAL REF", "RUNS", "STARTED", "TOOK"],
        [
            [
                s["name"],
                str(s["occurrence"]),
                s["status"] + (" (ambiguous)" if s["ambiguous"] else ""),
                s["external_ref"] or "-",
                f"{s['attempts']} ({s['authorized']} authorized)",
                timestamp(s["started_at"]),
                f"{s['duration_seconds']:.3f}s" if s["duration_seconds"] is not None else "-",
            ]
            for s in steps
        ],
        lambda i, v: "red" if i == 2 and "ambiguous" in v else None,
    )


def _print_signals(ctx: click.Context, signals: list[dict[str, Any]]) -> None:
    if not signals:
        return
    echo(ctx)
    echo(ctx, click.style("signals", bold=True) + "  (wait_for: each wait takes one)")
    for g in signals:
        if g["timed_out"]:
            state = f"wait {g['wait']} timed out"
        elif g["wait"] is None:
            state = "pending: kept for the next wait"
        else:
            state = f"taken by wait {g['wait']}"
        payload = g["unreadable"] or _dumped(g["payload"])
        echo(
            ctx,
            f"  {printable(g['name'])}  {state}  from {printable(g['sent_by'] or '-')}  "
            f"payload: {printable(payload)}",
        )


def _print_children(ctx: click.Context, children: list[dict[str, Any]]) -> None:
    if not children:
        return
    echo(ctx)
    echo(ctx, click.style("children", bold=True) + "  (celery-ledger show CHILD-ID)")
    print_table(
        ctx,
        ["CHILD ID", "TASK", "STEP", "STATE", "LAST ERROR"],
        [
            [
                c["child_id"],
                printable(c["task"], limit=SHOWN_CHARS),
                printable(f"{c['step']} #{c['occurrence']}", limit=SHOWN_CHARS),
                c["state"],
                printable(c["last_error"] or c["dropped"] or "-", limit=SHOWN_CHARS),
            ]
            for c in children
        ],
        lambda i, v: "yellow" if i == 3 and v == "pending" else "red" if v == "failing" else None,
    )
    if any(c["state"] == "failing" for c in children):
        echo(
            ctx,
            "a failing child is published by no sweep as it is: celery-ledger outbox "
            "repair KEY CHILD-ID --clear OPTION, or outbox drop KEY CHILD-ID",
        )


def _print_events(ctx: click.Context, events: list[dict[str, Any]]) -> None:
    echo(ctx)
    echo(ctx, click.style("events", bold=True))
    print_table(
        ctx,
        ["AT", "EVENT", "STATUS", "FENCE", "ACTOR", "DETAIL"],
        [
            [
                timestamp(e["at"]),
                e["event"],
                e["status"] or "-",
                str(e["fence"]),
                e["actor"] or "-",
                printable(e["detail"] or "", limit=SHOWN_CHARS),
            ]
            for e in events
        ],
        status_colour(2),
    )


# -- secrets --------------------------------------------------------------------------------


def _task_of(ctx: click.Context) -> Callable[[str], Any]:
    """The CLI app's task of a name, for its ``secret_args``; a stand-in with no signature
    (names unknown, nothing hidden wholesale) when the app does not register it."""
    try:
        tasks = load_app(ctx).tasks
    except Exception:  # noqa: BLE001 - an app that cannot say knows no secret_args
        tasks = {}

    def task_of(name: str) -> Any:
        task = tasks.get(name)
        return task if task is not None else object()  # no signature: names unknown

    return task_of


def redaction_for(
    ctx: click.Context, task_name: str, snapshot: Any
) -> tuple[dict[str, Any] | None, Redaction]:
    """An entry's snapshot safe to show, and the ``Redaction`` for the rest of its text
    (``celery_ledger.redact.entry_redaction``).

    The secret names are ``ledger_redact`` plus the task's ``secret_args`` when the CLI's app
    (``-A``) registers the task. Unlike the Flower page, an unknown task does not hide every
    value: whoever runs the CLI holds the ledger database's credentials and could read the
    row directly, and needs the arguments to choose a verdict. A positional argument of an
    unknown task is hidden whenever any secret name is set (its name is unknown). The tasks
    named in the snapshot's canvas placement (the rest of a chain, callbacks, errbacks) are
    redacted by the same rules, each by its own (``redact_snapshot``), as Flower's page does.
    """
    settings = load_settings(ctx)
    task_of = _task_of(ctx)
    return entry_redaction(
        snapshot, redact=settings.redact, task=task_of(task_name), task_of=task_of
    )


def scrub_view(view: dict[str, Any], redaction: Redaction) -> None:
    """Scrub the free text of an ``entry_view`` (its reason, a release's or mark-dead's why,
    the hint that may quote them): a reason may quote a secret."""
    view["reason"] = redaction.text(view.get("reason"))
    view["hint"] = redaction.text(view.get("hint"))
    for stamp in ("released", "marked_dead"):
        if view.get(stamp):
            view[stamp]["reason"] = redaction.text(view[stamp]["reason"])


def _redact_view(
    view: dict[str, Any], shown: dict[str, Any] | None, redaction: Redaction
) -> list[str]:
    """Hide secret argument values in ``view`` (``redaction_for``); the names hidden."""
    if shown is not None:
        view["snapshot"] = shown
    if not redaction.names:
        return []  # nothing is secret: nothing was hidden
    for name in ("result", "error"):
        view[name] = redaction.value(view.get(name))
    scrub_view(view, redaction)
    for step in view["steps"]:
        step["external_ref"] = redaction.text(step["external_ref"])
    for event in view["events"]:
        event["detail"] = redaction.text(event["detail"])
    return sorted(redaction.names)


# -- a Celery group -------------------------------------------------------------------------


def _member_view(m: Member) -> dict[str, Any]:
    return {
        "key": m.key,
        "task": m.task_name,
        "task_id": m.task_id,
        "status": m.status.value,
        "group_id": m.group_id,
        "parent_id": m.parent_id,
    }


def _print_members(ctx: click.Context, members: list[dict[str, Any]]) -> None:
    print_table(
        ctx,
        ["KEY", "TASK", "TASK ID", "STATUS"],
        [
            [m["key"][:16], printable(m["task"], limit=SHOWN_CHARS), m["task_id"], m["status"]]
            for m in members
        ],
        status_colour(3),
    )


def _show_members(ctx: click.Context, ref: str, members: list[Member], as_json: bool) -> None:
    """``show GROUP_ID``: a Celery group (or a parent task without an entry of its own)."""
    views = [_member_view(m) for m in members]
    counts: dict[str, int] = {}
    for m in views:
        counts[m["status"]] = counts.get(m["status"], 0) + 1
    if as_json:
        emit_json({"group": ref, "members": views, "counts": counts})
        return
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    echo(ctx, f"{printable(ref, limit=SHOWN_CHARS)}: {len(views)} member(s): {summary}")
    _print_members(ctx, views)
