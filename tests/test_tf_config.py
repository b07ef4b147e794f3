"""TF_CONFIG parsing and checks, the launcher's "tf" backend, rank/chief detection and the lost-worker hook
(fast, in-process)."""

from __future__ import annotations

import json

import pytest

from tfdist.cluster import is_chief, rank, world_size
from tfdist.cluster.backends import TFConfigBackend, make_tf_configs
from tfdist.comm.launch_env import LOCAL_DEVICES_ENV
from tfdist.comm.tf_config import parse_tf_config
from tfdist.errors import ConfigError

TWO = {"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", "index": 1}}


def test_parse_valid_config():
    cfg = parse_tf_config(json.dumps(TWO))
    assert (cfg.num_workers, cfg.rank, cfg.is_chief, cfg.task_name) == (2, 1, False, "/job:worker/replica:0/task:1")
    assert cfg.peers() == [("worker", 0, "localhost:2222")]
    chief = parse_tf_config({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]}, "task": {"type": "worker",
                                                                                            "index": 0}})
    assert (chief.num_workers, chief.rank, chief.is_chief) == (3, 1, False)


@pytest.mark.parametrize("text, words", [
    ("{not json", ["not valid JSON"]),
    (json.dumps({"cluster": {"worker": ["h:1"]}}), ["no 'task'"]),
    (json.dumps({"task": {"type": "worker", "index": 0}}), ["no 'cluster'"]),
    (json.dumps({**TWO, "task": {"type": "worker", "index": 2}}), ["index 2 is out of range", "0..1"]),
    (json.dumps({**TWO, "task": {"type": "worker", "index": -1}}), ["out of range"]),
    (json.dumps({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}}),
     ["'h:1' twice"]),
    (json.dumps({"cluster": {"worker": ["h:1", "nohostport"]}, "task": {"type": "worker", "index": 0}}),
     ["host:port", "nohostport"]),
    (json.dumps({"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "worker", "index": 0}}),
     ["job 'ps'"]),
    (json.dumps({**TWO, "task": {"type": "chief", "index": 0}}), ["'chief' is not a job"]),
    (json.dumps({**TWO, "task": {"type": "worker", "index": "0"}}), ["must be an integer"]),
    (json.dumps([1, 2]), ["JSON object"]),
])
def test_malformed_config_names_the_problem(text, words):
    with pytest.raises(ConfigError) as info:
        parse_tf_config(text)
    for word in words:
        assert word in str(info.value)


def test_strategy_rejects_malformed_tf_config(monkeypatch):
    # The check runs before TensorFlow is touched, so it works in the test process.
    import tfdist

    monkeypatch.setenv("TF_CONFIG", json.dumps({**TWO, "task": {"type": "worker", "index": 5}}))
    with pytest.raises(ConfigError, match="index 5 is out of range"):
        tfdist.MultiWorkerMirroredStrategy()
    monkeypatch.setenv("TF_CONFIG", "{broken")
    with pytest.raises(ConfigError, match="not valid JSON"):
        tfdist.MultiWorkerMirroredStrategy()


def test_local_devices_naming_absent_devices_is_a_config_error(monkeypatch):
    import tfdist

    monkeypatch.delenv("TF_CONFIG", raising=False)
    # conftest configured 4 logical CPUs: /cpu:4 is not there, and this machine has no GPU.
    for bad, word in ((["/cpu:0", "/cpu:4"], "no device '/cpu:4'"), (["/gpu:0"], "no device '/gpu:0'"),
                      (["/tpu:0"], "not a local device"),
                      (["/cpu:0", "/cpu:0"], "listed twice"), ("cpu:0", "list of names"), (0, ">= 1")):
        with pytest.raises(ConfigError, match=word):
            tfdist.MultiWorkerMirroredStrategy(local_devices=bad)
    with pytest.raises(ConfigError, match="communication"):
        tfdist.MultiWorkerMirroredStrategy(communication="carrier-pigeon")


def test_make_tf_configs_uses_distinct_free_ports():
    configs = [parse_tf_config(c) for c in make_tf_configs(3)]
    addresses = configs[0].cluster["worker"]
    assert len(set(addresses)) == 3
    assert [c.task_index for c in configs] == [0, 1, 2]
    assert all(c.cluster == configs[0].cluster for c in configs)


def test_tf_backend_environments():
    with TFConfigBackend().environments(2, devices_per_worker=3) as envs:
        assert [e[LOCAL_DEVICES_ENV] for e in envs] == ["3", "3"]
        assert [parse_tf_config(e["TF_CONFIG"]).rank for e in envs] == [0, 1]
        assert [e["TFDIST_RANK"] for e in envs] == ["0", "1"]
        assert set(envs[0]) == {"TF_CONFIG", LOCAL_DEVICES_ENV, "TFDIST_RANK"}
    with pytest.raises(ConfigError, match="devices_per_worker"):
        with TFConfigBackend().environments(2, devices_per_worker=0):
            pass


def test_rank_and_chief_from_environment():
    assert (rank(environ={}), world_size(environ={}), is_chief(environ={})) == (0, 1, True)
    env = {"TF_CONFIG": json.dumps(TWO)}
    assert (rank(environ=env), world_size(environ=env), is_chief(environ=env)) == (1, 2, False)
    assert is_chief(environ={"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"})
    assert not is_chief(environ={"OMPI_COMM_WORLD_RANK": "1"})
    assert rank(environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == 3
    assert world_size(environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == 4
    # the launchers' table decides the order: Horovod's own variables before OpenMPI's, TF_CONFIG before all
    assert rank(environ={"OMPI_COMM_WORLD_RANK": "1", "HOROVOD_RANK": "2"}) == 2
    assert rank(environ={"TF_CONFIG": json.dumps(TWO), "TFDIST_RANK": "0"}) == 1
    assert (rank(environ={"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "3"}),
            world_size(environ={"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "3"})) == (1, 3)
    assert rank(environ={"HOROVOD_RANK": "", "SLURM_PROCID": "2"}) == 2  # empty values are no evidence


def test_lost_worker_hook_is_installed_once_and_names_the_latest_cluster(monkeypatch, capsys):
    import sys

    import tensorflow as tf

    from tfdist.comm import faults

    passed_on = []
    monkeypatch.setattr(sys, "excepthook", lambda exc_type, exc, tb: passed_on.append(exc_type))
    monkeypatch.setitem(faults._HOOK, "installed", False)
    monkeypatch.setitem(faults._HOOK, "config", None)
    faults.install_excepthook(parse_tf_config({**TWO, "task": {"type": "worker", "index": 0}}))
    hook = sys.excepthook
    faults.install_excepthook(parse_tf_config(TWO))  # a second strategy: task 1 of the same cluster
    assert sys.excepthook is hook  # not wrapped again
    err = tf.errors.UnavailableError(None, None, "Collective ops is aborted by: /job:worker/replica:0/task:0 gone")
    hook(type(err), err, None)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "tfdist: error: worker /job:worker/replica:0/task:1 lost /job:worker/replica:0/task:0 (localhost:2222)")
    hook(ValueError, ValueError("a bug in the model"), None)  # anything else: the previous hook
    assert passed_on == [ValueError]
