"""Per-process, per-app ledger runtime: the store, the settings, this worker's boot id.

The boot id names one start of a worker node. It is made in the worker's parent process
before the pool forks (``worker_init``), so the parent and its pool processes share it; a
restarted worker gets a new one, which is how the boot sweep tells its own previous, dead
process from a live one with the same node name.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Any

from celery_ledger.ledger import LedgerStore, Owner, SnapshotCipher, cipher_from
from celery_ledger.settings import LedgerSettings

_boot_id: str | None = None
_boot_lock = threading.Lock()


def boot_id() -> str:
    """This worker boot's id (made on first use; ``new_boot`` starts a new one)."""
    global _boot_id
    if _boot_id is None:
        with _boot_lock:
            if _boot_id is None:
                _boot_id = uuid.uuid4().hex
    return _boot_id


def new_boot() -> str:
    global _boot_id
    _boot_id = uuid.uuid4().hex
    return _boot_id


def default_node() -> str:
    return f"celery@{socket.gethostname()}"


def owner_for(hostname: str | None, *, per_process: bool = False) -> Owner:
    """Who runs an attempt in this process: the worker's node name (``hostname``), or with
    ``per_process`` (eager ``apply()``, no worker) a node of this process alone,
    ``eager-<pid>@<host>``.

    A node name stands for one worker: its boot id tells its previous, dead boot from itself
    (``LedgerStore.claim``). Processes without a worker each make their own boot id, so under
    one shared name each would take the others' live leases for a previous boot; a name per
    process cannot match another live process (a reused pid belongs to a process that died).
    """
    pid = os.getpid()
    node = f"eager-{pid}@{socket.gethostname()}" if per_process else hostname or default_node()
    return Owner(node=node, boot=boot_id(), pid=pid)


def settings_for(app: Any) -> LedgerSettings:
    return LedgerSettings.from_app(app)


def store_for(app: Any) -> LedgerStore:
    """The app's ledger store (one per app; its engine is per process and fork-safe)."""
    store = getattr(app, "_ledger_store", None)
    if store is None:
        settings = settings_for(app)
        store = LedgerStore(settings.url, durability=settings.durability)
        app._ledger_store = store
    return store


def snapshot_cipher(app: Any) -> SnapshotCipher | None:
    """The app's snapshot cipher (``ledger_snapshot_keys``), or None when no key is set."""
    try:
        cipher: SnapshotCipher | None = app._ledger_snapshot_cipher
    except AttributeError:
        cipher = app._ledger_snapshot_cipher = cipher_from(settings_for(app).snapshot_keys)
    return cipher


def publish_intent_enabled(app: Any) -> bool:
    """Whether ledgered tasks are recorded when published (``ledger_publish_intent``).

    On by default on every broker: a message can be lost before any claim on each of them
    (``filesystem://`` forgets what a killed worker fetched, Redis strands it in ``unacked``
    for ``visibility_timeout``, a broker restart without persistence drops its queues), and
    only an intent lets the sweep find such work. Its price is one write per publish.
    """
    flag = settings_for(app).publish_intent
    return True if flag is None else flag


def events_enabled(app: Any) -> bool:
    """Whether ledgered tasks send ``task-ledger-*`` events (``ledger_send_events``, else the
    worker's ``worker_send_task_events`` / ``-E``): fixed for a worker's life when it starts
    (``fix_events``), read from the configuration elsewhere."""
    fixed = getattr(app, "_ledger_events_fixed", None)
    if fixed is not None:
        return bool(fixed)
    return _events_setting(app)


def fix_events(app: Any) -> None:
    """Fix ``events_enabled`` for this worker, at its start (after ``-E`` is copied into the
    configuration, before the pool forks): a worker's setting does not change after that,
    and reading it from Celery's configuration costs about 15 us per lookup (a key looked up
    through each of its maps), twice per task."""
    app._ledger_events_fixed = _events_setting(app)


def _events_setting(app: Any) -> bool:
    flag = settings_for(app).send_events
    if flag is None:
        return bool(app.conf.worker_send_task_events)
    return flag
