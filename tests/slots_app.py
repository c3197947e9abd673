"""Tasks for the process tests of concurrency keys (docs/concurrency.md), registered on
``tests_app``'s app (a worker loads them with ``-I slots_app``: ``SLOT_TASKS``).

``per_customer`` runs at most one at a time per customer, fleet-wide. Each run appends its
start and its end, with the worker that ran it and a token of its own, to the file
``TEST_SLOT_LOG`` (one ``write`` of one line each, ``O_APPEND``: lines of several processes
never interleave), so that the test can check the runs' intervals per customer.
"""

from __future__ import annotations

import json
import os
import time
import uuid

from celery_ledger import LedgerTask
from tests_app import app

#: Worker option that imports this module.
SLOT_TASKS = ["-I", "slots_app"]


def record(what: str, customer: str, n: int, host: str, token: str) -> None:
    line = json.dumps({"what": what, "customer": customer, "n": n, "host": host, "token": token})
    fd = os.open(os.environ["TEST_SLOT_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line[:-1] + f', "at": {time.time()!r}}}\n').encode())
    finally:
        os.close(fd)


def run_logged(task: LedgerTask, customer: str, n: int, pause: float) -> str:
    """One run: its start, ``pause`` seconds, its end, each a line of the log."""
    token = uuid.uuid4().hex
    host = task.request.hostname or "?"
    record("start", customer, n, host, token)
    time.sleep(pause)
    record("end", customer, n, host, token)
    return f"{customer}:{n}"


# Idempotent: a run a SIGKILL cut short may simply run again (the test is about the slots).
@app.task(
    base=LedgerTask,
    bind=True,
    name="slots_app.per_customer",
    side_effect="idempotent",
    key_from=("customer", "n"),
    concurrency_key=("customer",),
    concurrency_limit=1,
)
def per_customer(self: LedgerTask, customer: str, n: int, pause: float) -> str:
    return run_logged(self, customer, n, pause)


#: ``per_customer_rated``'s rate per customer (one token every half second).
RATE_PER_CUSTOMER = 2.0


# One at a time per customer, and at most two a second per customer (docs/concurrency.md
# § "With a rate limit"): both gates in one claim.
@app.task(
    base=LedgerTask,
    bind=True,
    name="slots_app.per_customer_rated",
    side_effect="idempotent",
    key_from=("customer", "n"),
    concurrency_key=("customer",),
    concurrency_limit=1,
    ledger_rate_limit=f"{RATE_PER_CUSTOMER:g}/s per customer",
)
def per_customer_rated(self: LedgerTask, customer: str, n: int, pause: float) -> str:
    return run_logged(self, customer, n, pause)
