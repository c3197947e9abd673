"""Celery's canvas (chains, ``link`` callbacks, chords, groups) around ledgered tasks.

Celery publishes a finished task's next chain link and its ``link`` callbacks from the worker,
after the body returned and before the result is stored (``celery.app.trace``), and counts a
chord member when it stores the result (``Backend.on_chord_part_return``). A settled member
that is redelivered RETURNs its stored result, and the tracer then publishes and counts again
as if the body had run.

The ledger takes the links over (``links_of``): a completed settle records the next chain link
and the callbacks as outbox children in its own transaction (``ledger.links``), the tracer is
told there is nothing left to publish (``handed_over``), and the outbox publishes them once
the settle committed. A redelivery that RETURNs finds them recorded and publishes only what
was not confirmed yet. Chord counting stays Celery's: why that is exactly once for ledgered
members, and what is not, is argued in docs/design.md ("Canvas").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery.canvas import Signature, maybe_signature
from celery.exceptions import NotRegistered
from celery.utils.functional import arity_greater, maybe_list

from celery_ledger import runtime
from celery_ledger.codec import encode
from celery_ledger.crashpoints import crash_point
from celery_ledger.ledger import LINKS_STEP, Child, LedgerStore, OutboxMessage, link_task_id
from celery_ledger.recovery.outbox import publish

#: Options of a recorded link that the outbox sets itself (``task_id``) or that are a
#: signature's fields rather than publish options.
_NOT_OPTIONS = frozenset({"task_id", "immutable", "subtask_type"})


@dataclass
class Links:
    """What a finished delivery would publish next: the links the outbox takes over, and
    what stays Celery's (a group or chord as the next link or a callback)."""

    children: list[Child]
    #: The request's ``chain`` was taken over (its next link is a task signature).
    chain: bool
    #: The callbacks left to Celery's tracer (not task signatures).
    callbacks_left: list[Any]
    #: A failure's links: the ``link_error`` callbacks left to Celery (called in the worker
    #: with the request and the exception, or not task signatures). None: success links.
    errbacks_left: list[Any] | None = None

    def hand_over(self, request: Any) -> None:
        """Tell the tracer the links recorded here are not its to publish."""
        if self.errbacks_left is not None:
            if request.errbacks:
                request.errbacks = self.errbacks_left or None
            return
        if self.chain:
            request.chain = None
        if request.callbacks:
            request.callbacks = self.callbacks_left or None


def links_of(task: Any, request: Any, key: str, retval: Any, *, fence: int) -> Links:
    """The next chain link and the ``link`` callbacks of ``request``, as outbox children of
    ``key``'s settle at ``fence``, carrying ``retval`` (how the tracer would publish them:
    ``retval`` first, unless the signature is immutable).

    A link keeps its frozen task id (a chain's links are frozen when the chain is applied,
    and its ``AsyncResult`` points at them); a callback without one gets the outbox's
    deterministic id for this settle (``ledger.link_task_id``), the same on every redelivery
    and never an errback's id of an earlier, released failure.

    Raises:
        PayloadError: a link's arguments cannot be stored.
    """
    app = task.app
    limit = runtime.settings_for(app).max_snapshot_bytes
    cipher = runtime.snapshot_cipher(app)
    children: list[Child] = []
    parent = {"parent_id": request.id, "root_id": request.root_id or request.id}

    def add(sig: Signature, extra: dict[str, Any]) -> None:
        n = len(children)
        args = list(sig.args or ()) if sig.immutable else [retval, *(sig.args or ())]
        options = {k: v for k, v in (sig.options or {}).items() if k not in _NOT_OPTIONS}
        options.update(extra)
        payload = encode(
            {"args": args, "kwargs": dict(sig.kwargs or {}), "options": options},
            limit=limit,
            what=f"link {sig.task} of {task.name}",
            setting="ledger_max_snapshot_bytes",
        )
        if cipher is not None:  # encryption at rest, as for argument snapshots
            payload = cipher.seal(payload)
        child_id = (sig.options or {}).get("task_id") or link_task_id(key, fence, n)
        children.append(Child(child_id, sig.task, payload, n))

    chain = list(request.chain or ())
    took_chain = False
    if chain:
        nxt = maybe_signature(chain[-1], app=app)
        if _plain(nxt):
            add(nxt, {**parent, "chain": chain[:-1] or None})
            took_chain = True
    left: list[Any] = []
    for cb in request.callbacks or ():
        sig = maybe_signature(cb, app=app)
        if _plain(sig):
            add(sig, parent)
        else:
            left.append(cb)
    return Links(children, took_chain, left)


def errback_links_of(task: Any, request: Any, key: str, *, fence: int) -> Links:
    """The ``link_error`` callbacks of a failed ``request`` that Celery would publish as
    messages (errbacks taking only the failed task's id), as outbox children of ``key``'s
    settle at ``fence`` (ids as ``links_of``'s).

    Errbacks Celery calls in the worker itself (taking the request, the exception and the
    traceback) are not messages and stay Celery's.

    Raises:
        PayloadError: an errback's arguments cannot be stored.
    """
    app = task.app
    limit = runtime.settings_for(app).max_snapshot_bytes
    cipher = runtime.snapshot_cipher(app)
    children: list[Child] = []
    left: list[Any] = []
    parent = {"parent_id": request.id, "root_id": request.root_id or request.id}
    for eb in request.errbacks or ():
        sig = maybe_signature(eb, app=app)
        if not _plain(sig) or _called_inline(task, sig):
            left.append(eb)
            continue
        n = len(children)
        args = list(sig.args or ()) if sig.immutable else [request.id, *(sig.args or ())]
        options = {k: v for k, v in (sig.options or {}).items() if k not in _NOT_OPTIONS}
        options.update(parent)
        payload = encode(
            {"args": args, "kwargs": dict(sig.kwargs or {}), "options": options},
            limit=limit,
            what=f"errback {sig.task} of {task.name}",
            setting="ledger_max_snapshot_bytes",
        )
        if cipher is not None:  # encryption at rest, as for argument snapshots
            payload = cipher.seal(payload)
        child_id = (sig.options or {}).get("task_id") or link_task_id(key, fence, n)
        children.append(Child(child_id, sig.task, payload, n))
    return Links(children, False, [], errbacks_left=left)


def _called_inline(task: Any, sig: Signature) -> bool:
    """Whether Celery calls this errback in the worker (``Backend._call_task_errbacks``): a
    registered task whose run takes more than the failed task's id."""
    try:
        header = getattr(sig.type, "__header__", None)
    except NotRegistered:
        return False
    if header is None or isinstance(header, partial):
        return False
    greater = getattr(task.backend, "_errback_arity_greater", None)
    if greater is None:
        return arity_greater(header, 1)
    return bool(greater(sig, 1))


def _plain(sig: Any) -> bool:
    """A task signature (not a group, chain or chord, which Celery publishes itself)."""
    return type(sig) is Signature and isinstance(sig.task, str)


def publish_links(
    store: LedgerStore, app: Any, key: str, fence: int, links: Sequence[Child]
) -> None:
    """Publish links recorded with ``key``'s settle (broker-confirmed, then marked); what
    does not go out now is the sweep's (``recovery.outbox.sweep_outbox``)."""
    if not links:
        return
    publish(
        store,
        app,
        [
            OutboxMessage(
                child_id=c.child_id,
                parent_key=key,
                step=LINKS_STEP,
                occurrence=fence,
                n=c.n,
                task_name=c.task_name,
                payload=c.payload,
                fence=fence,
                created_at=0.0,
                published_at=None,
            )
            for c in links
        ],
        cipher=runtime.snapshot_cipher(app),
    )


def returned(task: Any, store: LedgerStore, key: str, fence: int, links: Links) -> None:
    """A RETURN gate: the links of this delivery that the settle recorded are the outbox's.

    Hand them over (the tracer must not publish them again) and publish those not confirmed
    yet: the worker that settled died before its publish, and this delivery is the first to
    know. Links the settle did not record (another delivery's chain under the same business
    key, an entry released by an operator) stay Celery's: the tracer publishes them with the
    stored result.
    """
    request = task.request
    if not links.children:
        return
    recorded = store.recorded_links(key)
    if any(c.child_id not in recorded for c in links.children):
        return
    links.hand_over(request)
    publish_links(
        store, task.app, key, fence, [c for c in links.children if not recorded[c.child_id]]
    )


def keep_chord_unlock(app: Any) -> None:
    """Deliver Celery's ``celery.chord_unlock`` the way ledgered tasks are delivered: acked
    after it ran, requeued when the pool process running it dies.

    On result backends without a native join (the database backends, the embedded
    ``db+sqlite``) a chord's callback is published by this one polling task, which Celery
    acks before it runs: a pool process killed while it runs loses the callback for good.
    Running it twice is harmless where running it never is not: it only reads the header's
    results and publishes the callback under the chord body's frozen id, which a ledgered
    callback's claim deduplicates. A ledger app's own ``chord_unlock`` is a ledgered task
    (``celery_ledger.unlock``), acked late already; this keeps the setting for whichever task
    the worker's app has under that name.
    """
    task = app.tasks.get("celery.chord_unlock")
    if task is not None:
        task.acks_late = True
        task.reject_on_worker_lost = True


def on_task_prerun(sender: Any = None, **_: Any) -> None:
    """``task_prerun``: the crash point ``chord-unlock`` fires as Celery's
    ``celery.chord_unlock`` starts in a pool process of a ledger app, and
    ``chord-unlock:retry`` as one of its retries (a poll after the first) starts."""
    if sender is None or getattr(sender, "name", None) != "celery.chord_unlock":
        return
    if not runtime.is_installed(sender.app):
        return
    settings = runtime.settings_for(sender.app)
    crash_point(settings, "chord-unlock")
    if getattr(sender.request, "retries", 0):
        crash_point(settings, "chord-unlock:retry")


#: Celery's count of the ``self.replace()`` calls that led to a message: its header, its
#: request field and its publish option.
REPLACED = "replaced_task_nesting"


def replacement(found: Any) -> int:
    """How many ``self.replace()`` calls led to a delivery (a request) or a publish (a
    placement mapping): Celery's ``replaced_task_nesting``; 0 for any other message.

    A replacement inherits the replaced task's id by Celery's design, with arguments of its
    own: it is a new call, not another delivery of the replaced one, so the ledger keys it
    apart (``LedgerTask.entry_key_of``).
    """
    value = found.get(REPLACED) if isinstance(found, Mapping) else getattr(found, REPLACED, 0)
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


#: A request's canvas fields, and the publish option each is re-sent with. The fields are
#: also the message's names: the first four travel in the body's embed, the rest in headers.
_PLACEMENT = (
    ("chain", "chain"),
    ("callbacks", "link"),
    ("errbacks", "link_error"),
    ("chord", "chord"),
    ("group", "group_id"),
    ("group_index", "group_index"),
    ("parent_id", "parent_id"),
    ("root_id", "root_id"),
    # Not a place in a canvas but how many ``self.replace()`` calls led here: it is part of
    # the delivery's identity (``replacement``), so a re-send must carry it.
    (REPLACED, REPLACED),
)
_EMBEDDED = frozenset(("chain", "callbacks", "errbacks", "chord"))


def placement(request: Any) -> dict[str, Any]:
    """Where ``request`` sits in a canvas, as the publish options that put it back there: kept
    in the entry's argument snapshot, so that recovery's re-send continues its chain, keeps its
    callbacks and counts in its chord (``recovery.resend.message``)."""
    return _kept({option: getattr(request, field_, None) for field_, option in _PLACEMENT})


def published_placement(options: dict[str, Any], link: Any, link_error: Any) -> dict[str, Any]:
    """``placement`` of a task being published by ``apply_async`` (its publish intent's
    snapshot): the options a chain, a group or a chord passes it, and its callbacks."""
    found = {option: options.get(option) for _, option in _PLACEMENT}
    found["link"] = maybe_list(link)
    found["link_error"] = maybe_list(link_error)
    return _kept(found)


def message_placement(headers: dict[str, Any], embed: Any) -> dict[str, Any]:
    """``placement`` of a published message (protocol 2: ``headers`` and the body's embed),
    for the publish intent of a task sent by name (``app.send_task``, the outbox)."""
    embed = embed if isinstance(embed, dict) else {}
    return _kept(
        {
            option: (embed if field_ in _EMBEDDED else headers).get(field_)
            for field_, option in _PLACEMENT
        }
    )


def _kept(found: dict[str, Any]) -> dict[str, Any]:
    out = {
        option: value
        for option, value in found.items()
        if value not in (None, [], ()) and not (option == REPLACED and not value)
    }
    # Parent and root alone are no canvas (every task sent from a task has them): the
    # snapshot of a plain task stays as it was.
    if not set(out) - {"parent_id", "root_id"}:
        return {}
    return out
