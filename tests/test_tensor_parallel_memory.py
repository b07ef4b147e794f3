"""Memory of split weights: `ModelParallelStrategy.memory_report` and `tfdist plan --tensor-parallel`, checked
against bytes computed from the layers' shapes (a split variable holds 1/T of its bytes on each model-axis
device; replicated variables and the optimizer's scalars sit on each row's first device)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import tfdist
from tfdist.cli import main

DEVICES = [f"/cpu:{i}" for i in range(4)]
F32 = 4


def mlp() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    x = keras.layers.Dense(16, name="down")(x)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(x))


def layout(mesh) -> tfdist.LayoutMap:
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return layout_map


# elements of the split variables (up kernel and bias, down kernel) and of the replicated ones (down bias, head)
SPLIT = 12 * 32 + 32 + 32 * 16
REPLICATED = 16 + 16 * 5 + 5


def expected(parts: int, first: bool, scalars: int) -> dict[str, int]:
    """Bytes one device holds: its slice of the split variables, plus the replicated ones on the row's first."""
    params = F32 * (SPLIT // parts + (REPLICATED if first else 0))
    return {"params": params, "gradients": params, "optimizer_state": 2 * params + (scalars if first else 0)}


@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_memory_report_bytes_per_device_are_the_shapes_over_t(shape):
    mesh = tfdist.DeviceMesh(shape, ("batch", "model"), DEVICES[:int(np.prod(shape))])
    strategy = tfdist.ModelParallelStrategy(layout(mesh))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(np.ones((16, 12), "float32"), np.ones((16, 5), "float32"), batch_size=8, verbose=0)
    report = strategy.memory_report(model)
    scalars = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables
                  if len(v.shape) == 0)  # iterations (int64), learning rate: on each row's first device
    parts = shape[1]
    rows = {r.device: r for r in report.rows}
    for r, row in enumerate(strategy.mesh_rows):
        for k, device in enumerate(row):
            got = rows[tfdist.devices.resolve_devices([device])[0]]
            assert {w: getattr(got, w) for w in ("params", "gradients", "optimizer_state")} == \
                expected(parts, k == 0, scalars), (r, k)
    whole = F32 * (SPLIT + REPLICATED)
    assert (report.replicated.params, report.replicated.gradients) == (whole, whole)
    assert report.replicated.optimizer_state == 2 * whole + scalars
    assert report.ratio("params") == pytest.approx((SPLIT / parts + REPLICATED) / (SPLIT + REPLICATED))
    assert report.num_params == SPLIT + REPLICATED and report.model_axis_size == parts
    assert "largest device / replicated" in str(report)


def test_memory_report_before_the_optimizer_is_built_counts_weights_only():
    mesh = tfdist.DeviceMesh((1, 2), ("batch", "model"), DEVICES[:2])
    strategy = tfdist.ModelParallelStrategy(layout(mesh))
    with strategy.scope():
        model = mlp()
    report = strategy.memory_report(model)  # splits the model first
    assert not report.optimizer_built
    assert [r.params for r in report.rows] == [expected(2, True, 0)["params"], expected(2, False, 0)["params"]]
    assert all(r.optimizer_state == 0 for r in report.rows)
    assert "optimizer not built" in str(report)


def test_plan_tensor_parallel_reads_the_model_file(tmp_path, capsys):
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    path = tmp_path / "m.keras"
    model.save(path)
    out = tmp_path / "p.json"
    assert main(["plan", "--model", str(path), "--tensor-parallel", "2", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["split_layers"] == {"up": "column", "down": "row"}  # LayoutMap.auto: one column/row pair
    assert plan["optimizer"] == "SGD"  # the file's optimizer: one momentum slot per variable
    first, second = plan["rows"]
    assert second["params"] == F32 * SPLIT // 2 and second["optimizer_state"] == F32 * SPLIT // 2
    assert first["params"] == F32 * (SPLIT // 2 + REPLICATED)
    assert plan["replicated"]["params"] == F32 * (SPLIT + REPLICATED)
    assert "largest device / replicated" in capsys.readouterr().out
    # the same numbers from a layout file, and a device limit that the split fits and the whole model does not
    rules = tmp_path / "layout.json"
    rules.write_text(json.dumps({"up/kernel": [None, "model"], "up/bias": ["model"], "down/kernel": ["model", None]}))
    limit = (first["total"] + 100) / 1e9
    assert main(["plan", "--model", str(path), "--tensor-parallel", "2", "--layout", str(rules),
                 "--device-memory", str(limit), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == plan["rows"]
    assert main(["plan", "--model", str(path), "--tensor-parallel", "1", "--device-memory", str(limit)]) == 1
    assert "too big" in capsys.readouterr().out


def test_plan_tensor_parallel_bad_input(tmp_path, capsys):
    model = mlp()
    path = tmp_path / "m.keras"
    model.save(path)
    assert main(["plan", "--params", "1M", "--tensor-parallel", "2"]) == 2  # which variables split needs a model
    assert main(["plan", "--params", "1M"]) == 2  # neither --replicas nor --tensor-parallel
    assert main(["plan", "--model", str(path), "--tensor-parallel", "0"]) == 2
    rules = tmp_path / "layout.json"
    rules.write_text(json.dumps({"up/kernel": [None, "model"]}))
    assert main(["plan", "--model", str(path), "--tensor-parallel", "3", "--layout", str(rules)]) == 2  # 32 % 3
    err = capsys.readouterr().err
    assert "--tensor-parallel needs --model" in err and "--replicas" in err and "must be >= 1" in err
    assert "cannot be split over axis 'model' of size 3" in err
