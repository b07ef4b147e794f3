"""Parameter-server SLURM steps: SlurmCluster(num_ps=K) from a synthetic step environment, `tfdist cluster
--tf-config --ps K`, and (slow, root only) slurm/ps.sbatch on the local two-node SLURM with a tiny program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfdist.cluster import is_chief, rank
from tfdist.cluster.slurm import SlurmCluster
from tfdist.comm.tf_config import PARAMETER_SERVER_JOBS, parse_tf_config
from tfdist.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def step(procid=0, nodelist="n[1-2]", tasks_per_node="2(x2)", ntasks=4, **extra):
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, **extra}


def clusters(num_ps: int, **kwargs) -> list[SlurmCluster]:
    env = step(**kwargs)
    return [SlurmCluster.from_environment({**env, "SLURM_PROCID": str(r)}, num_ps=num_ps)
            for r in range(int(env["SLURM_STEP_NUM_TASKS"]))]


def test_task_0_is_the_chief_then_parameter_servers_then_workers():
    tasks = clusters(2, nodelist="n[1-3]", tasks_per_node="2(x3)", ntasks=6)
    spec = tasks[0].cluster_spec()
    assert all(t.cluster_spec() == spec for t in tasks)  # every task computes the same cluster
    addresses = tasks[0].task_addresses()
    assert spec == {"chief": addresses[:1], "ps": addresses[1:3], "worker": addresses[3:]}
    assert [w.split(":")[0] for w in spec["worker"]] == ["n2", "n3", "n3"]
    assert [t.task for t in tasks] == [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1),
                                       ("worker", 2)]
    assert [t.tf_config()["task"] for t in tasks][:2] == [{"type": "chief", "index": 0}, {"type": "ps", "index": 0}]
    assert [t.is_chief for t in tasks] == [True] + [False] * 5
    assert tasks[4].describe()["task"] == {"type": "worker", "index": 1}
    # the TF_CONFIG each task exports parses (as a parameter-server cluster) and gives rank/is_chief
    configs = [parse_tf_config(t.tf_config(), jobs=PARAMETER_SERVER_JOBS) for t in tasks]
    assert [(c.task_type, c.task_index) for c in configs] == [t.task for t in tasks]
    envs = [{"TF_CONFIG": json.dumps(t.tf_config()), "SLURM_PROCID": str(t.rank)} for t in tasks]
    assert [is_chief(environ=e) for e in envs] == [True] + [False] * 5
    # rank() follows TF_CONFIG (chief, workers, then ps), not SLURM_PROCID
    assert [rank(environ=e) for e in envs] == [0, 4, 5, 1, 2, 3]


def test_without_num_ps_nothing_changes():
    tasks = clusters(None)
    assert tasks[0].cluster_spec() == {"worker": tasks[0].task_addresses()}
    assert [t.tf_config()["task"] for t in tasks] == [{"type": "worker", "index": r} for r in range(4)]
    assert tasks[2].task == ("worker", 2) and tasks[2].num_ps == 0


def test_one_ps_on_a_minimal_step():
    chief, ps, worker = clusters(1, nodelist="n1", tasks_per_node="3", ntasks=3)
    addresses = chief.task_addresses()
    assert worker.tf_config() == {"cluster": {"chief": [addresses[0]], "worker": [addresses[2]], "ps": [addresses[1]]},
                                  "task": {"type": "worker", "index": 0}}
    assert len(set(addresses)) == 3 and ps.task == ("ps", 0)  # one node: three distinct ports


@pytest.mark.parametrize("num_ps, kwargs, message", [
    (0, {}, r"--ps, TFDIST_NUM_PS .* whole number >= 1, got 0"),
    (-1, {}, r"whole number >= 1, got -1"),
    (3, {}, r"1 chief \+ 3 parameter server\(s\) \(--ps / TFDIST_NUM_PS=3\) \+ at least 1 worker = 5 tasks, "
            r"but this step has 4 .*sbatch --ntasks=5"),
    (1, {"nodelist": "n1", "tasks_per_node": "2", "ntasks": 2}, r"= 3 tasks, but this step has 2"),
])
def test_bad_parameter_server_layouts(num_ps, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SlurmCluster.from_environment(step(**kwargs), num_ps=num_ps)


def test_direct_construction_is_checked_too():
    c = clusters(1)[0]
    with pytest.raises(ConfigError, match="at least 1 worker"):
        SlurmCluster(**{**c.__dict__, "num_ps": 3})


def test_cli_tf_config_with_ps():
    env = {**os.environ, **step(procid=1)}
    out = subprocess.run([PY, "-m", "tfdist", "cluster", "--tf-config", "--ps", "1"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["task"] == {"type": "ps", "index": 0} and sorted(config["cluster"]) == ["chief", "ps", "worker"]
    bad = subprocess.run([PY, "-m", "tfdist", "cluster", "--tf-config", "--ps", "4"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "TFDIST_NUM_PS=4" in bad.stderr and "at least 1 worker" in bad.stderr


# --- slurm/ps.sbatch on a real SLURM (two nodes in network namespaces; root only) ----------------------
# Every task records its start; worker 0 SIGKILLs itself on its first start (its task restarts it); the
# parameter server and workers then sleep like TF servers; the chief waits for all of that, then exits.
TINY = r"""
import json, os, signal, sys, time
from tfdist.cluster import is_chief, rank
out = os.environ["OUT"]
config = json.loads(os.environ["TF_CONFIG"])
name = config["task"]["type"] + str(config["task"]["index"])
with open(os.path.join(out, name + ".starts"), "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "host": os.environ["SLURMD_NODENAME"], "role": os.environ["TFDIST_ROLE"],
                        "rank": rank(), "chief": is_chief(), "tf_config": config}) + "\n")
if name == "worker0" and not os.path.exists(os.path.join(out, "worker0.killed")):
    open(os.path.join(out, "worker0.killed"), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
if name != "chief0":
    time.sleep(3600)
deadline = time.monotonic() + 90
want = {"ps0": 1, "worker0": 2, "worker1": 1}
def lines(n):
    p = os.path.join(out, n + ".starts")
    return len(open(p).read().splitlines()) if os.path.exists(p) else 0
while any(lines(n) < k for n, k in want.items()):
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.1)
sys.exit(int(os.environ.get("TEST_CODE", "0")))
"""


def run_ps_template(slurm, tmp_path: Path, code: int, **extra_env: str) -> tuple[str, str, dict, Path]:
    (tmp_path / "tiny.py").write_text(TINY)
    venv_bin = Path(PY).parent
    out = tmp_path / "out"
    env = {"PATH": f"{venv_bin}:{os.environ['PATH']}", "TFDIST": str(venv_bin / "tfdist"), "TFDIST_PYTHON": PY,
           "TFDIST_SCRIPT": str(tmp_path / "tiny.py"), "TFDIST_OUT": str(out), "TEST_CODE": str(code), **extra_env}
    start = time.monotonic()
    job = slurm.sbatch([str(REPO / "slurm" / "ps.sbatch")], cwd=tmp_path, env=env)
    state = slurm.wait(job, timeout=180)
    log_path = tmp_path / f"tfdist-ps-{job}.out"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    seconds = time.monotonic() - start
    print(f"ps.sbatch job {job}: {state} after {seconds:.1f} s\n{log}")
    # ~3 s here: the chief's exit must end the step at once, not a timeout (a restarted worker once held it)
    assert seconds < 60, log
    return state, log, slurm.job_info(job), out


def starts(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{name}.starts").read_text().splitlines()]


@pytest.mark.slow
def test_ps_template_roles_restart_and_the_chief_ending_the_step(slurm, tmp_path):
    state, log, info, out = run_ps_template(slurm, tmp_path, code=0)
    assert state == "COMPLETED", log + slurm.log_tail()
    assert info["ExitCode"] == "0:0", info
    records = {n: starts(out, n) for n in ("chief0", "ps0", "worker0", "worker1")}
    assert [len(records[n]) for n in ("chief0", "ps0", "worker0", "worker1")] == [1, 1, 2, 1]
    # task 0 chief and task 1 ps on n1, the workers on n2 (block layout); one cluster for all
    assert {n: r[0]["host"] for n, r in records.items()} == {"chief0": "n1", "ps0": "n1", "worker0": "n2",
                                                           "worker1": "n2"}
    cluster = records["chief0"][0]["tf_config"]["cluster"]
    assert all(r[0]["tf_config"]["cluster"] == cluster for r in records.values())
    assert [h.split(":")[0] for h in cluster["chief"] + cluster["ps"] + cluster["worker"]] == ["n1", "n1", "n2", "n2"]
    assert {n: (r[0]["role"], r[0]["rank"], r[0]["chief"]) for n, r in records.items()} == {
        "chief0": ("chief", 0, True), "ps0": ("ps", 3, False), "worker0": ("worker", 1, False),
        "worker1": ("worker", 2, False)}
    assert records["worker0"][0]["tf_config"] == records["worker0"][1]["tf_config"]  # restarted, same TF_CONFIG
    assert "tfdist: worker 0 exited with code 137; restarting it in 1 s (1/3)" in log, log
    assert "tfdist: chief exited with code 0; ending the step" in log, log


@pytest.mark.slow
def test_ps_template_job_fails_with_the_chiefs_code(slurm, tmp_path):
    state, log, info, _ = run_ps_template(slurm, tmp_path, code=3)
    assert state == "FAILED" and info["ExitCode"] == "3:0", (info, log)
    assert "tfdist: chief exited with code 3; ending the step" in log, log


@pytest.mark.slow
def test_ps_template_with_too_few_tasks_is_a_clear_error(slurm, tmp_path):
    state, log, info, _ = run_ps_template(slurm, tmp_path, code=0, TFDIST_NUM_PS="3")  # 4 tasks: no worker left
    assert state == "FAILED" and info["ExitCode"] == "2:0", (info, log)
    assert "(--ps / TFDIST_NUM_PS=3) + at least 1 worker = 5 tasks, but this step has 4" in log, log
