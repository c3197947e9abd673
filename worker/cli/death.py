"""``celery-ledger mark-dead``: assert an entry's old attempts dead (the death-signal gate).

Under ``ledger_release_requires_death_signal`` a ``not-executed`` release of an ambiguous step
waits for it; see ``celery_ledger.ledger.death`` for why.
"""

from __future__ import annotations

from typing import Any

import click

from celery_ledger.announce import announce
from celery_ledger.authorize import Action, ActionDetails, Operator
from celery_ledger.cli.common import (
    echo,
    emit_json,
    guarded,
    load_app,
    load_settings,
    open_store,
    resolve_key,
)
from celery_ledger.ledger import check_release_text


@click.command("mark-dead")
@click.argument("ref")
@click.option("--by", help="Who asserts it (an operator token when tokens are set).  [required]")
@click.option("--reason", help="How you know the old worker is gone.  [required]")
@click.option(
    "--override-heartbeat",
    is_flag=True,
    help="Mark it dead although the old owner showed a sign of life within the grace window.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def mark_dead_cmd(
    ctx: click.Context,
    ref: str,
    by: str | None,
    reason: str | None,
    override_heartbeat: bool,
    as_json: bool,
) -> None:
    """Assert that every attempt of a stuck entry so far is dead (its worker is gone)."""
    from celery_ledger.cli.ops import _authorize

    if not by or not by.strip():
        raise click.ClickException("--by WHO is required: mark-dead is stamped with its author")
    if not reason or not reason.strip():
        raise click.ClickException(
            "--reason WHY is required: say how you know the old worker is gone"
        )
    check_release_text(by, reason, by_name="--by", reason_name="--reason", action="mark-dead")
    settings = load_settings(ctx)
    store = open_store(ctx)
    key = resolve_key(store, ref)
    entry = store.get_entry(key)
    _authorize(
        settings,
        Operator(by, "cli", authenticated=False),
        Action.MARK_DEAD,
        entry,
        ActionDetails(override_heartbeat=override_heartbeat),
    )
    signal = store.mark_dead(
        key,
        by=by,
        reason=reason,
        grace_seconds=settings.death_grace_seconds,
        lease_seconds=settings.lease_seconds,
        override_heartbeat=override_heartbeat,
    )
    announce(
        load_app(ctx), "marked-dead", task_id=entry.task_id, key=key, fence=signal.fence, by=by
    )
    data: dict[str, Any] = {
        "key": key,
        "dead_fence": signal.fence,
        "by": by,
        "reason": reason,
        "at": signal.at,
        "overridden": list(signal.overridden),
    }
    if as_json:
        emit_json(data)
        return
    echo(ctx, f"marked dead: every attempt of {key} up to fence {signal.fence}, by {by}")
    for sign in signal.overridden:
        echo(ctx, f"overridden: {sign}")


COMMANDS = [mark_dead_cmd]
