"""Free TCP ports on this machine, chosen by the kernel (bind port 0), never fixed numbers."""

from __future__ import annotations

import socket

__all__ = ["free_ports"]


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
