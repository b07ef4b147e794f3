"""Where the launchers of several nodes meet: `tfdist launch --nnodes N --node-rank R --master HOST:PORT`.

Node 0's launcher serves a small TCP rendezvous on HOST:PORT (that address only: IPv4, or IPv6 in brackets, e.g.
[fd00::1]:29400 or [fe80::1%eth0]:29400). Every node's launcher, node 0's included, sends one JSON line per start
and restart: its node rank, N, how many workers it runs and the address and ports they will listen on. The server
decides which round (a start of the whole job) a node joins: the open one, or a new one when the node has met in
the open one already (it restarted its workers, or its launcher was restarted and counts from 0 again). When all
N nodes of the round have arrived, each gets the whole list back, ordered by node rank, and builds the same
TF_CONFIG from it. While its workers run, every launcher watches for a newer round (`watch_rounds`): one node's
restart stops the others' workers, and the whole job meets again in that round.

Refused, naming the node and the fix: a rank out of range, a rank claimed twice, a node that disagrees about N or
the workers per node, and a round where some nodes advertise a loopback address and others a routable one (every
node of that round gets the error at once). A node that never comes is named when the wait runs out: the node's
--rdzv-timeout, or its job's --timeout when that ends first (`job_deadline`).

This module is what every node's launcher uses; node 0's server is `RendezvousServer` in
tfdist.cluster.rendezvous_server, which takes the address helpers and message pieces from here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace

from tfdist.errors import ConfigError

__all__ = ["NodeInfo", "address_towards", "host_part", "is_loopback", "job_deadline", "join", "loopback_note",
           "parse_master", "ran_out_note", "resolve_address", "seconds_text", "watch_rounds"]

# The end of this launcher's job (time.monotonic()), set by `job_deadline`: no rendezvous wait outlasts it.
_JOB_END: ContextVar[float | None] = ContextVar("tfdist_job_end", default=None)


@dataclass(frozen=True)
class NodeInfo:
    """What one node's launcher tells the others."""

    node_rank: int
    nnodes: int
    nproc: int              # workers on this node
    host: str               # where the other nodes reach this node's workers, as in HOST:PORT ([...] for IPv6)
    ports: list[int]        # one per worker
    round: int = 0          # the start this is for, by the node's count; the rendezvous answers with the job's


def parse_master(text: str) -> tuple[str, int]:
    """('host', port) of a --master HOST:PORT or [IPV6]:PORT (the host without brackets); ConfigError naming the
    option when malformed."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master must be HOST:PORT of node 0 (e.g. 10.0.0.1:29400 or [fd00::1]:29400), got "
                          f"{text!r}.")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not host or "[" in host or "]" in host or (":" in host and not bracketed):
        raise ConfigError(f"--master must be HOST:PORT of node 0, an IPv6 address in brackets (e.g. [fd00::1]:29400 "
                          f"or [fe80::1%eth0]:29400), got {text!r}.")
    return host, int(port)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`, as the host of HOST:PORT ([...] for IPv6): what the other
    nodes of the job can reach it at."""
    try:
        family, sockaddr = resolve_address(host, 9, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # no packet is sent: the kernel only picks the route and the source address
            return host_part(s.getsockname())
    except OSError as err:
        raise ConfigError(f"--master {host}: no route from this node ({err}).") from None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, as NodeInfo.host holds it) is a loopback one: reachable from its own machine only.
    A name is not resolved here: False."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


@contextlib.contextmanager
def job_deadline(timeout_s: float | None) -> Iterator[None]:
    """Within this context (this thread), every `join` also ends with the job, `timeout_s` from now (`tfdist launch
    --timeout`), when that comes before its own timeout, and then names --timeout as what ran out."""
    token = _JOB_END.set(None if timeout_s is None else time.monotonic() + timeout_s)
    try:
        yield
    finally:
        _JOB_END.reset(token)


def join(master: str, node: NodeInfo, timeout_s: float) -> list[NodeInfo]:
    """Meets the other nodes at `master` (HOST:PORT); returns every node's info, ordered by node rank, with the round
    the job is at. Waits at most `timeout_s` (--rdzv-timeout), or until the job's end (`job_deadline`) if sooner."""
    host, port = parse_master(master)
    wait_s, bound = _wait(timeout_s)
    conn = _connect(master, (host, port), wait_s, bound)
    with conn:
        conn.settimeout(wait_s + 30)  # the server gives up first and says which nodes are missing
        try:
            conn.sendall((json.dumps({**asdict(node), "wait_s": wait_s, "bound": bound}) + "\n").encode())
            line = conn.makefile().readline()
        except OSError as err:
            raise ConfigError(f"the rendezvous at --master {master} stopped answering ({err}).") from None
    if not line:
        raise ConfigError(f"the rendezvous at --master {master} closed the connection without an answer (node 0's "
                          "launcher ended: its output says why).")
    reply = json.loads(line)
    if "error" in reply:
        raise ConfigError(reply["error"])
    return _on_this_link([NodeInfo(**n) for n in reply["nodes"]], host)


@contextlib.contextmanager
def watch_rounds(master: str, node_rank: int, on_new_round: Callable[[int, list[int]], None]) -> Iterator[None]:
    """While the context lasts, a thread waits at the rendezvous on `master` for a round that node `node_rank` has
    not met in (another node restarted, or its launcher was restarted), then calls `on_new_round(round, node ranks
    there)` once. Nothing happens when the rendezvous closes (node 0's job ended) or cannot be reached."""
    try:
        conn = socket.create_connection(parse_master(master), timeout=10)
    except OSError:  # this node has just met there: node 0's launcher has ended, and with it the job
        yield
        return

    def wait() -> None:
        with contextlib.suppress(OSError, ValueError):
            conn.sendall((json.dumps({"watch": node_rank}) + "\n").encode())
            conn.settimeout(None)  # as long as the round runs
            line = conn.makefile().readline()  # "" once closed, by either end
            reply = json.loads(line) if line else {}
            if "round" in reply:
                on_new_round(reply["round"], reply["nodes"])

    thread = threading.Thread(target=wait, name="tfdist-rendezvous-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # ends the thread's read
        conn.close()
        thread.join(timeout=5)


# Shared with node 0's server (tfdist.cluster.rendezvous_server): where it listens, and the pieces of the
# messages both sides give when a wait runs out.


def resolve_address(host: str, port: int, kind: int) -> tuple[int, tuple]:
    """(address family, socket address) of host:port: the first that getaddrinfo gives, as create_connection tries
    first. A link-local IPv6 address keeps its interface (fe80::1%eth0) as the socket address's scope."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=kind)[0]
    return family, sockaddr


def host_part(sockaddr: tuple) -> str:
    """The host of HOST:PORT for a socket address, as gRPC and `parse_master` read it: IPv6 in brackets, a
    link-local address with its interface."""
    if len(sockaddr) == 2:
        return sockaddr[0]
    host, scope = sockaddr[0], sockaddr[3]
    if scope and "%" not in host:
        try:
            host += "%" + socket.if_indextoname(scope)
        except OSError:
            host += f"%{scope}"
    return f"[{host}]"


def seconds_text(s: float) -> str:
    """`s` seconds as an error message gives them: to a tenth, without trailing zeros."""
    return f"{round(s, 1):g}"


def ran_out_note(bound: str) -> str:
    """Which option's time ran out, `bound` ("--rdzv-timeout" or "--timeout"), as an error message says it."""
    return "(the job's --timeout, which ends before --rdzv-timeout)" if bound == "--timeout" else f"({bound})"


def loopback_note(master_host: str) -> str:
    """A sentence for a wait that ran out while the master is a loopback address ("" otherwise): a node on another
    machine cannot reach it."""
    if master_host != "localhost" and not is_loopback(master_host):
        return ""
    return (f" --master {master_host} is a loopback address: only launchers on node 0's machine reach it; give "
            "every node an address of node 0 that all the machines reach.")


def _wait(timeout_s: float) -> tuple[float, str]:
    """(seconds a join waits, the option that sets them): `timeout_s`, or what is left of the job if less."""
    end = _JOB_END.get()
    left = None if end is None else max(0.0, end - time.monotonic())
    return (left, "--timeout") if left is not None and left < timeout_s else (timeout_s, "--rdzv-timeout")


def _connect(master: str, address: tuple[str, int], wait_s: float, bound: str) -> socket.socket:
    """A connection to the rendezvous, tried again for `wait_s` seconds (node 0's launcher may start last)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(f"the rendezvous at --master {master} did not answer within "
                                  f"{seconds_text(wait_s)} s {ran_out_note(bound)}: is node 0's `tfdist launch` "
                                  "running, and can this node reach that address?"
                                  f"{loopback_note(address[0])}") from None
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))


def _on_this_link(nodes: list[NodeInfo], master_host: str) -> list[NodeInfo]:
    """`nodes` with each link-local address scoped to this node's interface towards the master: the interface of
    a link-local address is the dialling machine's, and each node advertised its own."""
    scope = master_host.partition("%")[2]
    if not scope:
        return nodes
    return [replace(n, host=f"[{n.host.strip('[]').partition('%')[0]}%{scope}]") if _link_local(n.host) else n
            for n in nodes]


def _link_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0]).is_link_local
    except ValueError:
        return False
