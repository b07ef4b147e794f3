"""`make test`'s scheduler (tests/xdist_scheduler.py): a test that kills its pytest worker is one failure, the
other tests of its group and of the whole run still run, and the run ends (stock xdist 3.8 runs the killing test
again on the replacement worker, then waits forever)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFTEST = '''
def pytest_xdist_make_scheduler(config, log):
    from xdist_scheduler import CrashSafeLoadGroupScheduling
    return CrashSafeLoadGroupScheduling(config, log)
'''
DIES = '''
import os, time

def test_before():
    time.sleep(0.3)

def test_dies():
    os._exit(1)

def test_after():
    pass
'''


def test_a_worker_killed_by_a_test_fails_that_test_and_the_run_still_ends(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_dies.py").write_text(DIES)
    for i in range(5):  # one-test groups: a replacement given one of them alone waited for a second
        (tmp_path / f"test_one_{i}.py").write_text("import time\n\ndef test_one():\n    time.sleep(0.3)\n")
    env = {"PYTHONPATH": str(Path(__file__).parent), "PATH": "/usr/bin:/bin"}
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-o", "addopts=",
                              "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the run did not end after a worker died:\n{e.stdout}") from None
    tail = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1 and "1 failed, 7 passed" in tail, run.stdout[-3000:]
    assert run.stdout.count("node down") == 1, run.stdout[-3000:]  # the killing test ran once
    assert "FAILED test_dies.py::test_dies" in run.stdout
