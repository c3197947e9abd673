"""The Ledger page's Tornado handlers, served by Flower (``celery_ledger.flower.hook``).

Each handler is a ``flower.views.BaseHandler``: Flower's own authentication decides who
gets in (``@web.authenticated`` with ``--basic-auth``, or the OAuth user of ``--auth``), and
Flower's ``render`` supplies its template helpers and URL prefix. Database work runs in
Flower's executor, never on the event loop that also receives Celery's events; only the
rendering and Flower's own in-memory event state are touched on the loop.

Actions (POST) are refused unless ``ledger_flower_actions`` is on and Flower is not
``--read_only``; every POST must carry Tornado's XSRF token (the ``_xsrf`` form field that
matches the ``_xsrf`` cookie), whatever Flower's own authentication mode.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlencode

import tornado.web
from flower.views import BaseHandler
from sqlalchemy import exc as sa_exc
from tornado import web
from tornado.ioloop import IOLoop

from celery_ledger.authorize import AuthorizerError, Operator
from celery_ledger.flower import actions, views
from celery_ledger.flower import queries as q
from celery_ledger.flower.context import LedgerPage, page_for
from celery_ledger.flower.loader import TEMPLATES, LedgerTemplateLoader, flower_templates
from celery_ledger.ledger import EntryNotFound, LedgerError, ReferenceTooLong, entry_key
from celery_ledger.outbox import KEPT_OPTIONS
from celery_ledger.view import duration, parse_duration, timestamp

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Rows per page of the stuck list: the default, and the most a request may ask for.
PAGE_SIZE = 50
MAX_PAGE_SIZE = 200

#: What the entry page says after a successful action (``actions.DONE``).
DONE = actions.DONE

_STATUS_BADGES = {
    "running": "text-bg-info",
    "completed": "text-bg-success",
    "failed": "text-bg-danger",
    "retrying": "text-bg-warning",
    "interrupted": "text-bg-warning",
    "blocked": "text-bg-danger",
    "scheduled": "text-bg-primary",
    "sleeping": "text-bg-primary",
    "cancelled": "text-bg-dark",
    "expired": "text-bg-dark",
}


def status_badge(status: str | None) -> str:
    return _STATUS_BADGES.get(status or "", "text-bg-secondary")


class LedgerHandler(BaseHandler):
    """What every Ledger page shares: its templates, its store, errors, the operator."""

    def get_template_path(self) -> str:
        # A cache key of its own: tornado caches loaders per template path, and this one
        # must be the loader that also serves the page's templates.
        return str(TEMPLATES)

    def create_template_loader(self, template_path: str) -> LedgerTemplateLoader:
        return LedgerTemplateLoader(str(self.settings.get("template_path") or flower_templates()))

    @property
    def page(self) -> LedgerPage:
        try:
            return page_for(self.application)
        except ValueError as exc:
            raise web.HTTPError(500, f"celery-ledger settings: {exc}") from None

    @property
    def actions_enabled(self) -> bool:
        return bool(self.page.settings.flower_actions) and not self.application.options.read_only

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in Flower's executor, turning a ledger outage into a 503."""
        try:
            return await IOLoop.current().run_in_executor(self.application.executor, fn, *args)
        except EntryNotFound as exc:
            raise web.HTTPError(404, str(exc)) from None
        except ReferenceTooLong as exc:  # bad input, not an outage
            raise web.HTTPError(400, str(exc)) from None
        except (LedgerError, sa_exc.SQLAlchemyError) as exc:
            log.warning("celery-ledger page: ledger unavailable: %s", exc)
            raise web.HTTPError(
                503, f"the ledger cannot be read: {' '.join(str(exc).split())[:300]}"
            ) from None

    def render_ledger(self, template: str, **kwargs: Any) -> None:
        self.render(
            f"ledger/{template}",
            actions_enabled=self.actions_enabled,
            status_badge=status_badge,
            ago=duration,
            utc=timestamp,
            cli_prefix=self.page.cli_prefix,
            **kwargs,
        )

    def operator(self) -> Operator | None:
        """The user Flower authenticated, or None when Flower authenticates nobody."""
        opts = self.application.options
        user = self.current_user
        if opts.auth and isinstance(user, str) and user:
            return Operator(user, "flower", True)
        if opts.basic_auth:
            # get_current_user() has checked the credentials; it returns True, not a name.
            header = self.request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme == "Basic":
                try:
                    name = base64.b64decode(token).decode().partition(":")[0]
                except (ValueError, UnicodeDecodeError):
                    return None
                if name:
                    return Operator(name, "flower", True)
        return None


class OverviewHandler(LedgerHandler):
    @web.authenticated
    async def get(self) -> None:
        page = self.page
        cache = page.aggregates
        if cache.empty and cache.claim_refresh():
            await self.blocking(cache.refresh)
        elif cache.claim_refresh():
            # Stale: serve what we have, refresh off the request.
            IOLoop.current().run_in_executor(self.application.executor, cache.refresh)
        model = await self.blocking(views.overview, page, cache.current())
        self.render_ledger("overview.html", sweep=self._next_sweep(model["now"]), **model)

    def _next_sweep(self, now: float) -> dict[str, Any]:
        """When the next sweep runs, from the last sweep Flower saw (its events)."""
        from celery_ledger.app import SWEEP_TASK

        interval = self.page.settings.sweep_interval
        seen: float | None = None
        state = getattr(self.application.events, "state", None)
        last = getattr(state, "last_sweep", None)  # celery_ledger.flower.states
        if last is not None and last.get("timestamp"):
            seen = float(last["timestamp"])
        tasks = state.tasks_by_type.get(SWEEP_TASK) if state is not None else None
        for task in list(tasks or ()):
            at = task.received or task.started or task.timestamp
            if at and (seen is None or at > seen):
                seen = float(at)
        if seen is None:
            return {"interval": interval, "last": None, "next_in": None}
        # Flower's clock, not the database's: both are wall clocks, off by at most their skew.
        elapsed = time.time() - seen
        return {"interval": interval, "last": elapsed, "next_in": interval - elapsed}


def _parse_filter(handler: LedgerHandler) -> tuple[q.StuckFilter, list[str]]:
    """The stuck list's filters from the query string, and what was wrong with them."""
    errors = []
    kinds = tuple(k for k in handler.get_query_arguments("kind") if k in q.KINDS_BY_NAME)
    task = handler.get_query_argument("task", "").strip() or None
    min_age = None
    raw_age = handler.get_query_argument("age", "").strip()
    if raw_age:
        try:
            min_age = parse_duration(raw_age)
        except ValueError:  # its wording names the CLI's --since
            errors.append(f"age {raw_age!r}: give seconds or a duration like 30s, 10m, 2h, 1d")
    return q.StuckFilter(kinds=kinds, task=task, min_age=min_age), errors


class StuckHandler(LedgerHandler):
    @web.authenticated
    async def get(self) -> None:
        flt, errors = _parse_filter(self)
        try:
            limit = int(self.get_query_argument("limit", str(PAGE_SIZE)))
        except ValueError:
            limit = PAGE_SIZE
        limit = min(max(limit, 1), MAX_PAGE_SIZE)
        after = before = None
        try:
            if self.get_query_argument("after", ""):
                after = q.Cursor.parse(self.get_query_argument("after"))
            elif self.get_query_argument("before", ""):
                before = q.Cursor.parse(self.get_query_argument("before"))
        except ValueError:
            errors.append("that page position is not valid; showing the first page")
        model = await self.blocking(
            lambda: views.stuck(self.page, flt, limit=limit, after=after, before=before)
        )
        base = {
            "kind": list(flt.kinds),
            "task": flt.task or "",
            "age": self.get_query_argument("age", ""),
            "limit": limit if limit != PAGE_SIZE else "",
        }

        def page_url(**extra: Any) -> str:
            params = [(k, v) for k, vs in base.items() for v in _listed(vs) if v != ""]
            params += list(extra.items())
            return self.reverse_url("ledger-stuck") + ("?" + urlencode(params) if params else "")

        self.render_ledger(
            "stuck.html",
            flt=flt,
            errors=errors,
            form=base,
            page_url=page_url,
            first_page=after is not None or before is not None,
            **model,
        )


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class EntryHandler(LedgerHandler):
    @web.authenticated
    async def get(self, key: str) -> None:
        await self.show(key)

    async def show(
        self, key: str, *, error: str | None = None, status: int = 200, form: Any = None
    ) -> None:
        view = await self.blocking(views.entry, self.page, key)
        done = DONE.get(self.get_query_argument("done", ""))
        self.set_status(status)
        self.render_ledger(
            "entry.html",
            view=view,
            e=view.entry,
            death=self.page.settings,
            error=error,
            done=done,
            form=form or {},
            operator=self.operator(),
            outbox_options=sorted(KEPT_OPTIONS),
        )


class ActionHandler(EntryHandler):
    """A POST that changes the ledger: off unless enabled, XSRF-checked, authorized."""

    def check_xsrf_cookie(self) -> None:
        # Flower checks the token only under OAuth (a cookie session); a form that changes
        # the ledger checks it always, on top of Flower's same-origin checks.
        super().check_xsrf_cookie()
        tornado.web.RequestHandler.check_xsrf_cookie(self)

    def acting_operator(self) -> Operator:
        if not self.actions_enabled:
            why = (
                "Flower runs --read_only"
                if self.application.options.read_only
                else "set ledger_flower_actions = True (or CELERY_LEDGER_FLOWER_ACTIONS=1)"
            )
            raise web.HTTPError(403, f"Ledger actions are off: the page is read-only ({why})")
        operator = self.operator()
        if operator is None:
            raise web.HTTPError(
                403,
                "Ledger actions need an authenticated Flower user: start Flower with "
                "--basic-auth or --auth",
            )
        return operator

    async def act(self, key: str, fn: Callable[[Operator], str]) -> None:
        operator = self.acting_operator()
        try:
            code = await self.blocking(fn, operator)
        except actions.ActionRefused as exc:
            await self.show(key, error=str(exc), status=exc.status, form=self._form())
            return
        except AuthorizerError as exc:
            await self.show(key, error=str(exc), status=500, form=self._form())
            return
        self.redirect(self.reverse_url("ledger-entry", key) + "?" + urlencode({"done": code}))

    def _form(self) -> dict[str, str]:
        return {
            k: self.get_body_argument(k, "")
            for k in ("verified", "reason", "result_json", "action", "signal_name", "payload_json")
        }


class ReleaseHandler(ActionHandler):
    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            done = actions.release(
                self.page,
                key,
                operator=operator,
                verdict_raw=self.get_body_argument("verified", None),
                reason_raw=self.get_body_argument("reason", None),
                result_raw=self.get_body_argument("result_json", None),
            )
            if done.resume is None:
                return "released-completed"
            return f"released-{done.resume}"

        await self.act(key, run)


class ResumeHandler(ActionHandler):
    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            outcome = actions.resume(
                self.page, key, operator=operator, reason_raw=self.get_body_argument("reason", None)
            )
            return "resumed" if outcome == "resumed" else f"resume-{outcome}"

        await self.act(key, run)


class MarkDeadHandler(ActionHandler):
    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            actions.mark_dead(
                self.page,
                key,
                operator=operator,
                reason_raw=self.get_body_argument("reason", None),
                override=self.get_body_argument("override_heartbeat", "") == "on",
            )
            return "marked-dead"

        await self.act(key, run)


class CancelHandler(ActionHandler):
    """design.md § "Durable time": cancel a task (``actions.cancel``)."""

    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            reason = self.get_body_argument("reason", None)
            return "cancel-" + actions.cancel(self.page, key, operator=operator, reason_raw=reason)

        await self.act(key, run)


class SignalHandler(ActionHandler):
    """design.md § "Durable signals": send a signal to a task (``actions.signal``)."""

    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            return actions.signal(
                self.page,
                key,
                operator=operator,
                name_raw=self.get_body_argument("signal_name", None),
                payload_raw=self.get_body_argument("payload_json", None),
            )

        await self.act(key, run)


class OutboxHandler(ActionHandler):
    """Drop or repair a failing outbox child of the entry (``actions.outbox_child``)."""

    @web.authenticated
    async def post(self, key: str) -> None:
        def run(operator: Operator) -> str:
            return actions.outbox_child(
                self.page,
                key,
                operator=operator,
                child_id=self.get_body_argument("child_id", None),
                action_raw=self.get_body_argument("outbox_action", None),
                reason_raw=self.get_body_argument("reason", None),
            )

        await self.act(key, run)


class TaskHandler(LedgerHandler):
    """From Flower's task page (``/task/<id>``) to the ledger entry of that task id."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        name = self.get_query_argument("name", "").strip()
        key = await self.blocking(self._find, task_id, name)
        if key is None:
            raise web.HTTPError(
                404,
                f"no ledger entry for task id {task_id}: not a LedgerTask, not claimed yet, "
                "or pruned by retention",
            )
        self.redirect(self.reverse_url("ledger-entry", key))

    def _find(self, task_id: str, name: str) -> str | None:
        store = self.page.store
        if name:
            # A task keyed by its task id (the default) has this key: one primary-key read.
            key = entry_key(name, task_id)
            try:
                if store.get_entry(key).task_id == task_id:
                    return key
            except EntryNotFound:
                pass
        # A business key: look the task id up (no index on task_id; a scan, one click's cost).
        keys = store.find_keys(task_id, limit=2)
        return keys[0] if len(keys) == 1 else None


class FindHandler(LedgerHandler):
    """The search box: a key, a key prefix or a task id."""

    @web.authenticated
    async def get(self) -> None:
        ref = self.get_query_argument("q", "").strip()
        if not ref:
            self.redirect(self.reverse_url("ledger-stuck"))
            return
        keys = await self.blocking(self._find, ref)
        if len(keys) == 1:
            self.redirect(self.reverse_url("ledger-entry", keys[0]))
            return
        raise web.HTTPError(
            404,
            f"{'several entries match' if keys else 'no ledger entry matches'} {ref!r} "
            "(a key, a key prefix or a task id)",
        )

    def _find(self, ref: str) -> list[str]:
        store = self.page.store
        if re.fullmatch(r"[0-9a-f]{64}", ref):
            # A whole key: its primary key, not find_keys' LIKE (a scan on PostgreSQL).
            try:
                return [store.get_entry(ref).key]
            except EntryNotFound:
                return []
        return store.find_keys(ref, limit=2)
