"""The ``celery-ledger`` command group, installed twice.

- console script ``celery-ledger`` (ledger URL from ``--url``, ``CELERY_LEDGER_URL`` or ``-A app``)
- Celery sub-command ``celery -A proj ledger ...`` (entry point group ``celery.commands``, the
  way Flower registers ``celery flower``): ``celery_ledger.cli.plugin``, which imports this
  module only when ``celery ledger`` is used

Each command family lives in a module of its own and is added here:
``celery_ledger.cli.ops`` (list/show/release/resume/sweep/stats),
``celery_ledger.cli.doctor`` (doctor), ``celery_ledger.cli.migrate`` (migrate),
``celery_ledger.metrics`` (metrics), ``celery_ledger.harness.demo`` (demo),
``celery_ledger.harness.verify`` (verify).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

#: (module, attribute) of every command added to the group; a module that is missing is
#: skipped so that a partial install still offers the rest.
COMMANDS = [
    ("celery_ledger.cli.ops", "COMMANDS"),
    ("celery_ledger.cli.outbox", "COMMANDS"),
    ("celery_ledger.cli.death", "COMMANDS"),
    ("celery_ledger.cli.sealing", "COMMANDS"),
    ("celery_ledger.cli.schedule", "COMMANDS"),
    ("celery_ledger.cli.doctor", "COMMANDS"),
    ("celery_ledger.cli.migrate", "COMMANDS"),
    ("celery_ledger.cli.metrics", "COMMANDS"),
    ("celery_ledger.harness.demo", "COMMANDS"),
    ("celery_ledger.harness.verify", "COMMANDS"),
]


class LedgerContext:
    """What every command needs: how to reach the ledger (and optionally the Celery app)."""

    def __init__(self, url: str | None, app_name: str | None, app: Any = None) -> None:
        self._url = url
        self._app_name = app_name
        self._app = app
        self._store: Any = None

    @property
    def app(self) -> Any:
        """The Celery app (``-A``), or the default app when none was named."""
        if self._app is None:
            if self._app_name:
                from celery.bin.celery import find_app

                self._app = find_app(self._app_name)
            else:
                from celery_ledger.app import create_app

                # The embedded default's data directory is ./.celery-ledger: made here, it
                # would litter wherever an operator runs a --url command. Only one named by
                # CELERY_LEDGER_DATA_DIR is made (a resume sends through its broker folders).
                self._app = create_app(make_dirs="CELERY_LEDGER_DATA_DIR" in os.environ)
        return self._app

    @property
    def url(self) -> str:
        """The ledger URL: ``--url`` (or ``CELERY_LEDGER_URL``), else the app's ledger.

        Raises:
            click.ClickException: ``--url`` was given empty (an unset shell variable, say): the
                operator named a ledger, and it must not silently become the default one.
        """
        if self._url is not None:
            if not self._url.strip():
                raise click.ClickException(
                    "--url is empty: give the ledger's URL, or leave --url out to use the "
                    "app's ledger"
                )
            return self._url
        from celery_ledger.runtime import settings_for

        return settings_for(self.app).url

    @property
    def store(self) -> Any:
        if self._store is None:
            from celery_ledger.ledger import LedgerStore

            self._store = LedgerStore(self.url, migrate=False)
        return self._store


def add_commands(group: click.Group) -> click.Group:
    """Add every family in ``COMMANDS`` to ``group`` (the console script, or ``celery ledger``
    on first use: ``celery_ledger.cli.plugin``)."""
    for module_name, attr in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        for command in getattr(module, attr):
            group.add_command(command)
    return group


@click.group()
@click.option("--url", envvar="CELERY_LEDGER_URL", help="Ledger database URL.")
@click.option("-A", "--app", "app_name", help="Celery app, as for `celery -A`.")
@click.pass_context
def main(ctx: click.Context, url: str | None, app_name: str | None) -> None:
    """celery-ledger: see, resolve and prove what the ledger does."""
    ctx.obj = LedgerContext(url, app_name)


add_commands(main)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
