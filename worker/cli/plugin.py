"""``celery ledger``: the sub-command Celery loads into every ``celery`` invocation.

Celery imports each ``celery.commands`` entry point when its command line starts, whatever
the command: ``celery -A proj worker`` included. So this module imports click and nothing
else; the ``ledger`` group adds its sub-commands (and with them SQLAlchemy, the ledger and
the CLI modules) only when it is asked for one. A worker that never runs ``celery ledger``
does not carry them, which ``benchmarks/memory.py`` relies on for an honest plain baseline.
"""

from __future__ import annotations

from typing import Any

import click


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use (help included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            from celery_ledger.cli.main import add_commands

            add_commands(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load()
        return super().get_command(ctx, cmd_name)


@click.group(name="ledger", cls=LazyGroup)
@click.option("--url", envvar="CELERY_LEDGER_URL", help="Ledger database URL.")
@click.pass_context
def celery_ledger_command(ctx: click.Context, url: str | None) -> None:
    """Operate the celery-ledger ledger of this app."""
    from celery_ledger.cli.main import LedgerContext

    celery_ctx = ctx.find_root().obj  # celery's CLIContext carries the -A app
    ctx.obj = LedgerContext(url, None, getattr(celery_ctx, "app", None))
