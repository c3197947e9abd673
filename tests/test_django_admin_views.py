"""The Django admin's ledger views (``celery_ledger.contrib.django``) through Django's test
client, over a real SQLite ledger: who may see, who may act (the authorizer with the Django
user, read-only without one), each action's store call, the lists and the settings.

Django is configured in this process (an in-memory database for users and sessions); the
ledger's state is written through the store the way a worker writes it. The browser test
(``test_django_admin.py``) proves the same pages against ``runserver`` and a real worker.
"""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")

import django
from celery import Celery
from django.conf import settings

from celery_ledger import LedgerTask
from celery_ledger.codec import encode
from celery_ledger.ledger import (
    RESUME_OWNER,
    ClaimRequest,
    EntryStatus,
    LedgerStore,
    Owner,
    StepStatus,
    entry_key,
)

CARD = "4111111111111111"
NODE = "celery@host-a"
PASSWORD = "pw-for-tests"
LIST = "/admin/celery_ledger/ledgerentry/"
SUPERUSER_ONLY = "djangoproj.admin_authorizer:may_act"


def _configure() -> None:
    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["testserver"],
        SECRET_KEY="celery-ledger-admin-view-tests",
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "celery_ledger.contrib.django",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        ROOT_URLCONF="djangoproj.admin_urls",
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        STATIC_URL="static/",
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],  # fast, test-only
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


@pytest.fixture(autouse=True)
def django_configured() -> None:
    """Django configured in this process when a test here first runs (not at collection: an
    xdist worker that runs none of them never configures Django)."""
    _configure()


class Ledger:
    """A SQLite ledger, the Celery app the admin uses, and entries written as a worker would."""

    def __init__(self, url: str, app: Celery) -> None:
        self.url = url
        self.app = app
        self.store = LedgerStore(url)
        self.store.now()

    def claim(self, *, group_id: str | None = None, lease: float = 60.0) -> Any:
        task_id = str(uuid.uuid4())
        snap = encode(
            {
                "args": [],
                "kwargs": {"order_id": "A-1", "amount": 10, "card_number": CARD},
                "queue": "orders",
                "ledger_key": None,
            },
            limit=100_000,
            what="snapshot",
        )
        return self.store.claim(
            ClaimRequest(
                key=entry_key("shop.pay", task_id),
                task_name="shop.pay",
                task_id=task_id,
                args_hash="task-id",
                snapshot=snap,
                side_effect="non_idempotent",
                owner=Owner(NODE, "boot-1", 4242),
                lease_seconds=lease,
                group_id=group_id,
            )
        )

    def blocked(self) -> str:
        """Parked on an ambiguous ``charge`` whose external ref was recorded."""
        c = self.claim()
        ident = ("charge", "h1", 0)
        assert self.store.write_step(c.key, c.fence, ident, seq=0, status=StepStatus.STARTED)
        assert self.store.record_external_ref(c.key, c.fence, ident, "ch_1")
        assert self.store.settle(
            c.key,
            c.fence,
            EntryStatus.BLOCKED,
            actor=NODE,
            reason="step 'charge' may have executed (external ref: ch_1); reconcile or release",
        )
        return str(c.key)

    def interrupted(self) -> str:
        c = self.claim()
        assert self.store.interrupt_owner(
            c.key, node=NODE, boot="boot-1", pid=4242, actor=NODE, why="pool process lost"
        )
        return str(c.key)


def celery_app(url: str, **conf: Any) -> Celery:
    app = Celery("django_admin_tests", broker="memory://", backend="cache+memory://")
    app.conf.update(ledger_url=url, **conf)

    @app.task(
        base=LedgerTask, bind=True, name="shop.pay", secret_args=("card_number",), shared=False
    )
    def pay(self: Any, order_id: str, amount: int, card_number: str) -> str:
        return "unused: the admin never runs tasks"

    return app


@pytest.fixture
def make_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make_ledger(**conf)``: a fresh ledger whose Celery app (``LEDGER_CELERY_APP``) has
    ``conf``; the admin's per-process page is made again for it."""
    for name in ("CELERY_LEDGER_URL", "CELERY_LEDGER_AUTHORIZER"):
        monkeypatch.delenv(name, raising=False)
    from celery_ledger.contrib.django import context

    made: list[Ledger] = []

    def make(**conf: Any) -> Ledger:
        url = f"sqlite:///{tmp_path}/ledger-{len(made)}.sqlite3"
        app = celery_app(url, **conf)
        monkeypatch.setattr(settings, "LEDGER_CELERY_APP", app, raising=False)
        monkeypatch.setattr(context, "_page", None)
        made.append(Ledger(url, app))
        return made[-1]

    yield make
    page = context._page
    if page is not None:
        page.store.dispose()
    for ledger in made:
        ledger.store.dispose()


def user(name: str, *, superuser: bool = False, perms: tuple[str, ...] = ()) -> Any:
    """A logged-in client of a staff user (a superuser, or with ``perms``)."""
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    u, _ = User.objects.get_or_create(username=name, defaults={"is_staff": True})
    u.is_staff, u.is_superuser = True, superuser
    u.set_password(PASSWORD)
    u.save()
    for codename in perms:
        u.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    assert client.login(username=name, password=PASSWORD)
    return client


def post(client: Any, key: str, action: str, **form: str) -> Any:
    return client.post(f"{LIST}{key}/{action}/", form)


def html(resp: Any) -> str:
    return str(resp.content.decode())


# -- who may see --------------------------------------------------------------------------------


def test_a_staff_user_needs_the_view_permission(make_ledger: Any) -> None:
    key = make_ledger().blocked()
    assert user("carl").get(LIST).status_code == 403
    assert user("carl").get(f"{LIST}{key}/").status_code == 403
    viewer = user("bob", perms=("view_ledgerentry",))
    assert viewer.get(LIST).status_code == 200
    assert viewer.get(f"{LIST}{key}/").status_code == 200
    # Django's own add and change forms do not exist here.
    assert viewer.get(f"{LIST}add/").status_code in (302, 404)
    from django.test import Client

    assert Client().get(LIST).status_code == 302  # the login page first


def test_the_entry_page_shows_steps_refs_events_and_no_secret(make_ledger: Any) -> None:
    ledger = make_ledger()
    key = ledger.blocked()
    page = html(user("ann", superuser=True).get(f"{LIST}{key}/"))
    assert 'id="entry-status">blocked<' in page
    assert 'data-step="charge" data-state="ambiguous"' in page
    assert "external ref <code>ch_1</code>" in page
    assert 'data-event="claimed"' in page and 'data-event="settled"' in page
    assert "--verified not-executed|completed" in page  # next_action's command
    assert "&quot;card_number&quot;: &quot;[redacted]&quot;" in page and CARD not in page
    assert user("ann", superuser=True).get(f"{LIST}{'0' * 64}/").status_code == 404


# -- who may act --------------------------------------------------------------------------------


def test_read_only_without_an_authorizer_even_for_a_superuser(make_ledger: Any) -> None:
    ledger = make_ledger()
    key = ledger.blocked()
    ann = user("ann", superuser=True)
    page = html(ann.get(f"{LIST}{key}/"))
    assert 'id="read-only-note"' in page and "<form" not in page.split('id="content-main"')[1]
    resp = post(ann, key, "release", verified="not-executed", reason="looked")
    assert resp.status_code == 403 and "Ledger actions are off" in html(resp)
    for action in ("resume", "mark-dead", "cancel"):
        assert post(ann, key, action, reason="r").status_code == 403
    entry = ledger.store.get_entry(key)
    assert entry.status is EntryStatus.BLOCKED and entry.released_by is None
    assert entry.dead_at is None and entry.cancel_requested_at is None


def test_the_authorizer_decides_with_the_django_user(make_ledger: Any) -> None:
    ledger = make_ledger(ledger_authorizer=SUPERUSER_ONLY)
    key = ledger.blocked()
    bob = user("bob", perms=("view_ledgerentry",))
    resp = post(bob, key, "release", verified="completed", result_json="null", reason="seen")
    assert resp.status_code == 403
    assert "not allowed: bob is not a superuser" in html(resp)
    assert ledger.store.get_entry(key).released_by is None

    ann = user("ann", superuser=True)
    resp = post(
        ann, key, "release", verified="completed", result_json='{"charged": true}', reason="seen"
    )
    assert resp.status_code == 302 and resp["Location"] == f"{LIST}{key}/"
    entry = ledger.store.get_entry(key)
    assert entry.status is EntryStatus.COMPLETED and entry.released_by == "ann"
    assert entry.result == '{"charged": true}'
    assert "Released as completed" in html(ann.get(resp["Location"]))
    # One-shot: the store refuses a second release; nothing changes.
    again = post(ann, key, "release", verified="not-executed", reason="again")
    assert again.status_code == 409 and "Nothing was changed" in html(again)


def test_an_action_without_djangos_csrf_token_is_refused(make_ledger: Any) -> None:
    ledger = make_ledger(ledger_authorizer=SUPERUSER_ONLY)
    key = ledger.blocked()
    ann = user("ann", superuser=True)
    ann.handler.enforce_csrf_checks = True
    resp = post(ann, key, "release", verified="not-executed", reason="r")
    assert resp.status_code == 403 and "CSRF" in html(resp)
    assert ledger.store.get_entry(key).released_by is None


def test_a_refused_input_changes_nothing(make_ledger: Any) -> None:
    ledger = make_ledger(ledger_authorizer=SUPERUSER_ONLY)
    key = ledger.blocked()
    ann = user("ann", superuser=True)
    no_reason = post(ann, key, "release", verified="not-executed", reason="  ")
    assert no_reason.status_code == 400 and "a reason is required" in html(no_reason)
    bad_json = post(ann, key, "release", verified="completed", result_json="{", reason="r")
    assert bad_json.status_code == 400 and "not valid JSON" in html(bad_json)
    assert post(ann, key, "explode", reason="r").status_code == 404
    assert ledger.store.get_entry(key).status is EntryStatus.BLOCKED


def test_resume_mark_dead_and_cancel_are_the_stores_calls(make_ledger: Any) -> None:
    ledger = make_ledger(ledger_authorizer=SUPERUSER_ONLY)
    ann = user("ann", superuser=True)
    interrupted = ledger.interrupted()
    resp = post(ann, interrupted, "resume", reason="worker is back")
    assert resp.status_code == 302
    entry = ledger.store.get_entry(interrupted)
    assert entry.status is EntryStatus.RUNNING and entry.owner == RESUME_OWNER
    assert "Re-enqueued" in html(ann.get(resp["Location"]))

    blocked = ledger.blocked()
    assert post(ann, blocked, "mark-dead", reason="VM destroyed").status_code == 302
    entry = ledger.store.get_entry(blocked)
    assert entry.dead_by == "ann" and entry.dead_reason == "VM destroyed"

    running = str(ledger.claim().key)
    resp = post(ann, running, "cancel", reason="customer withdrew")
    assert resp.status_code == 302
    entry = ledger.store.get_entry(running)
    assert entry.cancel_by == "ann" and entry.cancel_requested_at is not None
    assert "Cancellation recorded" in html(ann.get(resp["Location"]))


# -- the lists ----------------------------------------------------------------------------------


def keys_in(page: str) -> list[str]:
    return re.findall(r'class="entry-row" data-key="([0-9a-f]{64})"', page)


def test_status_filter_stuck_view_and_search(make_ledger: Any) -> None:
    ledger = make_ledger()
    blocked = ledger.blocked()
    interrupted = ledger.interrupted()
    member = ledger.claim(group_id="grp-7")
    ann = user("ann", superuser=True)
    assert set(keys_in(html(ann.get(LIST)))) == {blocked, interrupted, member.key}
    assert keys_in(html(ann.get(LIST, {"status": "blocked"}))) == [blocked]
    assert set(keys_in(html(ann.get(LIST, {"stuck": "1"})))) == {blocked, interrupted}
    stuck_blocked = html(ann.get(LIST, {"stuck": "1", "kind": "blocked"}))
    assert keys_in(stuck_blocked) == [blocked] and "Needs an operator" in stuck_blocked
    task_id = ledger.store.get_entry(interrupted).task_id
    assert keys_in(html(ann.get(LIST, {"q": task_id}))) == [interrupted]
    assert keys_in(html(ann.get(LIST, {"q": blocked[:12]}))) == [blocked]
    assert keys_in(html(ann.get(LIST, {"q": "grp-7"}))) == [member.key]
    assert keys_in(html(ann.get(LIST, {"q": "no-such-thing"}))) == []
    too_long = html(ann.get(LIST, {"q": "x" * 5000}))
    assert "at most" in too_long and keys_in(too_long) == []


# -- settings -----------------------------------------------------------------------------------


def test_settings_come_from_djangos_settings_through_the_celery_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_ledger.contrib.django import context

    for name in ("CELERY_LEDGER_URL", "CELERY_LEDGER_AUTHORIZER", "CELERY_LEDGER_MAX_RESUMES"):
        monkeypatch.delenv(name, raising=False)
    url = f"sqlite:///{tmp_path}/from-django.sqlite3"
    monkeypatch.setattr(settings, "CELERY_LEDGER_URL", url, raising=False)
    monkeypatch.setattr(settings, "CELERY_LEDGER_AUTHORIZER", SUPERUSER_ONLY, raising=False)
    monkeypatch.setattr(settings, "CELERY_LEDGER_MAX_RESUMES", 2, raising=False)
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    monkeypatch.setattr(settings, "LEDGER_CELERY_APP", app, raising=False)
    monkeypatch.setattr(context, "_page", None)
    page = context.ledger_page()
    try:
        assert page.settings.url == url and page.settings.max_resumes == 2
        assert context.actions_enabled(page) and page.settings.authorizer == SUPERUSER_ONLY
        assert page.cli_prefix == "celery -A proj ledger"
        # An environment variable overrides the Django setting, as everywhere (read when a
        # process first asks an app for its settings: a new app here).
        monkeypatch.setenv("CELERY_LEDGER_MAX_RESUMES", "7")
        fresh = Celery("proj", set_as_current=False)
        fresh.config_from_object("django.conf:settings", namespace="CELERY")
        monkeypatch.setattr(settings, "LEDGER_CELERY_APP", fresh)
        monkeypatch.setattr(context, "_page", None)
        again = context.ledger_page()
        assert again.settings.max_resumes == 7
        again.store.dispose()
    finally:
        page.store.dispose()


def test_an_app_that_does_not_import_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from celery_ledger.contrib.django import context

    monkeypatch.setattr(settings, "LEDGER_CELERY_APP", "no_such_module:app", raising=False)
    monkeypatch.setattr(context, "_page", None)
    with pytest.raises(ImproperlyConfigured, match="LEDGER_CELERY_APP"):
        context.ledger_page()


def test_the_apps_migration_creates_no_table_and_matches_the_model() -> None:
    """The ledger's tables are Alembic's: the one migration is Django's record of the
    unmanaged model, and ``makemigrations`` finds nothing to add to it."""
    from django.core.management import call_command

    sql = io.StringIO()
    call_command("sqlmigrate", "celery_ledger", "0001", stdout=sql)
    assert "(no-op)" in sql.getvalue() and "CREATE TABLE" not in sql.getvalue()
    call_command("makemigrations", "celery_ledger", check=True, dry_run=True, verbosity=0)
