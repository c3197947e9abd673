"""Step identity: which replay row a step call is, and when a call is drift.

A step is identified by its name and its **position**, the n-th call of that name in the body
(``occurrence`` in the replay row). Its input is *checked*, not trusted: the row stores the
hash of the input, and a resumed attempt compares.

For each step call, in order:

1. **Its own row.** A row of this name and this input hash replays (or re-runs, when it was
   authorized or is re-runnable), the one at this position first, else the first one not yet
   taken by another call: re-ordered loop items each find their own row wherever it sits.
2. **Drift.** An effect step (one that writes ``started``) that finds no row of its own, at a
   position where a row of *another* input started or completed, is the same step run with a
   changed input (a timestamp, a uuid, a value read outside any step). Running it could
   repeat the effect, so it is refused (``Drift``): the attempt parks the entry ``blocked``
   with both hashes in the reason.
3. **New.** Otherwise the call is a new step at its position.

A step whose identity is **declared** (``identify=``: the names of its arguments that identify
it, or a callable of its arguments) is stored under the hash of that material instead
(``ledger.declared_identity``) and found by it wherever it sits; the other arguments may
change between attempts. Its ``occurrence`` counts repeats of that identity. A declared call
meeting a row stored without a declaration (a deploy that added ``identify=``) replays it when
the whole input matches, and otherwise cannot check its identity: drift as well. The same holds
the other way round.

Read, idempotent and ``effect=False`` steps record no intent: re-running them is harmless by
their class, so they never drift; a changed input simply runs and is stored at its position.

What is checked before a call is placed lives here too: the step's name (``check_step_name``)
and its declared identity (``identity_of``).
"""

from __future__ import annotations

import inspect
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from celery_ledger.codec import arguments_hash
from celery_ledger.errors import Drift
from celery_ledger.ledger import (
    BODY_STEP,
    LINKS_STEP,
    StepRecord,
    declared_identity,
    is_declared,
)

#: A step's replay row identity: (name, stored input hash, occurrence).
Ident = tuple[str, str, int]

#: How much of a hash a drift reason prints (enough to tell two hashes apart by eye).
HASH_SHOWN = 16

#: Longest step name (the column holds 255; a name is read on one line of ``show``).
MAX_STEP_NAME = 200

#: What ``identify=`` may be: names of the step function's parameters, or a callable of the
#: step's arguments returning the identifying material.
Identify = Sequence[str] | Callable[..., Any]


def check_step_name(name: Any) -> None:
    """Refuse a step name that cannot be stored and shown as it is.

    Raises:
        ValueError: empty, longer than ``MAX_STEP_NAME``, or holding a character that is not
            printable (a newline, a tab, a terminal escape sequence ...), or the name the
            ledger reserves for a body without steps.
    """
    if not isinstance(name, str):
        raise ValueError(f"step name must be a string, not {type(name).__name__}")
    if not name:
        raise ValueError("step name is empty")
    if len(name) > MAX_STEP_NAME:
        raise ValueError(
            f"step name {name[:40]!r}... is {len(name)} characters, over the limit of "
            f"{MAX_STEP_NAME}"
        )
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        raise ValueError(
            f"step name {name[:60]!r} holds the unprintable character {bad!r} at {name.index(bad)}"
        )
    if name == BODY_STEP:
        raise ValueError(f"step name {name!r} is reserved for a body that records no steps")
    if name == LINKS_STEP:
        raise ValueError(f"step name {name!r} is reserved for the links a settle records")


def identity_of(
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    identify: Identify,
) -> str:
    """The stored identity of a step whose identifying arguments are declared: the hash of
    ``identify(*args, **kwargs)``, or of ``{parameter: value}`` for the named parameters of
    ``fn`` (bound as ``fn`` would bind them, defaults applied).

    Raises:
        TypeError: ``identify`` is a bare string, or the arguments do not fit ``fn``.
        ValueError: it names parameters ``fn`` does not have.
        IdentityError: the identifying material is not JSON.
    """
    if callable(identify):
        material = identify(*args, **kwargs)
    else:
        if isinstance(identify, str):
            raise TypeError(
                f"step {name!r}: identify= takes a tuple of parameter names or a callable, "
                f"not the string {identify!r}"
            )
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"step {name!r}: identify= names parameters, but {fn!r} has no signature to "
                "bind them by; pass a callable of the step's arguments instead"
            ) from exc
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"step {name!r}: {exc}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for param in sig.parameters.values():
            if param.kind is param.VAR_KEYWORD:
                values.update(values.pop(param.name, {}))
        missing = [n for n in identify if n not in values]
        if missing:
            raise ValueError(
                f"step {name!r}: identify= names {missing}, which are not parameters of "
                f"{getattr(fn, '__name__', fn)!r}{sig}"
            )
        material = {n: values[n] for n in identify}
    return declared_identity(arguments_hash(material))


class ReplayBook:
    """The replay rows of one attempt, and the calls of its body that took them."""

    def __init__(self, rows: Iterable[StepRecord] = ()) -> None:
        self._rows: dict[Ident, StepRecord] = {}
        #: Rows of one (name, stored hash), by occurrence: where an input's own rows are.
        self._by_input: dict[tuple[str, str], list[Ident]] = defaultdict(list)
        #: Undeclared rows of one (name, occurrence): what ran at a position.
        self._at_position: dict[tuple[str, int], list[Ident]] = defaultdict(list)
        #: Declared rows of one name: rows an undeclared call cannot check itself against.
        self._declared: dict[str, list[Ident]] = defaultdict(list)
        self._taken: set[Ident] = set()
        self._positions: Counter[str] = Counter()
        self._repeats: Counter[tuple[str, str]] = Counter()
        for row in sorted(rows, key=lambda r: r.occurrence):
            self._index(row)

    def _index(self, row: StepRecord) -> None:
        ident = row.ident
        self._rows[ident] = row
        name, stored, occurrence = ident
        self._by_input[(name, stored)].append(ident)
        if is_declared(stored):
            self._declared[name].append(ident)
        else:
            self._at_position[(name, occurrence)].append(ident)

    def get(self, ident: Ident) -> StepRecord | None:
        """The row of ``ident`` as this attempt knows it."""
        return self._rows.get(ident)

    def put(self, row: StepRecord) -> None:
        """Record a row this attempt wrote outside a step (a reconciled verdict)."""
        if row.ident in self._rows:
            self._rows[row.ident] = row
        else:
            self._index(row)

    def place(
        self, name: str, input_hash: str, *, identity: str | None, effect: bool
    ) -> tuple[Ident, StepRecord | None]:
        """Place one step call: its replay identity, and the row it takes (None: a new step).

        ``input_hash`` is the hash of the whole input; ``identity`` the stored form of a
        declared identity (``ledger.declared_identity``) or None; ``effect`` whether the step
        records its intent (only those can drift).

        Raises:
            Drift: an effect step whose call cannot be told apart from a changed input.
        """
        position = self._positions[name]
        self._positions[name] += 1
        if identity is not None:
            return self._place_declared(name, input_hash, identity, position, effect)
        own = self._take_own(name, input_hash, position)
        if own is not None:
            return own.ident, own
        ident = (name, input_hash, position)
        if effect:
            self._check_position(name, input_hash, position)
            for other in self._declared[name]:
                if other not in self._taken and self._may_have_run(other):
                    raise Drift(
                        name,
                        position,
                        f"step {name!r} #{position} has no identify= but rows of {name!r} "
                        "were stored with one: its identity cannot be checked; restore the "
                        "declaration, or release the entry",
                    )
        if ident in self._rows:
            # This input's row at this position was taken by an earlier call of this attempt:
            # the order of the steps changed between attempts.
            if effect:
                raise Drift(
                    name,
                    position,
                    f"step {name!r} #{position} repeats input {input_hash[:HASH_SHOWN]}, whose "
                    "row an earlier call already replayed: the order of the steps changed; "
                    "declare the arguments that identify it (identify=), or release the entry",
                )
            spare = max(i[2] for i in self._by_input[(name, input_hash)]) + 1
            ident = (name, input_hash, spare)
        return ident, None

    def _place_declared(
        self, name: str, input_hash: str, identity: str, position: int, effect: bool
    ) -> tuple[Ident, StepRecord | None]:
        repeat = self._repeats[(name, identity)]
        self._repeats[(name, identity)] += 1
        ident = (name, identity, repeat)
        row = self._rows.get(ident)
        if row is not None:
            self._taken.add(ident)
            return ident, row
        # Stored before identify= was declared: the same whole input is the same step.
        own = self._take_own(name, input_hash, position)
        if own is not None:
            return own.ident, own
        if effect:
            for other in self._at_position[(name, position)]:
                if other not in self._taken and self._may_have_run(other):
                    raise Drift(
                        name,
                        position,
                        f"step {name!r} #{position} declares identify= but its row at that "
                        f"position was stored without it (stored {other[1][:HASH_SHOWN]}, "
                        f"now {input_hash[:HASH_SHOWN]}): its identity cannot be checked; "
                        "release the entry",
                    )
        return ident, None

    def _take_own(self, name: str, input_hash: str, position: int) -> StepRecord | None:
        """The row of this name and input hash at ``position``, else the first one no call
        took yet; marks it taken."""
        candidates = self._by_input.get((name, input_hash), ())
        exact = (name, input_hash, position)
        if exact in candidates and exact not in self._taken:
            self._taken.add(exact)
            return self._rows[exact]
        for ident in candidates:
            if ident not in self._taken:
                self._taken.add(ident)
                return self._rows[ident]
        return None

    def _check_position(self, name: str, input_hash: str, position: int) -> None:
        for other in self._at_position[(name, position)]:
            if other[1] != input_hash and self._may_have_run(other):
                raise Drift(
                    name,
                    position,
                    f"step {name!r} #{position} input changed: stored "
                    f"{other[1][:HASH_SHOWN]}, now {input_hash[:HASH_SHOWN]}; if other "
                    "arguments identify the step, declare them (identify=), else release "
                    "the entry",
                )

    def _may_have_run(self, ident: Ident) -> bool:
        return self._rows[ident].may_have_run
