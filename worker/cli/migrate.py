"""``migrate``: the only command that creates or changes the ledger's schema.

It runs under the migration lock (``ledger.migrate.ensure_schema``), so it is safe beside running
workers; ``--plan`` changes nothing, and never creates a SQLite file that is not there.
"""

from __future__ import annotations

import os

import click
from sqlalchemy.engine import make_url

from celery_ledger.cli.common import echo, emit_json, guarded, sqlite_file_problem, sqlite_path
from celery_ledger.ledger.engine import is_sqlite, make_engine, normalize_url
from celery_ledger.ledger.errors import translate_db_errors
from celery_ledger.ledger.migrate import (
    all_revisions,
    current_revision,
    ensure_schema,
    head_revision,
    pending_revisions,
)


@click.command("migrate")
@click.option("--plan", is_flag=True, help="Show pending schema revisions; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def migrate_cmd(ctx: click.Context, plan: bool, as_json: bool) -> None:
    """Create or upgrade the ledger schema (under a lock; safe beside running workers)."""
    url = ctx.obj.url
    path = sqlite_path(url)
    empty = False
    if path is not None and os.path.exists(path):
        empty = os.path.getsize(path) == 0
        problem = None if empty else sqlite_file_problem(path)
        if problem is not None:
            raise click.ClickException(problem)  # never write into a file that is not ours
    if plan:
        _require_existing_or_empty_plan(url)
    current: str | None = None
    applied: list[str] = []
    if plan and empty:
        # Answered without opening it: SQLite writes its header into an empty file it opens.
        pending = all_revisions()
    else:
        engine = make_engine(url)
        try:
            with translate_db_errors(), engine.connect() as conn:
                current = current_revision(conn)
                pending = pending_revisions(conn)
            with translate_db_errors():
                applied = [] if plan else ensure_schema(engine)
        finally:
            engine.dispose()
    data = {
        "current": current,
        "head": head_revision(),
        "pending": pending,
        "applied": applied,
        "plan": plan,
    }
    if as_json:
        emit_json(data)
    elif plan:
        at = (
            "no ledger schema yet (empty database)" if current is None else f"schema at {current!r}"
        )
        echo(
            ctx,
            f"{at}, head {head_revision()!r}: "
            + (
                f"{len(pending)} pending: {', '.join(pending)} (`migrate` applies them)"
                if pending
                else "nothing to do"
            ),
        )
    else:
        echo(
            ctx,
            f"applied {', '.join(applied)}; schema at {head_revision()!r}"
            if applied
            else f"schema already at {head_revision()!r}",
        )


def _require_existing_or_empty_plan(url: str) -> None:
    """``--plan`` changes nothing: a missing SQLite file is reported, not created."""
    if is_sqlite(url):
        path = make_url(normalize_url(url)).database
        if path and path != ":memory:" and not os.path.exists(path):
            raise click.ClickException(
                f"no ledger database at {path}; `migrate` without --plan "
                f"creates it at revision {head_revision()!r}"
            )


COMMANDS = [migrate_cmd]
