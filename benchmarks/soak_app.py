"""The Celery app the soak runs (``benchmarks/soak.py``): ``celery -A soak_app worker|beat``.

One ledgered task, ``soak_app.stepped``: ``SOAK_STEPS`` trivial steps (``self.step``), with the
side effect ``SOAK_SIDE_EFFECT`` (default ``idempotent``: one ``completed`` row per step). Redis
broker and Redis results (``SOAK_BROKER_URL``), results kept ``SOAK_RESULT_EXPIRES`` seconds so a
long soak does not fill the shared Redis; the ledger at ``SOAK_LEDGER_URL``. Retention, the sweep
interval and the rest come from the ``CELERY_LEDGER_*`` environment the soak sets. The sweep goes
to a queue of its own (``<SOAK_QUEUE>-sweep``), which the soak's worker also consumes.

``SOAK_CLAIM_LOG=<dir>``: each pool process appends one line per claim to
``<dir>/claims-<pid>.txt``, ``<wall time> <seconds>``: the time ``LedgerStore.claim`` took, wall
clock around the call in the pool process (the statement, its round trip and the commit).

``SOAK_BEAT_EVERY=<seconds>``: beat also sends ``soak_app.stepped`` on that schedule (a ledgered
publish from beat, with its result channel on Redis): what beat does between sweeps in a
project whose periodic tasks are ledgered.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery_ledger import LedgerTask, create_app

QUEUE = os.environ.get("SOAK_QUEUE", "soak")
#: The sweep has a queue of its own: beat sends it with ``expires`` = the sweep interval, and
#: behind a backlog of tasks longer than that it would expire unrun, every time.
SWEEP_QUEUE = f"{QUEUE}-sweep"
STEPS = int(os.environ.get("SOAK_STEPS", "3"))

app = create_app(
    "soak_app",
    broker_url=os.environ.get("SOAK_BROKER_URL", "redis://127.0.0.1:6379/0"),
    result_backend=os.environ.get("SOAK_BROKER_URL", "redis://127.0.0.1:6379/0"),
    ledger_url=os.environ.get("SOAK_LEDGER_URL"),
    task_default_queue=QUEUE,
    task_routes={"celery_ledger.sweep": {"queue": SWEEP_QUEUE}},
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    result_expires=int(os.environ.get("SOAK_RESULT_EXPIRES", "120")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


def _same(x: int) -> int:
    return x


@app.task(
    base=LedgerTask,
    bind=True,
    name="soak_app.stepped",
    side_effect=os.environ.get("SOAK_SIDE_EFFECT", "idempotent"),
)
def stepped(self: Any, i: int) -> int:
    for n in range(STEPS):
        self.step(f"s{n}", _same, i + n)
    return i


if os.environ.get("SOAK_BEAT_EVERY"):
    app.conf.beat_schedule = {
        **(app.conf.beat_schedule or {}),
        "soak-stepped": {
            "task": "soak_app.stepped",
            "schedule": float(os.environ["SOAK_BEAT_EVERY"]),
            "args": (0,),
        },
    }


def _time_claims(directory: str) -> None:
    """Wrap ``LedgerStore.claim`` to log how long each call took (see the module's docstring)."""
    from celery_ledger.ledger import LedgerStore

    claim = LedgerStore.claim
    files: dict[int, Any] = {}

    def timed_claim(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return claim(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - started
            pid = os.getpid()
            out = files.get(pid)
            if out is None:
                path = Path(directory) / f"claims-{pid}.txt"
                out = files[pid] = open(path, "a", buffering=1)  # noqa: SIM115
            out.write(f"{time.time():.3f} {took:.6f}\n")

    LedgerStore.claim = timed_claim  # type: ignore[method-assign]


if os.environ.get("SOAK_CLAIM_LOG"):
    _time_claims(os.environ["SOAK_CLAIM_LOG"])
