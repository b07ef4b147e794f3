"""Free TCP ports on this machine, chosen by the kernel (bind port 0), never fixed numbers."""

from __future__ import annotations

import socket
import time

__all__ = ["free_ports", "port_open", "silent_after"]


def free_ports(n: int) -> list[int]:
    """Returns `n` distinct TCP ports that were free a moment ago.

    All sockets stay bound until every port is chosen, so the kernel never hands out one twice.
    Another program may still take a port in the short window before the worker binds it.

    Example:
        >>> a, b = free_ports(2)
    """
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))  # all interfaces: what TensorFlow's gRPC server binds
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_open(address: str, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections at 'host:port'."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False



def silent_after(addresses: list, timeout_s: float, address_of=lambda a: a) -> list:
    """Polls until every address accepts connections or `timeout_s` passes; returns the ones still silent.

    `address_of(item)` gives the 'host:port' of each item (the items themselves by default)."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    while pending and time.monotonic() < deadline:
        pending = [item for item in pending if not port_open(address_of(item))]
        if pending:
            time.sleep(0.2)
    return pending
