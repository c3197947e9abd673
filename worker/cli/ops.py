"""Operator commands: list, release, resume, sweep, stats (and ``show``, from ``cli.show``).

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
    echo,
    emit_json,
    guarded,
    load_app,
    load_settings,
    open_store,
    operator_actor,
    parse_since,
    print_table,
    resolve_key,
    sending_app,
    status_colour,
)
from celery_ledger.cli.show import redaction_for, scrub_view, show_cmd
from celery_ledger.codec import encode
from celery_ledger.ledger import (
    STEP_RETURNED_WARNING,
    EntryStatus,
    Interrupted,
    LedgerStore,
    Release,
    Verdict,
    check_release_text,
    cipher_from,
    is_sealed,
    step_returned,
)
from celery_ledger.recovery import ResumeOutcome, resume_entry, run_sweep
from celery_ledger.view import (
    decode_stored,
    duration,
    entry_view,
    next_action,
    one_line,
    slot_key_view,
    token_hold_view,
)

# -- list ---------------------------------------------------------------------------------


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
    holds = store.token_holds([e.key for e in found if e.status is EntryStatus.SCHEDULED])
    views = []
    for e in found:
        view = entry_view(e, now, next_action(e, now, prefix, holds.get(e.key)))
        view["held_for_token"] = token_hold_view(holds.get(e.key), now)
        views.append(view)
    cipher = None
    for e, view in zip(found, views, strict=True):
        if is_sealed(e.snapshot) and cipher is None:
            cipher = cipher_from(load_settings(ctx).snapshot_keys)
        scrub_view(view, redaction_for(ctx, e.task_name, decode_stored(e.snapshot, cipher)[0])[1])
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
    outcome = _resume_released(ctx, store, settings, rel, by)
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
    _print_release(ctx, rel, verdict, by, outcome)


def _resume_released(
    ctx: click.Context, store: LedgerStore, settings: Any, rel: Release, by: str
) -> ResumeOutcome | None:
    """Re-enqueue an entry a ``not-executed`` release left interrupted, from its snapshot;
    None for a ``completed`` release (nothing to run)."""
    if rel.to_status is not EntryStatus.INTERRUPTED:
        return None
    if rel.snapshot is None:
        return ResumeOutcome.NO_SNAPSHOT
    return resume_entry(
        store,
        load_app(ctx),
        Interrupted(rel.key, rel.task_name, rel.task_id, rel.fence),
        lease_seconds=settings.lease_seconds,
        max_resumes=settings.max_resumes,
        actor=by,
        cipher=cipher_from(settings.snapshot_keys),
    )


def _print_release(
    ctx: click.Context, rel: Release, verdict: Verdict, by: str, outcome: ResumeOutcome | None
) -> None:
    """What ``release`` did, and what the operator does next, for a person."""
    echo(
        ctx,
        f"released {rel.key} ({rel.task_name}): {rel.from_status.value} -> "
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
    # design.md § "Durable time": send a scheduled or sleeping entry now
    if entry.status.waits_for_time:
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
    slot_keys = [slot_key_view(k, store.now()) for k in store.slot_keys()]
    holds, now = store.held_for_tokens_by_bucket(), store.now()
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
        # design.md § "Fleet-wide rate limits": entries held for a token, per bucket.
        "held_for_token": {
            bucket: {"entries": n, "oldest_held_seconds": round(now - since, 3)}
            for bucket, (n, since) in sorted(holds.items())
        },
        "by_task": [
            {"task": t, "status": s, "count": n}
            for (t, s), n in sorted(stats.by_task_status.items())
        ],
        # docs/concurrency.md: the concurrency keys with waiters, longest wait first.
        "waiting_for_slots": slot_keys,
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
        + [
            (f"held: {bucket}", f"{n} for a token (oldest {duration(now - since)})")
            for bucket, (n, since) in sorted(holds.items())
        ]
    )
    echo(ctx, formatter.getvalue().rstrip())
    if slot_keys:
        echo(ctx)
        print_table(
            ctx,
            ["CONCURRENCY KEY", "LIMIT", "HOLDING", "WAITING", "OLDEST WAIT"],
            [
                [k["concurrency_key"], str(k["limit"]), str(k["holding"]), str(k["waiting"])]
                + [duration(k["oldest_wait_seconds"])]
                for k in slot_keys
            ],
            lambda _i, _v: None,
        )


COMMANDS = [list_cmd, show_cmd, release_cmd, resume_cmd, sweep_cmd, stats_cmd]
