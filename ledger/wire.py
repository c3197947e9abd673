"""The message headers the ledger puts on a Celery message and reads back: their names, here
once.

A header name is part of the wire: a producer of one version and a worker of the next must
agree on it, so it is spelled in one place and every module that writes or reads a header uses
the constant. They live in the ledger, which imports no Celery, because every layer uses them:
recovery writes them on every re-send (``recovery.resend``, ``recovery.outbox``), the runtime
reads them on every delivery (``celery_ledger.task``, ``envelope``, ``redelivery``, ``timing``,
``intents``, ``request``).

A stored argument snapshot keeps its business key under the field ``ledger_key``
(``ledger.envelope``): that is a stored row's field, not a header, and stays as it was written.
"""

#: Business key material a producer gives instead of the arguments (``LedgerTask.entry_key_of``);
#: kept in the entry's argument snapshot, so a re-send carries it again.
KEY = "ledger_key"
#: Marks the ledger's own re-send (the entry exists with these arguments): its publisher
#: records no publish intent and holds no countdown (``celery_ledger.intents``,
#: ``timing.hold_due``).
REDELIVERY = "ledger_redelivery"
#: How many times in a row a delivery was sent back because the ledger was unavailable (the
#: backoff, ``redelivery.ledger_unavailable``); like ``REDELIVERY``, no publish intent.
UNAVAILABLE = "ledger_unavailable"
#: An absolute deadline, seconds since the epoch on the database clock (``timing``, the claim).
DEADLINE = "ledger_deadline"
#: On an outbox child: the entry key of the task whose step sent it (``recovery.outbox``).
PARENT = "ledger_parent"
