"""Durable time (design.md § "Durable time") on the Ledger page in Flower: scheduled, cancelled and
expired entries are counted
on the overview (the handlers in Flower's own Tornado app, as ``test_ledger_page``)."""

from __future__ import annotations

import re

from test_ledger_page import USER, ActionCase, PageCase

from celery_ledger.ledger import ClaimRequest, EntryStatus, Owner


class TimePage(PageCase):
    def test_overview_counts_scheduled_cancelled_and_expired(self) -> None:
        for key in ("k-s1", "k-s2", "k-c"):
            assert self.store.schedule(
                ClaimRequest(
                    key=key,
                    task_name="shop.remind",
                    task_id=f"t-{key}",
                    args_hash="task-id",
                    snapshot='{"args": [], "kwargs": {}, "queue": null, "ledger_key": null}',
                    side_effect="non_idempotent",
                    owner=Owner("producer", None, None),
                    lease_seconds=60.0,
                ),
                due_in=3600.0,
            )
        done = self.store.request_cancel("k-c", by="ops", reason="asked", error='"x"')
        assert done.outcome == "cancelled"
        late = self.claim()
        assert self.store.settle(late.key, late.fence, EntryStatus.EXPIRED, error='"late"')
        html = self.page("/ledger")
        assert re.search(r'id="status-scheduled">.*?>2<', html, re.S), html
        assert re.search(r'id="status-cancelled">.*?>1<', html, re.S)
        assert re.search(r'id="status-expired">.*?>1<', html, re.S)


class TimeActions(ActionCase):
    def test_cancel_from_the_entry_page_stamps_the_flower_user(self) -> None:
        key = self.interrupted()
        assert 'id="cancel-form"' in self.page(f"/ledger/entry/{key}")
        resp = self.post(
            f"/ledger/entry/{key}/cancel", {"reason": "customer asked"}, xsrf_from="/ledger"
        )
        assert resp.code == 302 and resp.headers["Location"].endswith("done=cancel-cancelled")
        entry = self.store.get_entry(key)
        assert entry.status is EntryStatus.CANCELLED and entry.cancel_by == USER
        assert 'id="cancel-form"' not in self.page(f"/ledger/entry/{key}")
        again = self.post(f"/ledger/entry/{key}/cancel", {"reason": "twice"}, xsrf_from="/ledger")
        assert again.code == 409 and b"nothing to cancel" in again.body
        running = self.claim()
        resp = self.post(
            f"/ledger/entry/{running.key}/cancel", {"reason": "stop"}, xsrf_from="/ledger"
        )
        assert resp.headers["Location"].endswith("done=cancel-requested")
        assert self.store.get_entry(running.key).cancel_requested_at is not None
