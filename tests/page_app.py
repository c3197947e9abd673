"""The process tests' app plus one task with a secret argument, for the Ledger page's tests.

``celery -A page_app worker|flower`` finds ``app`` here: the same app object as
``tests_app`` (every task of it included), with ``page_app.pay`` added. Its card number is
declared secret (``secret_args``), so the Ledger page must never show it.
"""

from __future__ import annotations

from typing import Any

from celery_ledger import LedgerTask
from tests_app import app, effect

__all__ = ["app", "pay", "pay_ref"]


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="page_app.pay",
    key_from=("order_id",),
    secret_args=("card_number",),
)
def pay(self: LedgerTask, order_id: str, amount: int, card_number: str) -> dict[str, Any]:
    reserved = self.step("reserve", effect, order_id, "reserve")
    charged = self.step("charge", effect, order_id, "charge")
    return {"order_id": order_id, "amount": amount, "steps": [reserved, charged]}


def _charge_with_ref(task: LedgerTask, order_id: str, card_number: str) -> str:
    # A careless provider handle: built from the card number, so a blocked reason quotes it.
    task.record_external_ref(f"ch-{card_number}")
    return effect(order_id, "charge")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="page_app.pay_ref",
    key_from=("order_id",),
    secret_args=("card_number",),
)
def pay_ref(self: LedgerTask, order_id: str, card_number: str) -> str:
    return str(self.step("charge", lambda: _charge_with_ref(self, order_id, card_number)))
