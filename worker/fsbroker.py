"""kombu's ``filesystem://`` transport, without its torn reads: the embedded default's broker.

kombu's ``Channel._put`` creates a message file, then locks it and writes it; ``_get`` renames
the oldest file of its queue out of the folder and reads it, without the lock. A consumer that
lists the folder between the create and the write takes an empty message: ``loads`` raises
``JSONDecodeError`` inside the consumer's drain, which Celery treats as an unrecoverable error,
and the worker exits. Seen in CI: the demo's ledgered worker died at its first message and ran
none of its orders (kombu 5.x; kombu #1551 reports the same error).

Both halves are fixed here, so that either side alone is safe:

- ``_put`` writes the message under a name no consumer picks (``<name>.msg.part``: its queue
  part does not end in ``.msg``), then renames it into place. A rename within one folder is
  atomic: a consumer sees a whole message or none.
- ``_get`` takes a message only once it is whole: its writer's lock is free and it is not
  empty (kombu's own ``_put`` writes under that lock). A message still being written stays in
  the queue for the next poll. The rename that moves it out is still the claim: of two
  consumers, one rename wins.

``create_app`` selects this transport for ``filesystem://`` (``broker_transport``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

try:  # kombu defines it for Windows only
    from kombu.transport.filesystem import LOCK_NB
except ImportError:
    from fcntl import LOCK_NB

#: What ``broker_transport`` names to select this transport.
TRANSPORT = "celery_ledger.fsbroker:Transport"
#: The suffix of a message being written; ``_get`` never matches it.
PARTIAL = ".part"


class Channel(filesystem.Channel):
    # kombu's own filesystem Channel names the argument ``payload`` where its base names it
    # ``message``; this keeps the parent's name, as Celery's callers pass it by position.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` onto ``queue``: written aside, then renamed into place (atomic)."""
        body = str_to_bytes(dumps(payload))
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + PARTIAL
        try:
            with open(partial, "wb", buffering=0) as f:
                f.write(body)
            os.replace(partial, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        """The oldest whole message of ``queue``, moved out of it.

        Raises:
            Empty: no whole message waits (one still being written waits for the next poll).
        """
        queue_find = f"{queue}.msg"
        processed = self.processed_folder if self.store_processed else tempfile.gettempdir()
        for filename in sorted(os.listdir(self.data_folder_in)):
            if filename.partition(".")[2] != queue_find:
                continue
            path = os.path.join(self.data_folder_in, filename)
            if not _whole(path):
                continue
            try:
                # The claim: of two consumers, one rename succeeds.
                shutil.move(path, processed)
            except OSError:
                continue  # taken by another consumer meanwhile
            moved = os.path.join(processed, filename)
            try:
                with open(moved, "rb") as f:
                    payload = f.read()
                if not self.store_processed:
                    os.remove(moved)
            except OSError as exc:
                raise ChannelError(f"Cannot read file {moved!r} from queue.") from exc
            return loads(bytes_to_str(payload))
        raise Empty()


def _whole(path: str) -> bool:
    """Whether the message at ``path`` is written: not locked by its writer, and not empty
    (a writer that created it and has not taken its lock yet has written nothing)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the lock test
    except OSError:
        return False  # taken by another consumer
    try:
        try:
            filesystem.lock(f, filesystem.LOCK_EX | LOCK_NB)
        except OSError:
            return False  # its writer holds the lock: still writing
        try:
            return os.fstat(f.fileno()).st_size > 0
        finally:
            filesystem.unlock(f)
    finally:
        f.close()


class Transport(filesystem.Transport):
    Channel = Channel
