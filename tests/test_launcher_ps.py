"""`tfdist launch --ps K`: chief + workers + parameter servers with plain Python programs (no TensorFlow).

Every process of the test program records its environment in TEST_DIR/<type><index>.starts (one JSON line
per start) and says so; workers and parameter servers then sleep like TF servers, and the chief waits
until the files named in TEST_WAIT have enough lines, then exits with TEST_CODE.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tfdist.cluster import is_chief, rank, world_size
from tfdist.cluster.backends import make_tf_configs
from tfdist.cluster.launcher import launch
from tfdist.comm.tf_config import PARAMETER_SERVER_JOBS, parse_tf_config
from tfdist.errors import ConfigError

PY = sys.executable
PROGRAM = r"""
import json, os, sys, time
d = os.environ["TEST_DIR"]
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}{task['index']}"
keys = ("TF_CONFIG", "TFDIST_RANK", "TFDIST_ROLE", "TFDIST_LOCAL_DEVICES")
with open(os.path.join(d, name + ".starts"), "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "env": {k: os.environ.get(k) for k in keys}}) + "\n")
print("started", name, os.getpid(), flush=True)
if os.environ["TFDIST_ROLE"] != "chief":
    time.sleep(600)  # a TF server: never ends by itself
deadline = time.monotonic() + 60
for want in os.environ["TEST_WAIT"].split(","):
    file, _, lines = want.partition(":")
    path = os.path.join(d, file)
    while not (os.path.exists(path) and len(open(path).read().splitlines()) >= int(lines or 1)):
        if time.monotonic() > deadline:
            print("chief gave up waiting for", want, flush=True)
            sys.exit(99)
        time.sleep(0.05)
time.sleep(float(os.environ.get("TEST_LINGER", "0")))
sys.exit(int(os.environ["TEST_CODE"]))
"""


def _tasks(n: int, ps: int) -> list[str]:
    return ["chief0", *(f"worker{i}" for i in range(n)), *(f"ps{j}" for j in range(ps))]


def _run(tmp_path: Path, n: int, ps: int, *, wait: str, code: int = 0, linger: float = 0.0,
         **kwargs) -> tuple[int, list[str]]:
    out = io.StringIO()
    env = {"TEST_DIR": str(tmp_path), "TEST_WAIT": wait, "TEST_CODE": str(code), "TEST_LINGER": str(linger)}
    rc = launch([PY, "-c", PROGRAM], n, ps=ps, env=env, out=out, timeout_s=kwargs.pop("timeout_s", 120), **kwargs)
    return rc, out.getvalue().splitlines()


def _starts(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / f"{name}.starts"
    # complete lines only: a process may be writing its line right now
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill_when_started(tmp_path: Path, name: str, index: int):
    """An on_start hook: SIGKILL process `index` once task `name` has recorded its start, then write
    TEST_DIR/killed (what the chief can wait for)."""
    def on_start(procs: list[subprocess.Popen]) -> None:
        def later():
            deadline = time.monotonic() + 60
            while not _starts(tmp_path, name) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(procs[index].pid, signal.SIGKILL)
            (tmp_path / "killed").write_text(f"{name}\n")
        threading.Thread(target=later, daemon=True).start()
    return on_start


def test_tf_configs_roles_ranks_and_the_chief_ends_the_job(tmp_path):
    tasks = _tasks(2, 2)
    rc, lines = _run(tmp_path, 2, 2, wait=",".join(f"{t}.starts" for t in tasks), code=3, devices_per_worker=2)
    assert rc == 3, lines  # the chief's exit code is the job's
    records = {t: _starts(tmp_path, t) for t in tasks}
    assert all(len(r) == 1 for r in records.values()), records  # nobody restarted
    envs = {t: r[0]["env"] for t, r in records.items()}
    configs = {t: json.loads(e["TF_CONFIG"]) for t, e in envs.items()}
    cluster = configs["chief0"]["cluster"]
    assert all(c["cluster"] == cluster for c in configs.values())  # one cluster, seen alike by all
    assert sorted(cluster) == ["chief", "ps", "worker"]
    assert [len(cluster[j]) for j in ("chief", "worker", "ps")] == [1, 2, 2]
    addresses = [a for job in cluster.values() for a in job]
    assert len(set(addresses)) == 5 and all(a.startswith("localhost:") for a in addresses)
    assert {t: (c["task"]["type"], c["task"]["index"]) for t, c in configs.items()} == {
        "chief0": ("chief", 0), "worker0": ("worker", 0), "worker1": ("worker", 1), "ps0": ("ps", 0), "ps1": ("ps", 1)}
    # TFDIST_RANK: chief 0, workers 1..n, ps n+1..n+K; tfdist.cluster.rank() reads the same from TF_CONFIG
    assert {t: e["TFDIST_RANK"] for t, e in envs.items()} == {
        "chief0": "0", "worker0": "1", "worker1": "2", "ps0": "3", "ps1": "4"}
    assert {t: e["TFDIST_ROLE"] for t, e in envs.items()} == {
        "chief0": "chief", "worker0": "worker", "worker1": "worker", "ps0": "ps", "ps1": "ps"}
    assert all(e["TFDIST_LOCAL_DEVICES"] == "2" for e in envs.values())
    assert [rank(environ=envs[t]) for t in tasks] == [0, 1, 2, 3, 4]
    assert [is_chief(environ=envs[t]) for t in tasks] == [True, False, False, False, False]
    assert world_size(environ=envs["ps0"]) == 3  # chief + workers: parameter servers do not train
    # prefixes name the role; the chief's exit stops the servers, and says so (not as a failure)
    for prefix, name in [("[chief]", "chief0"), ("[worker 0]", "worker0"), ("[worker 1]", "worker1"),
                         ("[ps 0]", "ps0"), ("[ps 1]", "ps1")]:
        assert f"{prefix} started {name} {records[name][0]['pid']}" in lines
    assert "[launch] chief exited with code 3; the job ends with it: stopping worker 0, worker 1, ps 0, ps 1" in lines
    assert all(_gone(r[0]["pid"]) for r in records.values())


def test_a_killed_worker_is_restarted_with_the_same_tf_config(tmp_path):
    # worker 1 is process 2 (chief, worker 0, worker 1, ps 0); the chief ends once it has started twice
    rc, lines = _run(tmp_path, 2, 1, wait="worker1.starts:2", on_start=_kill_when_started(tmp_path, "worker1", 2))
    assert rc == 0, lines
    assert "[launch] worker 1 was killed by SIGKILL; restarting it in 1 s (1/3)" in lines
    first, second = _starts(tmp_path, "worker1")
    assert first["env"] == second["env"] and first["pid"] != second["pid"]  # same TF_CONFIG, new process
    assert f"[worker 1] started worker1 {second['pid']}" in lines
    assert [len(_starts(tmp_path, t)) for t in ("chief0", "worker0", "ps0")] == [1, 1, 1]
    assert _gone(second["pid"])  # the restarted worker is stopped with the others


def test_a_worker_failing_at_start_up_is_restarted_after_a_doubling_back_off():
    from tfdist.cluster.ps_supervisor import supervise_ps

    def start(code: int, seconds: float = 0.0) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"],
                                start_new_session=True)

    starts, lines = [], []

    def restart(i: int) -> subprocess.Popen:
        starts.append(time.monotonic())
        return start(1)

    procs = [start(0, seconds=4), start(1)]
    rc = supervise_ps(procs, [("chief", 0), ("worker", 0)], restart, lines.append, max_restarts=3, timeout_s=60,
                      backoff_s=0.25)
    assert rc == 0
    assert [line.split("; ")[1] for line in lines[:4]] == [
        "restarting it in 0.25 s (1/3)", "restarting it in 0.5 s (2/3)", "restarting it in 1 s (3/3)",
        "not restarting it (--max-restarts 3 used up)"]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 3 and gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps  # each wait at least its back-off


def test_max_restarts_0_does_not_restart(tmp_path):
    rc, lines = _run(tmp_path, 2, 1, wait="killed", linger=0.5, max_restarts=0,
                     on_start=_kill_when_started(tmp_path, "worker1", 2))
    assert rc == 0, lines  # the job goes on without that worker
    assert ("[launch] worker 1 was killed by SIGKILL; not restarting it (--max-restarts 0 allows none); "
            "the other workers go on") in lines
    assert len(_starts(tmp_path, "worker1")) == 1
    assert not any("; restarting it" in line for line in lines)


def test_a_lost_parameter_server_is_announced_not_restarted(tmp_path):
    # The chief (here: the test program) fails after losing its ps; its code ends the job.
    rc, lines = _run(tmp_path, 1, 1, wait="killed", linger=0.5, code=7,
                     on_start=_kill_when_started(tmp_path, "ps0", 2))
    assert rc == 7, lines
    assert any(line.startswith("[launch] ps 0 was killed by SIGKILL; parameter servers are not restarted")
               for line in lines), lines
    assert len(_starts(tmp_path, "ps0")) == 1
    assert "[launch] chief exited with code 7; the job ends with it: stopping worker 0" in lines


def test_timeout_stops_a_ps_job_with_124(tmp_path):
    pids: list[int] = []
    rc, lines = _run(tmp_path, 1, 1, wait="never", timeout_s=2,
                     on_start=lambda procs: pids.extend(p.pid for p in procs))
    assert rc == 124
    assert "[launch] job exceeded its timeout of 2 s; stopping all processes" in lines
    assert all(_gone(pid) for pid in pids)


def test_make_tf_configs_with_ps_and_without():
    plain = [parse_tf_config(c) for c in make_tf_configs(2)]
    assert [sorted(c.cluster) for c in plain] == [["worker"], ["worker"]]  # ps=0: as before
    with_ps = [parse_tf_config(c, jobs=PARAMETER_SERVER_JOBS) for c in make_tf_configs(2, ps=1)]
    assert [(c.task_type, c.task_index, c.rank, c.is_chief) for c in with_ps] == [
        ("chief", 0, 0, True), ("worker", 0, 1, False), ("worker", 1, 2, False), ("ps", 0, 3, False)]
    with pytest.raises(ConfigError, match="job 'ps'; MultiWorkerMirroredStrategy runs only"):
        parse_tf_config(make_tf_configs(1, ps=1)[0])  # all-reduce callers still refuse a ps job
    with pytest.raises(ConfigError, match="ps .*>= 0, got -1"):
        make_tf_configs(2, ps=-1)


@pytest.mark.parametrize("kwargs, message", [
    ({"ps": 0}, r"--ps \(number of parameter servers\) must be a whole number >= 1, got 0"),
    ({"ps": -2}, r"--ps .* >= 1, got -2"),
    ({"ps": 1, "backend": "horovod"}, r"--ps needs --backend tf .* got --backend 'horovod'"),
    ({"ps": 1, "max_restarts": -1}, r"--max-restarts .* >= 0, got -1"),
])
def test_bad_ps_options_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        launch([PY, "-c", "pass"], 2, out=io.StringIO(), **kwargs)


def test_cli_ps_errors_are_one_line_and_exit_2():
    for args, message in [(["--ps", "0"], "--ps (number of parameter servers) must be a whole number >= 1, got 0"),
                          (["--ps", "1", "--backend", "horovod"], "--ps needs --backend tf")]:
        proc = subprocess.run([PY, "-m", "tfdist", "launch", "-n", "2", *args, "--", PY, "-c", "pass"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr
