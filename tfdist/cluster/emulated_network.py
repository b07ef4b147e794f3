"""EmulatedNetwork: N "nodes" on one machine, each a network namespace whose link runs at a chosen rate.

Loopback moves ~10 GB/s here; real clusters link their nodes at 1–100 Gbit/s. To see a job as it runs
on such links, each node gets a network namespace with one veth link to a shared bridge, and the link's
egress is shaped by `tc qdisc tbf` at the node's rate, so every byte a node sends or acknowledges goes
through its own "NIC" (added delay is not emulated: this kernel has no netem). Processes of node i run
under `command(i, argv)` and reach node j at `address(j)`.

Needs root (namespaces, links, qdiscs). As a context manager it removes everything it made on exit.

Example:
    >>> with EmulatedNetwork(nodes=2, rate="1gbit") as net:
    ...     server = subprocess.Popen(net.command(0, ["python", "-m", "http.server", "8000"]))
    ...     subprocess.run(net.command(1, ["curl", f"http://{net.address(0)}:8000/"]))
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["EmulatedNetwork", "parse_rate", "unavailable_reason"]

TOOLS = ("ip", "tc", "nsenter")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate: '1gbit', '10gbit', '200mbit', '25Gbit'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", str(rate).lower())
    if not match:
        raise ConfigError(f"link rate must look like '1gbit', '200mbit' or '25gbit' (bits per second), got {rate!r}.")
    bits = float(match.group(1)) * _UNITS[match.group(2)]
    if bits < 1e6:
        raise ConfigError(f"link rate {rate!r} is below 1mbit: too slow for a training job.")
    return int(bits)


def unavailable_reason() -> str | None:
    """Why emulated nodes cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root: creates network namespaces, veth links and tc qdiscs"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing tools {missing} (Debian: apt-get install iproute2 util-linux)"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class EmulatedNetwork:
    """`nodes` network namespaces on one bridge, each node's egress shaped at `rate` (module docstring).

    Args:
        nodes: how many nodes (>= 1).
        rate: each node's link rate, tc style ('1gbit', '10gbit', '25gbit'), or None for an unshaped veth
            (~16 Gbit/s here).
    """

    def __init__(self, nodes: int, rate: str | None = "10gbit"):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"EmulatedNetwork: nodes must be a whole number >= 1, got {nodes!r}.")
        self.nodes = nodes
        self.rate = rate
        self.bits_per_second = None if rate is None else parse_rate(rate)
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"tfdnb{tag}"
        self.netns = [f"tfdnode{tag}-{i}" for i in range(nodes)]
        self._veth = [f"tfdn{tag}v{i}" for i in range(nodes)]
        self._subnet: str | None = None
        self._made: list[tuple[str, str]] = []  # ("netns"|"link", name), undone in reverse

    # --- what a job needs -------------------------------------------------------------------------
    def address(self, node: int) -> str:
        """Node `node`'s address on the emulated network."""
        if self._subnet is None:
            raise RuntimeError("EmulatedNetwork: use it inside `with` (the network exists only there)")
        return f"{self._subnet}.{node + 2}"

    def interface(self, node: int) -> str:
        """The name of node `node`'s link inside its namespace (e.g. for HOROVOD_GLOO_IFACE)."""
        return self._veth[node] + "p"

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node `node`'s network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns[node]}", "--", *argv]

    def qdisc(self, node: int) -> str:
        """`tc qdisc show` of node `node`'s link (what shapes it)."""
        return _sh(*self.command(node, ["tc", "qdisc", "show", "dev", self.interface(node)])).stdout.strip()

    # --- making and removing it -------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        reason = unavailable_reason()
        if reason:
            raise ConfigError(f"an emulated network cannot be made here: {reason}.")
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        self._subnet = self._free_subnet()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _sh("ip", "addr", "add", f"{self._subnet}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in range(self.nodes):
            ns, veth, inner = self.netns[node], self._veth[node], self.interface(node)
            _sh("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", inner)
            self._made.append(("link", veth))
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            inside = self.command(node, ["ip"])
            _sh(*inside, "addr", "add", f"{self.address(node)}/24", "dev", inner)
            _sh(*inside, "link", "set", inner, "up")
            _sh(*inside, "link", "set", "lo", "up")
            if self.bits_per_second is not None:
                # tbf needs a bucket of at least one timer tick of traffic (HZ >= 100), or the rate
                # falls short of the one asked for: 10 ms worth, and never below 64 KB.
                burst = max(64 * 1024, self.bits_per_second // 8 // 100)
                _sh(*self.command(node, ["tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate", str(self.rate),
                                         "burst", str(burst), "latency", "50ms"]))

    def close(self) -> None:
        """Removes the namespaces and links this network made (idempotent)."""
        while self._made:
            kind, name = self._made.pop()
            if kind == "netns":
                _sh("ip", "netns", "del", name, check=False)
            else:
                _sh("ip", "link", "del", name, check=False)
        self._subnet = None

    @staticmethod
    def _free_subnet() -> str:
        used = _sh("ip", "-4", "addr").stdout
        for k in range(os.getpid() % 200, os.getpid() % 200 + 250):
            subnet = f"10.214.{k % 250}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.214.x.0/24 subnet for the emulated network")
