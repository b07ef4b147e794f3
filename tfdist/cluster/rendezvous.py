"""Where the launchers of several nodes meet: `tfdist launch --nnodes N --node-rank R --master HOST:PORT`.

Node 0's launcher serves a small TCP rendezvous on HOST:PORT (that address only). Every node's launcher, node 0's
included, sends one JSON line per round (a round per start, so a restart meets again): its node rank, N, how many
workers it runs and the address and ports they will listen on. When all N nodes of the round have arrived, each
gets the whole list back, ordered by node rank, and builds the same TF_CONFIG from it. A rank out of range, a rank
claimed twice, or a node that disagrees about N or the workers per node gets an error that names it; a node that
never comes is named when the wait runs out.

Example (two launchers of one job, here in one process):
    >>> with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=10) as server:
    ...     ...  # join(server.address, NodeInfo(0, 2, 1, "10.0.0.1", [2222]), 10) on node 0, rank 1 on node 1
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from dataclasses import asdict, dataclass

from tfdist.errors import ConfigError

__all__ = ["NodeInfo", "RendezvousServer", "address_towards", "join", "parse_master"]


@dataclass(frozen=True)
class NodeInfo:
    """What one node's launcher tells the others."""

    node_rank: int
    nnodes: int
    nproc: int              # workers on this node
    host: str               # the address the other nodes reach this node's workers at
    ports: list[int]        # one per worker
    round: int = 0          # the start this is for (0, then one more per restart)


def parse_master(text: str) -> tuple[str, int]:
    """('host', port) of a --master HOST:PORT; ConfigError naming the option when malformed."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master must be HOST:PORT of node 0 (e.g. 10.0.0.1:29400), got {text!r}.")
    return host.strip("[]"), int(port)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`: what the other nodes of the job can reach it at."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: the kernel only picks the route and the source address
            return s.getsockname()[0]
    except OSError as err:
        raise ConfigError(f"--master {host}: no route from this node ({err}).") from None


class RendezvousServer:
    """Node 0's rendezvous (a thread), for as long as the context lasts."""

    def __init__(self, host: str, port: int, *, nnodes: int, timeout_s: float):
        self.nnodes, self.timeout_s = nnodes, timeout_s
        self._rounds: dict[int, dict[int, NodeInfo]] = {}
        self._changed = threading.Condition()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = 60  # seconds for the one line a launcher sends; an idle connection does not keep a thread

            def handle(self):
                try:
                    node = NodeInfo(**json.loads(self.rfile.readline(65536)))
                    reply = {"nodes": [asdict(n) for n in outer.meet(node)]}
                except (ConfigError, TypeError, ValueError, OSError) as err:
                    reply = {"error": str(err)}
                self.wfile.write((json.dumps(reply) + "\n").encode())

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._make = lambda: Server((host, port), Handler)
        self.address = f"{host}:{port}"

    def __enter__(self) -> RendezvousServer:
        try:
            self._server = self._make()
        except OSError as err:
            raise ConfigError(f"--master {self.address}: node 0 cannot listen there ({err}). Give an address of "
                              "node 0 and a free port.") from None
        host, port = self._server.server_address[:2]
        self.address = f"{host}:{port}"
        threading.Thread(target=self._server.serve_forever, name="tfdist-rendezvous", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def arrived(self, round: int = 0) -> list[int]:
        """The node ranks waiting in (or done with) round `round`."""
        with self._changed:
            return sorted(self._rounds.get(round, {}))

    def meet(self, node: NodeInfo) -> list[NodeInfo]:
        """Registers `node` for its round and waits until every node of the round has come (what each connection
        asks); ConfigError for a bad node or when the wait runs out."""
        if node.nnodes != self.nnodes:
            raise ConfigError(f"node {node.node_rank} says --nnodes {node.nnodes}, node 0 says {self.nnodes}.")
        if not 0 <= node.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {node.node_rank} is out of range for --nnodes {self.nnodes} "
                              f"(0..{self.nnodes - 1}).")
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            nodes = self._rounds.setdefault(node.round, {})
            if node.node_rank in nodes:
                raise ConfigError(f"two nodes claim --node-rank {node.node_rank}: {nodes[node.node_rank].host} "
                                  f"and {node.host}. Give each node its own rank.")
            other = next(iter(nodes.values()), None)
            if other is not None and other.nproc != node.nproc:
                raise ConfigError(f"node {node.node_rank} runs -n {node.nproc} workers, node {other.node_rank} "
                                  f"runs {other.nproc}: every node runs the same -n.")
            nodes[node.node_rank] = node
            self._changed.notify_all()
            while len(nodes) < self.nnodes:
                left = deadline - time.monotonic()
                if left <= 0:
                    del nodes[node.node_rank]  # this node gives up: a relaunch of it may claim the rank again
                    missing = sorted(set(range(self.nnodes)) - set(nodes) - {node.node_rank})
                    raise ConfigError(f"node rank(s) {missing} did not join the rendezvous at {self.address} within "
                                      f"{self.timeout_s:g} s (--rdzv-timeout): start `tfdist launch --nnodes "
                                      f"{self.nnodes} --node-rank R --master {self.address}` on every node.")
                self._changed.wait(left)
            return [nodes[r] for r in range(self.nnodes)]


def join(master: str, node: NodeInfo, timeout_s: float) -> list[NodeInfo]:
    """Meets the other nodes at `master` (HOST:PORT); returns every node's info, ordered by node rank."""
    host, port = parse_master(master)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(f"the rendezvous at --master {master} did not answer within {timeout_s:g} s "
                                  "(--rdzv-timeout): is node 0's `tfdist launch` running, and can this node reach "
                                  "that address?") from None
            time.sleep(0.5)
    with conn:
        conn.settimeout(timeout_s + 30)  # the server gives up first and says which nodes are missing
        try:
            conn.sendall((json.dumps(asdict(node)) + "\n").encode())
            line = conn.makefile().readline()
        except OSError as err:
            raise ConfigError(f"the rendezvous at --master {master} stopped answering ({err}).") from None
    if not line:
        raise ConfigError(f"the rendezvous at --master {master} closed the connection without an answer.")
    reply = json.loads(line)
    if "error" in reply:
        raise ConfigError(reply["error"])
    return [NodeInfo(**n) for n in reply["nodes"]]
