"""The ledger behind PgBouncer in transaction pooling (docs/operations.md § "Deploying").

A real ``pgbouncer`` of the tests' own (``celery_ledger.harness.pgbouncer``), two server
connections per database, in front of the test server: every client shares those two sessions.
A missing pgbouncer skips on a laptop and fails under CI=true, like a missing server.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_ledger.ledger import ClaimRequest, EntryStatus, Gate, LedgerStore, Owner, SlotAsk
from servers import CI

BIN = Path(sys.executable).parent
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


def claim_and_settle(stores: list[LedgerStore], pairs: int = PAIRS) -> list[str]:
    """Claim and settle ``pairs`` tasks of a class that writes lazily in ``effects`` mode, each
    pair on the next of ``stores`` in turn (the pool processes of a worker, each a client of
    the pooler); the errors, as type: message."""
    errors = []
    for i in range(pairs):
        key, store = f"k-{i}", stores[i % len(stores)]
        try:
            req = ClaimRequest(key, "t", f"tid-{i}", "h", "{}", "idempotent", OWNER, 60.0)
            claim = store.claim(req)
            assert store.settle(key, claim.fence, EntryStatus.COMPLETED, result="1")
        except Exception as e:  # noqa: BLE001 - counted and reported by the test
            cause = e.__cause__ or e
            errors.append(f"{type(cause).__name__}: {str(cause).strip()}")
    return errors


@contextmanager
def stores(url: str, n: int = 3, **options: Any) -> Iterator[list[LedgerStore]]:
    """``n`` stores on ``url``, disposed afterwards."""
    made = [LedgerStore(url, **options) for _ in range(n)]
    try:
        yield made
    finally:
        for store in made:
            store.dispose()


def test_effects_mode_leaves_other_clients_commits_synchronous(bouncer: Any, pg_url: str) -> None:
    """The lazy commits of ``effects`` mode are asked for per transaction: a server session
    that PgBouncer hands to another client afterwards still waits for the flush."""
    # Prepared statements are another matter (test_prepared_statements_...).
    no_prepare = {"connect_args": {"prepare_threshold": None}}
    with stores(through(bouncer, pg_url), durability="effects", engine_options=no_prepare) as s:
        assert claim_and_settle(s) == []
    seen = []
    for _ in range(20):
        with psycopg.connect(through(bouncer, pg_url), autocommit=True) as other:
            seen.append(other.execute("SHOW synchronous_commit").fetchone()[0])  # type: ignore[index]
    assert seen.count("off") == 0, f"{seen.count('off')} of {len(seen)} other clients: off"


@pytest.mark.parametrize(
    "query, options",
    [
        ("pooler=pgbouncer", {}),
        ("prepare_threshold=none", {}),
        ("", {"prepare_threshold": "none"}),  # ``LedgerStore(..., prepare_threshold=)``
    ],
    ids=["pooler-declared", "url-threshold-none", "store-argument-none"],
)
def test_prepared_statements_are_off_when_a_pooler_is_declared(
    bouncer: Any, pg_url: str, query: str, options: dict[str, Any]
) -> None:
    """psycopg prepares a statement at its fifth execution, under a name of the session's;
    PgBouncer 1.18 in transaction pooling then sends it to a server session that has it
    already, or has it not. Declared, the ledger prepares nothing."""
    with stores(through(bouncer, pg_url, query), **options) as s:
        assert claim_and_settle(s) == []


def test_concurrency_keys_hold_their_limit_through_the_pooler(bouncer: Any, pg_url: str) -> None:
    """A claim and a settle with a concurrency key (docs/concurrency.md) are transactions of
    several statements, pipelined by the driver: through PgBouncer in transaction pooling
    they keep the limit and hand the slots over in order, on every client, as directly."""
    slot = SlotAsk("shop:c-1", 2)
    with stores(through(bouncer, pg_url, "pooler=pgbouncer")) as s:
        claims = []
        for i in range(PAIRS // 4):
            req = ClaimRequest(f"k-{i}", "t", f"tid-{i}", "h", "{}", "idempotent", OWNER, 60.0)
            claims.append(s[i % len(s)].claim(dataclasses.replace(req, slot=slot)))
        assert [c.gate for c in claims[:2]] == [Gate.RUN, Gate.RUN]
        assert {c.gate for c in claims[2:]} == {Gate.HOLD}
        served = s[1].settle_in_slot(slot, "k-0", claims[0].fence, EntryStatus.COMPLETED)
        assert served is not None and [g.key for g in served] == ["k-2"]
        again = s[2].settle_in_slot(slot, "k-1", claims[1].fence, EntryStatus.FAILED, error="x")
        assert again is not None and [g.key for g in again] == ["k-3"]


def test_undeclared_the_pooler_breaks_prepared_statements(bouncer: Any, pg_url: str) -> None:
    """What the declaration is for: undeclared, the same run fails (so the test above can)."""
    with stores(through(bouncer, pg_url)) as s:
        errors = claim_and_settle(s)
    assert any("prepared statement" in e for e in errors), errors[:3]


def doctor(url: str) -> subprocess.CompletedProcess[str]:
    """``celery-ledger --url URL doctor``, through the installed console script."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    return subprocess.run(
        [str(BIN / "celery-ledger"), "--url", url, "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def pooler_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pooler ")]
    assert len(lines) == 1, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return " ".join(lines[0].split())


def test_doctor_finds_pgbouncer_and_says_what_it_needs(bouncer: Any, pg_url: str) -> None:
    migrated = LedgerStore(pg_url)  # a current schema: only the pooler may fail
    migrated.ensure_ready()
    migrated.dispose()
    proc = doctor(through(bouncer, pg_url))
    line = pooler_line(proc)
    assert line.startswith("pooler FAIL a connection pooler (PgBouncer?) answers"), line
    assert line.endswith(
        "prepared statements are on: add ?pooler=pgbouncer to the ledger URL (ledger_url)"
    ), line
    assert proc.returncode == 1
    declared = doctor(through(bouncer, pg_url, "pooler=pgbouncer"))
    assert pooler_line(declared) == (
        "pooler PASS behind a connection pooler; prepared statements off"
    )
    from celery_ledger.cli.doctor_pooler import check_pooler

    kept = check_pooler(through(bouncer, pg_url, "pooler=pgbouncer&prepare_threshold=5"))
    assert kept[1] == "WARN" and "prepare_threshold=5 keeps prepared statements on" in kept[2]


def test_doctor_sees_no_pooler_on_a_direct_or_proxied_connection(pg_url: str) -> None:
    """No false alarm: PostgreSQL itself, and a plain TCP proxy (which passes the start-up
    messages through unchanged)."""
    from celery_ledger.cli.doctor_pooler import check_pooler
    from celery_ledger.harness.tcpproxy import TcpProxy

    direct = ("pooler", "PASS", "direct to PostgreSQL (no connection pooler in between)")
    assert check_pooler(pg_url) == direct
    host = pg_url.split("@", 1)[1].split("/", 1)[0]
    proxy = TcpProxy(host.rsplit(":", 1)[0], int(host.rsplit(":", 1)[1])).start()
    try:
        proxied = pg_url.replace(host, f"127.0.0.1:{proxy.port}")
        assert check_pooler(proxied) == direct
        assert check_pooler(proxied + "?pooler=pgbouncer")[1:] == (
            "PASS",
            "pooler=pgbouncer declared but none seen (direct to PostgreSQL): statements are "
            "not prepared",
        )
    finally:
        proxy.stop()
    assert check_pooler(proxied) == (
        "pooler",
        "WARN",
        "not checked: the ledger is unreachable (see schema)",
    )


def test_the_urls_pooler_parameters_refuse_what_they_do_not_take(pg_url: str) -> None:
    from celery_ledger.cli.doctor_pooler import check_pooler

    assert check_pooler(pg_url + "?pooler=pgpool") == (
        "pooler",
        "FAIL",
        "the ledger URL's pooler='pgpool' is not one of: pgbouncer, none",
    )
    with pytest.raises(ValueError, match=r"prepare_threshold='-1' is not a whole number >= 0"):
        LedgerStore(pg_url + "?prepare_threshold=-1")
    with pytest.raises(ValueError, match="apply to postgresql:// ledger URLs only"):
        LedgerStore("sqlite:///ledger.sqlite3?pooler=pgbouncer")
    with pytest.raises(ValueError, match=r"prepare_threshold='often' is not a whole number"):
        LedgerStore(pg_url, prepare_threshold="often")
    # Refused in the ledger's words by the CLI too: one line, exit 1, no traceback.
    proc = subprocess.run(
        [str(BIN / "celery-ledger"), "--url", pg_url + "?pooler=pgpool", "stats"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "Error: the ledger URL's pooler='pgpool' is not one of: pgbouncer, none"
    ), proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(330)
def test_verify_through_pgbouncer_loses_nothing_and_duplicates_nothing(
    bouncer: Any, pg_url: str, redis: str
) -> None:
    """``celery-ledger verify --ledger postgresql://...@127.0.0.1:<pgbouncer>/...?pooler=
    pgbouncer``: the ledgered workers, beat and verify itself share the pooler's two server
    sessions, under verify's chaos (its ledger outages cut a proxy in front of the pooler)."""
    from test_verify import check, verify

    report = verify(
        "--broker", redis, "--ledger", through(bouncer, pg_url, "pooler=pgbouncer"), timeout=300
    )
    led = check(report)
    assert led["lost"] == 0 and led["duplicate_effects"] == 0 and led["never_claimed"] == 0, led
    assert report["ledger"].startswith(f"postgresql://postgres@127.0.0.1:{bouncer.port}/"), report
