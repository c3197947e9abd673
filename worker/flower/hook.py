"""How the Ledger page gets into Flower: before Flower builds its app, from its ``--conf`` file.

``celery flower --conf=flowerconfig.py`` executes the conf file inside ``apply_options``,
before ``Flower(capp=app, options=options, **settings)`` is built (``flower/command.py``).
At that moment Flower's route table (``flower.urls.handlers``) and application settings
(``flower.urls.settings``) are plain module-level objects, and ``Flower.__init__`` reads them
(``flower/app.py``: ``handlers = default_handlers``, prefixed by ``--url_prefix``). So
``install_in_flower()`` does two things there:

1. it inserts the page's routes into ``flower.urls.handlers``, ahead of Flower's catch-all
   404 route; Flower then serves them on its own port, prefixes them with its
   ``--url_prefix`` like its own routes, and each handler is a ``flower.views.BaseHandler``,
   so Flower's own authentication (``--basic-auth``, ``--auth`` OAuth, ``--auth_provider``)
   guards them exactly as it guards ``/tasks``;
2. it sets ``settings["template_loader"]`` (a tornado setting Flower leaves unset) to a loader
   (``celery_ledger.flower.loader``) that serves Flower's own templates, with two small
   insertions: a "Ledger" tab in Flower's navbar and a "Ledger entry" link on Flower's task
   page. The page's templates extend Flower's ``base.html``, so they carry Flower's CSS,
   scripts, theme and navbar.

An insertion whose anchor is not found in Flower's template (a Flower release that changed
its markup) is skipped with a warning: Flower's page renders untouched and the Ledger page is
still at ``/ledger``.

3. it makes Flower read the ledger's events as the ledger means them (``states.install()``:
   Flower's ``EventsState`` is replaced by a subclass, the one Flower class the page replaces,
   because Flower has no hook between an event and its task list). Nothing else of Flower is
   subclassed or monkeypatched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tornado.web import url

from celery_ledger.flower import handlers as pages
from celery_ledger.flower.loader import LedgerTemplateLoader, flower_templates

log = logging.getLogger(__name__)


def routes() -> list[Any]:
    """The page's routes, as ``tornado.web.url`` so Flower's ``reverse_url`` finds them."""
    key = r"([0-9a-f]{64})"
    return [
        url(r"/ledger", pages.OverviewHandler, name="ledger"),
        url(r"/ledger/stuck", pages.StuckHandler, name="ledger-stuck"),
        url(r"/ledger/find", pages.FindHandler, name="ledger-find"),
        url(r"/ledger/task/(.+)", pages.TaskHandler, name="ledger-task"),
        url(rf"/ledger/entry/{key}", pages.EntryHandler, name="ledger-entry"),
        url(rf"/ledger/entry/{key}/release", pages.ReleaseHandler, name="ledger-release"),
        url(rf"/ledger/entry/{key}/resume", pages.ResumeHandler, name="ledger-resume"),
        url(rf"/ledger/entry/{key}/mark-dead", pages.MarkDeadHandler, name="ledger-mark-dead"),
        url(rf"/ledger/entry/{key}/cancel", pages.CancelHandler, name="ledger-cancel"),
        url(rf"/ledger/entry/{key}/signal", pages.SignalHandler, name="ledger-signal"),
        url(rf"/ledger/entry/{key}/outbox", pages.OutboxHandler, name="ledger-outbox"),
    ]


def install_in_flower(
    handlers: list[Any] | None = None, settings: dict[str, Any] | None = None
) -> None:
    """Add the Ledger page to the Flower app about to be built. Idempotent.

    Call it from Flower's ``--conf`` file (the shipped ``flowerconfig.py`` does)::

        from celery_ledger.flower import install_in_flower; install_in_flower()

    ``handlers`` and ``settings`` default to ``flower.urls.handlers`` and
    ``flower.urls.settings``, the objects ``celery flower`` builds its app from.
    """
    if handlers is None or settings is None:
        from flower import urls

        handlers = urls.handlers if handlers is None else handlers
        settings = urls.settings if settings is None else settings
    if any(getattr(h, "name", None) == "ledger" for h in handlers):
        return
    # Ahead of Flower's catch-all ``(r".*", NotFoundErrorHandler)``, which would answer first.
    at = next((i for i, h in enumerate(handlers) if _pattern(h) in (r".*", "/.*")), len(handlers))
    handlers[at:at] = routes()
    settings["template_loader"] = LedgerTemplateLoader(
        os.fspath(settings.get("template_path") or flower_templates())
    )
    from celery_ledger.flower import context

    try:
        from celery_ledger.flower import states

        states.install()
    except Exception as exc:  # noqa: BLE001 - a Flower that changed: its task list as it is
        log.warning(
            "celery-ledger: Flower's task list keeps Celery's literal reading of the ledger's "
            "events (%r); the Ledger page is unaffected",
            exc,
        )
    context.cli_prefix = _cli_prefix()
    log.info("celery-ledger: Ledger page installed in Flower at /ledger")


def _pattern(handler: Any) -> str:
    if isinstance(handler, (tuple, list)):
        return str(handler[0])
    regex = getattr(handler, "regex", None)
    return regex.pattern.rstrip("$") if regex is not None else ""


def _cli_prefix() -> str:
    """``celery -A proj ledger`` when Flower runs as ``celery -A proj flower``."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        app = ctx.find_root().params.get("app")
        if app:
            return f"celery -A {app} ledger"
    return "celery-ledger"
