"""benchmarks.thread_cpu: CPU seconds per thread group, read from /proc, add up a named pool's threads."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from benchmarks.thread_cpu import _group, seconds_by_group, snapshot

SPIN_S = 0.3


def _pool_thread(index: int, spun: threading.Barrier, done: threading.Event) -> None:
    # PR_SET_NAME: the OS thread name a native pool (TensorFlow's, gRPC's) gives its threads
    ctypes.CDLL(None).prctl(15, f"bench_pool_{index}".encode(), 0, 0, 0)
    end = time.thread_time() + SPIN_S
    while time.thread_time() < end:
        pass
    spun.wait()
    done.wait()  # stay alive: /proc lists live threads only, as a pool's threads are


def test_a_named_pools_threads_add_up_to_the_cpu_they_used():
    done, spun = threading.Event(), threading.Barrier(3, timeout=60)
    pool = [threading.Thread(target=_pool_thread, args=(i, spun, done)) for i in range(2)]
    before = snapshot()
    for t in pool:
        t.start()
    spun.wait()  # both threads have used SPIN_S of CPU each
    used = seconds_by_group(before, snapshot())
    done.set()
    for t in pool:
        t.join()
    assert used["bench_pool"] == pytest.approx(2 * SPIN_S, abs=0.05)  # both threads' own CPU time, one group
    assert list(used.values()) == sorted(used.values(), reverse=True)  # biggest first


@pytest.mark.parametrize("name, group", [("tf_Compute", "tf_Compute"), ("grpc_global_tim", "grpc_global_tim"),
                                         ("event_engine", "event_engine"), ("worker-12", "worker"),
                                         ("python3.11", "python"), ("42", "42")])
def test_thread_names_group_without_their_numbers(name, group):
    assert _group(name) == group
