"""What prepared statements save on the hot path, directly and through PgBouncer.

    python benchmarks/prepared.py                     # 2,000 pairs per case, median of 3 rounds
    python benchmarks/prepared.py --pairs 300 --rounds 1

A transaction pooler needs them off (``?pooler=pgbouncer``, docs/operations.md § "Deploying"):
psycopg prepares a statement at its fifth execution under a name of the client session, and
the pooler hands server sessions from client to client. This measures what that costs: a
claim and a settle of a new entry (``LedgerStore.claim`` + ``settle``, ``effects``
durability, the ``idempotent`` class), one process, one thread, with psycopg's ``prepare_threshold``
at its default (5), at 0 (prepared at the first execution) and off (``none``: every statement
parsed and planned every time), on a connection straight to PostgreSQL and through a pgbouncer
of the benchmark's own (``celery_ledger.harness.pgbouncer``: transaction pooling, two server
connections). Even one process is several clients of the pooler (the hot path's connection and
the engine's pool), so a case that prepares may fail through it: the table says when. Figures:
client CPU and wall milliseconds per pair, median of the rounds (the cases alternate within a
round); hot-path statements per pair.
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


class Case:
    """One route and threshold: its store, and the figures of each round it ran."""

    def __init__(self, route: str, url: str, threshold: str) -> None:
        self.route, self.threshold = route, threshold
        sep = "&" if "?" in url else "?"
        self.store = LedgerStore(f"{url}{sep}prepare_threshold={threshold}")
        self.sent: list[str] = []
        self.keys = itertools.count()
        self.paired = 0
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.failure = ""

    def pair(self, _i: int) -> None:
        key = f"{self.route}-{self.threshold}-{next(self.keys)}"
        req = ClaimRequest(key, "t", f"tid-{key}", "h", "{}", "idempotent", OWNER, 60.0)
        claim = self.store.claim(req)
        if claim.gate is not Gate.RUN or not self.store.settle(
            key, claim.fence, EntryStatus.COMPLETED, result="1"
        ):
            raise RuntimeError(f"{key}: {claim.gate} then a refused settle")
        self.paired += 1

    def round(self, pairs: int) -> None:
        """``pairs`` timed pairs after 20 untimed ones; a failure ends the case."""
        if self.failure:
            return
        try:
            if not self.sent:
                self.store.ensure_ready()
                self.store.fast.listeners.append(self.sent.append)
            cpu, wall = per_task_ms(self.pair, pairs, warmup=20)
        except Exception as e:  # noqa: BLE001 - the figure is the failure
            cause = e.__cause__ or e
            self.failure = f"fails after {self.paired} pairs: {type(cause).__name__}"
            return
        self.cpu.append(cpu)
        self.wall.append(wall)

    def row(self) -> str:
        head = f"{self.route:<10} {self.threshold:>9}"
        if self.failure:
            return f"{head} {self.failure}"
        per_pair = len(self.sent) / max(self.paired, 1)
        return f"{head} {median(self.cpu):>8.3f} {median(self.wall):>8.3f} {per_pair:>6.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"claim + settle, {args.pairs} pairs per round, median of {args.rounds} rounds")
    print(f"{'route':<10} {'threshold':>9} {'CPU ms':>8} {'wall ms':>8} {'stmts':>6}")
    with pg_database() as direct, bouncer() as own:
        through = own.url(direct.rsplit("/", 1)[1])  # type: ignore[attr-defined]
        cases = [
            Case(route, url, threshold)
            for route, url in (("direct", direct), ("pgbouncer", through))
            for threshold in THRESHOLDS
        ]
        try:
            for _ in range(args.rounds):  # the cases alternate: a shared host's load drifts
                for case in cases:
                    case.round(args.pairs)
        finally:
            for case in cases:
                case.store.dispose()
        for case in cases:
            print(case.row())


if __name__ == "__main__":
    main()
