"""The local launcher with plain Python workers: rank prefixes, exit codes, stopping the rest, real signals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from tfdist.cluster import launcher
from tfdist.cluster.launcher import launch, load_backend
from tfdist.errors import ConfigError

PY = sys.executable


def _run(code: str, n: int, **kwargs) -> tuple[int, list[str], float]:
    out = io.StringIO()
    start = time.monotonic()
    rc = launch([PY, "-c", code], n, out=out, timeout_s=120, **kwargs)
    return rc, out.getvalue().splitlines(), time.monotonic() - start


def test_prefixes_every_line_with_its_rank_and_passes_environment():
    code = ("import os, sys; r = os.environ['TFDIST_RANK']; print('hello from', r); "
            "print('err', r, os.environ['TFDIST_LOCAL_DEVICES'], file=sys.stderr)")
    rc, lines, _ = _run(code, 3, devices_per_worker=2)
    assert rc == 0
    for r in range(3):
        assert f"[{r}] hello from {r}" in lines
        assert f"[{r}] err {r} 2" in lines
    assert all(line[:3] in ("[0]", "[1]", "[2]") for line in lines)


def test_returns_first_failure_and_stops_the_others():
    # Rank 1 fails fast; ranks 0 and 2 would sleep for minutes: the launcher must stop them.
    code = ("import os, sys, time; r = int(os.environ['TFDIST_RANK']); print('pid', os.getpid(), flush=True); "
            "time.sleep(0.5); sys.exit(7) if r == 1 else time.sleep(300)")
    rc, lines, seconds = _run(code, 3)
    assert rc == 7
    assert any("[launch] worker 1" in line and "exited with code 7" in line and "stopping" in line for line in lines)
    pids = [int(line.split()[-1]) for line in lines if " pid " in line]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every worker is gone
    assert seconds < 60


def test_a_killed_worker_stops_the_job_with_128_plus_signal():
    # A worker killed from outside by SIGKILL (a real signal) ends the job; others are stopped, even if
    # they ignore SIGTERM (TensorFlow's coordination service catches SIGTERM for preemption).
    code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('pid', os.getpid(), flush=True); time.sleep(300)")
    pids: list[int] = []

    def killer(procs: list[subprocess.Popen]):
        def later():
            time.sleep(1.0)
            pids.extend(p.pid for p in procs)
            os.kill(procs[1].pid, signal.SIGKILL)
        import threading
        threading.Thread(target=later, daemon=True).start()

    rc, lines, seconds = _run(code, 2, on_start=killer)
    assert rc == 128 + signal.SIGKILL
    assert any("worker 1" in line and "SIGKILL" in line for line in lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert seconds < 60


def test_progress_bar_redraws_keep_the_final_text():
    code = r"import sys; sys.stdout.write('1/3 [=>   ]\r2/3 [==> ]\b\b\r3/3 [====] done\n')"
    rc, lines, _ = _run(code, 1)
    assert rc == 0 and lines == ["[0] 3/3 [====] done"]


def test_bad_arguments_and_missing_backend(monkeypatch):
    with pytest.raises(ConfigError, match="-n"):
        launch([PY, "-c", "pass"], 0)
    with pytest.raises(ConfigError, match="no command"):
        launch([], 2)
    with pytest.raises(ConfigError, match="--backend must be one of"):
        load_backend("carrier-pigeon")
    monkeypatch.setitem(launcher.BACKENDS, "horovod", "tfdist.cluster.not_installed_here:GlooBackend")
    with pytest.raises(ConfigError, match="backend 'horovod' is not available"):
        load_backend("horovod")


def test_cli_launch_runs_and_reports_missing_command():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    tfdist_cmd = [PY, "-m", "tfdist"]
    ok = subprocess.run([*tfdist_cmd, "launch", "-n", "2", "--", PY, "-c", "print('ok')"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "[0] ok" in ok.stdout and "[1] ok" in ok.stdout
    bad = subprocess.run([*tfdist_cmd, "launch", "-n", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "no command given" in bad.stderr
    fail = subprocess.run([*tfdist_cmd, "launch", "-n", "2", "--", PY, "-c", "import sys; sys.exit(3)"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert fail.returncode == 3


@pytest.mark.parametrize("program, message", [
    ("/no/such/program", "cannot launch '/no/such/program': no such file"),
    ("no-such-program-tfdist", "cannot launch 'no-such-program-tfdist': no such program on PATH"),
])
def test_a_program_that_does_not_exist_is_one_line_and_exit_2(program, message):
    proc = subprocess.run([PY, "-m", "tfdist", "launch", "-n", "2", "--", program], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tfdist launch: error: {message}. usage: tfdist launch -n 2 -- python train.py"


def test_a_file_that_is_not_executable_is_named(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')")
    with pytest.raises(ConfigError, match="not executable .* -- python script.py"):
        launch([str(script)], 2, out=io.StringIO())

