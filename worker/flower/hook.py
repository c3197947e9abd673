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
   that serves Flower's own templates, with two small insertions: a "Ledger" tab in Flower's
   navbar and a "Ledger entry" link on Flower's task page. The page's templates extend
   Flower's ``base.html``, so they carry Flower's CSS, scripts, theme and navbar.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tornado import template
from tornado.web import url

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).parent / "templates"
#: Template names under this prefix are the page's own; every other name is Flower's.
OWN_PREFIX = "ledger/"

_NAV_ANCHOR = "</ul>"
# The count beside "Ledger" is the entries blocked now (an operator decides them), on every
# Flower page, the dashboard included; cached and refreshed off the request
# (``context.BlockedCount``).
_NAV_ITEM = """
        {% import celery_ledger.flower.context %}
        {% set ledger_blocked = celery_ledger.flower.context.blocked_for_nav(handler) %}
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'ledger' %} active{% end %}"
            href="{{ reverse_url('ledger') }}"
            {% if active_tab == 'ledger' %}aria-current="page"{% end %}
            >Ledger{% if ledger_blocked %} <span class="badge text-bg-warning"
              id="ledger-nav-blocked" title="blocked entries: an operator decides"
              >{{ ledger_blocked }}</span>{% end %}</a>
        </li>
      """
_TASK_ANCHOR = '<div class="detail-actions">'
_TASK_LINK = """
      <a class="btn btn-outline-secondary" id="ledger-entry-link"
         href="{{ reverse_url('ledger-task', task.uuid) }}?name={{ url_escape(task.name or '') }}"
         >Ledger entry</a>"""


def _insert_before(anchor: str, snippet: str) -> Callable[[str, str], str]:
    def patch(name: str, source: str) -> str:
        if anchor not in source:
            log.warning("celery-ledger: %s has no %r; its Ledger link is left out", name, anchor)
            return source
        return source.replace(anchor, snippet + anchor, 1)

    return patch


def _insert_after(anchor: str, snippet: str) -> Callable[[str, str], str]:
    def patch(name: str, source: str) -> str:
        if anchor not in source:
            log.warning("celery-ledger: %s has no %r; its Ledger link is left out", name, anchor)
            return source
        return source.replace(anchor, anchor + snippet, 1)

    return patch


_TASKS_FILTER_ANCHOR = '<button class="task-state-filter" type="button" data-task-state="RETRY"'
_TASKS_FILTER = """<button class="task-state-filter" type="button" data-task-state="LEDGER-BLOCKED"
      aria-pressed="false" title="blocked by the ledger: an operator decides">Blocked</button>
    <button class="task-state-filter" type="button" data-task-state="LEDGER-INTERRUPTED"
      aria-pressed="false"
      title="its worker was lost mid-body: the redelivery or the sweep resumes it"
      >Interrupted</button>
    """
_TASKS_TABLE_ANCHOR = "</table>"
# After each draw of Flower's task list, a badge beside the state says what the ledger did to
# the task (its ``ledger`` field, ``celery_ledger.flower.states``): resumed, replayed, fenced...
# Text only (textContent), so nothing from an event becomes markup.
_TASKS_BADGES = """</table>
    <script>
    document.addEventListener("DOMContentLoaded", function () {
      var SHOWN = ["resumed", "replayed", "fenced", "returned", "waited", "interrupted",
                   "conflict", "reconciled", "released", "marked-dead"];
      // Not failures, but stuck until someone (an operator, the sweep) acts.
      var NEEDS_EYES = ["LEDGER-BLOCKED", "LEDGER-INTERRUPTED"];
      jQuery(document).on("draw.dt", "#tasks-table", function () {
        jQuery("#tasks-table").DataTable().rows({page: "current"}).every(function () {
          var marks = (this.data().ledger || []).filter(function (m) {
            return SHOWN.indexOf(m) >= 0;
          });
          var badge = this.node() && this.node().querySelector(".badge");
          if (!badge) return;
          if (NEEDS_EYES.indexOf(this.data().state) >= 0) {
            badge.classList.remove("text-bg-secondary");
            badge.classList.add("text-bg-warning");
          }
          if (!marks.length || badge.parentNode.querySelector(".ledger-marks")) return;
          var extra = document.createElement("span");
          extra.className = "badge text-bg-info ms-1 ledger-marks";
          extra.title = "what the ledger did to this task";
          extra.textContent = marks.join(", ");
          badge.parentNode.appendChild(extra);
        });
      });
    });
    </script>"""


def _replace_first(anchor: str, replacement: str) -> Callable[[str, str], str]:
    def patch(name: str, source: str) -> str:
        if anchor not in source:
            log.warning("celery-ledger: %s has no %r; its ledger badges are left out", name, anchor)
            return source
        return source.replace(anchor, replacement, 1)

    return patch


def _both(*patches: Callable[[str, str], str]) -> Callable[[str, str], str]:
    def patch(name: str, source: str) -> str:
        for one in patches:
            source = one(name, source)
        return source

    return patch


#: Flower template -> what the page adds to it.
PATCHES: dict[str, Callable[[str, str], str]] = {
    "navbar.html": _insert_before(_NAV_ANCHOR, _NAV_ITEM),
    "task.html": _insert_after(_TASK_ANCHOR, _TASK_LINK),
    "tasks.html": _both(
        _insert_before(_TASKS_FILTER_ANCHOR, _TASKS_FILTER),
        _replace_first(_TASKS_TABLE_ANCHOR, _TASKS_BADGES),
    ),
}


class LedgerTemplateLoader(template.Loader):
    """Flower's templates (patched as above) plus the page's own under ``ledger/``."""

    def resolve_path(self, name: str, parent_path: str | None = None) -> str:
        # Names are absolute in this loader: ``{% extends "base.html" %}`` from
        # ``ledger/entry.html`` means Flower's base.html, not ``ledger/base.html``.
        return name

    def _create_template(self, name: str) -> template.Template:
        path = TEMPLATES / name if name.startswith(OWN_PREFIX) else Path(self.root) / name
        source = path.read_text(encoding="utf-8")
        patch = PATCHES.get(name)
        if patch is not None:
            source = patch(name, source)
        return template.Template(source, name=name, loader=self)


def routes() -> list[Any]:
    """The page's routes, as ``tornado.web.url`` so Flower's ``reverse_url`` finds them."""
    from celery_ledger.flower import handlers as h

    key = r"([0-9a-f]{64})"
    return [
        url(r"/ledger", h.OverviewHandler, name="ledger"),
        url(r"/ledger/stuck", h.StuckHandler, name="ledger-stuck"),
        url(r"/ledger/find", h.FindHandler, name="ledger-find"),
        url(r"/ledger/task/(.+)", h.TaskHandler, name="ledger-task"),
        url(rf"/ledger/entry/{key}", h.EntryHandler, name="ledger-entry"),
        url(rf"/ledger/entry/{key}/release", h.ReleaseHandler, name="ledger-release"),
        url(rf"/ledger/entry/{key}/resume", h.ResumeHandler, name="ledger-resume"),
        url(rf"/ledger/entry/{key}/mark-dead", h.MarkDeadHandler, name="ledger-mark-dead"),
        url(rf"/ledger/entry/{key}/cancel", h.CancelHandler, name="ledger-cancel"),
        url(rf"/ledger/entry/{key}/outbox", h.OutboxHandler, name="ledger-outbox"),
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


def flower_templates() -> str:
    import flower

    return os.path.join(os.path.dirname(flower.__file__), "templates")
