"""`tfdist launch --nnodes N --node-rank R --master HOST:PORT`: a job over several machines without SLURM.

The rendezvous is checked in-process (launchers as threads): order, rounds, and each bad input named. The real
thing runs on emulated nodes (network namespaces, root only): 2 and 3 nodes, each a `tfdist launch` of its own
that meets the others at node 0, training MultiWorkerMirroredStrategy to the weights of one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.cluster.rendezvous import NodeInfo, RendezvousServer, join
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
        while server.arrived(7) != [0]:  # node 0 waits in round 7 before node 1 comes with another -n
            time.sleep(0.01)
        with pytest.raises(ConfigError, match="node 1 runs -n 2 workers, node 0 runs 1"):
            join(server.address, NodeInfo(1, 2, 2, "b", [2, 3], round=7), 5)
        first.join()
    from tfdist.cluster.ports import free_ports

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
            envs: dict[int, list] = {}

            def start(r):
                with backends[r].environments(2, 1) as e:
                    envs[r] = e

            threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
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
    ({"nnodes": 0, "master": "h:1"}, "--nnodes must be a whole number >= 1"),
    ({"nnodes": 2, "master": "h:1", "backend": "horovod"}, "horovodrun -H"),
    ({"nnodes": 2, "master": "h:1", "ps": 1}, "cannot be combined with --ps"),
])
def test_bad_node_options_are_refused_before_anything_starts(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        launch([PY, "-c", "raise SystemExit(3)"], 1, **kwargs)


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
