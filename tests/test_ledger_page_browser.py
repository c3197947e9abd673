"""The Ledger page in a real browser: Debian's chromium, driven by Selenium, against real
``celery flower`` processes over a ledger that crashes left with one blocked and one
interrupted entry.

How the ledger gets there (real workers on Redis, ledger on PostgreSQL, named crash points):

- ``page_app.pay`` (its ``card_number`` is a declared secret) runs on worker ``w1``, whose
  pool process is SIGKILLed right after the ``started`` row of ``charge``: the worker's parent
  marks the entry interrupted, Redis redelivers the message, the takeover finds ``charge``
  ambiguous with no reconciler, and the entry is **blocked**;
- ``tests_app.steps_then_wait`` runs on worker ``w2``, which dies whole (``@worker``) right
  after step ``a`` completed: nobody is left to say so, the entry's short lease runs out, and
  the sweep's stale-lease step (``store.interrupt_expired``, what beat's sweep does first)
  marks it **interrupted**. No beat runs yet, so it stays that way.

Two Flowers serve the page: a read-only one (the default) and one with
``CELERY_LEDGER_FLOWER_ACTIONS=1``. Both use basic auth. ``CELERY_LEDGER_SCREENSHOTS=<dir>``
saves the screenshots ``docs/monitoring.md`` shows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from test_metrics import free_port

from celery_ledger.harness.processes import Process, ProcessGroup
from celery_ledger.ledger import EntryStatus, LedgerStore, entry_key
from helpers import effect_counts
from procs import REPO, TESTS, test_env, wait_for
from servers import CI, create_pg_database, drop_pg_database, redis_url

pytestmark = [
    pytest.mark.processes,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.browser,
    pytest.mark.timeout(300),
]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Chromium as root in a container, quiet: no sandbox, no GPU, nothing phoning home.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1100",
]
FLOWERCONFIG = REPO / "worker" / "flowerconfig.py"
USER, PASSWORD = "operator-ann", "correct-horse"
CARD = "4111111111111111"
ORDER = "A-1001"


def browser_missing(why: str) -> None:
    """Skip on a laptop without chromium; fail under CI, which installs it (.ci/run)."""
    if CI:
        pytest.fail(f"{why}, and CI=true requires it", pytrace=False)
    pytest.skip(why)


def chromium() -> Any:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        browser_missing(f"{CHROMIUM} and {CHROMEDRIVER} (apt: chromium chromium-driver) missing")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        browser_missing("selenium is not installed (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver._ledger_profile = profile  # removed with the driver
    return driver


def close(driver: Any) -> None:
    try:
        driver.quit()
    finally:
        shutil.rmtree(driver._ledger_profile, ignore_errors=True)


@dataclass
class Cluster:
    procs: ProcessGroup
    env: dict[str, str]
    store: LedgerStore
    pg_url: str
    read_only: int
    actions: int
    blocked: str
    interrupted: str

    def base(self, port: int, *, auth: bool = True) -> str:
        creds = f"{USER}:{PASSWORD}@" if auth else ""
        return f"http://{creds}127.0.0.1:{port}"


def worker(procs: ProcessGroup, name: str, queue: str, **env: str) -> Process:
    """A ``page_app`` worker sending task events (Flower's task page links to the entry)."""
    return procs.worker(
        name,
        queue=queue,
        node=f"{name}-{procs.env['TEST_ID']}@%h",
        concurrency=1,
        env=env,
        heartbeat=True,
        extra=["-E"],
    ).wait_ready(90)


def flower(procs: ProcessGroup, name: str, **env: str) -> int:
    port = free_port()
    proc = procs.celery(
        name,
        [
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--conf={FLOWERCONFIG}",
            f"--basic-auth={USER}:{PASSWORD}",
        ],
        env=env,
    )

    def up() -> bool:
        if proc.proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"flower exited:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2):
                return True
        except OSError:
            return False

    wait_for(up, timeout=60, what=f"Flower {name}")
    return port


def status_of(store: LedgerStore, key: str) -> EntryStatus | None:
    try:
        return store.get_entry(key).status
    except Exception:  # noqa: BLE001 - not claimed yet
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    chromium_check = chromium()  # skip (or fail under CI) before starting anything
    close(chromium_check)
    tmp_path = tmp_path_factory.mktemp("ledger-page")
    db_name, pg_url = create_pg_database()
    broker = redis_url()
    env = test_env(tmp_path, broker=broker, ledger_url=pg_url)
    procs = ProcessGroup(tmp_path, app="page_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    store = LedgerStore(pg_url)
    try:
        store.now()  # the schema, as the first worker would create it
        client = Celery("client", broker=broker, backend=broker)
        # -- blocked: w1's pool process dies after `charge` started; the redelivery blocks it
        worker(
            procs,
            "w1",
            env["TEST_QUEUE"],
            CELERY_LEDGER_CRASH_AT="step-started:charge",
            CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-w1"),
        )
        client.send_task(
            "page_app.pay",
            kwargs={"order_id": ORDER, "amount": 42, "card_number": CARD},
            queue=env["TEST_QUEUE"],
        )
        blocked = entry_key("page_app.pay", {"order_id": ORDER})
        wait_for(
            lambda: status_of(store, blocked) is EntryStatus.BLOCKED,
            timeout=90,
            what="the order blocked on its ambiguous charge",
        )
        # -- interrupted: w2 dies whole after step `a`; its lease runs out; the sweep marks it
        queue2 = env["TEST_QUEUE"] + "-w2"
        w2 = worker(
            procs,
            "w2",
            queue2,
            CELERY_LEDGER_CRASH_AT="step-completed:a@worker",
            CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-w2"),
            CELERY_LEDGER_LEASE_SECONDS="3",
        )
        sent = client.send_task(
            "tests_app.steps_then_wait", kwargs={"tag": "B-7", "seconds": 0}, queue=queue2
        )
        interrupted = entry_key("tests_app.steps_then_wait", sent.id)
        wait_for(lambda: w2.proc.poll() is not None, timeout=90, what="w2 killed whole")
        wait_for(
            lambda: store.interrupt_expired(actor="sweep"),
            timeout=30,
            interval=0.5,
            what="the dead worker's lease to run out and the sweep to interrupt it",
        )
        assert status_of(store, interrupted) is EntryStatus.INTERRUPTED
        assert status_of(store, blocked) is EntryStatus.BLOCKED
        read_only = flower(procs, "flower-ro")
        actions = flower(procs, "flower-rw", CELERY_LEDGER_FLOWER_ACTIONS="1")
        yield Cluster(procs, env, store, pg_url, read_only, actions, blocked, interrupted)
    finally:
        procs.stop_all()
        store.dispose()
        drop_pg_database(db_name)


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = chromium()
    try:
        yield driver
    finally:
        close(driver)


def screenshot(driver: Any, name: str) -> None:
    folder = os.environ.get("CELERY_LEDGER_SCREENSHOTS")
    if folder:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1400, min(max(int(height) + 40, 700), 2400))
        driver.save_screenshot(str(Path(folder) / f"ledger-{name}.png"))
        driver.set_window_size(1400, 1100)


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text).strip()


def find_all(driver: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, css))


# -- cases --------------------------------------------------------------------------------------


def test_log_in_with_basic_auth_and_find_what_is_stuck(cluster: Cluster, browser: Any) -> None:
    # Without credentials Flower answers 401 with a Basic challenge; Chromium shows nothing.
    browser.get(cluster.base(cluster.read_only, auth=False) + "/ledger")
    assert 'id="count-blocked"' not in browser.page_source
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(cluster.base(cluster.read_only, auth=False) + "/ledger", timeout=5)
    assert refused.value.code == 401 and "Basic" in refused.value.headers["WWW-Authenticate"]
    browser.get(cluster.base(cluster.read_only) + "/ledger")
    assert browser.title == "Ledger · Flower"
    assert text_of(browser, "#count-blocked") == "1"
    assert text_of(browser, "#count-interrupted") == "1"
    screenshot(browser, "overview")
    # the navbar's Ledger tab, then the page's own Stuck tab: plain links, same credentials
    find_all(browser, "a.nav-link[href='/ledger/stuck']")[0].click()
    wait_for(lambda: find_all(browser, "#stuck-table"), timeout=10, what="the stuck list")
    kinds = {
        r.get_attribute("data-key"): r.get_attribute("data-kind")
        for r in find_all(browser, "tr.stuck-row")
    }
    assert kinds == {cluster.blocked: "blocked", cluster.interrupted: "interrupted"}
    rows = {r.get_attribute("data-key"): r.text for r in find_all(browser, "tr.stuck-row")}
    assert "Needs an operator: step 'charge' may have executed" in rows[cluster.blocked]
    assert "lease expired; the next sweep re-enqueues it" in rows[cluster.interrupted]
    screenshot(browser, "stuck")


def test_read_only_flower_shows_no_action_and_refuses_the_post(
    cluster: Cluster, browser: Any
) -> None:
    base = cluster.base(cluster.read_only)
    browser.get(base + "/ledger/stuck?kind=blocked")
    [link] = find_all(browser, "tr.stuck-row a.ledger-key")
    link.click()
    wait_for(lambda: find_all(browser, "#entry-status"), timeout=10, what="the entry page")
    assert text_of(browser, "#entry-status") == "blocked"
    assert find_all(browser, "#read-only-note")
    assert not find_all(browser, "form[method=post]") and not find_all(browser, "#release-button")
    # The form the actions Flower would show, built in this page with its own XSRF cookie.
    browser.execute_script(
        """
        const xsrf = document.cookie.split('; ').find(c => c.startsWith('_xsrf=')).slice(6);
        const form = document.createElement('form');
        form.method = 'post';
        form.action = location.pathname + '/release';
        for (const [k, v] of Object.entries({_xsrf: xsrf, verified: 'not-executed', reason: 'r'})) {
          const input = document.createElement('input');
          input.name = k; input.value = v; form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();
        """
    )
    wait_for(
        lambda: "Ledger actions are off" in browser.page_source,
        timeout=10,
        what="the refusal of the POST",
    )
    entry = cluster.store.get_entry(cluster.blocked)
    assert entry.status is EntryStatus.BLOCKED and entry.released_by is None


def test_the_secret_argument_never_reaches_the_html(cluster: Cluster, browser: Any) -> None:
    for port in (cluster.read_only, cluster.actions):
        base = cluster.base(port)
        for path in (
            "/ledger",
            "/ledger/stuck",
            f"/ledger/entry/{cluster.blocked}",
            f"/ledger/entry/{cluster.interrupted}",
        ):
            browser.get(base + path)
            html = browser.page_source
            assert "Ledger" in browser.title
            assert CARD not in html, path
        # the entry still shows which argument was hidden, and the rest of the arguments
        browser.get(base + f"/ledger/entry/{cluster.blocked}")
        shown = text_of(browser, "#entry-arguments")
        assert '"card_number": "[redacted]"' in shown and f'"order_id": "{ORDER}"' in shown


def test_release_the_blocked_entry_and_see_it_resume_and_complete(
    cluster: Cluster, browser: Any
) -> None:
    base = cluster.base(cluster.actions)
    browser.get(base + "/ledger/stuck?kind=blocked")
    [link] = find_all(browser, "tr.stuck-row a.ledger-key")
    link.click()
    wait_for(lambda: find_all(browser, "#release-form"), timeout=10, what="the release form")
    assert find_all(browser, "#verdict-not-executed")[0].is_selected()
    screenshot(browser, "entry")
    find_all(browser, "#release-reason")[0].send_keys(
        "provider dashboard shows no charge for A-1001"
    )
    find_all(browser, "#release-button")[0].click()
    wait_for(lambda: find_all(browser, "#action-done"), timeout=20, what="the release's answer")
    assert "re-enqueued" in text_of(browser, "#action-done")
    entry = cluster.store.get_entry(cluster.blocked)
    assert entry.released_by == USER
    assert entry.released_reason == "provider dashboard shows no charge for A-1001"

    # A worker and beat run; the released entry runs its charge once and completes.
    cluster.procs.beat("beat").wait_ready(60)
    worker(cluster.procs, "w2-back", cluster.env["TEST_QUEUE"] + "-w2")

    def completed() -> bool:
        browser.refresh()
        return text_of(browser, "#entry-status") == "completed"

    wait_for(completed, timeout=120, interval=1, what="the released entry completed")
    events = [r.get_attribute("data-event") for r in find_all(browser, "tr.event-row")]
    released = events.index("released")
    assert events[released + 1] == "resuming" and events[-1] == "settled", events
    assert USER in text_of(browser, "#entry-released")
    assert effect_counts(cluster.pg_url, ORDER) == {(ORDER, "reserve"): 1, (ORDER, "charge"): 1}
    # beat's sweep resumed the interrupted one too; it replayed step a and ran b
    wait_for(
        lambda: status_of(cluster.store, cluster.interrupted) is EntryStatus.COMPLETED,
        timeout=120,
        what="the interrupted entry resumed by beat's sweep",
    )
    assert effect_counts(cluster.pg_url, "B-7") == {("B-7", "a"): 1, ("B-7", "b"): 1}
