"""How many connections a fleet of workers holds to a PostgreSQL ledger (docs/operations.md §
"Deploying"), and the pool options that bound one process's share.

Each process reaches the ledger two ways (``core.py``): the hot path's raw connections
(``fastpath.FastPath``: claim of a new key, settle, step writes, lease renewal) and a SQLAlchemy
pool (a claim of an existing entry, the sweep, operators). Counted in ``pg_stat_activity`` with
real prefork workers (``tests/test_fleet_budget.py``):

- a worker's main process: 1 (its schema check's pooled connection; it runs no task, and its
  hot-path connection is closed before the pool forks, ``LedgerStore.prepare_for_fork``), 2
  when its boot sweep found work (a hot-path write of its own);
- a pool process: 1 hot-path connection once it has run a task; 2 when a claim found its
  entry already written and took the pooled path, which is every claim with the publish
  intent on (the default: ``ledger_publish_intent``), or when it ran a sweep; one more, kept,
  once a lease renewal (the heartbeat thread) overlapped a hot-path write of the task's thread;
- ``celery beat``: 1.

So a node with ``-c C`` holds ``1 + 2C`` (with the publish intent on) and at most ``2 + 3C``.
What bounds it per process is ``ledger_max_connections`` (``pool_options``), for the pools
where threads share a process (``-P threads``, gevent): a prefork pool process has only its
task's thread and the heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Connections a worker's main process holds, and at most.
MAIN_PROCESS = 1
MAIN_PROCESS_PEAK = 2
#: Connections a prefork pool process holds once it has run a task, and at most.
POOL_PROCESS_HELD = 2
POOL_PROCESS_PEAK = 3
#: Connections a ``celery beat`` holds.
BEAT = 1
#: The smallest ``ledger_max_connections``: one hot-path connection and one pooled.
MIN_MAX_CONNECTIONS = 2


def pool_options(max_connections: int | None) -> tuple[dict[str, Any], int | None]:
    """(SQLAlchemy engine options, hot-path connections kept idle) for one process bounded to
    ``max_connections``, or ({}, None) for the defaults (``engine.make_engine``: pool of 2 plus
    4 overflow; ``FastPath``: 2 kept).

    Bounded: the hot path keeps one connection; the pool holds at most the rest and never
    overflows (a thread beyond waits for a connection, up to SQLAlchemy's ``pool_timeout``).
    """
    if max_connections is None:
        return {}, None
    pool = max(1, max_connections - 1)
    return {"pool_size": pool, "max_overflow": 0}, 1


@dataclass(frozen=True)
class Fleet:
    """Worker nodes of one concurrency each, and beats."""

    workers: int
    concurrency: int
    beats: int = 1

    @property
    def held(self) -> int:
        """Connections the fleet holds once every pool process has run a task."""
        per_node = MAIN_PROCESS + POOL_PROCESS_HELD * self.concurrency
        return self.workers * per_node + self.beats * BEAT

    @property
    def peak(self) -> int:
        """Connections the fleet can hold at once (each pool process at its most)."""
        per_node = MAIN_PROCESS_PEAK + POOL_PROCESS_PEAK * self.concurrency
        return self.workers * per_node + self.beats * BEAT

    def describe(self) -> str:
        beats = f" + {self.beats} beat{'s' if self.beats != 1 else ''}" if self.beats else ""
        workers = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        return f"{workers} x -c {self.concurrency}{beats}"


def parse_fleet(text: str) -> Fleet:
    """``WORKERSxCONCURRENCY`` or ``WORKERSxCONCURRENCY+BEATS`` (``6x4+2``).

    Raises:
        ValueError: in the ledger's words.
    """
    head, _, beats = text.strip().lower().partition("+")
    workers, sep, concurrency = head.partition("x")
    try:
        fleet = Fleet(int(workers), int(concurrency), int(beats) if beats else 1)
    except ValueError:
        fleet = None
    if not sep or fleet is None or fleet.workers < 1 or fleet.concurrency < 1 or fleet.beats < 0:
        raise ValueError(
            f"--fleet {text!r} is not WORKERSxCONCURRENCY[+BEATS] (for example 6x4+2: six "
            "worker nodes of -c 4 and two beats)"
        )
    return fleet
