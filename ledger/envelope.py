"""The envelope: the message as the producer meant it, stored once per entry.

Everything needed to send a task again is kept here, so that every path that sends it again
(the sweep's resume, the wake pass, the overdue-retry re-send, the publish intent's re-send)
builds the same message from the same value (``recovery.resend``): a path that carries only
part of the message was the fault this value exists to remove.

- **arguments**: ``args``, ``kwargs`` (the body's input);
- **routing**: ``queue``, and in ``options`` the ``exchange``, ``routing_key`` and
  ``priority`` (the workers that consume it, in the order the producer asked);
- **limits**: ``options``' ``time_limit`` and ``soft_time_limit`` (the pool stops a body past
  them);
- **the user's headers**: ``options["headers"]`` (what the producer attached: tracing,
  tenancy);
- **the business key**: ``ledger_key`` (the same entry);
- **the retry count**: ``retries`` (``max_retries`` counts the re-sent retry);
- **the canvas placement**: ``canvas`` (``chain``, ``link``, ``link_error``, ``chord``,
  ``group_id``, ``group_index``, ``parent_id``, ``root_id``: the chain goes on, the chord
  counts it);
- **the deadline**: the entry's ``deadline_at`` column, read by the admission gate.

The deadline is not in the envelope but beside it, in the entry's own column, because it only
ever tightens (``admission.earliest``) while the envelope is sealed once.

Stored as a JSON object in ``entries.snapshot``, sealed when ``ledger_snapshot_keys`` is set;
the JSON encoding itself is the Celery side's (kombu's, which keeps datetimes and UUIDs
intact), so the ledger only maps this value to and from that object. An envelope written by
an older version lacks ``options`` (and maybe ``retries``, ``canvas``): ``from_data`` reads it
with their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The publish options an envelope keeps besides the queue, the retry count and the canvas.
#: ``headers`` holds the user's own headers only (never Celery's protocol headers, never the
#: ledger's ``ledger_*`` ones, which the re-send sets itself).
OPTIONS = ("exchange", "routing_key", "priority", "time_limit", "soft_time_limit", "headers")


@dataclass(frozen=True)
class Envelope:
    """What recovery needs to send a task again with its original task id, as it was meant."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: The queue (routing key) the task was published or delivered on; None: its default.
    queue: str | None = None
    #: The ``ledger_key`` header the task was sent with (business key material), if any.
    ledger_key: Any = None
    #: Celery's retry count of the delivery to re-send (a retry's: 1 for the first retry), so
    #: that a re-sent retry counts against ``max_retries`` like the message it replaces.
    retries: int = 0
    #: Where the delivery sits in a Celery canvas: the publish options that carry it on
    #: (``chain``, ``link``, ``link_error``, ``chord``, ``group_id``, ``group_index``,
    #: ``parent_id``, ``root_id``), so that a re-send continues the chain and counts in the
    #: chord. Opaque to the ledger; empty for a task outside any canvas.
    canvas: Mapping[str, Any] = field(default_factory=dict)
    #: The other publish options the producer gave (``OPTIONS``); only those it gave.
    options: Mapping[str, Any] = field(default_factory=dict)

    def as_data(self) -> dict[str, Any]:
        """The JSON object stored for this envelope (``retries``, ``canvas`` and ``options``
        only when not empty: a plain task's envelope stays as small as its arguments)."""
        data = {
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "queue": self.queue,
            "ledger_key": self.ledger_key,
        }
        if self.retries:
            data["retries"] = self.retries
        if self.canvas:
            data["canvas"] = dict(self.canvas)
        if self.options:
            data["options"] = dict(self.options)
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Envelope:
        """The envelope a stored JSON object describes (missing keys take their defaults;
        an option this version does not know is dropped)."""
        options = data.get("options") or {}
        return cls(
            args=tuple(data.get("args") or ()),
            kwargs=dict(data.get("kwargs") or {}),
            queue=data.get("queue") or None,
            ledger_key=data.get("ledger_key"),
            retries=int(data.get("retries") or 0),
            canvas=dict(data.get("canvas") or {}),
            options={k: v for k, v in dict(options).items() if k in OPTIONS},
        )


#: The name this value had before it held the whole message: recovery's resume read only the
#: arguments and the routing.
ArgumentSnapshot = Envelope
