"""Who may act on a ledger entry: one authorizer hook shared by the CLI, the Flower page and
the Django admin (``celery_ledger.contrib.django``).

An operator action (release, resume, mark-dead; later cancel) is allowed only when the
authorizer answers allow. The hook is one callable, named by the ``ledger_authorizer`` setting
(``"package.module:function"``, or the callable itself in the Celery config)::

    def may_act(operator: Operator, action: Action, entry: Entry) -> Decision | bool:
        if action is Action.RELEASE_NOT_EXECUTED and operator.name not in ONCALL:
            return Decision.deny("only the on-call may authorize a re-run")
        return Decision.allow()

An authorizer may take a fourth parameter, ``details`` (positional or keyword): what else the
operator asked with the action (``ActionDetails``), such as a mark-dead that overrides a recent
sign of life of the old worker (``override_heartbeat``)::

    def may_act(operator, action, entry, details):
        if action is Action.MARK_DEAD and details.override_heartbeat:
            return operator.name in ONCALL
        return True

One with the three parameters above is called with those three, as before.

It runs after every other check of the request and before the one write, in the process
that writes (the CLI, or Flower's), so it sees the entry as it is now. An authorizer that
raises, or answers anything but a ``Decision`` or a bool, denies: the hook fails closed.

**The security boundary.** On the Flower page the authorizer is the boundary: a Flower user
reaches the ledger only through the page, Flower has authenticated them (basic auth, OAuth),
and ``operator.authenticated`` is True. In the CLI it is a guard against mistakes: ``--by``
is whatever the operator typed, and anyone who can run the CLI holds the ledger database's
credentials, which carry release authority on their own (a release is one SQL transaction).

The default (no ``ledger_authorizer``) keeps today's rule: when ``ledger_operator_tokens`` is
set, a self-declared operator (the CLI's ``--by``) must name one of the tokens to release
or to mark dead;
an authenticated operator (a Flower user) may act; resume is always allowed, since it is what
the sweep does on its own.
"""

from __future__ import annotations

import hmac
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from celery_ledger.errors import AuthorizerError
from celery_ledger.ledger import Entry, Verdict

log = logging.getLogger(__name__)


class Action(str, Enum):
    """What an operator asks to do to an entry."""

    #: Release with the verdict "it ran": the entry becomes completed with a given result.
    RELEASE_COMPLETED = "release-completed"
    #: Release with the verdict "it did not run": authorizes exactly one more run.
    RELEASE_NOT_EXECUTED = "release-not-executed"
    #: Re-enqueue an interrupted entry now (what the sweep would do).
    RESUME = "resume"
    #: Assert the entry's old attempts dead (``mark-dead``): it unlocks a ``not-executed``
    #: release under ``ledger_release_requires_death_signal``, so it is gated like one.
    MARK_DEAD = "mark-dead"
    #: Cancel a task (design.md § "Durable time"): it never starts, or stops at its next effect
    #: step.
    CANCEL = "cancel"
    #: Drop or repair a pending outbox child of the entry (``celery-ledger outbox``): a
    #: dropped child is never sent, so it is gated like a release.
    OUTBOX = "outbox"
    #: Send a durable signal to the entry (``celery-ledger signal``, design.md § "Durable
    #: signals"): the waiting task goes on with its payload.
    SIGNAL = "signal"

    @property
    def is_release(self) -> bool:
        return self in (Action.RELEASE_COMPLETED, Action.RELEASE_NOT_EXECUTED)

    @property
    def needs_operator(self) -> bool:
        """Gated by operator tokens in the default rule (a release, or what unlocks one)."""
        return self.is_release or self in (Action.MARK_DEAD, Action.OUTBOX)

    @classmethod
    def release(cls, verdict: Verdict) -> Action:
        """The release action of an operator's verdict."""
        return cls.RELEASE_COMPLETED if verdict is Verdict.COMPLETED else cls.RELEASE_NOT_EXECUTED


@dataclass(frozen=True)
class Operator:
    """Who asks."""

    #: The name the action is stamped with (``released_by``, the audit event's actor).
    name: str
    #: Where the request came from: ``cli``, ``flower`` or ``django`` (the Django admin).
    via: str
    #: True when something other than the operator vouched for ``name`` (Flower's or
    #: Django's login); False for the CLI's ``--by``, which is whatever was typed.
    authenticated: bool
    #: The front end's own user object, for an authorizer that asks it more than a name: the
    #: Django admin passes ``request.user`` (``operator.user.has_perm(...)``). None from the
    #: CLI and Flower, which know a name only.
    user: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ActionDetails:
    """What else the operator asked with the action: the authorizer's ``details``."""

    #: mark-dead only: mark it dead although the old owner showed a sign of life within the
    #: grace window (the CLI's ``--override-heartbeat``, Flower's "override a recent sign of
    #: life"). An authorizer may refuse the override and still allow a plain mark-dead.
    override_heartbeat: bool = False


@dataclass(frozen=True)
class Decision:
    """An authorizer's answer, with the reason shown to the operator when it denies."""

    allowed: bool
    reason: str = ""

    @classmethod
    def allow(cls, reason: str = "") -> Decision:
        return cls(True, reason)

    @classmethod
    def deny(cls, reason: str) -> Decision:
        return cls(False, reason)


Authorizer = Callable[[Operator, Action, Entry], "Decision | bool"]


def load_authorizer(spec: Any) -> Authorizer | None:
    """The callable ``spec`` names (``"pkg.mod:fn"``, ``"pkg.mod.fn"``, or a callable).

    Raises:
        AuthorizerError: it does not import, or is not callable.
    """
    if spec is None:
        return None
    if callable(spec):
        return spec
    text = str(spec)
    module_name, sep, attr = text.partition(":")
    if not sep:
        module_name, _, attr = text.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise AuthorizerError(f"ledger_authorizer={text!r} cannot be imported: {exc}") from None
    if not callable(target):
        raise AuthorizerError(f"ledger_authorizer={text!r} is not callable")
    return target


def default_decision(tokens: frozenset[str], operator: Operator, action: Action) -> Decision:
    """Today's rule: operator tokens gate the CLI's self-declared ``--by`` on release."""
    if not action.needs_operator or operator.authenticated or not tokens:
        return Decision.allow()
    # compare_digest on every token: the time taken does not say how close a guess came.
    if any(hmac.compare_digest(operator.name.encode(), t.encode()) for t in tokens):
        return Decision.allow()
    return Decision.deny("--by does not match any operator token (CELERY_LEDGER_OPERATOR_TOKENS)")


def authorize(
    settings: Any,
    operator: Operator,
    action: Action,
    entry: Entry,
    details: ActionDetails | None = None,
) -> Decision:
    """Ask the configured authorizer (or the default rule) whether ``operator`` may act,
    with ``details`` (``ActionDetails()`` when not given) if the authorizer takes them.

    Never raises for the authorizer's own failures: they deny, with the failure as reason.

    Raises:
        AuthorizerError: ``ledger_authorizer`` cannot be loaded (a configuration error).
    """
    hook = load_authorizer(settings.authorizer)
    if hook is None:
        return default_decision(settings.operator_tokens, operator, action)
    details = details if details is not None else ActionDetails()
    try:
        answer = _call(hook, operator, action, entry, details)
    except Exception as exc:  # noqa: BLE001 - a broken authorizer must deny, not allow
        log.warning(
            "authorizer %r raised for %s by %s on key=%s task_id=%s fence=%s: %r",
            settings.authorizer,
            action.value,
            operator.name,
            entry.key,
            entry.task_id,
            entry.fence,
            exc,
        )
        return Decision.deny(f"the authorizer failed ({type(exc).__name__}); nothing was done")
    if isinstance(answer, Decision):
        return answer
    if isinstance(answer, bool):
        return Decision(answer, "" if answer else "denied by ledger_authorizer")
    return Decision.deny(
        f"the authorizer answered {type(answer).__name__}, not a Decision or a bool; "
        "nothing was done"
    )


def _call(
    hook: Callable[..., Any],
    operator: Operator,
    action: Action,
    entry: Entry,
    details: ActionDetails,
) -> Any:
    """Call ``hook`` with ``details`` when its signature takes a fourth argument (or a
    ``details`` keyword), else with the three arguments authorizers always had."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to read: the three arguments
        return hook(operator, action, entry)
    for args, kwargs in (
        ((operator, action, entry, details), {}),
        ((operator, action, entry), {"details": details}),
    ):
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            continue
        return hook(*args, **kwargs)
    return hook(operator, action, entry)
