"""Ledger entries in the Django admin: the lists, the entry page and its actions.

A ``ModelAdmin`` for the unmanaged ``LedgerEntry`` whose views read and write through the
store, not the ORM (``celery_ledger.contrib.django.models`` says why). What each page shows is
the operator view the CLI and Flower render: a row's next action is ``next_action``, the
stuck list is Flower's (``flower.views.stuck``, one index range per kind, keyset-paged), and
the entry page is ``flower.views.entry``, built from ``entry_detail`` with its secrets
redacted. An action is Flower's (``flower.actions``): every check before the one write,
``ledger_authorizer`` asked last with the Django user, the store's refusals shown as they are.

Django's admin supplies the login, the staff check, CSRF and the look; ``view_ledgerentry``
(or a superuser) is needed to see the pages; acting needs an authorizer (``context``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.http import urlencode
from sqlalchemy import exc as sa_exc

from celery_ledger.authorize import Operator
from celery_ledger.contrib.django.context import actions_enabled, ledger_page
from celery_ledger.contrib.django.models import LedgerEntry
from celery_ledger.errors import AuthorizerError
from celery_ledger.flower import actions, views
from celery_ledger.flower import queries as q
from celery_ledger.flower.context import LedgerPage
from celery_ledger.ledger import (
    Entry,
    EntryNotFound,
    EntryStatus,
    LedgerError,
    ReferenceTooLong,
)
from celery_ledger.view import duration, next_action, timestamp

log = logging.getLogger(__name__)

#: Rows of a list: the newest of a status, one page of the stuck list, or a search's matches.
PAGE_SIZE = 50

#: The actions the entry page posts (``<key>/<action>/``); outbox drop and repair stay with
#: the CLI and Flower's page.
ACTIONS = ("release", "resume", "mark-dead", "cancel")

#: How the entry page's note names this front end when a task is unknown to its app.
_WHERE = "Django process"
_FIX = "Set LEDGER_CELERY_APP to the Celery app that defines it."


def _operator(request: HttpRequest) -> Operator:
    """The Django user as the operator: authenticated by Django's login, stamped by username."""
    user = request.user
    return Operator(user.get_username(), "django", True, user=user)


class LedgerEntryAdmin(admin.ModelAdmin):
    """The ledger's pages under ``/admin/celery_ledger/ledgerentry/``."""

    # -- what Django's admin may do with the model: look only -----------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Django's change form would save through the ORM; the entry page acts through the
        # store instead, and only as the authorizer allows.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.list_view), name="{}_{}_changelist".format(*info)),
            path("<str:key>/", wrap(self.entry_page), name="{}_{}_change".format(*info)),
            path(
                "<str:key>/<str:action>/",
                wrap(self.action_view),
                name="{}_{}_action".format(*info),
            ),
        ]

    # -- helpers ----------------------------------------------------------------------------

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": True,
            **extra,
        }

    def _page(self, request: HttpRequest) -> LedgerPage:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return ledger_page()

    def _unavailable(self, request: HttpRequest, exc: Exception) -> TemplateResponse:
        log.warning("celery-ledger admin: ledger unavailable: %s", exc)
        return TemplateResponse(
            request,
            "celery_ledger/admin/unavailable.html",
            self._context(
                request,
                "Ledger unavailable",
                error=" ".join(str(exc).split())[:300],
            ),
            status=503,
        )

    # -- the lists --------------------------------------------------------------------------

    def list_view(self, request: HttpRequest) -> HttpResponse:
        """``?status=``: the newest entries of a status; ``?stuck=1`` (with ``kind=``): what
        waits for an operator or the sweep; ``?q=``: a key, key prefix, task id or group id."""
        page = self._page(request)
        ref = request.GET.get("q", "").strip()
        status = request.GET.get("status", "")
        stuck = request.GET.get("stuck", "") == "1"
        kinds = tuple(k for k in request.GET.getlist("kind") if k in q.KINDS_BY_NAME)
        errors: list[str] = []
        more: str | None = None
        try:
            if ref:
                rows = self._search(page, ref)
            elif stuck:
                rows, more = self._stuck(page, request, kinds, errors)
            else:
                chosen = [status] if status in {s.value for s in EntryStatus} else None
                found = page.store.list_entries(statuses=chosen, limit=PAGE_SIZE)
                now = page.store.now()
                rows = [self._row(page, e, now) for e in found]
        except ReferenceTooLong as exc:
            rows, errors = [], [str(exc)]
        except (LedgerError, sa_exc.SQLAlchemyError) as exc:
            return self._unavailable(request, exc)
        here = reverse("admin:celery_ledger_ledgerentry_changelist")
        filters = [("All", here, not (status or stuck or ref))]
        filters.append(("Stuck", f"{here}?stuck=1", stuck and not kinds))
        filters += [
            (
                f"Stuck: {k.label}",
                f"{here}?{urlencode({'stuck': 1, 'kind': k.name})}",
                kinds == (k.name,),
            )
            for k in q.STUCK_KINDS
        ]
        filters += [
            (s.value, f"{here}?{urlencode({'status': s.value})}", status == s.value and not stuck)
            for s in EntryStatus
        ]
        title = (
            "Stuck ledger entries" if stuck else f"Ledger entries{f': {status}' if status else ''}"
        )
        return TemplateResponse(
            request,
            "celery_ledger/admin/entry_list.html",
            self._context(
                request,
                title,
                rows=rows,
                filters=filters,
                search=ref,
                errors=errors,
                more=more,
                stuck=stuck,
                actions_enabled=actions_enabled(page),
                page_size=PAGE_SIZE,
            ),
        )

    def _row(self, page: LedgerPage, e: Entry, now: float) -> dict[str, Any]:
        nxt = next_action(e, now, page.cli_prefix)
        return {
            "key": e.key,
            "task": e.task_name,
            "task_id": e.task_id,
            "status": e.status.value,
            "kind": "",
            "age": duration(now - e.updated_at),
            "reason": views.scrubbed(page, e).text(e.reason) or "",
            "hint": nxt.hint,
            "command": nxt.command,
        }

    def _stuck(
        self, page: LedgerPage, request: HttpRequest, kinds: tuple[str, ...], errors: list[str]
    ) -> tuple[list[dict[str, Any]], str | None]:
        after = None
        if request.GET.get("after"):
            try:
                after = q.Cursor.parse(request.GET["after"])
            except ValueError:
                errors.append("that page position is not valid; showing the first page")
        model = views.stuck(
            page, q.StuckFilter(kinds=kinds), limit=PAGE_SIZE, after=after, before=None
        )
        rows = [
            {
                "key": r.key,
                "task": r.task_name,
                "task_id": r.task_id,
                "status": r.status,
                "kind": r.kind_label,
                "age": r.age,
                "reason": r.reason,
                "hint": r.action.hint,
                "command": r.action.command,
            }
            for r in model["rows"]
        ]
        more = None
        if model["next"] is not None:
            params = [("stuck", "1"), *(("kind", k) for k in kinds), ("after", model["next"].token)]
            more = "?" + urlencode(params)
        return rows, more

    def _search(self, page: LedgerPage, ref: str) -> list[dict[str, Any]]:
        """A whole key (its primary key), else a key prefix or task id (``find_keys``), and the
        members of a group or of a parent task with that id (``store.members``)."""
        store = page.store
        keys: list[str] = []
        if re.fullmatch(r"[0-9a-f]{64}", ref):
            keys = [ref]
        else:
            keys = store.find_keys(ref, limit=PAGE_SIZE)
            keys += [m.key for m in store.members(ref)]
        found: list[Entry] = []
        for key in dict.fromkeys(keys[:PAGE_SIZE]):
            try:
                found.append(store.get_entry(key))
            except EntryNotFound:
                continue
        now = store.now()
        return [self._row(page, e, now) for e in found]

    # -- one entry ----------------------------------------------------------------------------

    def entry_page(
        self,
        request: HttpRequest,
        key: str,
        *,
        error: str | None = None,
        status: int = 200,
    ) -> HttpResponse:
        page = self._page(request)
        try:
            view = views.entry(page, key, where=_WHERE, fix=_FIX)
        except EntryNotFound:
            raise Http404(f"no ledger entry with key {key}") from None
        except (LedgerError, sa_exc.SQLAlchemyError) as exc:
            return self._unavailable(request, exc)
        e = view.entry
        now = view.now
        lease = "-"
        if view.lease_left is not None:
            lease = (
                f"{duration(view.lease_left)} left"
                if view.lease_left > 0
                else f"expired {duration(-view.lease_left)} ago"
            )
        s = page.settings
        alive = e.seen_alive_at is not None and now - e.seen_alive_at < s.death_grace_seconds
        form = request.POST if request.method == "POST" else {}
        return TemplateResponse(
            request,
            "celery_ledger/admin/entry.html",
            self._context(
                request,
                f"{e.task_name} {e.key[:8]}",
                view=view,
                e=e,
                lease=lease,
                created=timestamp(e.created_at),
                updated=f"{timestamp(e.updated_at)} ({duration(now - e.updated_at)} ago)",
                settled=timestamp(e.settled_at) if e.settled_at else None,
                released_at=timestamp(e.released_at),
                dead_at=timestamp(e.dead_at),
                seen_alive=(
                    None
                    if e.seen_alive_at is None
                    else f"{timestamp(e.seen_alive_at)} ({duration(now - e.seen_alive_at)} ago)"
                ),
                seen_alive_recent=alive,
                steps=[
                    {
                        "s": st,
                        "started": timestamp(st.started_at),
                        "completed": timestamp(st.completed_at) if st.completed_at else None,
                    }
                    for st in view.steps
                ],
                events=[{"ev": ev, "at": timestamp(ev.at)} for ev in view.events],
                actions_enabled=actions_enabled(page),
                offer_mark_dead=e.status is not EntryStatus.COMPLETED,
                offer_cancel=not e.status.settled,
                death_gate=s.release_requires_death_signal and e.dead_at is None,
                grace=int(s.death_grace_seconds),
                default_verdict="completed" if view.release_warning else "not-executed",
                form=form,
                error=error,
                changelist=reverse("admin:celery_ledger_ledgerentry_changelist"),
            ),
            status=status,
        )

    # -- actions ------------------------------------------------------------------------------

    def action_view(self, request: HttpRequest, key: str, action: str) -> HttpResponse:
        """POST release | resume | mark-dead | cancel: refused unless an authorizer is set,
        then exactly Flower's action; its refusal is shown on the entry page."""
        page = self._page(request)
        if action not in ACTIONS:
            raise Http404(f"no ledger action {action!r}")
        if request.method != "POST":
            return HttpResponseRedirect(
                reverse("admin:celery_ledger_ledgerentry_change", args=[key])
            )
        if not actions_enabled(page):
            return self.entry_page(
                request,
                key,
                error=(
                    "Ledger actions are off: the admin is read-only until "
                    "CELERY_LEDGER_AUTHORIZER (ledger_authorizer) names who may act"
                ),
                status=403,
            )
        operator = _operator(request)
        post = request.POST
        try:
            if action == "release":
                done = actions.release(
                    page,
                    key,
                    operator=operator,
                    verdict_raw=post.get("verified"),
                    reason_raw=post.get("reason"),
                    result_raw=post.get("result_json"),
                )
                code = "released-completed" if done.resume is None else f"released-{done.resume}"
            elif action == "resume":
                outcome = actions.resume(
                    page, key, operator=operator, reason_raw=post.get("reason")
                )
                code = "resumed" if outcome == "resumed" else f"resume-{outcome}"
            elif action == "mark-dead":
                actions.mark_dead(
                    page,
                    key,
                    operator=operator,
                    reason_raw=post.get("reason"),
                    override=post.get("override_heartbeat", "") == "on",
                )
                code = "marked-dead"
            else:
                code = "cancel-" + actions.cancel(
                    page, key, operator=operator, reason_raw=post.get("reason")
                )
        except actions.ActionRefused as exc:
            return self.entry_page(request, key, error=str(exc), status=exc.status)
        except AuthorizerError as exc:
            return self.entry_page(request, key, error=str(exc), status=500)
        except EntryNotFound:
            raise Http404(f"no ledger entry with key {key}") from None
        except (LedgerError, sa_exc.SQLAlchemyError) as exc:
            return self._unavailable(request, exc)
        messages.success(request, actions.DONE.get(code, code))
        return HttpResponseRedirect(reverse("admin:celery_ledger_ledgerentry_change", args=[key]))


admin.site.register(LedgerEntry, LedgerEntryAdmin)
