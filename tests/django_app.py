"""The Celery app of the Django tests: ``celery -A django_app worker``, Django set up first.

Each task writes ``Credit`` rows through Django's ORM inside a Django transaction step; the
ledger lives in Django's database (``TEST_DJANGO_DB`` = ``CELERY_LEDGER_URL``).
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djangoproj.settings")
django.setup()

from django.db import transaction
from djangoproj.models import Credit

from celery_ledger import LedgerTask, create_app

app = create_app("django_app")
app.conf.task_default_queue = os.environ.get("TEST_QUEUE", "celery")
app.conf.worker_lost_wait = 1.0  # as tests_app: a killed pool process's task requeued in 1 s


def _credit(order_id: str, kind: str) -> str:
    Credit.objects.create(order_id=order_id, kind=kind)
    return f"{kind}:{order_id}"


@app.task(
    shared=False, base=LedgerTask, bind=True, name="django_app.credit", key_from=("order_id",)
)
def credit(self: LedgerTask, order_id: str) -> list[str]:
    """A Django transaction step on its own, then one inside the caller's atomic block."""
    first = self.django_transaction_step("credit", _credit, order_id, "credit")
    with transaction.atomic():
        Credit.objects.create(order_id=order_id, kind="outer")
        second = self.django_transaction_step("bonus", _credit, order_id, "bonus")
    return [first, second]


def _credit_rolled_back(order_id: str) -> str:
    Credit.objects.create(order_id=order_id, kind="credit")
    transaction.set_rollback(True)  # refused by the ledger (guarantees.md § "Bad input", item 6)
    return f"credit:{order_id}"


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="django_app.rolled_back",
    key_from=("order_id",),
)
def rolled_back(self: LedgerTask, order_id: str) -> str:
    """A Django transaction step whose function marks the step's transaction for rollback."""
    return self.django_transaction_step("credit", _credit_rolled_back, order_id)
