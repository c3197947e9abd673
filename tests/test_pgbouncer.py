"""The ledger behind PgBouncer in transaction pooling (docs/operations.md § "Deploying").

A real ``pgbouncer`` of the tests' own (``celery_ledger.harness.pgbouncer``), two server
connections per database, in front of the test server: every client shares those two sessions.
A missing pgbouncer skips on a laptop and fails under CI=true, like a missing server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner
from servers import CI

OWNER = Owner("w@host", "b0", 1)
#: Claim-and-settle pairs per test: psycopg prepares a statement at its fifth execution, so
#: 60 pairs on a few connections prepare each hot statement on both server sessions.
PAIRS = 60


@pytest.fixture(scope="module")
def bouncer() -> Iterator[Any]:
    """A pgbouncer of this module's own, in transaction pooling, stopped by its PID."""
    from celery_ledger.harness.pgbouncer import OwnPgBouncer, PgBouncerUnavailable

    try:
        own = OwnPgBouncer()
        own.start()
    except PgBouncerUnavailable as e:
        if CI:
            pytest.fail(f"{e}, and CI=true requires it", pytrace=False)
        pytest.skip(str(e))
    try:
        yield own
    finally:
        own.close()


def through(bouncer: Any, pg_url: str, query: str = "") -> str:
    """``pg_url``'s database, reached through ``bouncer`` (``query``: URL parameters)."""
    url = bouncer.url(pg_url.rsplit("/", 1)[1])
    return f"{url}?{query}" if query else url


def claim_and_settle(store: LedgerStore, pairs: int = PAIRS) -> list[str]:
    """Claim and settle ``pairs`` tasks (each class that writes lazily in ``effects`` mode);
    the errors, as type: message."""
    errors = []
    for i in range(pairs):
        key = f"k-{i}"
        try:
            req = ClaimRequest(key, "t", f"tid-{i}", "h", "{}", "idempotent", OWNER, 60.0)
            claim = store.claim(req)
            assert store.settle(key, claim.fence, EntryStatus.COMPLETED, result="1")
        except Exception as e:  # noqa: BLE001 - counted and reported by the test
            cause = e.__cause__ or e
            errors.append(f"{type(cause).__name__}: {cause}")
    return errors


def test_effects_mode_leaves_other_clients_commits_synchronous(bouncer: Any, pg_url: str) -> None:
    """The lazy commits of ``effects`` mode are asked for per transaction: a server session
    that PgBouncer hands to another client afterwards still waits for the flush."""
    store = LedgerStore(
        through(bouncer, pg_url),
        durability="effects",
        # Prepared statements are another matter (test_prepared_statements_...).
        engine_options={"connect_args": {"prepare_threshold": None}},
    )
    try:
        assert claim_and_settle(store) == []
    finally:
        store.dispose()
    seen = []
    for _ in range(20):
        with psycopg.connect(through(bouncer, pg_url), autocommit=True) as other:
            seen.append(other.execute("SHOW synchronous_commit").fetchone()[0])  # type: ignore[index]
    assert seen.count("off") == 0, f"{seen.count('off')} of {len(seen)} other clients: off"
