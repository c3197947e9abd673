"""``celery-ledger reseal``: re-encrypt stored argument snapshots under the first key.

The rotation story (``celery_ledger.ledger.sealing``): put the new key first in
``ledger_snapshot_keys`` everywhere, keep the old ones, run ``reseal``, then drop the old keys.
Plain (never sealed) snapshots are sealed too.
"""

from __future__ import annotations

import click

from celery_ledger.cli.common import echo, emit_json, guarded, load_settings, open_store
from celery_ledger.ledger import SnapshotSealError, cipher_from


@click.command("reseal")
@click.option("--batch", default=500, show_default=True, help="Entries per transaction.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def reseal_cmd(ctx: click.Context, batch: int, as_json: bool) -> None:
    """Re-encrypt every stored argument snapshot under the first ledger_snapshot_keys key."""
    if batch < 1:
        raise click.ClickException("--batch must be at least 1")
    cipher = cipher_from(load_settings(ctx).snapshot_keys)
    if cipher is None:
        raise click.ClickException(
            "ledger_snapshot_keys is not set (CELERY_LEDGER_SNAPSHOT_KEYS): nothing to seal with"
        )
    store = open_store(ctx)
    unreadable = 0

    def reseal(text: str) -> str | None:
        nonlocal unreadable
        try:
            return cipher.reseal(text)
        except SnapshotSealError:
            unreadable += 1
            return None

    resealed, after = 0, ""
    while True:
        done, last = store.rewrite_snapshots(reseal, after=after, limit=batch)
        resealed += done
        if last is None:
            break
        after = last
    if as_json:
        emit_json({"resealed": resealed, "unreadable": unreadable})
        return
    echo(ctx, f"resealed {resealed} argument snapshot(s) under the first key")
    if unreadable:
        echo(
            ctx,
            f"{unreadable} snapshot(s) could not be opened with any key and were left as "
            "they are: keep the key that sealed them",
        )
    if unreadable:
        ctx.exit(1)


COMMANDS = [reseal_cmd]
