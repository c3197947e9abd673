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
  characters; shorter values are hidden where they are named but cannot be searched for in
  free text without hiding innocent digits.

Its users: the Flower page, the CLI's ``show`` (``cli.ops._redact_view``), and the argument
reprs of the worker's ``task-received`` event and log lines (``request.LedgerRequest``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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

    def text(self, value: str | None) -> str | None:
        """``value`` with every secret value replaced by ``REDACTED``."""
        if value is None:
            return None
        for secret in self.values:
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
