"""The Celery app, ledger settings and store the admin uses: made once per process.

**Which settings.** The admin reads the ledger settings of the project's Celery app,
``LedgerSettings.from_app(app)``, exactly as its workers, beat, Flower and the CLI do. With
Celery's Django setup (``app.config_from_object("django.conf:settings", namespace="CELERY")``)
that is Django's settings module: ``CELERY_LEDGER_URL``, ``CELERY_LEDGER_AUTHORIZER``,
``CELERY_LEDGER_REDACT`` ... beside ``CELERY_BROKER_URL``; a ``CELERY_LEDGER_*`` environment
variable overrides one, as everywhere. Reading them through the app rather than from
``django.conf.settings`` directly keeps one source of truth: whatever namespace (or none) the
app was configured with, the admin and the workers cannot disagree about which ledger, which
redactions, which authorizer.

**Which app.** ``LEDGER_CELERY_APP`` in Django's settings (``"proj.celery:app"``, or the app
itself), else ``celery.current_app``: the app ``proj/__init__.py`` imports in Celery's Django
layout. The app also sends what a release or resume re-enqueues, over its broker.

**Read-only unless an authorizer is set.** Flower's page is read-only until
``ledger_flower_actions`` is switched on, and then lets every user Flower authenticated act.
In Django every staff user is authenticated, and many are not operators: so here the switch
is ``ledger_authorizer`` itself. Without one the admin shows no action and refuses every
POST; with one, each action is what it answers for ``Operator(username, "django", True,
user=request.user)``.
"""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from celery_ledger.flower.context import LedgerPage

_lock = threading.Lock()
_page: LedgerPage | None = None


def celery_app() -> Any:
    """The project's Celery app (``LEDGER_CELERY_APP``, else ``celery.current_app``).

    Raises:
        ImproperlyConfigured: ``LEDGER_CELERY_APP`` does not import.
    """
    spec = getattr(django_settings, "LEDGER_CELERY_APP", None)
    if spec is None:
        from celery import current_app

        return current_app._get_current_object()
    if not isinstance(spec, str):
        return spec
    try:
        return import_string(spec.replace(":", "."))
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"LEDGER_CELERY_APP={spec!r} cannot be imported: {exc}"
        ) from None


def ledger_page() -> LedgerPage:
    """This process's settings, store and Celery app, made on first use.

    Raises:
        ImproperlyConfigured: the app's ledger settings do not parse.
    """
    global _page
    with _lock:
        if _page is None:
            app = celery_app()
            prefix = f"celery -A {app.main} ledger" if app.main else "celery-ledger"
            try:
                _page = LedgerPage(app, cli_prefix=prefix)
            except ValueError as exc:
                raise ImproperlyConfigured(f"celery-ledger settings: {exc}") from None
        return _page


def actions_enabled(page: LedgerPage) -> bool:
    """Whether the admin offers actions: only with ``ledger_authorizer`` set."""
    return page.settings.authorizer is not None
