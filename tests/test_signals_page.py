"""Durable signals (design.md § "Durable signals") on the Ledger page in Flower: the signal
action (authenticated, XSRF-checked, authorized), and the entry's signals shown with their
payloads redacted like arguments (the handlers in Flower's own Tornado app, as
``test_ledger_page``)."""

from __future__ import annotations

import json

from test_ledger_page import CARD, USER, ActionCase

from celery_ledger.ledger import EntryStatus


class SignalActions(ActionCase):
    def test_a_signal_from_the_entry_page_is_kept_stamped_and_shown_redacted(self) -> None:
        running = self.claim()
        path = f"/ledger/entry/{running.key}"
        assert 'id="signal-form"' in self.page(path)
        payload = json.dumps({"ok": True, "card_number": CARD})
        resp = self.post(
            f"{path}/signal",
            {"signal_name": "approved", "payload_json": payload},
            xsrf_from="/ledger",
        )
        assert resp.code == 302 and resp.headers["Location"].endswith("done=signal-kept")
        [row] = self.store.signals_of(running.key)
        assert (row.name, row.sent_by, row.wait) == ("approved", USER, None)
        html = self.page(path)
        assert 'id="entry-signals"' in html and 'data-signal="approved"' in html
        assert "[redacted]" in html and CARD not in html

    def test_bad_input_and_a_settled_entry_are_refused_and_keep_nothing(self) -> None:
        running = self.claim()
        path = f"/ledger/entry/{running.key}/signal"
        bad = self.post(path, {"signal_name": "go", "payload_json": "{nope"}, xsrf_from="/ledger")
        assert bad.code == 400 and b"not valid JSON" in bad.body
        nameless = self.post(path, {"signal_name": " ", "payload_json": "1"}, xsrf_from="/ledger")
        assert nameless.code == 400 and b"signal name" in nameless.body
        assert self.store.signals_of(running.key) == []
        assert self.store.settle(running.key, running.fence, EntryStatus.COMPLETED, result="1")
        done = self.post(path, {"signal_name": "go", "payload_json": "1"}, xsrf_from="/ledger")
        assert done.code == 409 and b"is completed" in done.body
        no_xsrf = self.post(path, {"signal_name": "go", "payload_json": "1"})
        assert no_xsrf.code == 403
        assert self.store.signals_of(running.key) == []
