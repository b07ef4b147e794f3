"""Elastic restarts (`tfdist launch --max-restarts R`, slurm/*.sbatch TFDIST_MAX_RESTARTS) and silent peers.

Quick tests use plain Python workers: whole-job restarts with fresh ports, restarts that run out, a stopped
worker named by the launcher. Slow tests train for real (tests/elastic_job.py): a worker SIGKILLs itself
mid-epoch, then in the next round a worker SIGSTOPs itself mid-epoch; the job restarts twice and ends with
the weights of an uninterrupted run, under the tf and horovod backends and in a real SLURM step relaunch.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError

PY = sys.executable
# Workers here SIGSTOP themselves and the launcher reads their state by PID: fresh processes, no stand-ins.
pytestmark = pytest.mark.usefixtures("fresh_processes")
JOB = Path(__file__).with_name("elastic_job.py")
EPOCHS = 5
# Round 0: worker 1 SIGKILLs itself in epoch 2 (index); round 1: worker STOP_RANK SIGSTOPs itself in epoch 3.
FAULTS = "0:KILL:1:2:5 1:STOP:{stop}:3:5"
SILENT_LIMIT_S = 60  # the peers of a stopped worker must give up within this (the bound)


class Lines(io.TextIOBase):
    """The launcher's `out`: keeps every line with the time.time() it arrived."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.lines.extend((time.time(), line) for line in text.splitlines())
        return len(text)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _python_job(code: str, n: int, **kwargs) -> tuple[int, list[str]]:
    out = Lines()
    rc = launch([PY, "-c", code], n, out=out, timeout_s=120, **kwargs)
    return rc, [line for _, line in out.lines]


# --- the launcher's policy, with plain Python workers -------------------------------------------------
def test_a_failure_restarts_every_worker_with_a_fresh_tf_config(tmp_path):
    # Worker 1 fails in rounds 0 and 1 (once worker 0 has printed) while worker 0 waits, like a peer in a
    # collective; round 2 succeeds.
    code = f"""
import json, os, sys, time
r, k = int(os.environ['TFDIST_RANK']), int(os.environ['TFDIST_RESTART_COUNT'])
print('round', k, 'of', os.environ['TFDIST_MAX_RESTARTS'], 'pid', os.getpid(), 'ports',
      json.loads(os.environ['TF_CONFIG'])['cluster']['worker'], flush=True)
ready = os.path.join({str(tmp_path)!r}, f'printed-{{k}}')
if r == 0:
    open(ready, 'w').close()
    time.sleep(300 if k < 2 else 0)
elif k < 2:
    while not os.path.exists(ready):
        time.sleep(0.05)
    sys.exit(3)
"""
    rc, lines = _python_job(code, 2, max_restarts=2)
    assert rc == 0, lines
    rounds = [re.search(r"^\[(\d)\] round (\d) of 2 pid (\d+) ports (.*)$", line) for line in lines]
    seen = sorted((int(m.group(2)), int(m.group(1))) for m in rounds if m)
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], lines
    ports = {int(m.group(2)): m.group(4) for m in rounds if m}
    assert len(set(ports.values())) == 3, ports  # every round has its own TF_CONFIG (fresh ports)
    for k in (1, 2):
        assert f"[launch] restarting all 2 workers ({k}/2); they resume from their last checkpoint " \
               "(e.g. tfdist.training.BackupAndRestore)" in lines
    failures = [line for line in lines if line.startswith("[launch] worker 1 ")]
    assert len(failures) == 2 and all("exited with code 3; stopping worker(s) [0]" in f for f in failures), lines
    for m in rounds:  # every worker of every round is gone
        if m:
            with pytest.raises(ProcessLookupError):
                os.kill(int(m.group(3)), 0)


def test_restarts_run_out_and_the_job_fails_with_the_last_code():
    rc, lines = _python_job("import os, sys; sys.exit(5 + int(os.environ['TFDIST_RESTART_COUNT']))", 2,
                            max_restarts=1)
    assert rc == 6
    assert sum("restarting all 2 workers (1/1)" in line for line in lines) == 1
    assert lines[-1] == ("[launch] no restart left (--max-restarts 1 used up); the job fails with code 6. "
                         "See docs/troubleshooting.md#the-launcher-stopped-the-job.")


def test_without_max_restarts_the_job_fails_fast_as_before():
    code = ("import os, sys, time; print('round', os.environ['TFDIST_RESTART_COUNT'], flush=True); "
            "sys.exit(4) if os.environ['TFDIST_RANK'] == '1' else time.sleep(300)")
    rc, lines = _python_job(code, 2)
    assert rc == 4
    assert not any("restart" in line for line in lines if line.startswith("[launch]")), lines
    rounds = [line for line in lines if " round " in line]  # worker 0 may be stopped before it prints
    assert "[1] round 0" in rounds and set(rounds) <= {"[0] round 0", "[1] round 0"}, lines


def test_timeout_covers_every_round():
    # Worker 1 fails at once in every round, worker 0 hangs: rounds repeat until the job's timeout ends them.
    code = "import os, sys, time; sys.exit(3) if os.environ['TFDIST_RANK'] == '1' else time.sleep(300)"
    out = Lines()
    rc = launch([PY, "-c", code], 2, out=out, timeout_s=2, max_restarts=1000)
    lines = [line for _, line in out.lines]
    assert rc == 124, lines
    assert lines[-1] in ("[launch] job exceeded its timeout of 2 s; not restarting",
                         "[launch] job exceeded its timeout of 2 s; stopping all workers"), lines
    assert any("restarting all 2 workers (1/1000)" in line for line in lines)


def test_a_stopped_worker_is_named_and_killed(tmp_path):
    # Worker 1 stops itself (alive, silent); worker 0 sees it stopped and fails, as a peer's timeout would.
    code = f"""
import os, signal, sys, time
pid_file = {str(tmp_path / "pid")!r}
if os.environ['TFDIST_RANK'] == '1':
    open(pid_file + '.tmp', 'w').write(str(os.getpid())); os.rename(pid_file + '.tmp', pid_file)
    os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)   # never reached: the launcher kills a stopped worker
while not os.path.exists(pid_file):
    time.sleep(0.05)
stat = '/proc/%s/stat' % open(pid_file).read()
while open(stat).read().rsplit(')', 1)[1].split()[0] != 'T':
    time.sleep(0.05)
print('peer stopped; giving up', flush=True)
sys.exit(1)
"""
    rc, lines = _python_job(code, 2)
    assert rc == 1, lines
    pid = int((tmp_path / "pid").read_text())
    assert (f"[launch] worker 0 (pid {lines_pid(lines, 0)}) exited with code 1; worker 1 (pid {pid}) is stopped "
            "(SIGSTOP or SIGTSTP: alive but silent, so its peers gave up waiting for it); stopping worker(s) [1]") \
        in lines, lines
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # SIGKILLed at once: a stopped process cannot act on SIGTERM


def lines_pid(lines: list[str], rank: int) -> int:
    """The pid the launcher gives for `rank` in its failure line."""
    for line in lines:
        m = re.match(rf"\[launch\] worker {rank} \(pid (\d+)\)", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no launcher line for worker {rank}: {lines}")


def test_each_round_has_its_own_gloo_rendezvous():
    pytest.importorskip("horovod.runner.http.http_server")
    code = ("import os, sys; k = os.environ['TFDIST_RESTART_COUNT']; "
            "print('round', k, 'rendezvous', os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT'], flush=True); "
            "sys.exit(0 if k == '1' else 2)")
    rc, lines = _python_job(code, 2, backend="horovod", max_restarts=1)
    assert rc == 0, lines
    ports = {line.split()[2]: line.split()[4] for line in lines if " rendezvous " in line}
    assert set(ports) == {"0", "1"} and ports["0"] != ports["1"], lines  # a stale one would hold old addresses


@pytest.mark.parametrize("kwargs, message", [
    ({"max_restarts": -1}, r"--max-restarts \(restarts of all workers\) must be a whole number >= 0, got -1"),
    ({"max_restarts": True}, r"--max-restarts .* got True"),
    ({"ps": 1, "max_restarts": -2}, r"--max-restarts \(restarts per worker\) .* got -2"),
])
def test_bad_max_restarts(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        launch([PY, "-c", "pass"], 2, out=io.StringIO(), **kwargs)


def test_cli_max_restarts():
    code = "import os, sys; sys.exit(0 if os.environ['TFDIST_RESTART_COUNT'] == '1' else 9)"
    proc = subprocess.run([PY, "-m", "tfdist", "launch", "-n", "2", "--max-restarts", "1", "--", PY, "-c", code],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "[launch] restarting all 2 workers (1/1)" in proc.stdout, proc.stdout + proc.stderr


def test_a_silent_coordination_leader_is_named():
    # What worker 1 gets when worker 0 (the coordination leader) is stopped: its heartbeat RPC times out.
    import tensorflow as tf

    from tfdist.comm.faults import lost_worker_error
    from tfdist.comm.tf_config import parse_tf_config

    cluster = {"worker": ["localhost:1111", "localhost:2222"]}
    text = ("{{function_node __wrapped__CollectiveReduceV2}} Collective ops is aborted by: Deadline Exceeded\n\n"
            "RPC: /tensorflow.CoordinationService/Heartbeat\nThe error could be from a previous operation.")
    err = tf.errors.DeadlineExceededError(None, None, text)
    worker1 = parse_tf_config({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    assert "worker /job:worker/replica:0/task:1 lost /job:worker/replica:0/task:0 (localhost:1111, the coordination " \
           "leader) (Collective ops is aborted; DeadlineExceededError)" in str(lost_worker_error(err, worker1))
    leader = parse_tf_config({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    assert "lost contact with another worker" in str(lost_worker_error(err, leader))  # never itself


# --- real training: kill, restart, stop, restart, identical weights ----------------------------------------------
def _train(tmp_path: Path, name: str, backend: str, faults: str = "", max_restarts: int = 0) -> tuple[int, Lines, Path]:
    out = tmp_path / name
    out.mkdir()
    lines = Lines()
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "JOB_BACKEND": backend, "JOB_FAULTS": faults,
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "15"}  # Gloo's recv timeout: how long a silent peer is waited for
    rc = launch([PY, str(JOB), str(out), str(tmp_path / f"{name}-backup"), str(EPOCHS)], 2, backend=backend,
                max_restarts=max_restarts, env=env, out=lines, timeout_s=400)
    return rc, lines, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    """Final weights of the uninterrupted run (tf backend; the horovod backend's are the same floats here)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    rc, lines, out = _train(tmp_path, "clean", "tf")
    assert rc == 0, lines.text()[-3000:]
    assert "RESULT {'restored': None, 'ran': [0, 1, 2, 3, 4]}" in lines.text()
    return np.load(out / "weights-rank0.npy")


def check_elastic_run(lines: Lines, out: Path, reference: np.ndarray, stopped_rank: int) -> None:
    """Round 0 lost worker 1 to SIGKILL, round 1 had worker `stopped_rank` stopped; round 2 finished."""
    text = lines.text()
    assert "[launch] worker 1 (pid " in text and ") was killed by SIGKILL; stopping worker(s) [0]" in text, text[-4000:]
    assert "restarting all 2 workers (1/2)" in text and "restarting all 2 workers (2/2)" in text
    # The silent peer: its peer exits by itself within SILENT_LIMIT_S and the launcher names it (rank and pid).
    stop = next((t, line) for t, line in lines.lines if "FAULT SIGSTOP" in line)
    pid = int(stop[1].split()[3])
    mark = f"worker {stopped_rank} (pid {pid}) is stopped"
    named = next(((t, line) for t, line in lines.lines if mark in line), None)
    assert named is not None, text[-4000:]
    other = 1 - stopped_rank
    assert named[1].startswith(f"[launch] worker {other} (pid "), named  # it exited first, by itself
    print(f"\n{named[0] - stop[0]:.1f} s from SIGSTOP to: {named[1]}")
    assert named[0] - stop[0] < SILENT_LIMIT_S
    # Every epoch ran; the last round resumed after epoch 4 (backed up before the stop in epoch index 3).
    assert "tfdist: restored" in text and "resuming at epoch 3" in text and "resuming at epoch 4" in text
    assert text.count("RESULT {'restored': 3, 'ran': [3, 4]}") == 2, text[-4000:]
    for rank in (0, 1):
        assert np.abs(np.load(out / f"weights-rank{rank}.npy") - reference).max() <= 1e-6


@pytest.mark.slow
def test_tf_job_survives_a_kill_and_a_silent_leader(tmp_path, reference):
    # Round 1 stops worker 0, the coordination leader: worker 1 names it from its failed heartbeat.
    rc, lines, out = _train(tmp_path, "elastic", "tf", FAULTS.format(stop=0), max_restarts=2)
    assert rc == 0, lines.text()[-4000:]
    check_elastic_run(lines, out, reference, stopped_rank=0)
    assert re.search(r"\[1\] tfdist: error: worker /job:worker/replica:0/task:1 lost /job:worker/replica:0/task:0 "
                     r"\(localhost:\d+, the coordination leader\)", lines.text()), lines.text()[-4000:]


@pytest.mark.slow
def test_horovod_job_survives_a_kill_and_a_silent_peer(tmp_path, reference):
    pytest.importorskip("horovod.tensorflow")
    rc, lines, out = _train(tmp_path, "elastic", "horovod", FAULTS.format(stop=1), max_restarts=2)
    assert rc == 0, lines.text()[-4000:]
    # Who notices the silent rank first varies from run to run (Gloo's 15 s recv timeout on its peer, or the
    # launcher's check of stopped workers); check_elastic_run asserts it is named and the job resumes either way.
    check_elastic_run(lines, out, reference, stopped_rank=1)


# --- SLURM: the multi-worker template relaunches its srun step ---------------------------------------------------
@pytest.mark.slow
def test_slurm_step_relaunch_resumes_to_identical_weights(slurm, tmp_path, reference):
    venv_bin = Path(PY).parent
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": f"{venv_bin}:{os.environ['PATH']}", "TFDIST": str(venv_bin / "tfdist"), "TF_CPP_MIN_LOG_LEVEL": "2",
           "TFDIST_SCRIPT": str(JOB), "TFDIST_ARGS": f"{out} {tmp_path / 'backup'} {EPOCHS}", "TFDIST_OUT": str(out),
           "TFDIST_MAX_RESTARTS": "2", "JOB_BACKEND": "tf", "JOB_FAULTS": FAULTS.format(stop=1)}
    template = Path(__file__).resolve().parents[1] / "slurm" / "multiworker.sbatch"
    job = slurm.sbatch([str(template)], cwd=tmp_path, env=env)
    state = slurm.wait(job, timeout=400)
    log = (tmp_path / f"tfdist-multiworker-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-4000:] + slurm.log_tail()
    assert "relaunching all tasks (1/2)" in log and "relaunching all tasks (2/2)" in log, log[-4000:]
    # Round 1: worker 1 stopped; worker 0, the coordination leader, names it from the missing heartbeats.
    assert re.search(r"tfdist: error: worker /job:worker/replica:0/task:0 lost /job:worker/replica:0/task:1 "
                     r"\(n2:\d+\)", log), log[-4000:]
    assert log.count("RESULT {'restored': 3, 'ran': [3, 4]}") == 2, log[-4000:]
    for rank in (0, 1):
        assert np.abs(np.load(out / f"weights-rank{rank}.npy") - reference).max() <= 1e-6


# --- Horovod without a launcher watching: the survivor names the lost rank itself ------------------------------
@pytest.mark.slow
def test_a_lost_horovod_rank_is_named_by_its_peer_within_60_s(tmp_path):
    """Two Gloo ranks started directly (no launcher to notice anything): rank 1 SIGSTOPs itself mid-epoch in one
    run and SIGKILLs itself in the other; rank 0 ends by itself within 60 s with one line naming rank 1's host
    and pid and what became of it, instead of Gloo's timeout text."""
    pytest.importorskip("horovod.tensorflow")
    import socket

    from tfdist.cluster.backends import GlooBackend

    for sig, fate in (("STOP", "it stopped answering"), ("KILL", "it exited")):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "JOB_BACKEND": "horovod",
               "JOB_FAULTS": f"0:{sig}:1:1:3"}
        with GlooBackend().environments(2, 1) as envs:
            procs = [subprocess.Popen([PY, str(JOB), str(tmp_path), str(tmp_path / f"backup-{sig}"), "3"],
                                      env={**env, **e}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for e in envs]
            try:
                log0, _ = procs[0].communicate(timeout=120)
                ended = time.time()
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()  # also ends the stopped rank
                    p.wait()
        log1 = procs[1].stdout.read()
        procs[1].stdout.close()
        fault = next(line for line in log1.splitlines() if line.startswith(f"FAULT SIG{sig}"))
        seconds = ended - float(fault.split()[3])
        named = next((line for line in log0.splitlines() if "tfdist: error:" in line), "")
        print(f"\nSIG{sig}: rank 0 ended {seconds:.1f} s later: {named}")
        assert procs[0].returncode != 0 and seconds < 60, (seconds, log0[-3000:])
        assert (f"tfdist: error: rank 0 lost rank 1 (host {socket.gethostname()}, pid {procs[1].pid}): {fate}"
                in named), log0[-3000:]
        assert "Traceback" not in log0, log0[-3000:]
