"""`tfdist launch --nnodes N --node-rank R --master HOST:PORT`: a job over several machines without SLURM.

The rendezvous is checked in-process (launchers as threads): order, rounds, and each bad input named; IPv6 masters
(on ::1 and a link-local address where the machine has them); the job's --timeout ending the wait; a loopback node
beside a routable one refused to every node at once; a node whose launcher comes back counting from round 0 (the
job restarts together in a new round) or was killed while it waited (its rank is free again). The real thing runs
on emulated nodes (network namespaces, root only): 2 and 3 nodes, each a `tfdist launch` of its own that meets the
others at node 0, training MultiWorkerMirroredStrategy to the weights of one device.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.cluster.ports import free_ports
from tfdist.cluster.rendezvous import (
    NodeInfo,
    _on_this_link,
    address_towards,
    is_loopback,
    job_deadline,
    join,
    parse_master,
    watch_rounds,
)
from tfdist.cluster.rendezvous_server import RendezvousServer
from tfdist.errors import ConfigError

PY = sys.executable


def meet(address: str, nodes: list[NodeInfo], timeout_s: float = 10) -> dict[str, object]:
    """Every node's `join` in a thread of its own; node host -> its answer (or the error it got)."""
    answers: dict[str, object] = {}

    def one(node):
        try:
            answers[node.host] = join(address, node, timeout_s)
        except ConfigError as err:
            answers[node.host] = err

    threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 40)
    return answers



def environments_in_threads(backends: list, n: int) -> dict[int, list]:
    """Each node backend's worker environments for `n` workers per node, the nodes meeting in threads at once."""
    envs: dict[int, list] = {}

    def start(r):
        with backends[r].environments(n, 1) as e:
            envs[r] = e

    threads = [threading.Thread(target=start, args=(r,)) for r in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return envs

def test_the_rendezvous_orders_nodes_meets_again_per_round_and_names_each_bad_node():
    with RendezvousServer("127.0.0.1", 0, nnodes=3, timeout_s=5) as server:
        nodes = [NodeInfo(r, 3, 2, f"10.0.0.{r + 1}", [2000 + r, 3000 + r]) for r in (2, 0, 1)]
        answers = meet(server.address, nodes)
        assert all(a == sorted(nodes, key=lambda n: n.node_rank) for a in answers.values()), answers
        again = [NodeInfo(r, 3, 2, f"10.0.0.{r + 1}", [4000 + r, 5000 + r], round=1) for r in range(3)]
        assert meet(server.address, again)["10.0.0.2"][2].ports == [4002, 5002]  # a restart meets with fresh ports
    with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=1) as server:
        bad = meet(server.address, [NodeInfo(0, 2, 1, "a", [1]), NodeInfo(0, 2, 1, "b", [2], round=0)])
        messages = " | ".join(str(a) for a in bad.values())
        assert "two nodes claim --node-rank 0: a and b" in messages or "two nodes claim --node-rank 0: b and a" \
            in messages
        assert "node rank(s) [1] did not join" in messages and "--rdzv-timeout" in messages
        for node, words in ((NodeInfo(2, 2, 1, "c", [3], round=5), "--node-rank 2 is out of range"),
                            (NodeInfo(0, 3, 1, "c", [3], round=6), "says --nnodes 3, node 0 says 2")):
            with pytest.raises(ConfigError, match=words):
                join(server.address, node, 5)
        first = threading.Thread(target=meet, args=(server.address, [NodeInfo(0, 2, 1, "a", [1], round=7)], 2))
        first.start()
        while server.arrived() != [0]:  # node 0 waits (the server counts rounds) before node 1 comes with another -n
            time.sleep(0.01)
        with pytest.raises(ConfigError, match="node 1 runs -n 2 workers, node 0 runs 1"):
            join(server.address, NodeInfo(1, 2, 2, "b", [2, 3], round=7), 5)
        first.join()
    closed = free_ports(1)[0]  # free a moment ago: nothing answers there
    with pytest.raises(ConfigError, match=rf"--master 127.0.0.1:{closed} did not answer within 1 s \(--rdzv-timeout\)"):
        join(f"127.0.0.1:{closed}", NodeInfo(1, 2, 1, "b", [2]), 1)


def test_each_start_of_a_node_meets_the_others_again_with_fresh_ports():
    """What `--max-restarts` relies on: every `environments()` of a node's backend is a new rendezvous round, and
    the nodes agree on one TF_CONFIG per round, node 0's workers first."""
    from tfdist.cluster.backends import NodesTFConfigBackend

    with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=10) as server:
        backends = [NodesTFConfigBackend(server.address, r, 2, 10) for r in range(2)]
        rounds = []
        for _ in range(2):
            envs = environments_in_threads(backends, 2)
            configs = [json.loads(e["TF_CONFIG"]) for r in range(2) for e in envs[r]]
            assert [c["task"]["index"] for c in configs] == [0, 1, 2, 3]
            assert [e["TFDIST_RANK"] for r in range(2) for e in envs[r]] == ["0", "1", "2", "3"]
            assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
            rounds.append(configs[0]["cluster"]["worker"])
        assert rounds[0] != rounds[1] and server.arrived(1) == [0, 1]


@pytest.mark.parametrize("kwargs, words", [
    ({"nnodes": 2, "node_rank": 2, "master": "h:1"}, "--node-rank must be in 0..1 for --nnodes 2, got 2"),
    ({"nnodes": 2, "node_rank": 1}, "--nnodes > 1 needs --master HOST:PORT"),
    ({"nnodes": 2, "master": "h"}, "--master must be HOST:PORT"),
    ({"nnodes": 2, "master": "h:99999"}, "--master must be HOST:PORT"),
    ({"nnodes": 2, "master": "::1:29400"}, r"an IPv6 address in brackets \(e.g. \[fd00::1\]:29400"),
    ({"nnodes": 2, "master": "[::1]"}, "--master must be HOST:PORT"),
    ({"nnodes": 2, "master": "[]:29400"}, "--master must be HOST:PORT"),
    ({"nnodes": 0, "master": "h:1"}, "--nnodes must be a whole number >= 1"),
    ({"nnodes": 2, "master": "h:1", "backend": "horovod"}, "horovodrun -H"),
    ({"nnodes": 2, "master": "h:1", "ps": 1}, "cannot be combined with --ps"),
])
def test_bad_node_options_are_refused_before_anything_starts(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        launch([PY, "-c", "raise SystemExit(3)"], 1, **kwargs)


def _ipv6_masters() -> list[str]:
    """Hosts to serve a rendezvous on over IPv6 here: ::1 and one link-local address with its interface, those the
    machine has (/proc/net/if_inet6: address, interface index, prefix, scope, flags, name)."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    hosts = ["::1"] if any(row[0] == "0" * 31 + "1" for row in rows) else []
    link = next((row for row in rows if row[3] == "20" and row[5] != "lo"), None)
    if link:
        hosts.append(str(__import__("ipaddress").ip_address(int(link[0], 16))) + "%" + link[5])
    return hosts


def test_ipv6_masters_are_parsed_and_addresses_stay_on_the_dialling_nodes_link():
    assert parse_master("[::1]:29400") == ("::1", 29400)
    assert parse_master("[fe80::1%eth0]:29400") == ("fe80::1%eth0", 29400)
    assert parse_master("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert [is_loopback(h) for h in ("[::1]", "127.0.0.2", "[::ffff:127.0.0.1]", "10.0.0.1", "[fe80::1%eth0]", "a")] \
        == [True, True, True, False, False, False]
    # a link-local address is dialled through this node's own interface, whatever the node that sent it calls its own
    nodes = [NodeInfo(0, 2, 1, "[fe80::a%eth0]", [1]), NodeInfo(1, 2, 1, "[fe80::b%ens5]", [2]),
             NodeInfo(1, 2, 1, "[fd00::b]", [2]), NodeInfo(1, 2, 1, "10.0.0.2", [2])]
    assert [n.host for n in _on_this_link(nodes, "fe80::a%eth1")] == ["[fe80::a%eth1]", "[fe80::b%eth1]", "[fd00::b]",
                                                                       "10.0.0.2"]
    assert _on_this_link(nodes, "fd00::a") == nodes


def test_the_rendezvous_serves_and_joins_over_ipv6_with_bracketed_tf_config_addresses():
    from tfdist.cluster.backends import NodesTFConfigBackend

    hosts = _ipv6_masters()
    if not hosts:
        pytest.skip("this machine has no IPv6 address (no ::1 in /proc/net/if_inet6)")
    for host in hosts:
        with RendezvousServer(host, 0, nnodes=2, timeout_s=10) as server:
            assert server.address.startswith(f"[{host}]:"), server.address
            backends = [NodesTFConfigBackend(server.address, r, 2, 10) for r in range(2)]
            assert address_towards(host) == f"[{host}]"  # the route to a local address starts at that address
            envs = environments_in_threads(backends, 1)
            workers = [json.loads(envs[r][0]["TF_CONFIG"])["cluster"]["worker"] for r in range(2)]
            assert workers[0] == workers[1] and all(w.rsplit(":", 1)[0] == f"[{host}]" for w in workers[0]), workers


def test_the_jobs_timeout_ends_the_wait_for_a_node_that_never_comes():
    port = free_ports(1)[0]
    began = time.monotonic()
    with pytest.raises(ConfigError) as node0:  # node 0 serves and waits for node 1, which never starts
        launch([PY, "-c", "pass"], 1, nnodes=2, master=f"127.0.0.1:{port}", timeout_s=1, out=io.StringIO())
    with pytest.raises(ConfigError) as node1:  # node 1 waits for node 0's rendezvous, which never starts
        launch([PY, "-c", "pass"], 1, nnodes=2, node_rank=1, master=f"127.0.0.1:{port}", timeout_s=1,
               out=io.StringIO())
    assert time.monotonic() - began < 10  # not --rdzv-timeout's default of 300 s
    assert f"node rank(s) [1] did not join the rendezvous at 127.0.0.1:{port} within 1 s (the job's --timeout, " \
           "which ends before --rdzv-timeout)" in str(node0.value)
    assert f"the rendezvous at --master 127.0.0.1:{port} did not answer within 1 s (the job's --timeout" \
           in str(node1.value) and "loopback" in str(node1.value)
    with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=1) as server, job_deadline(30):
        with pytest.raises(ConfigError, match=r"\[1\] did not join .* within 1 s \(--rdzv-timeout\)"):
            join(server.address, NodeInfo(0, 2, 1, "a", [1]), 10)  # node 0's --rdzv-timeout is the shorter


def test_a_loopback_node_beside_a_routable_one_fails_the_round_for_every_node_at_once():
    with RendezvousServer("127.0.0.1", 0, nnodes=3, timeout_s=30) as server:
        port = server.address.rsplit(":", 1)[1]
        began = time.monotonic()
        answers = meet(server.address, [NodeInfo(0, 3, 1, "10.0.0.1", [1]), NodeInfo(1, 3, 1, "127.0.0.1", [2])], 30)
        with pytest.raises(ConfigError) as late:  # a node that comes afterwards hears the same
            join(server.address, NodeInfo(2, 3, 1, "10.0.0.3", [3]), 30)
        assert time.monotonic() - began < 10  # at once, not after the timeout
        for answer in [*answers.values(), late.value]:
            assert isinstance(answer, ConfigError), answers
            assert str(answer).startswith("node(s) [1] advertise the loopback address 127.0.0.1 for their workers and "
                                          "node(s) [0] the routable 10.0.0.1: no other machine can reach a loopback "
                                          f"address. Give every node a routable --master, an address of node 0 that "
                                          f"every machine reaches (e.g. --master 10.0.0.1:{port})"), str(answer)


def test_a_node_that_comes_back_counting_from_round_0_starts_a_new_round_the_others_hear_of():
    said: list[str] = []
    with RendezvousServer("127.0.0.1", 0, nnodes=2, timeout_s=10, say=said.append) as server:
        first = [NodeInfo(r, 2, 1, f"10.0.0.{r + 1}", [r]) for r in range(2)]
        assert all(a == first for a in meet(server.address, first).values())
        heard: list[tuple[int, list[int]]] = []
        with watch_rounds(server.address, 0, lambda r, ranks: heard.append((r, ranks))):
            back = threading.Thread(target=meet, args=(server.address, [NodeInfo(1, 2, 1, "10.0.0.2", [5])]))
            back.start()  # node 1's launcher was restarted: its count starts at 0 again
            deadline = time.monotonic() + 10
            while not heard and time.monotonic() < deadline:
                time.sleep(0.01)
        assert heard == [(1, [1])] and server.arrived() == [1]
        assert said == ["[launch] node 1 came back at round 0 by its count while the job is at round 0: its launcher "
                        "was restarted. Every node restarts in round 1."]
        answers = meet(server.address, [NodeInfo(0, 2, 1, "10.0.0.1", [4], round=1)])
        back.join(10)
        assert [(n.round, n.ports) for n in answers["10.0.0.1"]] == [(1, [4]), (1, [5])]

        # A launcher killed while it waits leaves its rank free for its relaunch (no "two nodes claim").
        gone = socket.create_connection(parse_master(server.address))
        gone.sendall((json.dumps({"node_rank": 1, "nnodes": 2, "nproc": 1, "host": "10.0.0.2", "ports": [6]})
                      + "\n").encode())
        while server.arrived() != [1]:
            time.sleep(0.01)
        gone.close()
        answers = meet(server.address, [NodeInfo(1, 2, 1, "10.0.0.2", [7]), NodeInfo(0, 2, 1, "10.0.0.1", [8])])
        assert [(n.round, n.ports) for n in answers["10.0.0.2"]] == [(2, [8]), (2, [7])], answers

        # Node 0's launcher ends (no restart left) while node 1 waits: node 1 hears it at once.
        left: dict[str, object] = {}
        waiting = threading.Thread(target=lambda: left.update(meet(server.address, [NodeInfo(1, 2, 1, "b", [9])])))
        waiting.start()
        while server.arrived() != [1]:
            time.sleep(0.01)
    waiting.join(10)
    assert "closed before node rank(s) [0] came: node 0's launcher ended" in str(left["b"]), left


RELAUNCH_JOB = """
import json, os, sys, time
node, count = int(os.environ['TFDIST_RANK']), int(os.environ['TFDIST_RESTART_COUNT'])  # one worker per node
print('cluster', json.loads(os.environ['TF_CONFIG'])['cluster']['worker'], flush=True)
failed = os.path.join(sys.argv[1], 'failed')
if node == 1 and not os.path.exists(failed):
    open(failed, 'w').close()
    sys.exit(3)  # node 1's launcher (no restarts) ends with it; a cluster manager starts a new one
if node == 0 and count == 0:
    time.sleep(60)  # the all-reduce peer that would wait for the lost node
"""


def test_a_relaunched_node_launcher_and_the_others_restart_together(tmp_path):
    master = f"127.0.0.1:{free_ports(1)[0]}"
    command = [PY, "-c", RELAUNCH_JOB, str(tmp_path)]
    outs = [io.StringIO() for _ in range(3)]
    codes: dict[str, object] = {}

    def node0():
        try:
            codes["node 0"] = launch(command, 1, nnodes=2, master=master, max_restarts=1, timeout_s=40,
                                     rdzv_timeout_s=20, out=outs[0])
        except ConfigError as err:
            codes["node 0"] = err

    began = time.monotonic()
    thread = threading.Thread(target=node0)
    thread.start()
    for i in (1, 2):  # node 1's launcher, then its relaunch, which counts from round 0 again
        codes[f"node 1 ({i})"] = launch(command, 1, nnodes=2, node_rank=1, master=master, timeout_s=40,
                                        rdzv_timeout_s=20, out=outs[i])
    thread.join(60)
    lines = [out.getvalue().splitlines() for out in outs]
    assert codes == {"node 0": 0, "node 1 (1)": 3, "node 1 (2)": 0}, lines
    assert time.monotonic() - began < 30, lines
    assert "[launch] node(s) [1] started round 1 of the rendezvous (a node restarted, or its launcher was " \
           "restarted): stopping this node's workers, so that every node restarts together" in lines[0]
    assert "[launch] restarting all 1 workers (1/1); they resume from their last checkpoint " \
           "(e.g. tfdist.training.BackupAndRestore)" in lines[0]
    assert any(line.startswith(f"[launch] --master {master} is reached over loopback") for line in lines[1])
    clusters = [[line for line in out if line.startswith("[0] cluster")] for out in lines]
    assert clusters[0][1][4:] == clusters[2][0][4:] != clusters[0][0][4:], clusters  # round 1: one fresh TF_CONFIG


JOB = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tfdist
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=60)
    import keras
    import tensorflow as tf
    from tp_models import regression
    x, y, model_fn = regression()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        model = model_fn()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(12).with_options(options), epochs=2, verbose=0)
    with open(sys.argv[1] + f"/rank{tfdist.cluster.rank(strategy)}.json", "w") as f:
        json.dump({"weights": [w.tolist() for w in model.get_weights()],
                   "tf_config": json.loads(__import__("os").environ["TF_CONFIG"])}, f)
''')


@pytest.mark.slow
def test_two_and_three_emulated_nodes_train_to_one_devices_weights(tmp_path):
    from tfdist.cluster.emulated_network import EmulatedNetwork, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(why)
    from tp_models import regression

    x, y, model_fn = regression()
    reference = model_fn()
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    for nnodes in (2, 3):
        out = tmp_path / f"n{nnodes}"
        out.mkdir()
        with EmulatedNetwork(nnodes, rate=None) as net:
            addresses = [net.address(r) for r in range(nnodes)]
            master = f"{addresses[0]}:29400"
            logs = [open(out / f"node{r}.log", "w") for r in range(nnodes)]  # files: no pipe fills up
            procs = [subprocess.Popen(net.command(r, [PY, "-m", "tfdist", "launch", "--nnodes", str(nnodes),
                                                     "--node-rank", str(r), "--master", master, "-n", "1",
                                                     "--rdzv-timeout", "60", "--timeout", "240", "--", PY, str(job),
                                                     str(out)]),
                                      stdout=logs[r], stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join(
                                          [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
                     for r in range(nnodes)]
            for p, log in zip(procs, logs):
                p.wait(timeout=300)
                log.close()
        logs = [(out / f"node{r}.log").read_text() for r in range(nnodes)]
        assert [p.returncode for p in procs] == [0] * nnodes, "\n".join(log[-3000:] for log in logs)
        records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nnodes)]
        workers = records[0]["tf_config"]["cluster"]["worker"]
        assert [w.rsplit(":", 1)[0] for w in workers] == addresses  # node 0's worker first, then node 1's, ...
        assert [r["tf_config"]["task"]["index"] for r in records] == list(range(nnodes))
        for record in records:
            for got, want in zip(record["weights"], reference.get_weights()):
                np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
