"""``doctor``'s ``connections`` check: does the fleet's connection budget fit the PostgreSQL
server's ``max_connections`` (docs/operations.md § "Deploying")?

The budget is ``celery_ledger.ledger.budget``'s, counted with real workers: a node of ``-c C``
holds ``1 + 2C`` connections and at most ``1 + 3C``; a beat holds one. ``--fleet 6x4+2`` names
the fleet (six nodes of ``-c 4``, two beats); without it the check counts one node of the app's
``worker_concurrency`` (Celery's default: the machine's CPUs) and one beat. The server allows
``max_connections`` less ``superuser_reserved_connections``. Behind a transaction pooler the
fleet's connections are the pooler's clients, and only its pool reaches the server.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from celery_ledger.ledger.budget import Fleet, parse_fleet
from celery_ledger.ledger.engine import declared_pooler, is_sqlite, make_engine
from celery_ledger.view import one_line

NAME = "connections"
ADVICE = (
    "fewer workers or a lower -c, a larger max_connections, or PgBouncer in front "
    "(?pooler=pgbouncer in the ledger URL)"
)


def fleet_for(app: Any, fleet: str | None) -> Fleet:
    """The fleet ``--fleet`` names, or one node of the app's concurrency and one beat.

    Raises:
        ValueError: ``--fleet`` does not parse, in the ledger's words.
    """
    if fleet:
        return parse_fleet(fleet)
    concurrency = app.conf.worker_concurrency or os.cpu_count() or 1
    return Fleet(1, int(concurrency), 1)


def check_budget(url: str, app: Any, fleet: str | None) -> tuple[str, str, str]:
    """(name, PASS | WARN | FAIL, why). Read-only: one connection, one query."""
    try:
        if is_sqlite(url):
            return (NAME, "PASS", "SQLite: no server connections to budget")
        wanted = fleet_for(app, fleet)
        pooler = declared_pooler(url)
    except ValueError as exc:
        return (NAME, "FAIL", one_line(exc))
    who = wanted.describe()
    if pooler == "pgbouncer":
        return (
            NAME,
            "PASS",
            f"{who} open up to {wanted.peak} client connections to the pooler; its pool "
            "size is what reaches the server's max_connections",
        )
    try:
        allowed, reserved = _server_limits(url)
    except sa_exc.SQLAlchemyError:  # the schema check says why, in its line
        return (NAME, "WARN", "not checked: the ledger is unreachable (see schema)")
    room = allowed - reserved
    held = f"{who} hold {wanted.held} ledger connections (at most {wanted.peak})"
    server = f"the server allows {room} (max_connections {allowed} less {reserved} reserved)"
    if wanted.held > room:
        return (NAME, "FAIL", f"{held}; {server}: {ADVICE}")
    if wanted.peak > room:
        return (NAME, "WARN", f"{held}; {server}, fewer than at most: {ADVICE}")
    return (NAME, "PASS", f"{held}; {server}")


def _server_limits(url: str) -> tuple[int, int]:
    """(max_connections, superuser_reserved_connections) of the ledger's server.

    Raises:
        SQLAlchemyError: the ledger cannot be reached (the driver's error, wrapped).
    """
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT current_setting('max_connections')::int, "
                    "current_setting('superuser_reserved_connections')::int"
                )
            ).one()
    finally:
        engine.dispose()
    return int(row[0]), int(row[1])
