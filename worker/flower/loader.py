"""The Ledger page's template loader: Flower's templates, patched, and the page's own.

A tornado ``template.Loader`` that serves Flower's own templates with the page's insertions (a
"Ledger" tab in Flower's navbar, a "Ledger entry" link on Flower's task page, the ledger's
filter buttons and badges on its task list: ``PATCHES``), and the page's templates under
``ledger/``, which extend Flower's ``base.html``. ``hook`` installs it as Flower's
``template_loader``; every page handler (``handlers.LedgerHandler``) renders with it. It is a
module of its own so that ``handlers`` need not import ``hook`` (which imports ``handlers`` for
the routes): a cycle that an import inside ``hook.routes`` once hid.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from tornado import template

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


def flower_templates() -> str:
    import flower

    return os.path.join(os.path.dirname(flower.__file__), "templates")
