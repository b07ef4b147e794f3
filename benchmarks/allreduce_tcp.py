"""Raw TCP throughput between two emulated nodes: the ceiling a collective can reach on the same shaped link.

`tfdist bench allreduce --link-rates ...` reports it next to each backend's bus bandwidth, so a shortfall can be
told apart: a TCP stream that falls short of the link points at the link emulation (tbf burst, queue, MTU,
CPU), one that reaches it while a backend does not points at the backend's collective. Both nodes send at
once (as in a 2-node ring, where every link carries data one way and acknowledgements the other), each from
one Python socket, and the receiver times its stream from the first byte to the last.

Example (root):
    >>> tcp_both_ways("1gbit", 64 * 2**20)["goodput_over_link"]  # ~0.95: TCP/IP headers and ACKs take the rest
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

__all__ = ["tcp_both_ways"]

CHUNK = 4 << 20  # bytes per send/recv call


def _send(sock: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(CHUNK))
    left = nbytes
    while left:
        left -= sock.send(buf[:min(left, CHUNK)])


def _receive(sock: socket.socket, nbytes: int) -> tuple[int, float]:
    view = memoryview(bytearray(CHUNK))
    got, start = 0, None
    while got < nbytes:
        k = sock.recv_into(view)
        if not k:
            break
        start = start or time.perf_counter()
        got += k
    return got, time.perf_counter() - (start or time.perf_counter())


def _peer(role: str, host: str, port: int, nbytes: int) -> None:
    """One node: 'serve' listens on host:port, 'connect' connects; both send and receive nbytes at once."""
    if role == "serve":
        listener = socket.create_server((host, port))
        sock, _ = listener.accept()
    else:
        for _ in range(300):  # the server's Python may still be starting on a loaded machine
            try:
                sock = socket.create_connection((host, port), timeout=60)
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"no server at {host}:{port}")
        sock.settimeout(None)
    sender = threading.Thread(target=_send, args=(sock, nbytes))
    sender.start()
    got, seconds = _receive(sock, nbytes)
    sender.join()
    sock.shutdown(socket.SHUT_WR)
    print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)


def tcp_both_ways(rate: str, nbytes: int, port: int = 5601) -> dict:
    """Both nodes of a fresh 2-node EmulatedNetwork at `rate` send `nbytes` to each other at once; returns the
    receive goodput of each direction and the slower one as a share of the link rate."""
    from tfdist.cluster.emulated_network import EmulatedNetwork, parse_rate

    with EmulatedNetwork(2, rate) as net:
        cmd = [sys.executable, "-m", "benchmarks.allreduce_tcp"]
        server = subprocess.Popen(net.command(0, [*cmd, "serve", net.address(0), str(port), str(nbytes)]),
                                  stdout=subprocess.PIPE, text=True)
        client = subprocess.Popen(net.command(1, [*cmd, "connect", net.address(0), str(port), str(nbytes)]),
                                  stdout=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=600)[0] for p in (server, client)]
        if server.returncode or client.returncode:
            raise RuntimeError(f"TCP peers failed: exit codes {server.returncode}, {client.returncode}")
    runs = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    if any(r["bytes"] != nbytes for r in runs):
        raise RuntimeError(f"TCP peers received {[r['bytes'] for r in runs]} bytes, expected {nbytes}")
    bits = [r["bytes"] * 8 / r["seconds"] for r in runs]
    return {"rate": rate, "bytes": nbytes, "goodput_gbit_s": [b / 1e9 for b in bits],
            "goodput_over_link": min(bits) / parse_rate(rate)}


if __name__ == "__main__":
    _peer(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
