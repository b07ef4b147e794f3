"""What listens, and where, while `tfdist launch` runs: TF servers in the job's private network only."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from tfdist.cluster.launcher import launch
from tfdist.cluster.private_net import private_network

# Each worker starts TensorFlow's gRPC server on its TF_CONFIG port (as MultiWorkerMirroredStrategy does),
# reports the interfaces it sees, then waits for the test to let it go.
SERVER = r"""
import json, os, socket, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cfg = json.loads(os.environ["TF_CONFIG"])
server = tf.distribute.Server(tf.train.ClusterSpec(cfg["cluster"]), job_name="worker",
                              task_index=cfg["task"]["index"], start=True)
print("ready", json.dumps([name for _, name in socket.if_nameindex()]), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def _listening_ports() -> set[int]:
    """TCP ports in LISTEN state in this process's network namespace (IPv4 and IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
@pytest.mark.parametrize("network", ["private", "host"])
def test_tf_servers_of_a_local_launch_listen_in_the_private_network_only(tmp_path, network):
    with private_network() as (net, reason):
        if net is None:
            pytest.skip(f"no private network namespace on this machine: {reason}")
    # Each worker also prints its address from its own TF_CONFIG (the launcher picks the ports).
    program = SERVER.replace('print("ready"', 'print("address", cfg["cluster"]["worker"][cfg["task"]["index"]], '
                             'flush=True)\nprint("ready"')
    release = tmp_path / "release"
    lines: list[str] = []
    host_view: dict = {}

    class Out(io.TextIOBase):
        def write(self, text: str) -> int:
            for line in text.splitlines():
                lines.append(line)
                if sum(" ready " in x for x in lines) == 2 and "ports" not in host_view:
                    host_view["ports"] = _listening_ports()  # this (the host's) namespace, both servers up
                    release.touch()
            return len(text)

    code = launch([sys.executable, "-c", program, str(release)], 2, out=Out(), network=network, timeout_s=120,
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert code == 0, "\n".join(lines[-30:])
    ports = [int(x.rsplit(":", 1)[1]) for x in lines if " address " in x]
    interfaces = [json.loads(x.split(" ready ", 1)[1]) for x in lines if " ready " in x]
    assert len(ports) == 2 and "ports" in host_view
    if network == "private":
        assert interfaces == [["lo"], ["lo"]]  # nothing but loopback inside the job's namespace
        assert not set(ports) & host_view["ports"], (ports, sorted(host_view["ports"]))  # unreachable from here
    else:
        assert set(ports) <= host_view["ports"]  # the control: on the host network the same servers are seen


def test_the_horovod_rendezvous_binds_loopback_only():
    from tfdist.cluster.backends import GlooBackend

    backend = GlooBackend()
    assert backend.host == "127.0.0.1" and backend.iface == "lo"
    assert not getattr(backend, "listens_on_all_interfaces", False)  # stays on the host network, loopback only


def test_an_unknown_network_is_named():
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match="--network must be one of"):
        launch([sys.executable, "-c", "pass"], 1, network="public")
