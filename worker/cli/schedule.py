"""``cancel``: cancel a ledgered task durably (design.md § "Durable time"); ``signal``: send a
durable signal to a task's ``wait_for`` (design.md § "Durable signals").

A task that nothing runs right now (scheduled, sleeping, a retry waiting, interrupted, blocked)
is ``cancelled`` at once. A running one stops at its next effect step (the step's own write
refuses to start it) and settles ``cancelled``; a step already started finishes, or becomes
ambiguous as usual: cancellation never interrupts an effect mid-call. A settled task is left
as it is.
"""

from __future__ import annotations

import json
from typing import Any

import click

from celery_ledger.cli.common import (
    echo,
    emit_json,
    guarded,
    load_app,
    load_settings,
    open_store,
    operator_actor,
    resolve_key,
    sending_app,
)
from celery_ledger.ledger import check_release_text
from celery_ledger.view import one_line


@click.command("cancel")
@click.argument("ref")
@click.option("--by", help="Who cancels (an operator token when tokens are set).  [required]")
@click.option("--reason", help="Why; kept on the entry and in the events.  [required]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def cancel_cmd(
    ctx: click.Context, ref: str, by: str | None, reason: str | None, as_json: bool
) -> None:
    """Cancel a task (REF: key, key prefix or task id): it never starts, or stops at its next
    effect step, and settles cancelled."""
    if not by or not by.strip():
        raise click.ClickException(
            "--by WHO is required: a cancellation is stamped with its author"
        )
    if not reason or not reason.strip():
        raise click.ClickException(
            "--reason WHY is required: a cancellation is stamped with its why"
        )
    check_release_text(by, reason, by_name="--by", reason_name="--reason", action="cancel")
    settings = load_settings(ctx)
    if settings.operator_tokens and by not in settings.operator_tokens:
        raise click.ClickException("--by must be an operator token; nothing was cancelled")
    store = open_store(ctx)
    key = resolve_key(store, ref)
    from celery_ledger.authorize import Action, AuthorizerError, Operator, authorize
    from celery_ledger.timing import cancel_entry

    try:
        decision = authorize(
            settings, Operator(by, "cli", authenticated=False), Action.CANCEL, store.get_entry(key)
        )
    except AuthorizerError as exc:
        raise click.ClickException(str(exc).splitlines()[0]) from None
    if not decision.allowed:
        raise click.ClickException(f"{decision.reason or 'not allowed'}; nothing was cancelled")

    done = cancel_entry(load_app(ctx), store, key, by=by, reason=reason)
    data = {
        "key": key,
        "task": done.task_name,
        "task_id": done.task_id,
        "from_status": done.found.value,
        "outcome": done.outcome,
        "fence": done.fence,
        "by": by,
        "reason": reason,
    }
    if as_json:
        emit_json(data)
        return
    if done.outcome == "cancelled":
        echo(ctx, f"cancelled {key} ({done.task_name}): {done.found.value} -> cancelled, by {by}")
    elif done.outcome == "requested":
        echo(
            ctx,
            f"cancellation recorded for {key} ({done.task_name}): it is running and stops at "
            "its next effect step (a step already started finishes)",
        )
    else:
        raise click.ClickException(
            f"{key} is {done.found.value} already; there is nothing left to cancel"
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


@click.command("signal")
@click.argument("ref")
@click.argument("name")
@click.option("--payload", default="null", show_default=True, help="The signal's payload, as JSON.")
@click.option("--by", help="Who sends it (kept in the events; default celery-ledger:<user>).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def signal_cmd(
    ctx: click.Context, ref: str, name: str, payload: str, by: str | None, as_json: bool
) -> None:
    """Send signal NAME with a JSON payload to a task (REF: key, key prefix or task id): its
    ``wait_for(NAME)`` returns the payload, once. A task waiting now is sent at once; one
    not waiting yet keeps the signal for its wait."""
    from celery_ledger.authorize import Action, Operator, authorize
    from celery_ledger.ledger import SignalRefused, cipher_from
    from celery_ledger.signals import send

    try:
        value = json.loads(payload, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise SignalRefused(f"--payload is not JSON: {one_line(exc)}") from None
    settings = load_settings(ctx)
    sender = by or operator_actor()
    store = open_store(ctx)
    key = resolve_key(store, ref)
    decision = authorize(
        settings, Operator(sender, "cli", authenticated=False), Action.SIGNAL, store.get_entry(key)
    )
    if not decision.allowed:
        raise click.ClickException(f"{decision.reason or 'not allowed'}; no signal was kept")
    sent = send(
        store,
        sending_app(ctx),
        key,
        name,
        value,
        by=sender,
        cipher=cipher_from(settings.snapshot_keys),
        lease_seconds=settings.lease_seconds,
    )
    if as_json:
        emit_json(
            {
                "key": sent.key,
                "task": sent.task_name,
                "task_id": sent.task_id,
                "status": sent.status.value,
                "signal": name,
                "woken": sent.woken,
            }
        )
        return
    if sent.woken:
        echo(
            ctx, f"signal {name!r} sent to {sent.key} ({sent.task_name}): it was waiting; sent now"
        )
    elif sent.status.value == "sleeping":
        echo(
            ctx,
            f"signal {name!r} kept for {sent.key} ({sent.task_name}, sleeping): the sweep "
            "sends it when its wait for it is due",
        )
    else:
        echo(
            ctx,
            f"signal {name!r} kept for {sent.key} ({sent.task_name}, {sent.status.value}): "
            "its wait for it takes it",
        )


COMMANDS = [cancel_cmd, signal_cmd]


def resume_waiting(ctx: click.Context, store: Any, entry: Any, as_json: bool) -> None:
    """``resume`` of a scheduled or sleeping entry: send it now, before its due time."""
    from celery_ledger.authorize import Action, Operator, authorize
    from celery_ledger.cli.common import operator_actor
    from celery_ledger.ledger import cipher_from
    from celery_ledger.recovery.wake import wake_entry

    settings = load_settings(ctx)
    actor = operator_actor()
    decision = authorize(
        settings, Operator(actor, "cli", authenticated=False), Action.RESUME, entry
    )
    if not decision.allowed:
        raise click.ClickException(f"{decision.reason or 'not allowed'}; nothing was sent")
    outcome = wake_entry(
        store,
        load_app(ctx),
        entry.key,
        entry.fence,
        entry.status,
        entry.snapshot,
        task_id=entry.task_id,
        lease_seconds=settings.lease_seconds,
        actor=actor,
        only_due=False,
        cipher=cipher_from(settings.snapshot_keys),
    )
    if as_json:
        emit_json(
            {
                "key": entry.key,
                "task": entry.task_name,
                "task_id": entry.task_id,
                "outcome": outcome,
            }
        )
    elif outcome.value == "resumed":
        echo(
            ctx,
            f"sent {entry.key} ({entry.task_name}, {entry.status.value}) now "
            f"as task id {entry.task_id}",
        )
    if outcome.value == "no-snapshot":
        raise click.ClickException(
            f"{entry.key} has no argument snapshot; send task id {entry.task_id} by hand"
        )
    if outcome.value in ("lost-race", "blocked"):
        raise click.ClickException(
            f"{entry.key} was not sent ({outcome.value}): it moved first, is being cancelled, "
            "or the broker refused the message"
        )
