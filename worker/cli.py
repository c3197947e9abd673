"""Placeholder CLI (filled in by the operator-surface work)."""

import click


@click.group()
def main() -> None:
    """celery-ledger: operate the ledger."""


celery_ledger_command = main
