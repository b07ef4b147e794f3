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
import socket
import subprocess
import tempfile
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["EmulatedNetwork", "parse_rate", "tbf_burst_bytes", "unavailable_reason"]

TOOLS = ("ip", "tc", "nsenter", "unshare")
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


def tbf_burst_bytes(bits_per_second: int) -> int:
    """The token bucket of a node's tbf: 10 ms of traffic, never below 64 KB (one GSO packet).

    tbf needs a bucket of at least one timer tick of traffic (HZ >= 100), or the rate falls short of the one
    asked for when its timer fires late on a busy machine (docs/design.md, "Emulated links"). The price: after an idle moment a node sends this many bytes at
    veth speed, so messages not much larger than the bucket (1 MB at 1 gbit) look faster than the link.

    Example:
        >>> tbf_burst_bytes(parse_rate("1gbit"))
        1250000
    """
    return max(64 * 1024, bits_per_second // 8 // 100)


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
            (as fast as the host copies memory).
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
        self._hosts_dir: str | None = None  # per-node hosts files (see command)
        self._made: list[tuple[str, str]] = []  # ("netns"|"link", name), undone in reverse

    # --- what a job needs -------------------------------------------------------------------------
    def address(self, node: int) -> str:
        """Node `node`'s address on the emulated network."""
        if self._subnet is None:
            raise RuntimeError("EmulatedNetwork: use it inside `with` (the network exists only there)")
        return f"{self._subnet}.{node + 2}"

    def gateway(self) -> str:
        """This machine's address on the emulated network (the bridge): where a server that runs outside the
        nodes, such as the launcher's Horovod rendezvous, listens so that every node can reach it."""
        if self._subnet is None:
            raise RuntimeError("EmulatedNetwork: use it inside `with` (the network exists only there)")
        return f"{self._subnet}.1"

    def interface(self, node: int) -> str:
        """The name of node `node`'s link inside its namespace (e.g. for HOROVOD_GLOO_IFACE)."""
        return self._veth[node] + "p"

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node `node`'s network namespace, where this machine's hostname resolves to the
        node's own address (a private mount namespace binds the node's hosts file on /etc/hosts), as on a real
        node: programs that find their address from the hostname (Gloo does) get the node's."""
        enter = ["nsenter", f"--net=/run/netns/{self.netns[node]}", "--"]
        if self._hosts_dir is None:
            return [*enter, *argv]
        hosts = os.path.join(self._hosts_dir, f"hosts{node}")
        return [*enter, "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', hosts, *argv]

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
        _remove_stale_networks()
        self._subnet = self._free_subnet()
        self._hosts_dir = tempfile.mkdtemp(prefix="tfdist-nodes-")
        name = socket.gethostname()
        for node in range(self.nodes):
            with open(os.path.join(self._hosts_dir, f"hosts{node}"), "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n{self.address(node)}\t{name}\n")
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
                burst = tbf_burst_bytes(self.bits_per_second)
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
        if self._hosts_dir is not None:
            shutil.rmtree(self._hosts_dir, ignore_errors=True)
            self._hosts_dir = None

    @staticmethod
    def _free_subnet() -> str:
        used = _sh("ip", "-4", "addr").stdout
        for k in range(os.getpid() % 200, os.getpid() % 200 + 250):
            subnet = f"10.214.{k % 250}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.214.x.0/24 subnet for the emulated network")


def _remove_stale_networks() -> list[str]:
    """Removes the namespaces and bridges of emulated networks whose process is gone (a job killed before
    its `with` block could close them); returns their names. Names carry the maker's PID (`tfdnode{pid}-i`,
    `tfdnb{pid}`), so a live network is never touched."""
    stale = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(r"tfdnode(\d+)-\d+\b", line)
        if m and not _alive(int(m.group(1))):
            stale.append(("netns", line.split()[0]))
    for m in re.finditer(r"^\d+: (tfdnb(\d+))[:@]", _sh("ip", "-o", "link", "show", check=False).stdout, re.M):
        if not _alive(int(m.group(2))):
            stale.append(("link", m.group(1)))
    for kind, name in stale:
        _sh("ip", kind, "del", name, check=False)
    return [name for _, name in stale]


def _alive(tag: int) -> bool:
    # the tag is the PID modulo 100000: any live process with that remainder keeps the network
    return any(int(pid) % 100000 == tag for pid in os.listdir("/proc") if pid.isdigit())
