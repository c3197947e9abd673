"""Per-app ledger runtime: one ``LedgerRuntime`` per Celery app, and this worker's boot id.

Everything the ledger keeps for an app (its settings, store, snapshot cipher, events flag,
whether ``install`` ran) is one ``LedgerRuntime``, set on the app under one attribute
(``ATTRIBUTE``) and read through ``runtime_of(app)``; no other module sets anything on an app
(``tests/test_layout.py``). The functions below (``settings_for``, ``store_for``,
``snapshot_cipher``, ...) are thin reads of it, for the callers that hold only the app.

Fork: the runtime is made in the worker's parent (``install``, ``worker_init``) and each pool
process inherits a copy. What must not cross a fork is per process inside its parts, as it was
when they were separate attributes: the store's engine and connections
(``LedgerStore`` re-opens them in a process of another pid), and the confirming broker
connection (``recovery.publish.Confirming``, per pid). Settings, cipher and events flag are
plain values, the same in every process.

The boot id names one start of a worker node. It is made in the worker's parent process
before the pool forks (``worker_init``), so the parent and its pool processes share it; a
restarted worker gets a new one, which is how the boot sweep tells its own previous, dead
process from a live one with the same node name. It belongs to the process, not to an app.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Any

from celery_ledger.ledger import LedgerStore, Owner, SnapshotCipher, cipher_from
from celery_ledger.recovery.publish import Confirming, confirming
from celery_ledger.settings import LedgerSettings

#: The one attribute the ledger sets on a Celery app.
ATTRIBUTE = "_ledger_runtime"

_boot_id: str | None = None
_boot_lock = threading.Lock()


class LedgerRuntime:
    """The ledger's state for one Celery app: each part is made on first use.

    Made cheaply (``install`` makes it before any configuration is read); the settings are
    read from the app's configuration and ``CELERY_LEDGER_*`` on first use, and the store and
    cipher are built from them then. Two threads that race to build a part build it twice
    and keep one, as before: every part is a pure function of the settings.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        #: ``install(app)`` ran: the sweep task, beat entry and signal handlers are in place.
        self.installed = False
        self._settings: LedgerSettings | None = None
        self._store: LedgerStore | None = None
        self._cipher: SnapshotCipher | None = None
        self._cipher_made = False
        #: ``ledger_send_events`` as the worker fixed it at start (``fix_events``), or None.
        self._events_fixed: bool | None = None

    @property
    def settings(self) -> LedgerSettings:
        """The app's ledger settings, read once.

        Raises:
            ValueError: a setting that does not parse or cannot be used, naming it.
        """
        settings = self._settings
        if settings is None:
            settings = self._settings = LedgerSettings.from_app(self.app)
        return settings

    @property
    def store(self) -> LedgerStore:
        """The app's ledger store (its engine is per process and fork-safe)."""
        store = self._store
        if store is None:
            settings = self.settings
            store = self._store = LedgerStore(
                settings.url,
                durability=settings.durability,
                max_connections=settings.max_connections,
            )
        return store

    @property
    def cipher(self) -> SnapshotCipher | None:
        """The snapshot cipher (``ledger_snapshot_keys``), or None when no key is set."""
        if not self._cipher_made:
            self._cipher = cipher_from(self.settings.snapshot_keys)
            self._cipher_made = True
        return self._cipher

    @property
    def publisher(self) -> Confirming:
        """The app's confirmed-publish state (``recovery.publish``: whether its broker needs
        confirms, this process's confirming connection). Recovery keeps it, keyed by the app:
        it cannot import this module."""
        return confirming(self.app)

    def events_enabled(self) -> bool:
        """See ``events_enabled``."""
        fixed = self._events_fixed
        if fixed is not None:
            return fixed
        return self._events_setting()

    def fix_events(self) -> None:
        """See ``fix_events``."""
        self._events_fixed = self._events_setting()

    def _events_setting(self) -> bool:
        flag = self.settings.send_events
        if flag is None:
            return bool(self.app.conf.worker_send_task_events)
        return flag

    def reset(self) -> None:
        """Read the settings again on next use, and rebuild what is built from them (store,
        cipher, events flag); ``installed`` stays. The store built so far closes this
        process's connections. For a process whose configuration or environment changed (a
        test, a CLI run in the same process)."""
        store, self._store = self._store, None
        self._settings = None
        self._cipher, self._cipher_made = None, False
        self._events_fixed = None
        if store is not None:
            store.dispose()

    def parts(self) -> dict[str, Any]:
        """What this runtime holds now (for a report or a test): which parts are built, the
        events flag as fixed, the confirmed-publish state, the boot id. Builds none of them."""
        publisher = confirming(self.app)
        return {
            "installed": self.installed,
            "settings": self._settings is not None,
            "store": self._store is not None,
            "cipher": self._cipher_made and self._cipher is not None,
            "events_fixed": self._events_fixed,
            "publisher": {"confirms": publisher.needed, "connection": publisher.open_here()},
            "boot": _boot_id,
        }


def runtime_of(app: Any) -> LedgerRuntime:
    """``app``'s ``LedgerRuntime``, made on first use and kept on the app (``ATTRIBUTE``).

    ``setdefault`` on the app's own ``__dict__`` makes it once, whichever thread asks first.
    """
    found: LedgerRuntime | None = getattr(app, ATTRIBUTE, None)
    if found is None:
        found = vars(app).setdefault(ATTRIBUTE, LedgerRuntime(app))
    return found


def is_installed(app: Any) -> bool:
    """Whether ``install(app)`` ran (never makes a runtime for an app without one)."""
    found: LedgerRuntime | None = getattr(app, ATTRIBUTE, None)
    return found is not None and found.installed


def reset(app: Any) -> None:
    """``LedgerRuntime.reset`` for ``app``, if it has a runtime."""
    found: LedgerRuntime | None = getattr(app, ATTRIBUTE, None)
    if found is not None:
        found.reset()


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
    """The app's ledger settings (``LedgerRuntime.settings``)."""
    return runtime_of(app).settings


def store_for(app: Any) -> LedgerStore:
    """The app's ledger store (one per app; its engine is per process and fork-safe)."""
    return runtime_of(app).store


def snapshot_cipher(app: Any) -> SnapshotCipher | None:
    """The app's snapshot cipher (``ledger_snapshot_keys``), or None when no key is set."""
    return runtime_of(app).cipher


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
    return runtime_of(app).events_enabled()


def fix_events(app: Any) -> None:
    """Fix ``events_enabled`` for this worker, at its start (after ``-E`` is copied into the
    configuration, before the pool forks): a worker's setting does not change after that,
    and reading it from Celery's configuration costs about 15 us per lookup (a key looked up
    through each of its maps), twice per task."""
    runtime_of(app).fix_events()
