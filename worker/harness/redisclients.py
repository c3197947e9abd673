"""What a Redis server holds for one local process's connections (the soak and the tests).

Redis's ``CLIENT LIST`` names each connection by its address; ``/proc/<pid>/fd`` and
``/proc/<pid>/net/tcp`` say which local ports are that process's sockets. Matched, they give
the channels the process is subscribed to (``sub``) and the replies Redis buffers for it
(``omem``), on a server other processes share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def local_ports(pid: int) -> set[int]:
    """Local TCP ports of ``pid``'s sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def clients_of(client: Any, pid: int) -> dict[str, int]:
    """``pid``'s connections to ``client``'s server: how many, the channels they subscribe
    to, and the bytes of replies Redis holds for them."""
    ports = local_ports(pid)
    mine = [c for c in client.client_list() if int(c["addr"].rsplit(":", 1)[1]) in ports]
    return {
        "connections": len(mine),
        "subscribed": sum(int(c.get("sub", 0)) for c in mine),
        "omem": sum(int(c.get("omem", 0)) for c in mine),
    }
