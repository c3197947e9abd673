"""Operator commands for the outbox: ``outbox drop`` and ``outbox repair`` of a pending child.

A child a step recorded that no publish can send (an option Celery cannot build a message
from, recorded before ``send()`` checked its options) stays pending: the sweep tries it after
every good child, counts it, and ``show`` lists it as ``failing`` with its last error. An
operator either drops it (it is never sent; the parent's step stays completed) or repairs it by
clearing the bad option(s); the next sweep then publishes it first. Both are stamped with who
and why, in an event on the parent entry, and gated like a release (``Action.OUTBOX``).
"""

from __future__ import annotations

from typing import Any

import click

from celery_ledger.authorize import Action, Operator
from celery_ledger.cli.common import (
    echo,
    emit_json,
    guarded,
    load_settings,
    open_store,
    resolve_key,
)
from celery_ledger.cli.ops import _authorize
from celery_ledger.ledger import OutboxMessage, check_release_text, cipher_from
from celery_ledger.outbox import KEPT_OPTIONS, repaired_payload


@click.group("outbox")
def outbox_group() -> None:
    """Drop or repair a pending child a step sent (see `show ENTRY`, its children)."""


def _checked(by: str | None, reason: str | None, action: str) -> tuple[str, str]:
    if not by or not by.strip():
        raise click.ClickException(f"--by WHO is required: an outbox {action} is stamped with it")
    if not reason or not reason.strip():
        raise click.ClickException(
            f"--reason WHY is required: an outbox {action} is stamped with it"
        )
    check_release_text(
        by, reason, by_name="--by", reason_name="--reason", action=f"outbox {action}"
    )
    return by, reason


def _gate(ctx: click.Context, ref: str, by: str) -> tuple[Any, str]:
    store = open_store(ctx)
    key = resolve_key(store, ref)
    _authorize(
        load_settings(ctx),
        Operator(by, "cli", authenticated=False),
        Action.OUTBOX,
        store.get_entry(key),
    )
    return store, key


def _done(ctx: click.Context, child: OutboxMessage, verb: str, as_json: bool) -> None:
    data = {
        "key": child.parent_key,
        "child_id": child.child_id,
        "task": child.task_name,
        "step": child.step,
        "state": child.state,
    }
    if as_json:
        emit_json(data)
        return
    echo(
        ctx,
        f"{verb} child {child.child_id} ({child.task_name}) of {child.parent_key}: {child.state}",
    )


@outbox_group.command("drop")
@click.argument("ref")
@click.argument("child_id")
@click.option("--by", help="Who drops it (an operator token when tokens are set).  [required]")
@click.option("--reason", help="Why; kept in the parent entry's events.  [required]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def drop_cmd(
    ctx: click.Context, ref: str, child_id: str, by: str | None, reason: str | None, as_json: bool
) -> None:
    """Drop a pending child of entry REF: it is never published."""
    by, reason = _checked(by, reason, "drop")
    store, key = _gate(ctx, ref, by)
    _done(ctx, store.drop_child(key, child_id, by=by, reason=reason), "dropped", as_json)


@outbox_group.command("repair")
@click.argument("ref")
@click.argument("child_id")
@click.option(
    "--clear",
    "cleared",
    multiple=True,
    metavar="OPTION",
    help=f"An option to remove from the child ({', '.join(sorted(KEPT_OPTIONS))}); repeatable."
    "  [required]",
)
@click.option("--by", help="Who repairs it (an operator token when tokens are set).  [required]")
@click.option("--reason", help="Why; kept in the parent entry's events.  [required]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def repair_cmd(
    ctx: click.Context,
    ref: str,
    child_id: str,
    cleared: tuple[str, ...],
    by: str | None,
    reason: str | None,
    as_json: bool,
) -> None:
    """Clear the bad option(s) of a pending child of entry REF; the next sweep publishes it."""
    if not cleared:
        raise click.ClickException("--clear OPTION is required: name the option to remove")
    by, reason = _checked(by, reason, "repair")
    store, key = _gate(ctx, ref, by)
    found = next((c for c in store.children_of(key) if c.child_id == child_id), None)
    if found is None:
        raise click.ClickException(f"entry {key} recorded no child {child_id}")
    cipher = cipher_from(load_settings(ctx).snapshot_keys)
    try:
        payload = repaired_payload(found, cleared, cipher)
    except ValueError as exc:
        raise click.ClickException(f"--clear: {exc}") from None
    child = store.repair_child(
        key, child_id, payload, by=by, reason=f"cleared {', '.join(cleared)}: {reason}"
    )
    _done(ctx, child, "repaired", as_json)


COMMANDS = [outbox_group]
