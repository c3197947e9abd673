"""Concurrency keys (docs/concurrency.md) on Flower's Ledger page: the overview shows the waiters
per key, and a waiter's entry page says why it waits and since when."""

from __future__ import annotations

import dataclasses

from test_ledger_page import PageCase
from test_store_contract import request

from celery_ledger.ledger import Gate, SlotAsk, entry_key

CUSTOMER = "shop.charge:customer=c-9"


class TestSlotWaiters(PageCase):
    def claim_with_slot(self, name: str) -> Gate:
        key = entry_key("shop.charge", name)
        req = dataclasses.replace(request(key, task_id=f"t-{name}"), slot=SlotAsk(CUSTOMER, 1))
        return self.store.claim(req).gate

    def test_overview_shows_waiting_per_key_and_the_entry_why(self) -> None:
        html = self.page("/ledger")
        assert "no task waits for a slot" in html
        assert self.claim_with_slot("k-holder") is Gate.RUN
        assert self.claim_with_slot("k-wait-1") is Gate.HOLD
        assert self.claim_with_slot("k-wait-2") is Gate.HOLD
        html = self.page("/ledger")
        shown = html[html.index('id="slot-waiters"') :][:2000]
        assert f"<td>{CUSTOMER}</td><td>1</td><td>1</td><td>2</td>" in shown
        entry = self.page(f"/ledger/entry/{entry_key('shop.charge', 'k-wait-1')}")
        assert f"for a slot of {CUSTOMER}" in entry
