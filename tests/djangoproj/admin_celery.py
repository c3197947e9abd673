"""The admin tests' Celery app, as Celery's Django guide writes ``proj/celery.py``: its
configuration is Django's settings under the ``CELERY_`` namespace.

It declares ``page_app.pay`` as the project's task module would (the worker runs
``tests/page_app.py``'s): the admin learns the task's ``secret_args`` from its own app, so it
shows the order id and hides the card number.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_ledger import LedgerTask

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="page_app.pay",
    key_from=("order_id",),
    secret_args=("card_number",),
)
def pay(self: LedgerTask, order_id: str, amount: int, card_number: str) -> Any:
    raise NotImplementedError("runs on the test's worker (tests/page_app.py)")
