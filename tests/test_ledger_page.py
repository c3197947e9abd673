"""The Ledger page's handlers, in Flower's own Tornado app, over a real SQLite ledger.

Each case builds Flower's application exactly as ``celery flower`` does after the shipped
``flowerconfig.py`` ran (``install_in_flower`` into Flower's route table and settings, then
``flower.app.Flower``), serves it with Tornado's ``AsyncHTTPTestCase`` and talks HTTP to it.
The ledger's state is written through the store the way a worker writes it (claim, started
step, external ref, settle, interrupt). These tests prove the handlers; the browser tests
(``test_ledger_page_browser.py``) prove the same page against real worker, beat and Flower
processes.
"""

from __future__ import annotations

import base64
import re
import shutil
import tempfile
import time
import uuid
from typing import Any
from unittest import mock
from urllib.parse import urlencode

from celery import Celery
from flower import urls as flower_urls
from flower.app import Flower
from sqlalchemy import text
from tornado.options import options
from tornado.testing import AsyncHTTPTestCase
from tornado.web import RequestHandler

from celery_ledger import LedgerTask
from celery_ledger.authorize import Action, Decision, Operator
from celery_ledger.codec import encode
from celery_ledger.flower import install_in_flower
from celery_ledger.ledger import (
    RESUME_OWNER,
    STEP_RETURNED,
    ClaimRequest,
    Entry,
    EntryStatus,
    LedgerStore,
    Owner,
    StepStatus,
    entry_key,
)
from celery_ledger.ledger.engine import make_engine
from celery_ledger.ledger.schedule import PRUNED_FAILURE

USER, PASSWORD = "alice", "s3cret-pass"
CARD = "4111111111111111"
NODE = "celery@host-a"
ROWS = (
    "SELECT key, status, fence, released_by, result FROM ledger_entries",
    "SELECT key, name, status, fence, authorized FROM ledger_steps",
    "SELECT COUNT(*) FROM ledger_events",
)

#: What the authorizers below were asked, for the assertions.
ASKED: list[tuple[Operator, Action, Entry]] = []


def deny_not_executed(operator: Operator, action: Action, entry: Entry) -> Decision:
    """A ``ledger_authorizer``: only completed verdicts, never a re-run."""
    ASKED.append((operator, action, entry))
    if action is Action.RELEASE_NOT_EXECUTED:
        return Decision.deny(f"{operator.name} may not authorize a re-run of {entry.task_name}")
    return Decision.allow()


def broken_authorizer(operator: Operator, action: Action, entry: Entry) -> Decision:
    raise RuntimeError("directory service down")


def capp_for(url: str, **conf: Any) -> Celery:
    """The Celery app Flower runs with: knows ``shop.pay`` (whose card number is secret)."""
    app = Celery("ledger_page_tests", broker="memory://", backend="cache+memory://")
    app.conf.update(ledger_url=url, **conf)

    @app.task(
        base=LedgerTask, bind=True, name="shop.pay", secret_args=("card_number",), shared=False
    )
    def pay(self: Any, order_id: str, amount: int, card_number: str, cvv: str = "") -> str:
        return "unused: Flower never runs tasks"

    return app


class PageCase(AsyncHTTPTestCase):
    """Flower with the Ledger page, basic auth, over a fresh SQLite ledger."""

    basic_auth: list[str] | None = [f"{USER}:{PASSWORD}"]
    read_only = False
    url_prefix = ""
    conf: dict[str, Any] = {}

    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="ledger-page-")
        self.url = f"sqlite:///{self.tmp}/ledger.sqlite3"
        self.store = LedgerStore(self.url)  # migrates: the ledger a worker created
        self.store.now()
        self.patches = [
            mock.patch.object(options.mockable(), "basic_auth", self.basic_auth or []),
            mock.patch.object(options.mockable(), "read_only", self.read_only),
            mock.patch.object(options.mockable(), "url_prefix", self.url_prefix),
            mock.patch.object(options.mockable(), "auth", ""),
        ]
        for p in self.patches:
            p.start()
        # tornado caches template loaders per path for the whole process.
        RequestHandler._template_loaders.clear()
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        self.flower.executor.shutdown(wait=True)
        page = getattr(self.flower, "_celery_ledger_page", None)
        if page is not None:
            page.store.dispose()
        self.store.dispose()
        for p in reversed(self.patches):
            p.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def get_app(self) -> Flower:
        handlers, settings = list(flower_urls.handlers), dict(flower_urls.settings)
        install_in_flower(handlers, settings)
        self.capp = capp_for(self.url, **self.conf)
        with mock.patch("flower.app.default_handlers", handlers):
            self.flower = Flower(capp=self.capp, options=options, io_loop=self.io_loop, **settings)
        return self.flower

    # -- HTTP ---------------------------------------------------------------------------------

    def get(self, path: str, *, auth: tuple[str, str] | None = (USER, PASSWORD)) -> Any:
        return self.fetch(self.url_prefix + path, headers=_auth(auth), follow_redirects=False)

    def page(self, path: str) -> str:
        resp = self.get(path)
        assert resp.code == 200, (resp.code, resp.body[:800])
        return resp.body.decode()

    def post(
        self,
        path: str,
        form: dict[str, str],
        *,
        xsrf_from: str | None = None,
        auth: tuple[str, str] | None = (USER, PASSWORD),
    ) -> Any:
        """POST a form; with ``xsrf_from``, carry the XSRF token that page set (its form's
        hidden field when it has a form, else the cookie's own value, which tornado accepts)."""
        headers = _auth(auth)
        body = dict(form)
        if xsrf_from is not None:
            page = self.get(xsrf_from)
            cookie = _cookie(page, "_xsrf")
            found = re.search(r'name="_xsrf" value="([^"]+)"', page.body.decode())
            assert cookie, "every Ledger page sets the XSRF cookie"
            headers["Cookie"] = f"_xsrf={cookie}"
            body["_xsrf"] = found.group(1) if found else cookie
        return self.fetch(
            self.url_prefix + path,
            method="POST",
            body=urlencode(body),
            headers=headers,
            follow_redirects=False,
        )

    # -- ledger state, written the way a worker writes it --------------------------------------

    def claim(
        self,
        task: str = "shop.pay",
        *,
        kwargs: dict[str, Any] | None = None,
        snapshot: bool = True,
        lease: float = 60.0,
    ) -> Any:
        task_id = str(uuid.uuid4())
        kw = (
            kwargs if kwargs is not None else {"order_id": "A-1", "amount": 10, "card_number": CARD}
        )
        snap = encode(
            {"args": [], "kwargs": kw, "queue": "orders", "ledger_key": None},
            limit=100_000,
            what="snapshot",
        )
        return self.store.claim(
            ClaimRequest(
                key=entry_key(task, task_id),
                task_name=task,
                task_id=task_id,
                args_hash="task-id",
                snapshot=snap if snapshot else None,
                side_effect="non_idempotent",
                owner=Owner(NODE, "boot-1", 4242),
                lease_seconds=lease,
            )
        )

    def blocked(self, **kw: Any) -> str:
        """Parked on an ambiguous ``charge`` (reserve completed before it)."""
        c = self.claim(**kw)
        assert self.store.write_step(
            c.key, c.fence, ("reserve", "h0", 0), seq=0, status=StepStatus.STARTED
        )
        assert self.store.write_step(
            c.key,
            c.fence,
            ("reserve", "h0", 0),
            seq=0,
            status=StepStatus.COMPLETED,
            output='"held"',
        )
        ident = ("charge", "h1", 0)
        assert self.store.write_step(c.key, c.fence, ident, seq=1, status=StepStatus.STARTED)
        assert self.store.record_external_ref(c.key, c.fence, ident, "ch_1")
        assert self.store.settle(
            c.key,
            c.fence,
            EntryStatus.BLOCKED,
            actor=NODE,
            reason="step 'charge' may have executed (external ref: ch_1); reconcile or release",
        )
        return str(c.key)

    def interrupted(self, **kw: Any) -> str:
        c = self.claim(**kw)
        assert self.store.interrupt_owner(
            c.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
        )
        return str(c.key)

    def expired(self) -> str:
        return str(self.claim(lease=-1.0).key)  # negative: expired on the database clock

    def completed(self, result: str = '"ok"') -> str:
        c = self.claim()
        assert self.store.settle(c.key, c.fence, EntryStatus.COMPLETED, result=result, actor=NODE)
        return str(c.key)

    def backdate(self, key: str, seconds: float) -> None:
        """Make an entry look stuck for longer (test-only: time does not pass here)."""
        with self.store.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE ledger_entries SET updated_at = updated_at - :s, "
                    "lease_until = lease_until - :s WHERE key = :k"
                ),
                {"s": seconds, "k": key},
            )

    def rows(self) -> list[Any]:
        engine = make_engine(self.url)
        try:
            with engine.connect() as conn:
                return [sorted(map(tuple, conn.execute(text(q)).all())) for q in ROWS]
        finally:
            engine.dispose()


def _auth(auth: tuple[str, str] | None) -> dict[str, str]:
    if auth is None:
        return {}
    token = base64.b64encode(":".join(auth).encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _cookie(resp: Any, name: str) -> str | None:
    for header in resp.headers.get_list("Set-Cookie"):
        key, _, rest = header.partition("=")
        if key.strip() == name:
            return rest.split(";", 1)[0]
    return None


def keys_in(html: str) -> list[str]:
    return re.findall(r'class="stuck-row" data-key="([0-9a-f]{64})"', html)


def has_action_forms(html: str) -> bool:
    return any(
        s in html for s in ('id="release-form"', 'id="resume-form"', 'method="post"', "-button")
    )


# -- reading ------------------------------------------------------------------------------------


class TestReading(PageCase):
    def test_every_page_is_behind_flowers_basic_auth(self) -> None:
        key = self.blocked()
        for path in ("/ledger", "/ledger/stuck", f"/ledger/entry/{key}", "/ledger/find?q=x"):
            assert self.get(path, auth=None).code == 401, path
            assert self.get(path, auth=(USER, "wrong")).code == 401, path
            assert self.get(path).code in (200, 302, 404), path

    def test_overview_counts_what_needs_attention_and_previews_the_sweep(self) -> None:
        self.blocked()
        self.interrupted()
        self.interrupted(snapshot=False)
        old = self.expired()
        self.backdate(old, 120)
        self.expired()
        self.claim()  # running with a live lease: not stuck
        self.completed()
        html = self.page("/ledger")
        assert re.search(r'id="count-blocked">1<', html)
        assert re.search(r'id="count-interrupted">2<', html)
        assert re.search(r'id="count-expired">2<', html)
        assert re.search(r'id="duplicate-rate">0.0000<', html)
        # completed comes from the aggregates (stats()), computed for the first view
        assert re.search(r'id="status-completed">.*?>1<', html, re.S)
        # the oldest expired lease is the backdated one, 2 minutes past
        oldest = html[html.index('id="oldest-expired"') :]
        assert old[:16] in oldest[:1500] and "lease expired 2m" in oldest[:1500]
        preview = html[html.index('id="sweep-preview"') :][:1500]
        assert "interrupt <strong>2</strong>" in preview
        # 2 interrupted + the 2 it interrupts; one of them has no snapshot
        assert "look at <strong>4</strong>" in preview and "re-enqueue 3" in preview
        assert "report 1 without an argument snapshot" in preview
        assert "has not seen a sweep task yet" in html  # no events in this Flower
        # Flower's own event state: beat's last sweep task, 5 s ago, every 30 s by default
        self.flower.events.state.event(
            {
                "type": "task-received",
                "uuid": str(uuid.uuid4()),
                "name": "celery_ledger.sweep",
                "hostname": NODE,
                "timestamp": time.time() - 5,
                "local_received": time.time(),
                "clock": 1,
            }
        )
        sweep = self.page("/ledger")
        sweep = sweep[sweep.index('id="next-sweep"') :][:800]
        assert re.search(r"Last seen [4-6]s ago: next in about <strong>2[3-6]s</strong>", sweep), (
            sweep
        )

    def test_stuck_list_shows_a_retry_past_its_due_time(self) -> None:
        """guarantees.md § "The hardening faults", fault 3: a retry nobody claimed by its due time
        (its message may be lost) is stuck, kind ``overdue``; one still due later is not."""
        late, soon = self.claim(), self.claim()
        for c, due_in in ((late, -90.0), (soon, 600.0)):
            assert self.store.settle(c.key, c.fence, EntryStatus.RETRYING, due_in=due_in)
        html = self.page("/ledger/stuck?kind=overdue")
        assert keys_in(html) == [late.key]
        assert "retry past its due time by 1m" in _row_html(html, late.key)
        assert "the next sweep re-sends it" in _row_html(html, late.key)
        assert soon.key not in self.page("/ledger/stuck")

    def test_stuck_list_says_why_in_words_and_filters(self) -> None:
        b = self.blocked()
        i = self.interrupted()
        e = self.expired()
        other = self.interrupted(kwargs={"order_id": "x"}, snapshot=False)
        live = str(self.claim().key)  # running with a live lease: not stuck
        self.completed()
        html = self.page("/ledger/stuck")
        assert set(keys_in(html)) == {b, i, e, other} and live not in html
        row = {k: _row_html(html, k) for k in (b, i, e, other)}
        assert "Needs an operator: step &#x27;charge&#x27; may have executed" in row[b]
        assert "pool process lost; the next sweep re-enqueues it" in row[i]
        assert "lease expired" in row[e] and "celery@host-a, pid 4242" in row[e]
        assert "no argument snapshot" in row[other]
        # the exact command that resolves each one
        assert f"celery-ledger release {b} --verified not-executed|completed" in row[b]
        assert f"celery-ledger resume {i}" in row[i]

        assert keys_in(self.page("/ledger/stuck?kind=blocked")) == [b]
        assert set(keys_in(self.page("/ledger/stuck?kind=blocked&kind=expired"))) == {b, e}
        assert keys_in(self.page("/ledger/stuck?task=shop.other")) == []
        assert set(keys_in(self.page("/ledger/stuck?task=shop.pay"))) == {b, i, e, other}
        # age: stuck for at least an hour
        assert keys_in(self.page("/ledger/stuck?age=1h")) == []
        self.backdate(i, 7200)
        assert keys_in(self.page("/ledger/stuck?age=1h")) == [i]
        bad = self.page("/ledger/stuck?age=soon")
        assert "give seconds or a duration" in bad and len(keys_in(bad)) == 4

    def test_stuck_list_pages_by_position_longest_stuck_first(self) -> None:
        made = []
        for n in range(7):
            key = self.blocked()
            self.backdate(key, 1000 - n)  # made[0] is stuck longest
            made.append(key)
        seen: list[str] = []
        html = self.page("/ledger/stuck?limit=3")
        pages = 0
        while True:
            pages += 1
            seen += keys_in(html)
            nxt = re.search(r'href="([^"]+)" id="page-next"', html)
            if not nxt:
                break
            html = self.page(nxt.group(1).replace("&amp;", "&"))
            assert pages < 10
        assert seen == made and pages == 3
        prev = re.search(r'href="([^"]+)" id="page-prev"', html)
        assert prev, "the last page links back"
        assert keys_in(self.page(prev.group(1).replace("&amp;", "&"))) == made[3:6]
        assert "not valid" in self.page("/ledger/stuck?after=garbage")

    def test_entry_page_timeline_events_command_and_links(self) -> None:
        key = self.blocked()
        entry = self.store.get_entry(key)
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="entry-status">blocked<' in html
        steps = html[html.index('id="entry-steps"') :]
        assert 'data-step="reserve" data-state="completed"' in steps
        assert 'data-step="charge" data-state="ambiguous"' in steps
        assert "started, no completion recorded: ambiguous" in steps
        assert "external ref <code>ch_1</code>" in steps and "&quot;held&quot;" in steps
        events = re.findall(r'class="event-row" data-event="([a-z_]+)"', html)
        assert events == ["claimed", "settled"]
        command = (
            f"celery-ledger release {key} --verified not-executed|completed --by WHO --reason WHY"
        )
        assert command in html
        assert f'href="/task/{entry.task_id}"' in html
        assert 'href="/ledger/stuck"' in html  # and back
        assert self.get("/ledger/entry/" + "0" * 64).code == 404

    def test_flowers_task_page_links_to_the_entry(self) -> None:
        key = self.blocked()
        entry = self.store.get_entry(key)
        self.flower.events.state.event(
            {
                "type": "task-received",
                "uuid": entry.task_id,
                "name": "shop.pay",
                "hostname": NODE,
                "timestamp": 1.0,
                "local_received": 1.0,
                "clock": 1,
                "args": "()",
                "kwargs": "{}",
            }
        )
        html = self.page(f"/task/{entry.task_id}")
        link = re.search(r'id="ledger-entry-link"\s+href="([^"]+)"', html)
        assert link, "Flower's task page carries the Ledger link"
        assert 'href="/ledger"' in html  # the Ledger tab in Flower's navbar
        resp = self.get(link.group(1).replace("&amp;", "&"))
        assert resp.code == 302 and resp.headers["Location"] == f"/ledger/entry/{key}"
        # without the name (a business key): found by task id
        resp = self.get(f"/ledger/task/{entry.task_id}")
        assert resp.code == 302 and resp.headers["Location"] == f"/ledger/entry/{key}"
        assert self.get("/ledger/task/no-such-task?name=shop.pay").code == 404
        for ref in (key[:10], key, entry.task_id):
            resp = self.get(f"/ledger/find?q={ref}")
            assert resp.code == 302 and resp.headers["Location"] == f"/ledger/entry/{key}"
        assert self.get("/ledger/find?q=" + "e" * 64).code == 404

    def test_read_only_by_default_no_buttons_and_posts_refused(self) -> None:
        key = self.blocked()
        html = self.page(f"/ledger/entry/{key}")
        assert not has_action_forms(html) and 'id="read-only-note"' in html
        before = self.rows()
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "checked"},
            xsrf_from="/ledger",
        )
        assert resp.code == 403 and b"Ledger actions are off" in resp.body
        assert (
            self.post(f"/ledger/entry/{key}/resume", {"reason": "r"}, xsrf_from="/ledger").code
            == 403
        )
        assert self.rows() == before

    def test_a_ledger_that_cannot_be_read_is_a_503_not_a_traceback(self) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(text("DROP TABLE ledger_entries"))
        resp = self.get("/ledger/stuck")
        assert resp.code == 503 and b"the ledger cannot be read" in resp.body
        assert b"Traceback" not in resp.body


def _row_html(html: str, key: str) -> str:
    start = html.index(f'data-key="{key}"')
    return html[start : html.index("</tr>", start)]


# -- secrets ------------------------------------------------------------------------------------


class TestSecrets(PageCase):
    conf = {"ledger_redact": ["cvv"]}

    def test_secret_arguments_never_reach_the_html(self) -> None:
        key = self.blocked(
            kwargs={"order_id": "A-9", "amount": 10, "card_number": CARD, "cvv": "7391"}
        )
        # a body that copied the card number into its error and a step output
        with self.store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ledger_entries SET error = :e WHERE key = :k"),
                {"e": encode({"exc": f"declined {CARD}"}, limit=10_000, what="e"), "k": key},
            )
        html = self.page(f"/ledger/entry/{key}")
        assert CARD not in html and "7391" not in html
        assert "&quot;card_number&quot;: &quot;[redacted]&quot;" in html
        assert "&quot;cvv&quot;: &quot;[redacted]&quot;" in html
        assert "&quot;order_id&quot;: &quot;A-9&quot;" in html  # the rest stays readable
        assert "declined [redacted]" in html
        assert "hidden by name: card_number, cvv" in html
        for path in ("/ledger", "/ledger/stuck"):
            assert CARD not in self.page(path)

    def test_an_unknown_task_shows_no_argument_values(self) -> None:
        key = self.blocked(task="shop.elsewhere", kwargs={"iban": "DE44500105175407324931"})
        html = self.page(f"/ledger/entry/{key}")
        assert "DE44500105175407324931" not in html
        assert "&quot;iban&quot;: &quot;[hidden: task not importable here]&quot;" in html
        assert "is not registered in this Flower" in html


# -- actions ------------------------------------------------------------------------------------


class ActionCase(PageCase):
    conf = {"ledger_flower_actions": True}


class TestActions(ActionCase):
    def test_release_not_executed_stamps_the_flower_user_and_resumes(self) -> None:
        key = self.blocked()
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="release-form"' in html and 'name="_xsrf"' in html
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "provider shows no charge ch_1"},
            xsrf_from=f"/ledger/entry/{key}",
        )
        assert resp.code == 302, resp.body[:500]
        assert resp.headers["Location"] == f"/ledger/entry/{key}?done=released-resumed"
        entry = self.store.get_entry(key)
        assert (
            entry.released_by == USER and entry.released_reason == "provider shows no charge ch_1"
        )
        assert entry.status is EntryStatus.RUNNING and entry.owner == RESUME_OWNER
        events = self.store.entry_events(key)
        assert [(e.event, e.actor) for e in events[-2:]] == [("released", USER), ("resuming", USER)]
        charge = [s for s in self.store.load_steps(key) if s.name == "charge"][0]
        assert charge.status is StepStatus.NOT_EXECUTED and charge.authorized == 1
        assert "re-enqueued with its task id" in self.page(resp.headers["Location"])

    def test_the_release_form_warns_when_the_step_returned(self) -> None:
        """guarantees.md § "Bad input", item 19: blocked on a step that returned and whose output
        could not be stored: the form warns against not-executed and offers completed first."""
        key = self.blocked()
        plain = self.page(f"/ledger/entry/{key}")
        assert 'id="release-warning"' not in plain
        engine = make_engine(self.url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text("UPDATE ledger_entries SET reason = :r WHERE key = :k"),
                    {"r": f"step 'charge' {STEP_RETURNED} (too large); it executed", "k": key},
                )
        finally:
            engine.dispose()
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="release-warning"' in html and "runs it again" in html
        assert re.search(r'value="completed" id="verdict-completed" checked', html), html
        assert "--verified completed" in html

    def test_release_is_one_shot(self) -> None:
        key = self.blocked(snapshot=False)  # nothing resumes it: it stays interrupted
        form = {"verified": "not-executed", "reason": "first"}
        first = self.post(f"/ledger/entry/{key}/release", form, xsrf_from="/ledger")
        assert first.code == 302 and first.headers["Location"].endswith("released-no-snapshot")
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="release-form"' not in html and "release is one-shot" in html
        before = self.rows()
        again = self.post(
            f"/ledger/entry/{key}/release", {**form, "reason": "again"}, xsrf_from="/ledger"
        )
        assert again.code == 409 and b"release is one-shot" in again.body
        assert self.rows() == before and self.store.get_entry(key).released_reason == "first"

    def test_a_tombstone_offers_no_release_and_a_post_is_refused(self) -> None:
        """guarantees.md § "The seams", fault 10: a failed entry pruned to a tombstone forgot its
        completed ``reserve``; a
        release would re-run it. The page offers no release and says why; a POST is refused
        by the store in the same words and changes nothing."""
        c = self.claim()
        done = ("reserve", "h0", 0)
        assert self.store.write_step(c.key, c.fence, done, seq=0, status=StepStatus.STARTED)
        assert self.store.write_step(
            c.key, c.fence, done, seq=0, status=StepStatus.COMPLETED, output='"held"'
        )
        assert self.store.settle(c.key, c.fence, EntryStatus.FAILED, error="e", actor=NODE)
        with self.store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ledger_entries SET settled_at = settled_at - 3600 WHERE key = :k"),
                {"k": c.key},
            )
        assert self.store.prune_settled(60.0, tombstone=PRUNED_FAILURE) == 1
        html = self.page(f"/ledger/entry/{c.key}")
        assert 'id="release-form"' not in html and "tombstone" in html
        before = self.rows()
        for verdict in ("not-executed", "completed"):
            form = {"verified": verdict, "reason": "r", "result_json": "1"}
            if verdict == "not-executed":
                del form["result_json"]
            resp = self.post(f"/ledger/entry/{c.key}/release", form, xsrf_from="/ledger")
            assert resp.code == 409 and b"tombstone" in resp.body, (verdict, resp.body[-2000:])
        assert self.rows() == before

    def test_release_completed_checks_the_result_as_json(self) -> None:
        key = self.blocked()
        before = self.rows()
        for form, words in (
            ({"verified": "completed", "result_json": "{nope", "reason": "r"}, b"not valid JSON"),
            ({"verified": "completed", "result_json": "NaN", "reason": "r"}, b"not valid JSON"),
            ({"verified": "completed", "reason": "r"}, b"needs the task&#x27;s result"),
            (
                {"verified": "completed", "result_json": "1", "reason": "  "},
                b"a reason is required",
            ),
            ({"verified": "maybe", "reason": "r"}, b"choose a verdict"),
            ({"verified": "not-executed", "result_json": "1", "reason": "r"}, b"completed only"),
        ):
            resp = self.post(f"/ledger/entry/{key}/release", form, xsrf_from="/ledger")
            assert resp.code == 400 and words in resp.body, (form, resp.body[-3000:])
            assert b"Nothing was changed" in resp.body
        assert self.rows() == before
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "completed", "result_json": '{"charged": true}', "reason": "seen"},
            xsrf_from="/ledger",
        )
        assert resp.headers["Location"].endswith("done=released-completed")
        entry = self.store.get_entry(key)
        assert entry.status is EntryStatus.COMPLETED and entry.result == '{"charged": true}'

    def test_resume_reenqueues_an_interrupted_entry_once(self) -> None:
        key = self.interrupted()
        assert 'id="resume-form"' in self.page(f"/ledger/entry/{key}")
        resp = self.post(
            f"/ledger/entry/{key}/resume", {"reason": "worker back"}, xsrf_from="/ledger"
        )
        assert resp.code == 302 and resp.headers["Location"].endswith("done=resumed")
        entry = self.store.get_entry(key)
        assert entry.owner == RESUME_OWNER and self.store.entry_events(key)[-1].actor == USER
        again = self.post(f"/ledger/entry/{key}/resume", {"reason": "twice"}, xsrf_from="/ledger")
        assert again.code == 409 and b"not interrupted" in again.body
        assert (
            self.post(
                f"/ledger/entry/{self.blocked()}/resume", {"reason": "r"}, xsrf_from="/ledger"
            ).code
            == 409
        )

    def test_every_post_needs_the_xsrf_token(self) -> None:
        key = self.blocked()
        before = self.rows()
        resp = self.post(
            f"/ledger/entry/{key}/release", {"verified": "not-executed", "reason": "r"}
        )
        assert resp.code == 403 and b"_xsrf" in resp.body
        forged = self.fetch(
            f"/ledger/entry/{key}/release",
            method="POST",
            body=urlencode({"verified": "not-executed", "reason": "r", "_xsrf": "2|00|11|22"}),
            headers={**_auth((USER, PASSWORD)), "Cookie": "_xsrf=2|33|44|55"},
        )
        assert forged.code == 403
        assert self.rows() == before


class TestReadOnlyFlower(ActionCase):
    read_only = True

    def test_flowers_read_only_switch_turns_the_actions_off(self) -> None:
        key = self.blocked()
        html = self.page(f"/ledger/entry/{key}")
        assert not has_action_forms(html) and "Flower runs --read_only" in html
        before = self.rows()
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "r"},
            xsrf_from="/ledger",
        )
        assert resp.code == 403 and b"--read_only" in resp.body
        assert self.rows() == before


class TestNoAuthentication(ActionCase):
    basic_auth = None

    def test_actions_need_an_authenticated_user(self) -> None:
        key = self.blocked()
        before = self.rows()
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "r"},
            xsrf_from="/ledger",
            auth=None,
        )
        assert resp.code == 403 and b"need an authenticated Flower user" in resp.body
        assert self.rows() == before


class TestAuthorizer(ActionCase):
    conf = {
        "ledger_flower_actions": True,
        "ledger_authorizer": "test_ledger_page:deny_not_executed",
    }

    def test_the_authorizer_decides_with_the_flower_user(self) -> None:
        ASKED.clear()
        key = self.blocked()
        before = self.rows()
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "r"},
            xsrf_from="/ledger",
        )
        assert resp.code == 403 and b"alice may not authorize a re-run of shop.pay" in resp.body
        assert self.rows() == before
        operator, action, entry = ASKED[-1]
        assert operator == Operator(USER, "flower", True)
        assert action is Action.RELEASE_NOT_EXECUTED and entry.key == key
        ok = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "completed", "result_json": "null", "reason": "r"},
            xsrf_from="/ledger",
        )
        assert ok.code == 302 and ASKED[-1][1] is Action.RELEASE_COMPLETED


class TestBrokenAuthorizer(ActionCase):
    conf = {
        "ledger_flower_actions": True,
        "ledger_authorizer": "test_ledger_page:broken_authorizer",
    }

    def test_an_authorizer_that_raises_denies(self) -> None:
        key = self.interrupted()
        before = self.rows()
        resp = self.post(f"/ledger/entry/{key}/resume", {"reason": "r"}, xsrf_from="/ledger")
        assert resp.code == 403 and b"the authorizer failed (RuntimeError)" in resp.body
        assert self.rows() == before


class TestUrlPrefix(ActionCase):
    url_prefix = "/ops/flower"

    def test_routes_and_links_follow_flowers_url_prefix(self) -> None:
        key = self.blocked()
        html = self.page("/ledger/stuck")
        assert f'href="/ops/flower/ledger/entry/{key}"' in html
        assert self.fetch(f"/ledger/entry/{key}", headers=_auth((USER, PASSWORD))).code == 404
        resp = self.post(
            f"/ledger/entry/{key}/release",
            {"verified": "not-executed", "reason": "under a prefix"},
            xsrf_from=f"/ledger/entry/{key}",
        )
        assert resp.headers["Location"].startswith(f"/ops/flower/ledger/entry/{key}?done=")


# -- the death-signal gate on the page -----------------------------------------------------------


class TestDeathSignal(PageCase):
    conf = {"ledger_flower_actions": True, "ledger_release_requires_death_signal": True}

    def test_mark_dead_opens_the_gate_and_is_stamped_with_the_flower_user(self) -> None:
        key = self.blocked()
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="mark-dead-form"' in html and 'id="release-needs-death"' in html
        form = {"verified": "not-executed", "reason": "provider shows no charge"}
        refused = self.post(f"/ledger/entry/{key}/release", form, xsrf_from="/ledger")
        assert refused.code == 409 and b"needs a death signal" in refused.body
        assert (
            self.post(f"/ledger/entry/{key}/mark-dead", {"reason": "  "}, xsrf_from="/ledger").code
            == 400
        )
        done = self.post(
            f"/ledger/entry/{key}/mark-dead", {"reason": "VM destroyed"}, xsrf_from="/ledger"
        )
        assert done.code == 302 and done.headers["Location"].endswith("done=marked-dead")
        entry = self.store.get_entry(key)
        assert entry.dead_by == USER and entry.dead_reason == "VM destroyed"
        html = self.page(done.headers["Location"])
        assert 'id="entry-marked-dead"' in html and "VM destroyed" in html
        assert [(e.event, e.actor) for e in self.store.entry_events(key)[-1:]] == [
            ("marked-dead", USER)
        ]
        ok = self.post(f"/ledger/entry/{key}/release", form, xsrf_from="/ledger")
        assert ok.code == 302, ok.body[-2000:]

    def test_seen_alive_is_shown_and_refuses_mark_dead_unless_overridden(self) -> None:
        key = self.blocked()
        old_fence = self.store.get_entry(key).fence
        # A takeover moved the fence; then the superseded attempt wakes and tries to write.
        with self.store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ledger_entries SET fence = fence + 1 WHERE key = :k"), {"k": key}
            )
        assert self.store.record_seen_alive(key, old_fence, owner="celery@zombie", what="renew")
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="seen-alive-alert"' in html and "celery@zombie" in html
        assert 'id="entry-seen-alive"' in html
        stuck = self.page("/ledger/stuck?kind=blocked")
        assert "Its old worker (celery@zombie) was seen alive" in stuck
        before = self.rows()
        refused = self.post(
            f"/ledger/entry/{key}/mark-dead", {"reason": "looks dead"}, xsrf_from="/ledger"
        )
        assert refused.code == 409 and b"tried to write" in refused.body
        assert self.rows() == before and self.store.get_entry(key).dead_at is None
        forced = self.post(
            f"/ledger/entry/{key}/mark-dead",
            {"reason": "killed it myself", "override_heartbeat": "on"},
            xsrf_from="/ledger",
        )
        assert forced.code == 302
        assert "overriding" in (self.store.entry_events(key)[-1].detail or "")


class TestDeathSignalReadOnly(PageCase):
    def test_read_only_page_offers_no_mark_dead_and_refuses_the_post(self) -> None:
        key = self.blocked()
        assert 'id="mark-dead-form"' not in self.page(f"/ledger/entry/{key}")
        resp = self.post(f"/ledger/entry/{key}/mark-dead", {"reason": "r"}, xsrf_from="/ledger")
        assert resp.code == 403 and self.store.get_entry(key).dead_at is None


class TestNavbarCount(PageCase):
    def test_every_flower_page_shows_how_many_entries_are_blocked(self) -> None:
        self.blocked()
        self.blocked()
        self.interrupted()  # the sweep resumes it: not counted

        def shown() -> str | None:
            html = self.page("/tasks")  # Flower's own page, not the Ledger's
            found = re.search(r'id="ledger-nav-blocked"[^>]*>(\d+)<', html)
            return found.group(1) if found else None

        deadline = time.monotonic() + 10
        while shown() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the count is refreshed off the request, in Flower's executor
        assert shown() == "2"
        assert 'id="ledger-nav-blocked"' in self.page("/workers")


# -- sealed snapshots -----------------------------------------------------------------------------

try:
    from cryptography.fernet import Fernet

    SNAPSHOT_KEY = Fernet.generate_key().decode()
except ImportError:  # pragma: no cover - the dev extra installs it
    SNAPSHOT_KEY = ""


def seal_snapshot(store: LedgerStore, key: str) -> None:
    """Seal the entry's stored snapshot, as a worker with ``ledger_snapshot_keys`` writes it."""
    from celery_ledger.ledger import SnapshotCipher

    plain = store.get_entry(key).snapshot
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE ledger_entries SET snapshot = :s WHERE key = :k"),
            {"s": SnapshotCipher([SNAPSHOT_KEY]).seal(plain), "k": key},
        )


class TestSealedSnapshot(PageCase):
    conf = {"ledger_snapshot_keys": [SNAPSHOT_KEY]}

    def test_the_page_opens_a_sealed_snapshot_with_the_key_and_still_redacts(self) -> None:
        key = self.blocked()
        seal_snapshot(self.store, key)
        html = self.page(f"/ledger/entry/{key}")
        assert "A-1" in html and "[redacted]" in html and CARD not in html


class TestSealedSnapshotWithoutKey(PageCase):
    def test_without_the_key_the_page_says_it_is_sealed(self) -> None:
        key = self.blocked()
        seal_snapshot(self.store, key)
        html = self.page(f"/ledger/entry/{key}")
        assert "sealed" in html and "ledger_snapshot_keys" in html and CARD not in html


def deny_mark_dead(operator: Operator, action: Action, entry: Entry) -> Decision:
    """A ``ledger_authorizer`` that keeps mark-dead to the on-call."""
    ASKED.append((operator, action, entry))
    if action is Action.MARK_DEAD:
        return Decision.deny(f"{operator.name} is not on call")
    return Decision.allow()


class TestMarkDeadAuthorizer(ActionCase):
    conf = {
        "ledger_flower_actions": True,
        "ledger_authorizer": "test_ledger_page:deny_mark_dead",
    }

    def test_mark_dead_goes_through_the_shared_authorizer(self) -> None:
        ASKED.clear()
        key = self.blocked()
        before = self.rows()
        resp = self.post(f"/ledger/entry/{key}/mark-dead", {"reason": "r"}, xsrf_from="/ledger")
        assert resp.code == 403 and f"{USER} is not on call".encode() in resp.body
        assert self.rows() == before and self.store.get_entry(key).dead_at is None
        [(operator, action, entry)] = ASKED
        assert (operator.name, operator.via, operator.authenticated) == (USER, "flower", True)
        assert action is Action.MARK_DEAD and entry.key == key


def refuse_overrides(
    operator: Operator, action: Action, entry: Entry, details: Any = None
) -> Decision:
    """A ``ledger_authorizer`` that allows mark-dead, but not over a recent sign of life."""
    if action is Action.MARK_DEAD and getattr(details, "override_heartbeat", False):
        return Decision.deny("overriding a sign of life needs the on-call")
    return Decision.allow()


class TestOverrideAuthorizer(ActionCase):
    conf = {
        "ledger_flower_actions": True,
        "ledger_authorizer": "test_ledger_page:refuse_overrides",
    }

    def test_the_authorizer_can_refuse_an_override_and_allow_a_plain_mark_dead(self) -> None:
        key = self.blocked()
        before = self.rows()
        refused = self.post(
            f"/ledger/entry/{key}/mark-dead",
            {"reason": "killed it myself", "override_heartbeat": "on"},
            xsrf_from="/ledger",
        )
        assert refused.code == 403 and b"needs the on-call" in refused.body
        assert self.rows() == before and self.store.get_entry(key).dead_at is None
        plain = self.post(
            f"/ledger/entry/{key}/mark-dead", {"reason": "VM destroyed"}, xsrf_from="/ledger"
        )
        assert plain.code == 302
        assert self.store.get_entry(key).dead_at is not None


FOREVER = "f" * 64


class TestHostileTimes(PageCase):
    """guarantees.md § "Bad input", items 4 and 13: a stored infinite due time renders; ``?age=nan``
    is refused."""

    def test_the_pages_render_an_entry_held_forever(self) -> None:
        assert self.store.schedule(
            ClaimRequest(
                key=FOREVER,
                task_name="shop.pay",
                task_id="t-forever",
                args_hash="task-id",
                snapshot='{"args":["o-1",5,"4242"],"kwargs":{}}',
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            ),
            due_at=float("inf"),
            deadline_at=float("inf"),
        )
        html = self.page(f"/ledger/entry/{FOREVER}")
        assert FOREVER in html and "never" in html
        self.page("/ledger")
        self.page("/ledger/stuck")

    def test_a_stuck_age_that_is_no_finite_number_is_refused(self) -> None:
        for raw in ("nan", "inf"):
            bad = self.page(f"/ledger/stuck?age={raw}")
            assert "give seconds or a duration" in bad, raw
