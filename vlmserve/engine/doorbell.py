"""[worker] Rank 0 rings the other ranks before each message, so that they wait in the kernel.

MLX's ``ring`` backend polls while a rank waits in ``recv``: a rank that waited 4 s for a message
used 2.8 s of CPU. A rank waiting for rank 0's next step would keep a core busy for as long as the
server is idle. So rank 0 first writes one byte to each rank over a plain TCP connection (the
doorbell), and a rank reads that byte, sleeping in the kernel, before its ``recv``; the message
itself still goes over the group (the link ``jaccl`` makes fast). A rank that cannot reach rank 0
(no address known, a firewall) waits in ``recv`` as before; the start-up log says which.

Rank 0's address comes from what ``mlx.launch`` gives each rank: the ring hostfile
(``MLX_HOSTFILE``) or the jaccl coordinator (``MLX_JACCL_COORDINATOR``). The doorbell also tells a
rank at once when rank 0's process is gone (the connection closes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0


class RankZeroGone(ConnectionError):
    """Rank 0 closed its doorbell: its process ended."""


def rank0_host() -> str | None:
    """Rank 0's address as ``mlx.launch`` tells every rank, or None."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    hostfile = os.environ.get("MLX_HOSTFILE")
    try:
        hosts = json.loads(Path(hostfile).read_text()) if hostfile else None
        return str(hosts[0][0]).rsplit(":", 1)[0] if hosts else None
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


class Doorbell:
    """Rank 0: a connection to each rank that answered; another rank: its connection to rank 0."""

    def __init__(self, sockets: dict[int, socket.socket]) -> None:
        self.sockets = sockets

    def ring(self) -> None:
        """Rank 0, before a message: one byte to every rank."""
        for sock in self.sockets.values():
            sock.sendall(b"\x01")

    def wait(self) -> None:
        """Another rank: sleep until rank 0 rings (no-op without a connection)."""
        sock = self.sockets.get(0)
        if sock is not None and not sock.recv(1):
            raise RankZeroGone("rank 0 closed the connection")

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()


def _gather(value: int) -> list[int]:
    gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.int32))
    return [int(v) for v in np.array(gathered)]


def connect(rank: int, size: int) -> Doorbell:
    """Every rank calls this at start-up, together (two ``all_gather``s): rank 0 listens, the others
    connect to it."""
    listener: socket.socket | None = None
    accepted: dict[int, socket.socket] = {}
    if rank == 0:
        listener = socket.create_server(("", 0))
        listener.settimeout(CONNECT_TIMEOUT_S)
    port = _gather(listener.getsockname()[1] if listener is not None else 0)[0]

    def accept() -> None:
        assert listener is not None
        try:
            while len(accepted) < size - 1:
                sock, _ = listener.accept()
                sock.settimeout(None)
                accepted[sock.recv(1)[0]] = sock
        except (OSError, IndexError):
            pass  # a rank that never connects waits in recv instead

    acceptor = threading.Thread(target=accept, name="doorbell-accept", daemon=True)
    if rank == 0:
        acceptor.start()
    own: dict[int, socket.socket] = {}
    host = rank0_host() if rank else None
    if host is not None:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            sock.sendall(bytes([rank]))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            own[0] = sock
        except OSError as exc:
            log.warning("rank %d: no doorbell from rank 0 at %s:%d (%s): it will wait for each step in a polling recv",
                        rank, host, port, exc)
    connected = _gather(1 if own else 0)
    if rank:
        return Doorbell(own)
    assert listener is not None
    acceptor.join(CONNECT_TIMEOUT_S)
    listener.close()
    rung = {r: s for r, s in accepted.items() if connected[r]}
    for sock in rung.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    missing = [r for r in range(1, size) if r not in rung]
    if missing:
        log.warning("ranks %s have no doorbell: they wait for each step in a polling recv (a core each)", missing)
    return Doorbell(rung)
