"""The process tests' app plus the fuzz test's targets (``test_fuzz_messages.py``).

``celery -A fuzz_app worker|flower`` finds ``app`` here: the same app object as ``tests_app``
(every task of it included), with three tasks a careless caller sends bad arguments to by name.
Their bodies are ordinary user code: they use the arguments as the signature says, so a wrong
type fails in the body the way it would in any Celery shop.
"""

from __future__ import annotations

from typing import Any

from celery_ledger import LedgerTask
from tests_app import app, effect

__all__ = ["app", "charge", "keyed", "note"]


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="fuzz_app.charge",
    key_from=("order_id",),
    secret_args=("card",),
)
def charge(
    self: LedgerTask, order_id: str, amount: int, card: str = "", currency: str = "EUR"
) -> dict[str, Any]:
    """Two effect steps keyed by the order; ``amount`` must be a number."""
    cents = int(amount * 100)
    self.step("reserve", effect, str(order_id), "reserve")
    charged = self.step("charge", effect, str(order_id), "charge")
    return {"order_id": order_id, "cents": cents, "currency": currency, "charged": charged}


@app.task(shared=False, base=LedgerTask, bind=True, name="fuzz_app.note")
def note(self: LedgerTask, text: str, times: int = 1) -> int:
    """Stepless, keyed by the task id."""
    return len(text) * times


def _tag_key(tag: str, **_: Any) -> str:
    """User code the worker's parent runs: raises on a tag that is no string."""
    return tag.lower()


@app.task(shared=False, base=LedgerTask, bind=True, name="fuzz_app.keyed", key_from=_tag_key)
def keyed(self: LedgerTask, tag: str, **extra: Any) -> list[str]:
    return [self.step("only", effect, tag, "only"), *sorted(extra)]
