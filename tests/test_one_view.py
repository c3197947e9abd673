"""``celery-ledger show`` and the Flower entry page render one view (``celery_ledger.view``).

Each entry is written through the store the way a worker writes it (``test_ledger_page``);
``show --json`` runs in-process with click's runner, the page in Flower's own Tornado app.
Both read the same row, so they must say the same: the status, each step's state, the next
action and its command, and the warning beside a release. This proves the rendering, not a
delivery: no worker runs here.
"""

from __future__ import annotations

import html as htmllib
import json
import re
from typing import Any

from click.testing import CliRunner
from sqlalchemy import text
from test_ledger_page import NODE, ActionCase

from celery_ledger.cli.main import main
from celery_ledger.ledger import STEP_RETURNED, STEP_RETURNED_WARNING, StepStatus

#: How ``show`` prints a step (its stored status, and whether it says ambiguous) against the
#: state the page gives it, for entries with no live lease (none of those below has one).
SHOW_TO_PAGE = {
    ("completed", False): "completed",
    ("started", True): "ambiguous",
    ("not_executed", False): "not-executed",
}


class TestShowAndThePageAgree(ActionCase):
    def show(self, key: str) -> dict[str, Any]:
        env = {
            "CELERY_LEDGER_URL": self.url,
            "CELERY_LEDGER_DATA_DIR": f"{self.tmp}/data",
            "CELERY_LEDGER_OPERATOR_TOKENS": None,
            "NO_COLOR": None,
        }
        result = CliRunner().invoke(main, ["show", key, "--json"], env=env, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def entry_page(self, key: str) -> dict[str, Any]:
        page = self.page(f"/ledger/entry/{key}")
        status = re.search(r'id="entry-status">([a-z_]+)<', page)
        nxt = page[page.index('id="entry-next"') :]
        hint = re.search(r'<p class="mb-2">(.*?)</p>', nxt, re.S)
        command = re.search(r'id="entry-command"><code>(.*?)</code>', nxt, re.S)
        warning = re.search(
            r'id="release-warning"[^>]*>Do not release it as not executed: (.*?)\.</p>', page, re.S
        )
        steps = page[page.index('id="entry-steps"') : page.index('id="entry-next"')]
        assert status and hint, page
        return {
            "status": status.group(1),
            "steps": re.findall(r'data-step="([^"]+)" data-state="([a-z-]+)"', steps),
            "hint": htmllib.unescape(hint.group(1).strip()),
            "command": htmllib.unescape(command.group(1)) if command else None,
            "warning": htmllib.unescape(warning.group(1)) if warning else None,
        }

    def assert_agree(self, key: str) -> dict[str, Any]:
        shown, page = self.show(key), self.entry_page(key)
        assert shown["status"] == page["status"]
        steps = [(s["name"], SHOW_TO_PAGE[s["status"], s["ambiguous"]]) for s in shown["steps"]]
        assert steps == page["steps"]
        assert (shown["hint"], shown["next_command"]) == (page["hint"], page["command"])
        # ``show`` says the release warning as its next step; the page beside its form.
        said = shown["hint"] if shown["hint"] == STEP_RETURNED_WARNING else None
        assert said == page["warning"]
        return page

    # -- the entries ----------------------------------------------------------------------------

    def stepped(self) -> Any:
        """Claimed, ``reserve`` completed, ``charge`` started (its ref recorded) and no more."""
        c = self.claim()
        for status in (StepStatus.STARTED, StepStatus.COMPLETED):
            assert self.store.write_step(
                c.key, c.fence, ("reserve", "h0", 0), seq=0, status=status, output='"held"'
            )
        ident = ("charge", "h1", 0)
        assert self.store.write_step(c.key, c.fence, ident, seq=1, status=StepStatus.STARTED)
        assert self.store.record_external_ref(c.key, c.fence, ident, "ch_1")
        return c

    def test_a_blocked_entry(self) -> None:
        key = self.blocked()
        page = self.assert_agree(key)
        assert page["status"] == "blocked" and ("charge", "ambiguous") in page["steps"]
        assert page["command"] and "--verified not-executed|completed" in page["command"]
        assert page["warning"] is None

    def test_a_blocked_entry_whose_step_returned_warns_in_both(self) -> None:
        key = self.blocked()
        with self.store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ledger_entries SET reason = :r WHERE key = :k"),
                {"r": f"step 'charge' {STEP_RETURNED} (too large); it executed", "k": key},
            )
        page = self.assert_agree(key)
        assert page["warning"] == STEP_RETURNED_WARNING

    def test_an_interrupted_entry(self) -> None:
        c = self.stepped()
        assert self.store.interrupt_owner(
            c.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
        )
        page = self.assert_agree(c.key)
        assert page["status"] == "interrupted"
        assert page["steps"] == [("reserve", "completed"), ("charge", "ambiguous")]
        assert page["command"] and page["command"].endswith(f"resume {c.key}")

    def test_a_cancelled_entry(self) -> None:
        key = self.blocked()
        done = self.store.request_cancel(key, by="ops", reason="asked", error='"cancelled"')
        assert done.outcome == "cancelled"
        page = self.assert_agree(key)
        assert page["status"] == "cancelled"
        assert (page["hint"], page["command"], page["warning"]) == ("-", None, None)
