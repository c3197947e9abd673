"""Keeping secret argument values out of sight: one redaction function for every renderer.

A task's arguments are secret by name: the ``ledger_redact`` setting (every task) and a
task's own ``secret_args`` attribute, when it has one. ``redact_arguments`` turns an argument
snapshot into what may be shown, and a ``Redaction`` that scrubs the same values out of any
other text shown next to it (a result, a step output, an error, an audit detail), in case a
body copied a secret there.

Rules, all failing closed:

- a secret name is matched at any depth: ``kwargs["card_number"]`` and
  ``kwargs["payment"]["card_number"]`` are both hidden;
- a positional argument is matched by the parameter name the task's signature gives it; when
  the task is not importable here (so neither its signature nor its ``secret_args`` is known),
  every argument value is hidden and only the names and positions stay;
- scrubbing replaces every occurrence of a secret value of at least ``MIN_SCRUB_LENGTH``
  characters, raw and in each form JSON text escapes it to (a stored error, an audit
  detail: ``P\\u00e4sswort``, ``\\"``); shorter values are hidden where they are named but
  cannot be searched for in free text without hiding innocent digits.

A stored argument snapshot also holds other tasks' arguments: its canvas placement
(``canvas``: the rest of a chain, the ``link``/``link_error`` callbacks, a chord's body, each
possibly carrying more of them in its options). ``redact_snapshot`` hides each of those by its
own task's rules, as if it were that task's arguments, and scrubs every secret it found from
all of it.

Its users: the Flower page (entry and stuck list) and the CLI's ``show`` and ``list``
(``cli.show.redaction_for``), all through ``entry_redaction``; a blocked reason as it leaves the
worker (``scrub_for_call``: its log line, event and ``LedgerBlocked``); and the argument reprs
of the worker's ``task-received`` event and log lines (``request.LedgerRequest``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

#: What a hidden value is shown as.
REDACTED = "[redacted]"
#: What an argument is shown as when the task is unknown here, so its secrets are unknown too.
HIDDEN = "[hidden: task not importable here]"
#: Shorter secret values are not searched for in free text (they would match innocent text).
MIN_SCRUB_LENGTH = 4


@dataclass(frozen=True)
class Redaction:
    """What one entry's arguments hid: the names, and the values to scrub from other text."""

    names: frozenset[str]
    #: Secret values as text, longest first (so that a value containing another goes first).
    values: tuple[str, ...] = ()
    #: True when every argument value was hidden because the task is unknown here.
    blind: bool = False

    @cached_property
    def _forms(self) -> tuple[str, ...]:
        """Each secret value as raw text and as it reads inside JSON text (a stored error, an
        audit detail): escaped with ``ensure_ascii`` (``P\\u00e4sswort``) and without (only
        quotes, backslashes and control characters escaped). Longest first."""
        forms = {
            form
            for secret in self.values
            for form in (
                secret,
                json.dumps(secret)[1:-1],
                json.dumps(secret, ensure_ascii=False)[1:-1],
            )
        }
        return tuple(sorted(forms, key=lambda s: (-len(s), s)))

    def text(self, value: str | None) -> str | None:
        """``value`` with every secret value, raw or JSON-escaped, replaced by ``REDACTED``."""
        if value is None:
            return None
        for secret in self._forms:
            value = value.replace(secret, REDACTED)
        return value

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like ``value`` with secret names hidden and secret text scrubbed."""
        return _walk(value, self.names, self)


def secret_names(redact: Iterable[str], task: Any | None) -> frozenset[str]:
    """``ledger_redact`` plus the task's own ``secret_args`` (if the task declares any)."""
    declared = getattr(task, "secret_args", None) or ()
    if isinstance(declared, str):
        declared = (declared,)
    return frozenset(redact) | frozenset(declared)


def redact_arguments(
    args: list[Any] | tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    names: frozenset[str],
    task: Any | None,
) -> tuple[list[Any], dict[str, Any], Redaction]:
    """(args, kwargs) safe to show, and the ``Redaction`` to apply to everything else.

    ``task`` is the registered task object (None when this process does not know it).
    """
    if task is None:
        # Its secret_args are unknown: hide every value, keep the shape.
        hidden_kwargs = {k: HIDDEN for k in kwargs}
        values = _secret_values([*args, *kwargs.values()])
        return [HIDDEN] * len(args), hidden_kwargs, Redaction(names, values, blind=True)
    positional = _parameter_names(task, len(args))
    secrets: list[Any] = []
    shown_args = []
    for i, value in enumerate(args):
        name = positional[i] if i < len(positional) else None
        if name in names or (name is None and names):
            # A positional argument without a name (``*args``) cannot be told safe.
            secrets.append(value)
            shown_args.append(REDACTED)
        else:
            shown_args.append(value)
    for name, value in kwargs.items():
        if name in names:
            secrets.append(value)
    secrets.extend(_nested_secrets([*args, *kwargs.values()], names))
    redaction = Redaction(names, _secret_values(secrets))
    return (
        [redaction.value(v) if v != REDACTED else v for v in shown_args],
        {k: (REDACTED if k in names else redaction.value(v)) for k, v in kwargs.items()},
        redaction,
    )


def scrub_for_call(text: str, *, redact: Iterable[str], task: Any, args: Any, kwargs: Any) -> str:
    """``text`` (a reason) with the secret argument values of one call of ``task`` scrubbed,
    before it leaves the worker: a log line, an event, the exception Celery logs. A reason may
    quote a secret (an external ref built from a card number). Fails closed: when the
    arguments cannot be read, the whole text is hidden."""
    names = secret_names(redact, task)
    if not names:
        return text
    try:
        _, _, redaction = redact_arguments(
            list(args or ()), dict(kwargs or {}), names=names, task=task
        )
    except Exception:  # noqa: BLE001 - fail closed
        return REDACTED
    return redaction.text(text) or ""


def redact_snapshot(
    snapshot: Mapping[str, Any],
    *,
    redact: Iterable[str],
    task: Any | None,
    task_of: Callable[[str], Any | None],
) -> tuple[dict[str, Any], Redaction]:
    """An argument snapshot safe to show, and the ``Redaction`` for everything else shown
    with it.

    Its ``args``/``kwargs`` are ``task``'s (``redact_arguments``); every task signature in its
    ``canvas`` placement is redacted by the rules of the task it names (``task_of(name)``:
    the registered task, None when unknown here, which hides all its values), nested ones
    (a link's own ``link``, a chain's ``tasks``) by theirs. Each secret found anywhere is then
    scrubbed from all of it: a value one task hides is not shown as another's.
    """
    names = secret_names(redact, task)
    args, kwargs, own = redact_arguments(
        snapshot.get("args") or [], snapshot.get("kwargs") or {}, names=names, task=task
    )
    shown = {**snapshot, "args": args, "kwargs": kwargs}
    placement = snapshot.get("canvas")
    if not placement:
        return shown, own
    found = [own]
    shown["canvas"] = _canvas(placement, frozenset(redact), task_of, found)
    merged = Redaction(
        frozenset().union(*(r.names for r in found)),
        tuple(sorted({v for r in found for v in r.values}, key=lambda v: (-len(v), v))),
        blind=own.blind,
    )
    return {k: merged.value(v) if k in _ARGUMENTS else v for k, v in shown.items()}, merged


def entry_redaction(
    snapshot: Any,
    *,
    redact: Iterable[str],
    task: Any | None,
    task_of: Callable[[str], Any | None],
) -> tuple[dict[str, Any] | None, Redaction]:
    """An entry's decoded ``snapshot`` safe to show (None when it has none that reads), and
    the ``Redaction`` for every other text shown of the entry: its reason, result, error,
    step refs and audit details, wherever they are shown (a list row as much as ``show``).
    Without a snapshot only the names are known, so nothing can be scrubbed by value.
    """
    if not isinstance(snapshot, Mapping):
        return None, Redaction(secret_names(redact, task))
    return redact_snapshot(snapshot, redact=redact, task=task, task_of=task_of)


#: The keys of a snapshot that hold arguments (its own, and its canvas placement's).
_ARGUMENTS = frozenset({"args", "kwargs", "canvas"})


def _canvas(
    value: Any, redact: frozenset[str], task_of: Callable[[str], Any | None], found: list[Redaction]
) -> Any:
    """``value`` with every task signature in it redacted by its own task's rules; each
    ``Redaction`` made is appended to ``found``."""
    if isinstance(value, Mapping):
        name = value.get("task")
        if not (isinstance(name, str) and ("args" in value or "kwargs" in value)):
            return {k: _canvas(v, redact, task_of, found) for k, v in value.items()}
        task = task_of(name)
        # Signatures nested in its arguments first (a chain's or group's ``tasks``, a chord's
        # header and body), each by its own task's rules; then this task's rules over them.
        args = [_canvas(v, redact, task_of, found) for v in value.get("args") or ()]
        kwargs = {
            k: _canvas(v, redact, task_of, found) for k, v in (value.get("kwargs") or {}).items()
        }
        # Unless immutable, it is called with the previous result (a callback, a chain link) or
        # the failed task's id (an errback) first: its own arguments start at the second
        # parameter, whose name decides.
        lead = [] if value.get("immutable") else [None]
        args, kwargs, redaction = redact_arguments(
            [*lead, *args], kwargs, names=secret_names(redact, task), task=task
        )
        args = args[len(lead) :]
        found.append(redaction)
        out = {**value, "args": args, "kwargs": kwargs}
        if "options" in value:  # its own link, link_error, chain: more signatures
            out["options"] = _canvas(value["options"], redact, task_of, found)
        return out
    if isinstance(value, (list, tuple)):
        return [_canvas(v, redact, task_of, found) for v in value]
    return value


def _parameter_names(task: Any, count: int) -> list[str | None]:
    """Names of the first ``count`` positional parameters of the task's body."""
    try:
        params = list(inspect.signature(task.run).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return [None] * count
    names: list[str | None] = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            break
    return (names + [None] * count)[:count]


def _nested_secrets(values: list[Any], names: frozenset[str]) -> list[Any]:
    found: list[Any] = []
    stack = list(values)
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for k, v in item.items():
                if k in names:
                    found.append(v)
                else:
                    stack.append(v)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _secret_values(values: list[Any]) -> tuple[str, ...]:
    """Every leaf of ``values`` as text, long enough to be searched for, longest first."""
    out: set[str] = set()
    stack = list(values)
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif item is not None and not isinstance(item, bool):
            text = str(item)
            if len(text) >= MIN_SCRUB_LENGTH:
                out.add(text)
    return tuple(sorted(out, key=lambda s: (-len(s), s)))


def _walk(value: Any, names: frozenset[str], redaction: Redaction) -> Any:
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if k in names else _walk(v, names, redaction)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_walk(v, names, redaction) for v in value]
    if isinstance(value, str):
        return redaction.text(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = str(value)
        if text in redaction.values:
            return REDACTED
    return value
