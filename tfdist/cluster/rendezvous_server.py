"""Node 0's side of the rendezvous of `tfdist launch --nnodes N` (how it works: tfdist.cluster.rendezvous).

`RendezvousServer` listens on --master HOST:PORT in a thread of node 0's launcher and answers every launcher's
`join` (one JSON line each way) and `watch_rounds` connection; a launcher that hangs up while it waits gives its
rank back.

Example (two launchers of one job, here in one process):
    >>> with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=10) as server:
    ...     ...  # join(server.address, NodeInfo(0, 2, 1, "10.0.0.1", [2222]), 10) on node 0, rank 1 on node 1
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

from tfdist.cluster.rendezvous import (
    NodeInfo,
    host_part,
    is_loopback,
    loopback_note,
    ran_out_note,
    resolve_address,
    seconds_text,
)
from tfdist.errors import ConfigError, troubleshooting

__all__ = ["RendezvousServer"]

# Seconds between two looks at whether a waiting launcher has hung up (killed while it waited): its rank is then
# free for its relaunch, and a watcher's thread ends.
POLL_S = 0.5


class _HungUp(Exception):
    """The launcher on the other end of a connection has gone: there is nobody to answer."""


@dataclass(eq=False)
class _Seat:
    """A node's place in a round: what it sent, and whether its launcher has hung up since."""

    node: NodeInfo
    hung_up: Callable[[], bool]


class RendezvousServer:
    """Node 0's rendezvous (a thread), for as long as the context lasts. `say` gets a line when a node's launcher
    comes back counting from its first round (it was restarted)."""

    def __init__(self, host: str, port: int, *, nnodes: int, timeout_s: float,
                 say: Callable[[str], None] | None = None):
        self.nnodes, self.timeout_s = nnodes, timeout_s
        self._host, self._port = host, port
        self._say = say or (lambda line: None)
        self._rounds: dict[int, dict[int, _Seat]] = {0: {}}
        self._open = 0                     # the round arriving nodes join
        self._failed: dict[int, str] = {}  # round -> the error every node of it gets
        self._closing = False
        self._answering = 0                # connections being answered
        self._changed = threading.Condition()
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def __enter__(self) -> RendezvousServer:
        try:
            family, sockaddr = resolve_address(self._host, self._port, socket.SOCK_STREAM)
            self._server = _Server(sockaddr, family, self)
        except OSError as err:
            raise ConfigError(f"--master {self.address}: node 0 cannot listen there ({err}). Give an address of "
                              "node 0 and a free port.") from None
        sockaddr = self._server.server_address
        self._port = sockaddr[1]  # the one the kernel chose for port 0
        self.address = f"{host_part(sockaddr)}:{sockaddr[1]}"
        threading.Thread(target=self._server.serve_forever, name="tfdist-rendezvous", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:  # every node still waiting here is told, instead of waiting out its timeout
            self._closing = True
            self._changed.notify_all()
            # ... before this process may exit: its handler threads are daemons, ended without a word
            self._changed.wait_for(lambda: not self._answering, timeout=5)
        self._server.shutdown()
        self._server.server_close()

    def arrived(self, round: int | None = None) -> list[int]:
        """The node ranks waiting in (or done with) round `round`, by default the open one."""
        with self._changed:
            return sorted(self._rounds.get(self._open if round is None else round, {}))

    def meet(self, node: NodeInfo, *, wait_s: float | None = None, bound: str = "--rdzv-timeout",
             hung_up: Callable[[], bool] | None = None) -> list[NodeInfo]:
        """Puts `node` in its round (`_round_for`) and waits until every node of that round has come (what each
        connection asks); returns them with that round. ConfigError for a bad node, a failed round, or when the wait
        runs out: this server's timeout_s or the node's own `wait_s` (set by its option `bound`), whichever is
        shorter. `hung_up` says whether the node's launcher is gone: then it leaves the round."""
        self._check(node)
        hung_up = hung_up or (lambda: False)
        if wait_s is None or not 0 <= wait_s < self.timeout_s:
            wait_s, bound = self.timeout_s, "--rdzv-timeout"
        deadline = time.monotonic() + wait_s
        with self._changed:
            r = self._round_for(node)
            seats = self._rounds[r]
            other = next(iter(seats.values()), None)
            if other is not None and other.node.nproc != node.nproc:
                raise ConfigError(f"node {node.node_rank} runs -n {node.nproc} workers, node {other.node.node_rank} "
                                  f"runs {other.node.nproc}: every node runs the same -n.")
            seat = seats[node.node_rank] = _Seat(replace(node, round=r), hung_up)
            self._check_reachable(r)
            self._changed.notify_all()
            try:
                while not self._complete(r):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ConfigError(self._missing(r, node.node_rank, wait_s, bound))
                    if hung_up():
                        raise _HungUp
                    self._changed.wait(min(left, POLL_S))
            except BaseException:
                if seats.get(node.node_rank) is seat:  # it gives up or is gone: a relaunch of it may take the rank
                    del seats[node.node_rank]
                    self._changed.notify_all()
                raise
            return [seats[k].node for k in range(self.nnodes)]

    def watch(self, node_rank: int, hung_up: Callable[[], bool]) -> dict:
        """Waits until a round opens that `node_rank` has not met in (another node restarted) and returns it as
        {"round": r, "nodes": [ranks there]}; _HungUp when the watcher hangs up or the server closes first."""
        with self._changed:
            since = max((r for r, seats in self._rounds.items() if node_rank in seats), default=-1)
            while not self._closing and not hung_up():
                newer = self._rounds[self._open] if self._open > since else {}
                if newer:
                    return {"round": self._open, "nodes": sorted(newer)}
                self._changed.wait(POLL_S)
            raise _HungUp

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Counts one connection as being answered while the context lasts: closing waits for its reply."""
        with self._changed:
            self._answering += 1
        try:
            yield
        finally:
            with self._changed:
                self._answering -= 1
                self._changed.notify_all()

    def answer(self, request: dict, hung_up: Callable[[], bool]) -> dict:
        """The reply to one connection's request: a watch (`watch_rounds`) or a node's join (`join`)."""
        if "watch" in request:
            return self.watch(int(request["watch"]), hung_up)
        wait_s, bound = request.pop("wait_s", None), str(request.pop("bound", "--rdzv-timeout"))
        nodes = self.meet(NodeInfo(**request), wait_s=None if wait_s is None else float(wait_s), bound=bound,
                          hung_up=hung_up)
        return {"nodes": [asdict(n) for n in nodes]}

    def _check(self, node: NodeInfo) -> None:
        if node.nnodes != self.nnodes:
            raise ConfigError(f"node {node.node_rank} says --nnodes {node.nnodes}, node 0 says {self.nnodes}.")
        if not 0 <= node.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {node.node_rank} is out of range for --nnodes {self.nnodes} "
                              f"(0..{self.nnodes - 1}).")

    def _round_for(self, node: NodeInfo) -> int:
        """The round `node` joins: the open one, or a new one once it has met there already. The server counts the
        job's rounds, not the node: a launcher restarted by a cluster manager counts from 0 again, and joins the job
        where it is."""
        r, rank = self._open, node.node_rank
        self._raise_if_failed(r)
        seats = self._rounds[r]
        if len(seats) < self.nnodes:  # a launcher killed while it waited must not complete the round, nor hold its rank
            for gone in [k for k, seat in seats.items() if seat.hung_up()]:
                del seats[gone]
        if rank in seats and len(seats) < self.nnodes:
            raise ConfigError(f"two nodes claim --node-rank {rank}: {seats[rank].node.host} and {node.host}. "
                              "Give each node its own rank.")
        if rank not in seats:
            return r
        self._open = r + 1
        self._rounds[self._open] = {}
        if node.round <= r:  # a restart of its workers would count r + 1
            self._say(f"[launch] node {rank} came back at round {node.round} by its count while the job is at round "
                      f"{r}: its launcher was restarted. Every node restarts in round {self._open}.")
        return self._open

    def _check_reachable(self, r: int) -> None:
        """Fails round `r` for all its nodes at once when some advertise a loopback address and others a routable
        one: no other machine reaches a loopback address, so the round could never form (a node that reaches the
        master through a tunnel or a port forward, with --master 127.0.0.1, advertises its own loopback)."""
        nodes = {k: seat.node for k, seat in self._rounds[r].items()}
        local = sorted(k for k, n in nodes.items() if is_loopback(n.host))
        routable = sorted(set(nodes) - set(local))
        if local and routable:
            example = f" (e.g. --master {nodes[0].host}:{self._port})" if 0 in routable else ""
            self._failed[r] = (
                f"node(s) {local} advertise the loopback address {nodes[local[0]].host} for their workers and node(s) "
                f"{routable} the routable {nodes[routable[0]].host}: no other machine can reach a loopback address. "
                f"Give every node a routable --master, an address of node 0 that every machine reaches{example}, "
                "not 127.0.0.1, localhost or ::1 (a tunnel to the master does not carry the workers' connections)."
                + troubleshooting("a-node-does-not-join---nnodes"))

    def _complete(self, r: int) -> bool:
        """Whether every node of round `r` has come; ConfigError when the round has failed or node 0's launcher is
        ending."""
        self._raise_if_failed(r)
        return len(self._rounds[r]) == self.nnodes

    def _raise_if_failed(self, r: int) -> None:
        if r in self._failed:
            raise ConfigError(self._failed[r])
        if self._closing:
            raise ConfigError(f"the rendezvous at {self.address} closed before node rank(s) "
                              f"{sorted(set(range(self.nnodes)) - set(self._rounds[r]))} came: node 0's launcher "
                              "ended (its job finished or failed; its output says which)."
                              + troubleshooting("a-node-does-not-join---nnodes"))

    def _missing(self, r: int, rank: int, waited_s: float, bound: str) -> str:
        missing = sorted(set(range(self.nnodes)) - set(self._rounds[r]) - {rank})
        return (f"node rank(s) {missing} did not join the rendezvous at {self.address} within "
                f"{seconds_text(waited_s)} s {ran_out_note(bound)}: start `tfdist launch --nnodes {self.nnodes} "
                f"--node-rank R --master {self.address}` on every node.{loopback_note(self._host)}"
                + troubleshooting("a-node-does-not-join---nnodes"))


class _Handler(socketserver.StreamRequestHandler):
    """One connection: a launcher's request line, answered by the RendezvousServer behind its `_Server`."""

    timeout = 60  # seconds for the one line a launcher sends; an idle connection does not keep a thread
    server: _Server

    def handle(self) -> None:
        rendezvous = self.server.rendezvous
        with rendezvous.answering():
            try:
                reply = rendezvous.answer(json.loads(self.rfile.readline(65536)), lambda: _hung_up(self.connection))
            except _HungUp:
                return
            except (ConfigError, TypeError, ValueError, AttributeError, OSError) as err:
                reply = {"error": str(err)}
            with contextlib.suppress(OSError):
                self.wfile.write((json.dumps(reply) + "\n").encode())


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple, family: int, rendezvous: RendezvousServer):
        self.address_family = family  # read by TCPServer.__init__ when it makes the socket
        self.rendezvous = rendezvous  # what each connection's _Handler asks
        super().__init__(address, _Handler)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the other end of `conn` has closed it (a launcher killed while it waits): readable, yet no byte."""
    try:
        poller = select.poll()  # not select.select: no limit on the descriptor's number
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(0)) and not conn.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True
