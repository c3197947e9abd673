"""Operator commands: list, show, release, resume, sweep, stats.

Every command gets a ``celery_ledger.cli.main.LedgerContext`` as ``ctx.obj`` and is installed
twice (the ``celery-ledger`` console script and ``celery -A proj ledger``); shared rules and helpers
are in ``celery_ledger.cli.common``.
"""

from __future__ import annotations

import json
from typing import Any

import click

from celery_ledger.announce import announce
from celery_ledger.authorize import Action, ActionDetails, AuthorizerError, Operator, authorize
from celery_ledger.cli.common import (
    command_prefix,
    decode_stored,
    duration,
    echo,
    emit_json,
    entry_view,
    guarded,
    load_app,
    load_settings,
    next_action,
    one_line,
    open_store,
    operator_actor,
    parse_since,
    print_table,
    printable,
    resolve_key,
    sending_app,
    status_colour,
    timestamp,
)
from celery_ledger.codec import encode
from celery_ledger.ledger import (
    STEP_RETURNED_WARNING,
    TRANSACTION_STEP_REF,
    EntryNotFound,
    EntryStatus,
    Interrupted,
    Member,
    StepStatus,
    Verdict,
    check_release_text,
    cipher_from,
    is_sealed,
    step_returned,
)
from celery_ledger.recovery import ResumeOutcome, resume_entry, run_sweep

# -- list / show ----------------------------------------------------------------------------


@click.command("list")
@click.option(
    "--stuck",
    is_flag=True,
    help="Interrupted, blocked, running past its lease, or a retry past its due time.",
)
@click.option(
    "--status", "statuses", multiple=True, help="Only these statuses (repeat, or comma-separate)."
)
@click.option("--task", help="Only this task name.")
@click.option("--since", help="Only entries changed within this long (30s, 10m, 2h, 1d).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def list_cmd(
    ctx: click.Context,
    stuck: bool,
    statuses: tuple[str, ...],
    task: str | None,
    since: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Entries, newest change first, with what to do next."""
    wanted = [s.strip() for raw in statuses for s in raw.split(",") if s.strip()]
    known = [s.value for s in EntryStatus]
    bad = [s for s in wanted if s not in known]
    if bad:
        raise click.ClickException(f"unknown status {bad[0]!r}; one of {', '.join(known)}")
    since_seconds = parse_since(since) if since else None
    store = open_store(ctx)
    found = store.list_entries(
        statuses=wanted or None, task=task, stuck=stuck, since_seconds=since_seconds, limit=limit
    )
    now = store.now()
    prefix = command_prefix(ctx)
    views = [entry_view(e, now, prefix) for e in found]
    cipher = None
    for e, view in zip(found, views, strict=True):
        if is_sealed(e.snapshot) and cipher is None:
            cipher = cipher_from(load_settings(ctx).snapshot_keys)
        _scrub_view(view, _redaction(ctx, e.task_name, decode_stored(e.snapshot, cipher)[0])[1])
    if as_json:
        emit_json({"now": now, "entries": views})
        return
    if not views:
        echo(ctx, "no entries")
        return
    rows = [
        [
            v["key"][:12],
            v["task"],
            v["status"],
            duration(v["age_seconds"]),
            str(v["fence"]),
            v["owner"] or "-",
            v["hint"],
        ]
        for v in views
    ]
    print_table(
        ctx, ["KEY", "TASK", "STATUS", "AGE", "FENCE", "OWNER", "NEXT"], rows, status_colour(2)
    )


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
    entry = store.get_entry(key)
    steps = store.load_steps(key)
    events = store.entry_events(key, limit=1000)
    now = store.now()
    view = entry_view(entry, now, command_prefix(ctx))
    # Decoded defensively: an entry whose snapshot, result or error no process can read (a
    # hostile sender's argument nested 5,000 deep) is shown with why, and can be released.
    unreadable: dict[str, str] = {}
    cipher = cipher_from(load_settings(ctx).snapshot_keys) if is_sealed(entry.snapshot) else None
    for name in ("snapshot", "result", "error"):
        view[name], problem = decode_stored(getattr(entry, name), cipher)
        if problem is not None:
            unreadable[name] = problem
    view["unreadable"] = unreadable
    view["steps"] = [
        {
            "name": s.name,
            "occurrence": s.occurrence,
            "status": s.status.value,
            "external_ref": s.external_ref,
            "fence": s.fence,
            "attempts": s.attempts,
            "authorized": s.authorized,
            "started_at": s.started_at,
            "completed_at": s.completed_at,
            "duration_seconds": (
                None
                if s.completed_at is None or s.started_at is None
                else round(s.completed_at - s.started_at, 6)
            ),
            # A transaction step's marker row is never ambiguous: its writes commit with its
            # completed row or not at all.
            "ambiguous": s.status is StepStatus.STARTED and s.external_ref != TRANSACTION_STEP_REF,
        }
        for s in steps
    ]
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
        for c in store.children_of(key)
    ]
    parent = store.parent_of(entry.task_id)
    view["parent"] = (
        None
        if parent is None
        else {"key": parent.parent_key, "step": parent.step, "occurrence": parent.occurrence}
    )
    # Celery's canvas: the group this entry was published in, and the entries it published
    # (the next link of a chain, a group it sent) with their states.
    view["group_id"] = entry.group_id
    view["parent_id"] = entry.parent_id
    view["members"] = [_member_view(m) for m in store.members(entry.task_id)]
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
        for e in events
    ]
    view["redacted"] = _redact_view(ctx, entry.task_name, view)
    if as_json:
        view["now"] = now
        emit_json(view)
        return
    if "snapshot" in unreadable:
        arguments = f"cannot be read: {unreadable['snapshot']}"
    elif view["snapshot"]:
        arguments = _dumped(view["snapshot"])
    else:
        arguments = "no snapshot (cannot be re-enqueued)"
    fields = [
        ("key", view["key"]),
        ("task", f"{view['task']}  (task id {view['task_id']})"),
        ("status", view["status"]),
        ("reason", view["reason"] or "-"),
        ("fence", str(view["fence"])),
        ("owner", view["owner"] or "-"),
        (
            "lease",
            duration(view["lease_remaining_seconds"]) + " left"
            if view["lease_remaining_seconds"] is not None
            else "-",
        ),
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
    formatter = click.HelpFormatter(width=120)
    # Stored free text (reasons, names, ids) is printed escaped and bounded, never raw.
    formatter.write_dl([(k, printable(v, limit=SHOWN_CHARS)) for k, v in fields], col_max=14)
    echo(ctx, formatter.getvalue().rstrip())
    echo(ctx)
    echo(ctx, click.style("steps", bold=True))
    if steps:
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
                for s in view["steps"]
            ],
            lambda i, v: "red" if i == 2 and "ambiguous" in v else None,
        )
    else:
        echo(ctx, "  (none recorded)")
    if view["children"]:
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
                for c in view["children"]
            ],
            lambda i, v: (
                "yellow" if i == 3 and v == "pending" else "red" if v == "failing" else None
            ),
        )
        if any(c["state"] == "failing" for c in view["children"]):
            echo(
                ctx,
                "a failing child is published by no sweep as it is: celery-ledger outbox "
                "repair KEY CHILD-ID --clear OPTION, or outbox drop KEY CHILD-ID",
            )
    if view["members"]:
        echo(ctx)
        echo(ctx, click.style("members", bold=True) + "  (the entries this task published)")
        _print_members(ctx, view["members"])
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
            for e in view["events"]
        ],
        status_colour(2),
    )
    echo(ctx)
    echo(ctx, f"next: {printable(view['hint'])}")
    if view["next_command"]:
        echo(ctx, f"  {printable(view['next_command'])}")


#: Longest stored text ``show`` prints for one field (reasons written before their bound).
SHOWN_CHARS = 2000


def _dumped(value: Any) -> str:
    """A decoded value as compact JSON, or why it cannot be printed (never raises)."""
    try:
        return json.dumps(value, default=str)
    except (RecursionError, ValueError) as exc:
        return f"(cannot be printed: {type(exc).__name__})"


# -- release / resume / sweep ---------------------------------------------------------------


def _parse_verdict(raw: str | None) -> Verdict:
    value = (raw or "").strip().lower().replace("_", "-")
    if value == "completed":
        return Verdict.COMPLETED
    if value == "not-executed":
        return Verdict.NOT_EXECUTED
    raise click.ClickException(
        f"--verified must be 'completed' or 'not-executed', not {raw!r}"
        if raw
        else "--verified completed|not-executed is required"
    )


def _parse_result(text: str | None, verdict: Verdict, limit: int) -> str | None:
    if verdict is Verdict.NOT_EXECUTED:
        if text is not None:
            raise click.ClickException("--result-json goes with --verified completed only")
        return None
    if text is None:
        raise click.ClickException(
            "--verified completed needs --result-json (the task's result; 'null' for none)"
        )

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        raise click.ClickException(f"--result-json is not valid JSON: {one_line(exc)}") from None
    return encode(value, limit=limit, what="--result-json")


def _authorize(
    settings: Any,
    operator: Operator,
    action: Action,
    entry: Any,
    details: ActionDetails | None = None,
) -> None:
    """Ask the authorizer (``ledger_authorizer``, else operator tokens) before the write."""
    try:
        decision = authorize(settings, operator, action, entry, details)
    except AuthorizerError as exc:
        raise click.ClickException(one_line(exc)) from None
    if not decision.allowed:
        verb = {Action.RESUME: "re-enqueued", Action.MARK_DEAD: "marked"}.get(action, "released")
        raise click.ClickException(f"{decision.reason or 'not allowed'}; nothing was {verb}")


def _redaction(
    ctx: click.Context, task_name: str, snapshot: Any
) -> tuple[dict[str, Any] | None, Any]:
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
    from celery_ledger.redact import entry_redaction

    settings = load_settings(ctx)
    try:
        tasks = load_app(ctx).tasks
    except Exception:  # noqa: BLE001 - an app that cannot say knows no secret_args
        tasks = {}

    def task_of(name: str) -> Any:
        task = tasks.get(name)
        return task if task is not None else object()  # no signature: names unknown

    return entry_redaction(
        snapshot, redact=settings.redact, task=task_of(task_name), task_of=task_of
    )


def _scrub_view(view: dict[str, Any], redaction: Any) -> None:
    """Scrub the free text of an ``entry_view`` (its reason, a release's or mark-dead's why,
    the hint that may quote them): a reason may quote a secret."""
    view["reason"] = redaction.text(view.get("reason"))
    view["hint"] = redaction.text(view.get("hint"))
    for stamp in ("released", "marked_dead"):
        if view.get(stamp):
            view[stamp]["reason"] = redaction.text(view[stamp]["reason"])


def _redact_view(ctx: click.Context, task_name: str, view: dict[str, Any]) -> list[str]:
    """Hide secret argument values in ``view`` (``_redaction``); the names hidden."""
    shown, redaction = _redaction(ctx, task_name, view.get("snapshot"))
    if shown is not None:
        view["snapshot"] = shown
    if not redaction.names:
        return []  # nothing is secret: nothing was hidden
    for name in ("result", "error"):
        view[name] = redaction.value(view.get(name))
    _scrub_view(view, redaction)
    for step in view["steps"]:
        step["external_ref"] = redaction.text(step["external_ref"])
    for event in view["events"]:
        event["detail"] = redaction.text(event["detail"])
    return sorted(redaction.names)


@click.command("release")
@click.argument("ref")
@click.option(
    "--verified",
    "verified_raw",
    metavar="completed|not-executed",
    help="Your verdict on the ambiguous step.  [required]",
)
@click.option("--by", help="Who releases (an operator token when tokens are set).  [required]")
@click.option("--reason", help="Why; kept on the entry and in the events.  [required]")
@click.option("--result-json", help="With --verified completed: the task's result, as JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def release_cmd(
    ctx: click.Context,
    ref: str,
    verified_raw: str | None,
    by: str | None,
    reason: str | None,
    result_json: str | None,
    as_json: bool,
) -> None:
    """Resolve a stuck entry once: it ran (completed) or it did not (not-executed)."""
    verdict = _parse_verdict(verified_raw)
    if not by or not by.strip():
        raise click.ClickException("--by WHO is required: a release is stamped with its author")
    if not reason or not reason.strip():
        raise click.ClickException("--reason WHY is required: a release is stamped with its why")
    # The store refuses them too; checked here first, before anything is loaded or read.
    check_release_text(by, reason, by_name="--by", reason_name="--reason")
    settings = load_settings(ctx)
    result = _parse_result(result_json, verdict, settings.max_result_bytes)
    store = open_store(ctx)
    key = resolve_key(store, ref)
    action = Action.release(verdict)
    entry = store.get_entry(key)
    _authorize(settings, Operator(by, "cli", authenticated=False), action, entry)
    if verdict is Verdict.NOT_EXECUTED and step_returned(entry.reason):
        click.echo(f"warning: {STEP_RETURNED_WARNING}", err=True)
    # One-shot, live-lease and completed refusals are decided in the release transaction.
    rel = store.release(
        key,
        verdict,
        by=by,
        reason=reason,
        result=result,
        require_death_signal=settings.release_requires_death_signal,
    )
    announce(
        load_app(ctx),
        "released",
        task_id=rel.task_id,
        key=key,
        fence=rel.fence,
        verified=verdict.value,
        by=by,
    )
    outcome = None
    if rel.to_status is EntryStatus.INTERRUPTED:
        outcome = ResumeOutcome.NO_SNAPSHOT
        if rel.snapshot is not None:
            outcome = resume_entry(
                store,
                load_app(ctx),
                Interrupted(key, rel.task_name, rel.task_id, rel.fence),
                lease_seconds=settings.lease_seconds,
                max_resumes=settings.max_resumes,
                actor=by,
                cipher=cipher_from(settings.snapshot_keys),
            )
    data = {
        "key": key,
        "verified": verdict.value,
        "by": by,
        "reason": reason,
        "from_status": rel.from_status.value,
        "to_status": rel.to_status.value,
        "fence": rel.fence,
        "steps_released": list(rel.steps_released),
        "task": rel.task_name,
        "task_id": rel.task_id,
        "resume": outcome,
    }
    if as_json:
        emit_json(data)
        return
    echo(
        ctx,
        f"released {key} ({rel.task_name}): {rel.from_status.value} -> "
        f"{rel.to_status.value}, fence {rel.fence}, verified {verdict.value} by {by}",
    )
    if rel.steps_released:
        echo(ctx, f"authorized one more run of: {', '.join(rel.steps_released)}")
    if outcome is ResumeOutcome.RESUMED:
        echo(ctx, f"re-enqueued as task id {rel.task_id}")
    elif outcome is ResumeOutcome.NO_SNAPSHOT:
        echo(
            ctx,
            f"no argument snapshot: re-send task id {rel.task_id} by hand; it stays "
            "interrupted until then",
        )
    elif outcome is not None:
        echo(ctx, f"not re-enqueued ({outcome.value}); the sweep will pick it up")


@click.command("resume")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def resume_cmd(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Re-enqueue an interrupted entry now (or send a scheduled or sleeping one before its
    due time), with its task id and argument snapshot."""
    store = open_store(ctx)
    key = resolve_key(store, ref)
    entry = store.get_entry(key)
    sending_app(ctx)  # before anything is written: a resume must reach a worker
    if entry.status.waits_for_time:  # issue 18: send a scheduled or sleeping entry now
        from celery_ledger.cli.schedule import resume_waiting

        resume_waiting(ctx, store, entry, as_json)
        return
    if entry.status is not EntryStatus.INTERRUPTED:
        hint = next_action(entry, store.now(), command_prefix(ctx))
        raise click.ClickException(
            f"{key} is {entry.status.value}, not interrupted; next: {hint.hint}"
        )
    if entry.snapshot is None:
        raise click.ClickException(
            f"{key} has no argument snapshot; re-send task id {entry.task_id} by hand"
        )
    settings = load_settings(ctx)
    actor = operator_actor()
    _authorize(settings, Operator(actor, "cli", authenticated=False), Action.RESUME, entry)
    outcome = resume_entry(
        store,
        load_app(ctx),
        Interrupted(key, entry.task_name, entry.task_id, entry.fence, entry.interruptions),
        lease_seconds=settings.lease_seconds,
        max_resumes=settings.max_resumes,
        actor=actor,
        cipher=cipher_from(settings.snapshot_keys),
    )
    if as_json:
        emit_json(
            {"key": key, "task": entry.task_name, "task_id": entry.task_id, "outcome": outcome}
        )
    elif outcome is ResumeOutcome.RESUMED:
        echo(ctx, f"re-enqueued {key} ({entry.task_name}) as task id {entry.task_id}")
    if outcome is ResumeOutcome.BLOCKED:
        raise click.ClickException(
            f"{key} was interrupted {entry.interruptions} times "
            f"(ledger_max_resumes={settings.max_resumes}): blocked as a "
            "crash loop; inspect it and release it"
        )
    if outcome is ResumeOutcome.LOST_RACE:
        raise click.ClickException(
            f"{key} was not re-enqueued: another resumer moved it first, "
            "or the broker refused the message"
        )


@click.command("sweep")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def sweep_cmd(ctx: click.Context, as_json: bool) -> None:
    """Run one recovery sweep now (what beat's celery-ledger-sweep runs) and report it."""
    store = open_store(ctx)
    settings = load_settings(ctx)
    # run_sweep with *this* store, not the app's: `--url` may name another ledger than the app.
    report = run_sweep(
        store,
        load_app(ctx),
        lease_seconds=settings.lease_seconds,
        max_resumes=settings.max_resumes,
        retention_days=settings.retention_days,
        batch=settings.sweep_batch,
        actor=operator_actor(),
        cipher=cipher_from(settings.snapshot_keys),
        tombstone_days=settings.tombstone_days,
    )
    if as_json:
        emit_json(report.as_dict())
        return
    data = report.as_dict()
    keys = data.pop("resumed_keys")
    formatter = click.HelpFormatter()
    formatter.write_dl([(k.replace("_", " "), str(v)) for k, v in data.items()])
    echo(ctx, formatter.getvalue().rstrip())
    for key in keys:
        echo(ctx, f"  resumed {key}")


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def stats_cmd(ctx: click.Context, as_json: bool) -> None:
    """Entries by status, blocked, oldest running, duplicate-execution rate (target 0.0)."""
    store = open_store(ctx)
    stats = store.stats()
    data = {
        "by_status": stats.by_status,
        "blocked": stats.by_status.get("blocked", 0),
        "expired_running": stats.expired_running,
        "oldest_running_age_seconds": round(stats.oldest_running_age, 3),
        "interruptions": stats.interruptions,
        "entries": stats.entries,
        "duplicate_executions": stats.duplicate_executions,
        "duplicate_execution_rate": stats.duplicate_execution_rate,
        "unclaimed": stats.unclaimed,
        "oldest_unclaimed_age_seconds": round(stats.oldest_unclaimed_age, 3),
        "unclaimed_lapses": stats.unclaimed_lapses,
        # The outbox: children not yet published, and of them those no publish can send.
        "outbox_pending": store.count_unpublished(),
        "outbox_failing": store.count_failing(),
        "by_task": [
            {"task": t, "status": s, "count": n}
            for (t, s), n in sorted(stats.by_task_status.items())
        ],
    }
    if as_json:
        emit_json(data)
        return
    print_table(
        ctx,
        ["STATUS", "ENTRIES"],
        [[s, str(n)] for s, n in stats.by_status.items()],
        status_colour(0),
    )
    echo(ctx)
    formatter = click.HelpFormatter()
    formatter.write_dl(
        [
            ("blocked", str(data["blocked"])),
            ("expired leases", str(stats.expired_running)),
            ("oldest running", duration(stats.oldest_running_age)),
            ("interruptions", str(stats.interruptions)),
            ("entries", str(stats.entries)),
            ("duplicates", str(stats.duplicate_executions)),
            ("duplicate rate", f"{stats.duplicate_execution_rate:.4f} (target 0.0)"),
            ("unclaimed", f"{stats.unclaimed} (oldest {duration(stats.oldest_unclaimed_age)})"),
            ("lapses", f"{stats.unclaimed_lapses} (of unclaimed tasks: re-sent or deferred)"),
            (
                "outbox",
                f"{data['outbox_pending']} pending, {data['outbox_failing']} failing "
                "(celery-ledger outbox drop|repair)",
            ),
        ]
    )
    echo(ctx, formatter.getvalue().rstrip())


COMMANDS = [list_cmd, show_cmd, release_cmd, resume_cmd, sweep_cmd, stats_cmd]


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
