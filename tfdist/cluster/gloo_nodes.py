"""Horovod/Gloo ranks on emulated nodes: what `tfdist launch --backend horovod --link-rate RATE` runs.

Each rank is a node of an EmulatedNetwork (its own network namespace and shaped link): Horovod's
rendezvous server listens on the network's gateway (the bridge, in the launcher's namespace), and every
rank's Gloo pairs bind its node's interface, so all of its collective traffic crosses the shaped link.
The plan names one host per node (`node0:1,node1:1,...`): local_size 1, cross_size n, as on n machines.

Horovod 0.28.1 makes the Gloo contexts of its process sets (process set 0 included, which carries every
collective) from this machine's hostname, whatever HOROVOD_GLOO_IFACE says (`InitializeForProcessSet` in
horovod/common/gloo/gloo_context.cc leaves the device's interface empty, and Gloo then binds the address the
hostname resolves to). EmulatedNetwork resolves the hostname to the node's own address inside each node, as
on a real machine, so those pairs bind the node's address and their traffic crosses the shaped link.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tfdist.cluster.backends import GlooBackend
from tfdist.cluster.emulated_network import EmulatedNetwork
from tfdist.errors import ConfigError

__all__ = ["GlooNodesBackend"]


class GlooNodesBackend(GlooBackend):
    """Launcher backend "horovod" on an emulated network: rank i on node i.

    Args:
        network: the EmulatedNetwork the launcher made (open: inside its `with`), one node per rank.

    Example:
        >>> with EmulatedNetwork(2, "1gbit") as net:
        ...     with GlooNodesBackend(net).environments(2, devices_per_worker=1) as envs:
        ...         procs = [subprocess.Popen(net.command(i, ["python", "train.py"]), env={**os.environ, **e})
        ...                  for i, e in enumerate(envs)]
    """

    def __init__(self, network: EmulatedNetwork, verbose: int = 0):
        super().__init__(host=network.gateway(), iface="", verbose=verbose)
        self.network = network

    @contextlib.contextmanager
    def environments(self, n: int, devices_per_worker: int) -> Iterator[list[dict[str, str]]]:
        if n != self.network.nodes:
            raise ConfigError(f"GlooNodesBackend: the emulated network has {self.network.nodes} nodes, one per rank; "
                              f"got n={n} ranks. Make the network with nodes={n}.")
        with super().environments(n, devices_per_worker) as envs:
            yield envs

    def _hosts(self, n: int) -> str:
        return ",".join(f"node{i}:1" for i in range(n))  # one host per node: local_size 1, cross_size n

    def _slot_env(self, slot, port: int, devices_per_worker: int) -> dict[str, str]:
        # slot.rank == i here (one slot per host, hosts in order): rank i binds node i's interface.
        return {**self._rank_env(slot, port, slot.hostname, devices_per_worker),
                "HOROVOD_GLOO_IFACE": self.network.interface(slot.rank)}
