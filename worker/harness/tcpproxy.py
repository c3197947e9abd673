"""A small TCP proxy on 127.0.0.1 that ``celery-ledger verify`` cuts and restores: a ledger
outage that touches only the processes verify started (they reach the ledger through it).

``stop()`` closes the listening socket and every relayed connection, so clients see the
database as gone (connection refused, then reset); ``start()`` listens on the same port again.
It only ever listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Relay 127.0.0.1:``port`` to ``target``; one thread per direction per connection."""

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        """Listen (again): on the first start a free port is picked unless one was given."""
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", self.port))
        lsock.listen(64)
        self.port = lsock.getsockname()[1]
        self._listener = lsock
        threading.Thread(target=self._accept, args=(lsock,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Refuse new connections and cut every relayed one."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, lsock: socket.socket) -> None:
        while True:
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not lsock:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
