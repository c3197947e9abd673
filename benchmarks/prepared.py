"""What prepared statements save on the hot path, directly and through PgBouncer.

    python benchmarks/prepared.py                     # 2,000 pairs per case, median of 3 rounds
    python benchmarks/prepared.py --pairs 300 --rounds 1

A transaction pooler needs them off (``?pooler=pgbouncer``, docs/operations.md § "Deploying"):
psycopg prepares a statement at its fifth execution under a name of the client session, and
the pooler hands server sessions from client to client. This measures what that costs: a
claim and a settle of a new entry (``LedgerStore.claim`` + ``settle``, ``effects``
durability, the default class), one process, one thread, with psycopg's ``prepare_threshold``
at its default (5), at 0 (prepared at the first execution) and off (``none``: every statement
parsed and planned every time), on a connection straight to PostgreSQL and through a pgbouncer
of the benchmark's own (``celery_ledger.harness.pgbouncer``: transaction pooling, two server
connections). Even one process is several clients of the pooler (the hot path's connection and
the engine's pool), so a case that prepares may fail through it: the table says when. Figures:
client CPU and wall milliseconds per pair, median of the rounds; hot-path statements per pair.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(__file__))

from common import median, per_task_ms, pg_database

from celery_ledger.ledger import ClaimRequest, EntryStatus, Gate, LedgerStore, Owner

OWNER = Owner("bench@host", "b0", 1)
THRESHOLDS = ("5", "0", "none")


@contextlib.contextmanager
def bouncer() -> Iterator[object]:
    from celery_ledger.harness.pgbouncer import OwnPgBouncer

    own = OwnPgBouncer()
    own.start()
    try:
        yield own
    finally:
        own.close()


def one_case(url: str, threshold: str, pairs: int, rounds: int, tag: str) -> str:
    """CPU and wall ms per claim + settle pair at ``threshold`` on ``url``, and statements
    sent per pair; or the error that stopped it."""
    sep = "&" if "?" in url else "?"
    store = LedgerStore(f"{url}{sep}prepare_threshold={threshold}")
    sent: list[str] = []
    done = itertools.count()
    try:
        store.ensure_ready()
        store.fast.listeners.append(sent.append)
        cpu, wall = [], []

        def pair(_i: int) -> None:
            key = f"{tag}-{threshold}-{next(done)}"
            req = ClaimRequest(key, "t", f"tid-{key}", "h", "{}", "idempotent", OWNER, 60.0)
            claim = store.claim(req)
            if claim.gate is not Gate.RUN or not store.settle(
                key, claim.fence, EntryStatus.COMPLETED, result="1"
            ):
                raise RuntimeError(f"{key}: {claim.gate} then a refused settle")

        for _ in range(rounds):
            sent.clear()
            c, w = per_task_ms(pair, pairs, warmup=20)
            cpu.append(c)
            wall.append(w)
        per_pair = len(sent) / (pairs + 20)
        return f"{median(cpu):>8.3f} {median(wall):>8.3f} {per_pair:>6.1f}"
    except Exception as e:  # noqa: BLE001 - the figure is the failure
        cause = e.__cause__ or e
        return f"fails after {next(done) - 1} pairs: {type(cause).__name__}"
    finally:
        store.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"claim + settle, {args.pairs} pairs per round, median of {args.rounds} rounds")
    print(f"{'route':<10} {'threshold':>9} {'CPU ms':>8} {'wall ms':>8} {'stmts':>6}")
    with pg_database() as direct, bouncer() as own:
        through = own.url(direct.rsplit("/", 1)[1])  # type: ignore[attr-defined]
        for route, url in (("direct", direct), ("pgbouncer", through)):
            for threshold in THRESHOLDS:
                got = one_case(url, threshold, args.pairs, args.rounds, route)
                print(f"{route:<10} {threshold:>9} {got}")


if __name__ == "__main__":
    main()
