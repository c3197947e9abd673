"""The ledger in the Django admin (``celery_ledger.contrib.django``), in a real browser: Debian's
chromium through Selenium, against real ``django runserver`` processes and a real worker.

How the ledger gets there (as in tests/test_ledger_page_browser.py): ``page_app.pay`` runs on
worker ``w1``, whose pool process is SIGKILLed right after the ``started`` row of ``charge``;
Redis redelivers the message, the takeover finds ``charge`` ambiguous with no reconciler, and
the entry is **blocked**. ``w1`` stays up (the crash point fires once) to run it again.

Two Django servers over ``tests/djangoproj/admin_settings.py`` serve the admin: a read-only
one (the default: no ``ledger_authorizer``) and one whose ``CELERY_LEDGER_AUTHORIZER`` lets a
superuser act. Neither has a ``CELERY_LEDGER_*`` variable in its environment: the ledger's URL
reaches them as the Django setting ``CELERY_LEDGER_URL``, through the Celery app's ``CELERY``
namespace. ``CELERY_LEDGER_SCREENSHOTS=<dir>`` saves the entry page docs/django.md shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from test_ledger_page_browser import chromium, close, find_all, status_of, text_of
from test_metrics import free_port

from celery_ledger.harness.processes import ProcessGroup, child_env
from celery_ledger.ledger import EntryStatus, LedgerStore, entry_key
from helpers import effect_counts
from procs import TESTS, test_env, wait_for
from servers import create_pg_database, drop_pg_database, redis_url

pytest.importorskip("django")

pytestmark = [
    pytest.mark.processes,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.browser,
    pytest.mark.timeout(300),
]

ADMIN, PASSWORD = "admin-ann", "correct-horse-battery"
CARD = "4111111111111111"
ORDER = "D-2001"
AUTHORIZER = "djangoproj.admin_authorizer:may_act"
LIST = "/admin/celery_ledger/ledgerentry/"


@dataclass
class Site:
    procs: ProcessGroup
    store: LedgerStore
    pg_url: str
    read_only: int
    actions: int
    blocked: str
    task_id: str

    @staticmethod
    def base(port: int) -> str:
        return f"http://127.0.0.1:{port}"


def django_env(tmp_path: Path, *, broker: str, ledger_url: str) -> dict[str, str]:
    """The Django servers' environment: the ledger named only in Django's settings."""
    return {
        "DJANGO_SETTINGS_MODULE": "djangoproj.admin_settings",
        "TEST_DJANGO_ADMIN_DB": str(tmp_path / "django.sqlite3"),
        "TEST_BROKER_URL": broker,
        "TEST_LEDGER_URL": ledger_url,
    }


def manage(env: dict[str, str], *args: str) -> None:
    """``python -m django <args>`` in the servers' environment, to its end."""
    out = subprocess.run(
        [sys.executable, "-m", "django", *args],
        env=child_env(env, drop_prefixes=("CELERY_",), pythonpath=[TESTS]),
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def runserver(procs: ProcessGroup, name: str, **env: str) -> int:
    port = free_port()
    proc = procs.spawn(
        name,
        [sys.executable, "-m", "django", "runserver", "--noreload", f"127.0.0.1:{port}"],
        env=env,
    )

    def up() -> bool:
        if proc.proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"runserver exited:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2):
                return True
        except OSError:
            return False

    wait_for(up, timeout=60, what=f"Django {name}")
    return port


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    close(chromium())  # skip (or fail under CI) before starting anything
    tmp_path = tmp_path_factory.mktemp("django-admin")
    db_name, pg_url = create_pg_database()
    broker = redis_url()
    env = test_env(tmp_path, broker=broker, ledger_url=pg_url)
    procs = ProcessGroup(tmp_path, app="page_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    dj_env = django_env(tmp_path, broker=broker, ledger_url=pg_url)
    # The servers get none of the worker's CELERY_* variables (nor this process's).
    django = ProcessGroup(
        tmp_path / "django", env=dj_env, cwd=TESTS, pythonpath=[TESTS], drop_prefixes=("CELERY_",)
    )
    store = LedgerStore(pg_url)
    try:
        store.now()  # the schema, as the first worker would create it
        procs.worker(
            "w1",
            queue=env["TEST_QUEUE"],
            node=f"w1-{env['TEST_ID']}@%h",
            concurrency=1,
            env={
                "CELERY_LEDGER_CRASH_AT": "step-started:charge",
                "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash-w1"),
            },
            heartbeat=True,
        ).wait_ready(90)
        sent = Celery("client", broker=broker, backend=broker).send_task(
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
        manage(dj_env, "migrate", "--noinput", "-v0")
        manage(
            {**dj_env, "DJANGO_SUPERUSER_PASSWORD": PASSWORD},
            "createsuperuser",
            "--noinput",
            f"--username={ADMIN}",
            "--email=ann@example.com",
        )
        read_only = runserver(django, "django-ro")
        actions = runserver(django, "django-rw", TEST_ADMIN_AUTHORIZER=AUTHORIZER)
        yield Site(procs, store, pg_url, read_only, actions, blocked, sent.id)
    finally:
        django.stop_all()
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
        # The window is taller than the page it shows by the browser's own chrome: grow it
        # until the viewport holds the whole page (twice at most; a page is at most 2400 px).
        for _ in range(2):
            inner, height = driver.execute_script(
                "return [window.innerHeight, document.documentElement.scrollHeight]"
            )
            outer = driver.get_window_size()["height"]
            driver.set_window_size(1400, min(outer + int(height) - int(inner) + 8, 2400))
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))
        driver.set_window_size(1400, 1100)


def log_in(driver: Any, port: int) -> None:
    driver.get(Site.base(port) + "/admin/login/?next=/admin/")
    find_all(driver, "#id_username")[0].send_keys(ADMIN)
    find_all(driver, "#id_password")[0].send_keys(PASSWORD)
    find_all(driver, "input[type=submit]")[0].click()
    wait_for(lambda: find_all(driver, "#user-tools"), timeout=20, what="the admin's index")


def open_blocked(driver: Any, site: Site, port: int) -> None:
    """From the admin's index to the entry: the app's link, the stuck filter, the row."""
    find_all(driver, f"a[href='{LIST}']")[0].click()
    wait_for(lambda: find_all(driver, "#result_list"), timeout=20, what="the entry list")
    [stuck] = [a for a in find_all(driver, "#changelist-filter a") if a.text == "Stuck: blocked"]
    stuck.click()
    wait_for(lambda: find_all(driver, "tr.entry-row"), timeout=20, what="the stuck list")
    rows = {r.get_attribute("data-key"): r.text for r in find_all(driver, "tr.entry-row")}
    assert list(rows) == [site.blocked]
    assert "step 'charge' may have executed" in rows[site.blocked]
    find_all(driver, "tr.entry-row a.ledger-key")[0].click()
    wait_for(lambda: find_all(driver, "#entry-status"), timeout=20, what="the entry page")


# -- cases --------------------------------------------------------------------------------------


def test_log_in_and_find_the_blocked_entry_read_only(site: Site, browser: Any) -> None:
    browser.get(Site.base(site.read_only) + LIST)
    assert "/admin/login/" in browser.current_url  # Django's login first
    log_in(browser, site.read_only)
    open_blocked(browser, site, site.read_only)
    assert text_of(browser, "#entry-status") == "blocked"
    steps = {li.get_attribute("data-step"): li for li in find_all(browser, "#entry-steps li")}
    assert steps["reserve"].get_attribute("data-state") == "completed"
    assert steps["charge"].get_attribute("data-state") == "ambiguous"
    assert "release" in text_of(browser, "#entry-next") and "--verified" in text_of(
        browser, "#entry-command"
    )
    assert find_all(browser, "#read-only-note")
    assert not find_all(browser, "form#release-form") and not find_all(browser, "#release-button")
    # The admin's Celery app declares page_app.pay's secret_args (djangoproj/admin_celery.py).
    shown = text_of(browser, "#entry-arguments")
    assert '"card_number": "[redacted]"' in shown and f'"order_id": "{ORDER}"' in shown
    assert CARD not in browser.page_source


def test_the_read_only_default_refuses_a_posted_action(site: Site, browser: Any) -> None:
    log_in(browser, site.read_only)
    browser.get(Site.base(site.read_only) + f"{LIST}{site.blocked}/")
    # The form the actions server would show, built in this page with Django's CSRF cookie.
    browser.execute_script(
        """
        const csrf = document.cookie.split('; ').find(c => c.startsWith('csrftoken=')).slice(10);
        const form = document.createElement('form');
        form.method = 'post';
        form.action = location.pathname + 'release/';
        const fields = {csrfmiddlewaretoken: csrf, verified: 'not-executed', reason: 'r'};
        for (const [k, v] of Object.entries(fields)) {
          const input = document.createElement('input');
          input.name = k; input.value = v; form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();
        """
    )
    wait_for(lambda: find_all(browser, "#action-error"), timeout=20, what="the refusal")
    assert "Ledger actions are off" in text_of(browser, "#action-error")
    entry = site.store.get_entry(site.blocked)
    assert entry.status is EntryStatus.BLOCKED and entry.released_by is None


def test_release_from_the_admin_and_see_it_resume_and_complete(site: Site, browser: Any) -> None:
    log_in(browser, site.actions)
    # The search box finds it by its task id.
    browser.get(Site.base(site.actions) + LIST)
    find_all(browser, "#searchbar")[0].send_keys(site.task_id)
    find_all(browser, "#changelist-search input[type=submit]")[0].click()
    wait_for(lambda: find_all(browser, "tr.entry-row"), timeout=20, what="the search's match")
    assert [r.get_attribute("data-key") for r in find_all(browser, "tr.entry-row")] == [
        site.blocked
    ]
    find_all(browser, "tr.entry-row a.ledger-key")[0].click()
    wait_for(lambda: find_all(browser, "#release-form"), timeout=20, what="the release form")
    assert find_all(browser, "#verdict-not-executed")[0].is_selected()
    assert find_all(browser, "#mark-dead-form") and find_all(browser, "#cancel-form")
    screenshot(browser, "django-admin-entry")
    find_all(browser, "#release-reason")[0].send_keys("provider shows no charge for D-2001")
    find_all(browser, "#release-button")[0].click()
    wait_for(lambda: find_all(browser, "ul.messagelist"), timeout=30, what="the release's answer")
    assert "re-enqueued" in text_of(browser, "ul.messagelist")
    entry = site.store.get_entry(site.blocked)
    assert entry.released_by == ADMIN
    assert entry.released_reason == "provider shows no charge for D-2001"

    # w1 is still up: it runs the released entry, the charge once more, and completes it.
    def completed() -> bool:
        browser.refresh()
        return text_of(browser, "#entry-status") == "completed"

    wait_for(completed, timeout=120, interval=1, what="the released entry completed")
    events = [r.get_attribute("data-event") for r in find_all(browser, "tr.event-row")]
    released = events.index("released")
    assert events[released + 1] == "resuming" and events[-1] == "settled", events
    assert ADMIN in text_of(browser, "#entry-released")
    assert effect_counts(site.pg_url, ORDER) == {(ORDER, "reserve"): 1, (ORDER, "charge"): 1}
    # Completed: nothing left to release, resume or cancel.
    assert not find_all(browser, "#release-form") and not find_all(browser, "#cancel-form")
