"""One process per device set, under every launcher: which GPUs each local process trains on.

No GPU is needed: the rule (`tfdist.devices.gpu_share`) is checked on the environment each launcher really writes
(`tfdist launch`'s own, srun's with and without --gpus-per-task, mpirun's, horovodrun's, a cluster manager's
TF_CONFIG), and the physical GPUs of every process of a machine must be disjoint and each process's count right.
The seam into TensorFlow (`process_devices` making the share the only GPUs TF shows) is checked with a table of
physical devices the test sets."""

from __future__ import annotations

import io
import sys

import pytest

from tfdist.cluster.launcher import launch
from tfdist.cluster.local_gpus import per_process_env, visible_gpus
from tfdist.comm.launch_env import local_process
from tfdist.devices import LocalProcess, gpu_share
from tfdist.errors import ConfigError, InitOrderError


def physical(env: dict, count: int | None, node_gpus: int) -> list[int]:
    """The physical GPUs (node indices) the process with this environment trains on."""
    shown = visible_gpus(env) if "CUDA_VISIBLE_DEVICES" in env else [str(i) for i in range(node_gpus)]
    return [int(shown[i]) for i in gpu_share(count, len(shown), local_process(env))]


def assert_one_set_each(envs: list[dict], count: int | None, node_gpus: int, each: int) -> None:
    sets = [physical(env, count, node_gpus) for env in envs]
    assert all(len(s) == each for s in sets), sets
    flat = [g for s in sets for g in s]
    assert len(set(flat)) == len(flat), f"overlapping GPUs: {sets}"


def test_tfdist_launch_gives_each_worker_its_own_gpus_by_cuda_visible_devices():
    for n, m in ((2, 2), (4, 1)):  # 2 x 2 and 4 x 1 on a 4-GPU node
        envs = per_process_env(n, m, ["0", "1", "2", "3"])
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ([f"{2 * i},{2 * i + 1}" for i in range(n)] if m == 2
                                                             else [str(i) for i in range(n)])
        assert {e["TFDIST_OWN_DEVICES"] for e in envs} == {"1"}
        assert [local_process(e) for e in envs] == [LocalProcess(i, n, True) for i in range(n)]
        assert_one_set_each(envs, m, 4, m)
    # A scheduler gave the launcher a subset: the workers share that subset, in its order.
    assert [e["CUDA_VISIBLE_DEVICES"] for e in per_process_env(2, 1, visible_gpus({"CUDA_VISIBLE_DEVICES": "5,7"}))] \
        == ["5", "7"]
    # No GPUs: only the local rank and size; the workers split their CPU as before.
    assert per_process_env(2, 2, []) == [{"TFDIST_LOCAL_RANK": "0", "TFDIST_LOCAL_SIZE": "2"},
                                         {"TFDIST_LOCAL_RANK": "1", "TFDIST_LOCAL_SIZE": "2"}]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at the first bad entry
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8e3f,GPU-91aa"}) == ["GPU-8e3f", "GPU-91aa"]  # UUIDs


def test_the_launcher_counts_gpus_from_device_files_as_cuda_numbers_them(tmp_path):
    for name in ("nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):  # a container given the host's GPUs 2 and 3
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == ["0", "1"]


def test_srun_with_a_gpu_per_task_and_with_every_gpu_of_the_node():
    def task(local: int, **extra) -> dict:
        return {"SLURM_PROCID": str(4 + local), "SLURM_LOCALID": str(local), "SLURM_NODEID": "1",
                "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", **extra}

    # --gpus-per-task=1: SLURM shows each task its own GPU as GPU 0 (HorovodStrategy used to ask for GPU local_rank).
    bound = [task(i, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES=str(i)) for i in range(4)]
    assert [local_process(e) for e in bound] == [LocalProcess(i, 4, True) for i in range(4)]
    assert_one_set_each(bound, 1, 4, 1)
    # --gres=gpu:4 for the node: every task sees all four and takes its local rank's share (a count or None).
    shared = [task(i, CUDA_VISIBLE_DEVICES="0,1,2,3") for i in range(4)]
    assert_one_set_each(shared, 1, 4, 1)
    assert_one_set_each(shared, None, 4, 1)
    # An uneven step (3 tasks on node 0, 1 on node 1): the lone task takes the whole node.
    lone = {"SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "3,1"}
    assert physical(lone, None, 4) == [0, 1, 2, 3]
    # A batch script's own python (no srun step): the node's one process, every GPU.
    assert local_process({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"}) == LocalProcess(0, 1)
    # --gpus-per-task=1 with --gpu-bind=none: every task sees all four, so they are not its own; local ranks split.
    unbound = [task(i, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="0,1,2,3") for i in range(4)]
    assert not any(local_process(e).own_devices for e in unbound)
    assert_one_set_each(unbound, 1, 4, 1)


def test_mpirun_map_by_horovodrun_and_a_cluster_managers_tf_config():
    # mpirun -np 4 --map-by ppr:2:node: two ranks per 4-GPU node, two GPUs each.
    for node in range(2):
        ranks = [{"OMPI_COMM_WORLD_RANK": str(2 * node + i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i),
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"} for i in range(2)]
        assert [physical(e, 2, 4) for e in ranks] == [[0, 1], [2, 3]]
    hvd = [{"HOROVOD_RANK": str(i), "HOROVOD_LOCAL_RANK": str(i), "HOROVOD_LOCAL_SIZE": "4"} for i in range(4)]
    assert_one_set_each(hvd, 1, 4, 1)
    # A training operator writes TF_CONFIG, one process per pod: the pod's GPUs are its own.
    pod = {"TF_CONFIG": '{"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": "worker", "index": 1}}'}
    assert local_process(pod) == LocalProcess(0, 1, False) and physical(pod, None, 2) == [0, 1]
    # `tfdist launch` started inside an srun task: its own ranks count, not SLURM's.
    inner = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "TFDIST_RANK": "0", "TFDIST_LOCAL_RANK": "0",
             "TFDIST_LOCAL_SIZE": "2"}
    assert local_process(inner) == LocalProcess(0, 2, False)


@pytest.mark.parametrize("count, visible, local, words", [
    (2, 3, LocalProcess(1, 2), ["local_devices=2", "2 processes", "GPUs 2..3", "shows 3 GPU(s)",
                                "--devices-per-worker"]),
    (1, 1, LocalProcess(1, 2), ["overlap", "CUDA_VISIBLE_DEVICES per process"]),  # two processes, one GPU
    (None, 3, LocalProcess(0, 2), ["local_devices=None", "evenly", "there are 2", "Pass local_devices=M"]),
    (2, 1, LocalProcess(0, 1, True), ["local_devices=2", "sees 1 GPU"]),  # asks for more than it can see
    (0, 4, LocalProcess(), ["whole number >= 1"]),
])
def test_a_device_set_that_does_not_exist_or_overlaps_is_refused(count, visible, local, words):
    with pytest.raises(ConfigError) as err:
        gpu_share(count, visible, local)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_inconsistent_launcher_variables_are_named():
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2"):
        local_process({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                       "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE='2x' is not of the form"):
        local_process({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
                       "SLURM_STEP_TASKS_PER_NODE": "2x"})
    with pytest.raises(ConfigError, match="HOROVOD_LOCAL_RANK must be a whole number >= 0, got 'x'"):
        local_process({"HOROVOD_RANK": "0", "HOROVOD_LOCAL_RANK": "x"})


def test_the_launcher_narrows_each_workers_gpus_and_refuses_too_few_before_starting():
    code = ("import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['TFDIST_LOCAL_RANK'], "
            "os.environ['TFDIST_LOCAL_SIZE'], os.environ['TFDIST_OWN_DEVICES'])")
    out = io.StringIO()
    assert launch([sys.executable, "-c", code], 2, devices_per_worker=2, out=out, timeout_s=60,
                  env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == 0
    assert sorted(out.getvalue().splitlines()) == ["[0] 4,5 0 2 1", "[1] 6,7 1 2 1"]
    with pytest.raises(ConfigError, match="-n 2 --devices-per-worker 2 needs 4 GPUs.*shows 3.*CUDA_VISIBLE_DEVICES="):
        launch([sys.executable, "-c", "raise SystemExit(3)"], 2, devices_per_worker=2,
               env={"CUDA_VISIBLE_DEVICES": "0,1,2"})


def test_process_devices_shows_tensorflow_only_the_share(monkeypatch):
    """The seam into TF: with a table of 4 physical GPUs, local rank 1 of 2 makes GPUs 2 and 3 the only ones TF
    shows it, and names them as its GPU 0 and 1."""
    import tensorflow as tf

    from tfdist import devices

    table = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(4)]
    shown = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: table if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda device: None)
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: table)
    monkeypatch.setattr(tf.config, "set_visible_devices", lambda gpus, kind=None: shown.append((gpus, kind)))
    assert devices.process_devices(2, local=LocalProcess(1, 2)) == ["/device:GPU:0", "/device:GPU:1"]
    assert shown == [(table[2:], "GPU")]
    assert devices.mesh_process_devices(["/device:GPU:0", "/device:GPU:1"], 2, LocalProcess(0, 2)) == \
        ["/device:GPU:0", "/device:GPU:1"] and shown[-1] == (table[:2], "GPU")

    def after_start(gpus, kind=None):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", after_start)
    with pytest.raises(InitOrderError, match="GPU:3.*must be chosen before TensorFlow initialises"):
        devices.process_devices(1, local=LocalProcess(3, 4))


def test_tfdist_cluster_reports_each_process_devices_and_refuses_an_overlap():
    from tfdist.cli.cluster import devices_report

    assert devices_report({"TFDIST_RANK": "1", "TFDIST_LOCAL_RANK": "1", "TFDIST_LOCAL_SIZE": "2",
                           "TFDIST_LOCAL_DEVICES": "2", "CUDA_VISIBLE_DEVICES": ""}) == {
        "local_rank": 1, "local_size": 2, "own_devices": False, "visible_gpus": [], "trains_on": "2 logical CPU(s)"}
    mpirun = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
              "CUDA_VISIBLE_DEVICES": "0,1,2,3", "TFDIST_LOCAL_DEVICES": "2"}
    assert devices_report(mpirun)["trains_on"] == ["GPU 2", "GPU 3"]
    overlap = devices_report({**mpirun, "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert "trains_on" not in overlap and "overlap" in overlap["error"]


def test_tfdist_cluster_reports_versions_build_and_collectives():
    import keras
    import tensorflow as tf

    from tfdist.cli.cluster import software_report

    report = software_report(gpus=True)
    assert (report["tensorflow"], report["keras"]) == (tf.__version__, keras.__version__)
    cuda = tf.test.is_built_with_cuda()
    assert report["cuda_build"] is cuda and (report["cuda"] is not None) is cuda
    assert report["multi_worker_collectives"] == ("NCCL" if cuda else "TF's ring over gRPC (CPU)")
