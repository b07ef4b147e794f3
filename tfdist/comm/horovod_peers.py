"""Naming a lost Horovod rank: every rank answers liveness probes, and a failed collective says who is gone.

Gloo reports a lost peer as its own text ("Timed out waiting 15000ms for recv operation to complete",
"Connection closed by peer [addr]:port") with no rank in it. At start-up every rank opens a small TCP responder
on the address its peers reach it at and the ranks exchange (rank, host, pid, address). When a collective fails
with Horovod's or Gloo's error, the survivor probes every peer: a refused connection is a rank that exited, a
connection that gets no answer is a rank that is stopped or hung (its kernel still accepts, its threads do not
run). The uncaught error then ends the process with one line naming them, as for the TF backend.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from tfdist.comm.faults import WorkerLostError, add_lost_peer_namer
from tfdist.errors import troubleshooting

__all__ = ["Peer", "lost_rank_error", "probe", "start"]

PROBE_TIMEOUT_S = 2.0
# Phrases of Horovod's and Gloo's errors that mean a peer is gone (or Horovod stopped because of it).
_PEER_GONE = ("Gloo", "gloo", "Horovod has been shut down", "HorovodInternalError", "Connection closed by peer",
              "Timed out waiting", "Connection reset by peer", "MPI_ERR", "stall")


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    address: str  # host:port of its responder


_STATE: dict = {"rank": None, "peers": (), "server": None}
_LOCK = threading.Lock()


def _reachable_address() -> str:
    """The address peers reach this rank at: this host's address toward the Gloo rendezvous (where every rank
    connects), else its host name's."""
    rendezvous = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if rendezvous:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet sent: picks the route only
            s.connect((rendezvous, int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "9"))))
            return s.getsockname()[0]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _serve(server: socket.socket) -> None:
    reply = f"alive {os.getpid()}\n".encode()
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            try:
                conn.sendall(reply)
            except OSError:
                pass


def start(hvd) -> None:
    """Once per process, after `hvd.init()`, on every rank (a collective): the responder and the table of peers."""
    with _LOCK:
        if _STATE["server"] is not None:
            return
        host = _reachable_address()
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((host, 0))  # the one address peers use, an ephemeral port
        server.listen(16)
        threading.Thread(target=_serve, args=(server,), daemon=True, name="tfdist-liveness").start()
        _STATE["server"] = server
    own = Peer(hvd.rank(), socket.gethostname(), os.getpid(), f"{host}:{server.getsockname()[1]}")
    _STATE["rank"], _STATE["peers"] = own.rank, tuple(hvd.allgather_object(own))
    add_lost_peer_namer(lost_rank_error)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """'alive', 'exited' (nothing accepts at `address`) or 'silent' (accepted, no answer: stopped or hung)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            return "alive" if conn.recv(64).startswith(b"alive") else "exited"
    except TimeoutError:
        return "silent"
    except OSError:
        return "exited"


def lost_rank_error(err: BaseException) -> WorkerLostError | None:
    """A WorkerLostError naming the ranks that exited or stopped answering, if `err` is Horovod's or Gloo's way of
    saying a peer is gone and a probe finds one; else None."""
    text = f"{type(err).__name__}: {err}"
    if _STATE["rank"] is None or not any(phrase in text for phrase in _PEER_GONE):
        return None
    others = [p for p in _STATE["peers"] if p.rank != _STATE["rank"]]
    found = {p: probe(p.address) for p in others}
    lost = [f"rank {p.rank} (host {p.host}, pid {p.pid}): " + ("it exited" if status == "exited" else
                                                                "it stopped answering (stopped, hung or unreachable)")
            for p, status in found.items() if status != "alive"]
    if not lost:
        return None
    cause = next(phrase for phrase in _PEER_GONE if phrase in text)
    return WorkerLostError(f"rank {_STATE['rank']} lost " + "; ".join(lost) + f" ({cause}). The job cannot continue: "
                           "restart all ranks (with tfdist.training.BackupAndRestore, training resumes from the last "
                           "finished epoch)." + troubleshooting("a-worker-was-lost"))
