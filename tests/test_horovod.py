"""HorovodStrategy in one process: options, missing Horovod, single-process mode, the build cache, GlooBackend."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

import tfdist
from tfdist.errors import ConfigError

LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


@pytest.mark.parametrize("kwargs, needle", [
    ({"compression": "zip"}, "compression must be None, 'fp16' or 'bf16', got 'zip'"),
    ({"op": "max"}, "op must be one of ['average', 'sum', 'adasum'], got 'max'"),
])
def test_unknown_compression_or_op_is_a_config_error(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        tfdist.HorovodStrategy(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("value", [-1, "fast", True, float("inf")])
def test_bad_cycle_time_names_the_parameter_and_the_default(value):
    with pytest.raises(ConfigError, match=r"cycle_time_ms must be a number >= 0 \(Horovod's default is 1 ms\)"):
        tfdist.HorovodStrategy(cycle_time_ms=value)


def test_cycle_time_reaches_horovod_at_init_and_a_later_different_one_is_refused(python):
    # HOROVOD_CYCLE_TIME is read once, by hvd.init(): the first strategy sets it; the same value later is
    # fine, another one names what Horovod runs with instead of being silently ignored.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "HOROVOD_CYCLE_TIME"}
    proc = python("""
        import os, tfdist
        from tfdist.errors import ConfigError
        tfdist.HorovodStrategy(cycle_time_ms=0.1)
        print("ENV", os.environ["HOROVOD_CYCLE_TIME"])
        tfdist.HorovodStrategy(cycle_time_ms=0.10)  # the same number, written differently
        try:
            tfdist.HorovodStrategy(cycle_time_ms=2)
        except ConfigError as err:
            print("REFUSED", err)
    """, env=env, check=True)
    assert "ENV 0.1" in proc.stdout
    assert "REFUSED cycle_time_ms=2: Horovod is already initialised in this process with HOROVOD_CYCLE_TIME=0.1" \
        in proc.stdout


def test_require_launcher_names_the_launch_commands(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as err:
        tfdist.HorovodStrategy(require_launcher=True)
    assert "horovodrun -np 2" in str(err.value) and "tfdist launch --backend horovod" in str(err.value)


def test_importing_tfdist_never_needs_horovod_and_use_says_how_to_install(python):
    proc = python("""
        import sys
        sys.modules["horovod"] = None          # as if Horovod were not installed
        import tfdist
        from tfdist.strategies import HorovodStrategy, make_strategy
        assert "horovod" in tfdist.strategies.strategy_names()
        try:
            HorovodStrategy()
        except ImportError as err:
            print("MESSAGE", err)
        else:
            raise SystemExit("no ImportError")
    """)
    message = proc.stdout.split("MESSAGE", 1)[1]
    assert "tfdist build-horovod" in message and "make horovod" in message


def test_single_process_mode_trains_like_one_device(python, tmp_path):
    # A plain `python script.py`: Horovod of size 1, and the strategy is one replica on this process.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = python(f"""
        import json, keras, numpy as np, tensorflow as tf, tfdist
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from horovod_worker import dense_model, regression_data
        x, y = regression_data()
        def train(strategy):
            with strategy.scope():
                model = dense_model(keras)
                model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
            model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
            return model.get_weights()
        s = tfdist.HorovodStrategy()
        ours, ref = train(s), train(tf.distribute.get_strategy())
        print(json.dumps({{"size": s.size, "replicas": s.num_replicas_in_sync, "chief": s.is_chief,
                          "diff": max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))}}))
    """, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"size": 1, "replicas": 1, "chief": True, "diff": out["diff"]}
    assert out["diff"] <= 1e-6


def test_build_patch_removes_only_the_xla_ops_line(tmp_path):
    from tfdist.cli.build_horovod import patch_source

    cmake = tmp_path / "horovod" / "tensorflow" / "CMakeLists.txt"
    cmake.parent.mkdir(parents=True)
    cmake.write_text('list(APPEND SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc"\n'
                     '                    "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n'
                     'add_library(x)\n')
    patch_source(str(tmp_path))
    text = cmake.read_text()
    assert "xla_mpi_ops" not in text and "mpi_ops.cc" in text and "add_library(x)" in text


def test_build_cache_is_keyed_by_horovod_tf_and_python(tmp_path):
    import sys

    import tensorflow as tf

    from tfdist.cli.build_horovod import cache_key, cached_wheel

    key = cache_key(gpu=False)
    assert key.startswith(f"horovod-0.28.1-tf{tf.__version__}-py{sys.version_info.major}{sys.version_info.minor}")
    assert key.endswith("-cpu") and cache_key(gpu=True).endswith("-gpu")
    assert cached_wheel(str(tmp_path), gpu=False) is None
    (tmp_path / key).mkdir()
    wheel = tmp_path / key / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    assert cached_wheel(str(tmp_path), gpu=False) == str(wheel)


@pytest.mark.slow  # horovodrun --check-build starts TensorFlow in subprocesses (~20 s)
def test_installed_horovod_lists_tensorflow_mpi_and_gloo():
    from tfdist.cli.build_horovod import check_build

    out = check_build()  # raises unless `horovodrun --check-build` lists all three
    assert "[X] TensorFlow" in out


def test_gloo_backend_gives_every_rank_its_environment_and_serves_rendezvous():
    from tfdist.cluster.backends import GlooBackend

    with GlooBackend().environments(3, devices_per_worker=2) as envs:
        assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1", "2"]
        assert {e["HOROVOD_SIZE"] for e in envs} == {"3"} and {e["HOROVOD_LOCAL_SIZE"] for e in envs} == {"3"}
        assert [e["HOROVOD_LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
        assert {e["HOROVOD_CROSS_SIZE"] for e in envs} == {"1"} and {e["HOROVOD_CROSS_RANK"] for e in envs} == {"0"}
        assert {e["HOROVOD_CONTROLLER"] for e in envs} == {"gloo"} == {e["HOROVOD_CPU_OPERATIONS"] for e in envs}
        assert {e["TFDIST_LOCAL_DEVICES"] for e in envs} == {"2"}
        assert {e["HOROVOD_HOSTNAME"] for e in envs} == {"localhost"}
        port = int(envs[0]["HOROVOD_GLOO_RENDEZVOUS_PORT"])
        # The rendezvous server answers (an unknown key: 404 is an answer from Horovod's handler).
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/global/nokey", timeout=5)
        assert err.value.code == 404
    with pytest.raises(OSError):  # closed with the job
        urllib.request.urlopen(f"http://127.0.0.1:{port}/global/nokey", timeout=5)
    with pytest.raises(ConfigError):
        with GlooBackend().environments(0, 1):
            pass
