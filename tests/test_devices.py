"""Device set-up errors: each names the parameter and the fix."""

from __future__ import annotations

import pytest

import tfdist
from tfdist.devices import resolve_devices


@pytest.mark.parametrize("n", [0, -1, 2.5, "4", True, None])
def test_virtual_cpus_rejects_bad_counts(n):
    with pytest.raises(tfdist.ConfigError, match="virtual_cpus: n must be a whole number"):
        tfdist.devices.virtual_cpus(n)


def test_virtual_cpus_is_idempotent_for_the_same_count():
    assert tfdist.devices.virtual_cpus(4) == [f"/device:CPU:{i}" for i in range(4)]


def test_virtual_cpus_after_tensorflow_started_says_how_to_fix(python):
    proc = python("""
        import tensorflow as tf, tfdist
        tf.constant(1.0)  # initialises TensorFlow with one CPU
        try:
            tfdist.devices.virtual_cpus(2)
        except tfdist.InitOrderError as err:
            print("ERROR:", err)
    """)
    assert "already initialised with 1 logical CPU" in proc.stdout
    assert "before any tensor, model or strategy is created" in proc.stdout


def test_virtual_cpus_in_a_fresh_process_gives_that_many_replicas(python):
    proc = python("""
        import tfdist
        print(tfdist.devices.virtual_cpus(3))
        print(tfdist.MirroredStrategy().num_replicas_in_sync)
    """)
    assert proc.stdout.split("\n")[:2] == ["['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']", "3"]


@pytest.mark.parametrize("devices, message", [
    (["/gpu:0"], r"no device '/gpu:0' on this machine; available: .*CPU:3.*virtual_cpus"),
    (["/cpu:9"], r"no device '/cpu:9'"),
    (["nonsense"], r"'nonsense' is not a device name"),
    ([], r"devices is empty"),
    (["/cpu:0", "/device:CPU:0"], r"listed twice"),
    ("/cpu:0", r"must be a list of device names"),
    (["/job:worker/task:1/cpu:0"], r"remote devices need tfdist.MultiWorkerMirroredStrategy"),
])
def test_bad_device_lists_are_named(devices, message):
    with pytest.raises(tfdist.ConfigError, match=message):
        resolve_devices(devices)
    with pytest.raises(tfdist.ConfigError, match="devices"):
        tfdist.MirroredStrategy(devices)


def test_bad_cross_device_ops_is_named():
    with pytest.raises(tfdist.ConfigError, match="cross_device_ops must be .*'reduce_to_one'.*got 'ring'"):
        tfdist.MirroredStrategy(cross_device_ops="ring")


def test_default_devices_are_all_logical_cpus():
    assert resolve_devices(None) == [f"/device:CPU:{i}" for i in range(4)]
