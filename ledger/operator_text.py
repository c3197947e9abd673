"""The operator text rules: the who and the why of every stamp an operator writes.

A release, a ``mark-dead``, a cancellation and an outbox drop or repair each record a ``by``
and a ``reason``, read back by every ``show`` and audit view of the entry. ``check_release_text``
refuses one that is blank, too long or not printable before anything is read or written. It has
a module of its own because each of those writers uses it (``operator``'s ``release``,
``death``, ``schedule``, ``outbox``), and none of them should import another for it (``death``
once imported ``operator`` inside a function, hiding a cycle).
"""

from __future__ import annotations

from celery_ledger.ledger.errors import OperatorTextError

#: Longest ``by`` of a release: a name or an operator token, printed in every ``show`` and
#: audit line (and the width of its column, ``released_by``).
MAX_RELEASE_BY_CHARS = 255
#: Longest ``reason`` of a release: a few sentences, or a ticket link. It is read back by every
#: ``show`` and audit view of the entry; a pasted log (1 MB was accepted once and made every
#: later ``show`` take seconds) belongs in the ticket, not in the ledger.
MAX_RELEASE_REASON_CHARS = 4096


def check_release_text(
    by: str,
    reason: str,
    *,
    by_name: str = "by",
    reason_name: str = "reason",
    action: str = "release",
) -> None:
    """Refuse a release's who or why before anything is read or written.

    ``by`` must be 1 to ``MAX_RELEASE_BY_CHARS`` printable characters; ``reason`` 1 to
    ``MAX_RELEASE_REASON_CHARS`` characters, printable but for line breaks and tabs (terminal
    escapes and other control characters would rewrite an operator's screen on ``show``).
    ``by_name``/``reason_name`` are how the caller calls the fields (``--by`` in the CLI);
    ``action`` names what is stamped (``release``, ``mark-dead``).

    Raises:
        OperatorTextError: naming the field and what is wrong with it.
    """
    for name, value, limit, allowed in (
        (by_name, by, MAX_RELEASE_BY_CHARS, ""),
        (reason_name, reason, MAX_RELEASE_REASON_CHARS, "\n\t"),
    ):
        if not isinstance(value, str) or not value.strip():
            raise OperatorTextError(f"{action} {name} is required and must not be blank")
        if len(value) > limit:
            raise OperatorTextError(
                f"{action} {name} is {len(value)} characters, over the limit of {limit}"
                + ("; put the details in a ticket and give its link" if allowed else "")
            )
        bad = next((c for c in value if not (c.isprintable() or c in allowed)), None)
        if bad is not None:
            raise OperatorTextError(
                f"{action} {name} contains the control character {bad!r}; use printable text"
            )
