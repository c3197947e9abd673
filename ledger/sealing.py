"""Encryption at rest for argument snapshots: Fernet, with a key list for rotation.

A snapshot holds a task's arguments (card numbers included) because resume needs them. With
``ledger_snapshot_keys`` set, the worker seals each snapshot before it is written: the stored
text is ``fernet:`` + a Fernet token (AES-128-CBC + HMAC-SHA256, ``cryptography``'s
``Fernet``), and only a process holding a key (the worker, beat's sweep, the CLI's resume,
Flower's page) can read it. A database dump, a replica or a backup then carries no argument
value.

Rotation (``MultiFernet``): the *first* key seals; every key opens. To rotate, put the new key
first and keep the old ones (``new,old``) in every process that reads snapshots; new snapshots
are sealed with the new key, old ones still open. ``celery-ledger reseal`` re-encrypts the
stored snapshots under the first key; after it (or after every entry sealed with the old key
has settled and been pruned, ``ledger_retention_days``), drop the old key.

Snapshots written before a key was set stay plain JSON and are read as before; a sealed
snapshot without a key that opens it cannot be resumed (the sweep parks the entry with the
reason, as for any unreadable snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_ledger.ledger.errors import SnapshotSealError

#: How a sealed snapshot starts (a plain one is a JSON object: ``{``).
PREFIX = "fernet:"


def is_sealed(text: str | None) -> bool:
    return text is not None and text.startswith(PREFIX)


class SnapshotCipher:
    """Seals and opens snapshots with a key list (the first key seals)."""

    def __init__(self, keys: Sequence[str]) -> None:
        """
        Raises:
            SnapshotSealError: no key, a key that is not a Fernet key (32 url-safe base64
                bytes), or ``cryptography`` is not installed. The message never holds a key.
        """
        if not keys:
            raise SnapshotSealError("ledger_snapshot_keys is empty")
        try:
            from cryptography.fernet import Fernet, MultiFernet
        except ImportError:
            raise SnapshotSealError(
                "ledger_snapshot_keys needs the cryptography package: "
                "pip install 'celery-ledger[encryption]'"
            ) from None
        fernets = []
        for i, key in enumerate(keys, 1):
            try:
                fernets.append(Fernet(key.encode("ascii") if isinstance(key, str) else key))
            except (ValueError, TypeError, UnicodeEncodeError):
                raise SnapshotSealError(
                    f"ledger_snapshot_keys: key {i} of {len(keys)} is not a Fernet key "
                    "(32 url-safe base64-encoded bytes; make one with "
                    "`python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())'`)"
                ) from None
        self._fernet: Any = MultiFernet(fernets)
        self.keys = len(fernets)

    def seal(self, text: str) -> str:
        """``text`` encrypted under the first key, as ``fernet:<token>``."""
        return PREFIX + self._fernet.encrypt(text.encode("utf-8")).decode("ascii")

    def open(self, text: str) -> str:
        """The plain text of a sealed snapshot; a plain one is returned as it is.

        Raises:
            SnapshotSealError: no key opens it (rotated away, or another deployment's key).
        """
        if not is_sealed(text):
            return text
        from cryptography.fernet import InvalidToken

        try:
            return self._fernet.decrypt(text[len(PREFIX) :].encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError, ValueError):
            raise SnapshotSealError(
                "the argument snapshot is sealed with a key that is not in ledger_snapshot_keys"
            ) from None

    def reseal(self, text: str) -> str:
        """``text`` sealed under the first key (a plain snapshot is sealed; a sealed one is
        re-encrypted, keeping its original timestamp: ``MultiFernet.rotate``).

        Raises:
            SnapshotSealError: no key opens it.
        """
        if not is_sealed(text):
            return self.seal(text)
        from cryptography.fernet import InvalidToken

        try:
            token = self._fernet.rotate(text[len(PREFIX) :].encode("ascii"))
        except (InvalidToken, ValueError):
            raise SnapshotSealError(
                "the argument snapshot is sealed with a key that is not in ledger_snapshot_keys"
            ) from None
        return PREFIX + token.decode("ascii")


def cipher_from(keys: Sequence[str]) -> SnapshotCipher | None:
    """A cipher over ``keys``, or None when there is none (snapshots stay plain JSON)."""
    return SnapshotCipher(keys) if keys else None


def open_snapshot(text: str, cipher: SnapshotCipher | None) -> str:
    """The plain JSON of a stored snapshot, sealed or not.

    Raises:
        SnapshotSealError: it is sealed and ``cipher`` is None or holds no key that opens it.
    """
    if not is_sealed(text):
        return text
    if cipher is None:
        raise SnapshotSealError(
            "the argument snapshot is sealed (encrypted at rest) and no ledger_snapshot_keys "
            "is set in this process"
        )
    return cipher.open(text)
