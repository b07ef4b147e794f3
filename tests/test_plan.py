"""`tfdist plan`: per-stage memory per replica from a parameter count or a .keras file."""

from __future__ import annotations

import json

import keras
import pytest

import tfdist
from tfdist.cli import main
from tfdist.cli.plan import parse_count
from tfdist.zero import zero_formula


def test_parse_count():
    assert parse_count("25M") == 25_000_000
    assert parse_count("1.3B") == 1_300_000_000
    assert parse_count("12345") == 12345


def test_formula_matches_paper():
    psi, n = 1_000_000, 4
    assert zero_formula(psi, n, 0)["total"] == 16 * psi
    assert zero_formula(psi, n, 1)["total"] == 8 * psi + 8 * psi / n
    assert zero_formula(psi, n, 2)["total"] == 4 * psi + 12 * psi / n


def test_plan_params_picks_smallest_fitting_stage(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # 25M params, Adam, 4 replicas: 0.400 / 0.250 / 0.175 GB per replica
    assert main(["plan", "--params", "25M", "--replicas", "4", "--device-memory", "0.3", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["smallest_fitting_stage"] == 1
    assert plan["state_bytes_per_param"] == 8  # measured from a built Adam
    assert plan["stages"]["2"]["total"] == pytest.approx(4 * 25e6 + 12 * 25e6 / 4)
    assert "smallest stage that fits 0.3 GB: ZeRO-1" in capsys.readouterr().out


def test_plan_reads_model_file_and_its_optimizer(tmp_path, capsys):
    model = tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16)
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="sparse_categorical_crossentropy")
    path = tmp_path / "m.keras"
    model.save(path)
    assert main(["plan", "--model", str(path), "--replicas", "2", "--json", str(tmp_path / "p.json")]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["num_params"] == model.count_params()
    assert plan["optimizer"] == "SGD" and plan["state_bytes_per_param"] == 4


def test_plan_counts_the_replicated_start_up_of_a_zero3_model(tmp_path, capsys):
    """21B parameters on 8 x 80 GB: ZeRO-3's 42 GB per replica fit after the cut, but the model is created
    replicated first (84 GB per device), so nothing fits, and the plan says why and what to do."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--params", "21B", "--replicas", "8", "--device-memory", "80", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "ZeRO-3      10.500    10.500    21.000    42.000  too big at start-up" in printed
    assert "would fit 80 GB after the cut" in printed and "tensor parallelism" in printed
    plan = json.loads(out.read_text())
    assert plan["creation_bytes_per_replica"] == 84e9 and plan["smallest_fitting_stage"] is None
    assert main(["plan", "--params", "21B", "--replicas", "8", "--device-memory", "90"]) == 0
    assert "smallest stage that fits 90 GB: ZeRO-3" in capsys.readouterr().out


def test_plan_nothing_fits_and_bad_input(capsys):
    assert main(["plan", "--params", "10B", "--replicas", "8", "--device-memory", "1"]) == 1
    assert "no stage fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # argparse's type check, before TensorFlow would start
        main(["plan", "--params", "lots", "--replicas", "2"])
    assert refused.value.code == 2
    assert main(["plan", "--params", "1M", "--replicas", "0"]) == 2
    assert main(["plan", "--params", "1M", "--replicas", "2", "--optimizer", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--params" in err and "--replicas" in err and "--optimizer" in err


def test_plan_devices_compares_every_layout_and_reads_the_exchanges(tmp_path, capsys):
    """`--devices N`: data parallel and ZeRO by the formulas, tensor parallelism measured on N logical CPUs (the
    exchanged bytes read from a traced step: one all-reduce of the b×h activation per pair and direction)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="down")(keras.layers.Dense(32, activation="relu", name="up")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    model.compile(optimizer="adam", loss="mse")
    path, out = tmp_path / "mlp.keras", tmp_path / "layouts.json"
    model.save(path)
    psi, n, batch = model.count_params(), 2, 8
    assert main(["plan", "--model", str(path), "--devices", str(n), "--batch-size", str(batch),
                 "--device-memory", "1e-5", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    rows = {c["layout"]: c for c in plan["candidates"]}
    assert plan["num_params"] == psi and plan["optimizer"] == "Adam"
    data = rows["data parallel"]
    assert (data["params"], data["gradients"], data["optimizer_state"]) == (4 * psi, 4 * psi, 8 * psi)
    assert data["sent_per_step"] == pytest.approx(2 * (n - 1) / n * 4 * psi)
    fsdp = rows["ZeRO-3 (FSDP)"]
    assert fsdp["params"] == 4 * psi / n and fsdp["sent_per_step"] == pytest.approx(1.5 * data["sent_per_step"])
    assert fsdp["created"] == 4 * psi  # created whole on every device before the cut
    tp = rows[f"tensor parallel, {n} ways"]
    assert tp["params"] < 4 * psi  # the up/down pair is split; the head stays whole
    # one pair: its output (batch × 16 float32) all-reduced forward; its input is the model's, whose gradient
    # nothing reads, so the backward all-reduce is pruned from the traced step
    assert tp["sent_per_step"] == pytest.approx(2 * (n - 1) / n * batch * 16 * 4)
    assert rows[f"pipeline, {n} stages"]["params"] < 4 * psi
    assert plan["first_fitting"] == next(c["layout"] for c in plan["candidates"] if c["fits"])
    printed = capsys.readouterr().out
    assert "tensor parallel, 2 ways" in printed and "first layout that fits" in printed


def test_a_layout_fits_only_when_the_model_fits_while_it_is_created():
    from tfdist.cli.plan_layouts import Candidate

    fsdp = Candidate("ZeRO-3 (FSDP)", "zero_stage=3", params=1.0, gradients=1.0, optimizer_state=2.0,
                     activations=0.0, sent_per_step=0.0, created=8.0)
    assert fsdp.total == 4.0 and not fsdp.fits(5.0) and fsdp.fits(8.0) and fsdp.fits(None)
    split = Candidate("tensor parallel", "ModelParallelStrategy", 1.0, 1.0, 2.0, 0.0, 0.0)  # created in pieces
    assert split.fits(4.0) and not split.fits(3.9)


def test_plan_model_with_a_custom_layer_names_the_option(tmp_path, capsys):
    module = tmp_path / "my_layers.py"
    module.write_text(
        "import keras\n\n"
        "@keras.saving.register_keras_serializable(package='plan_test')\n"
        "class Scale(keras.layers.Layer):\n"
        "    def build(self, shape):\n"
        "        self.w = self.add_weight(shape=(shape[-1],), initializer='ones')\n"
        "    def call(self, x):\n"
        "        return x * self.w\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_layers_for_saving", module)
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    model = keras.Sequential([keras.Input((6,)), layers.Scale(), keras.layers.Dense(3)])
    path = tmp_path / "custom.keras"
    model.save(path)
    keras.saving.get_custom_objects().pop("plan_test>Scale")  # a fresh process would not know the class
    assert main(["plan", "--model", str(path), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "--custom-objects" in err and "register_keras_serializable" in err and "Traceback" not in err
    assert main(["plan", "--model", str(path), "--replicas", "2", "--custom-objects", str(module)]) == 0
    assert f"{model.count_params():,} trainable parameters" in capsys.readouterr().out


def test_plan_counts_the_bytes_of_each_dtype(tmp_path, capsys):
    """Mixed policies keep float32 variables (the plan is float32's); a 'bfloat16' policy halves parameters,
    gradients and Adam's state (Keras' slots take their variable's dtype). A model file's variables are counted
    by their own dtypes; --dtype-policy with --model is refused with the reason."""
    tables = {}
    for policy in ("mixed_bfloat16", "bfloat16"):
        out = tmp_path / f"{policy}.json"
        assert main(["plan", "--params", "10M", "--replicas", "4", "--dtype-policy", policy, "--json", str(out)]) == 0
        tables[policy] = json.loads(out.read_text())
    mixed, bf16 = tables["mixed_bfloat16"], tables["bfloat16"]
    assert mixed["params_by_dtype"] == {"float32": 10_000_000} and mixed["stages"]["0"]["total"] == 16 * 10e6
    assert bf16["params_by_dtype"] == {"bfloat16": 10_000_000} and bf16["state_bytes_per_param"] == 4
    assert bf16["stages"]["2"]["total"] == pytest.approx(2 * 10e6 + (2 + 4) * 10e6 / 4)
    assert bf16["creation_bytes_per_replica"] == 2 * 10e6
    assert "variables under the bfloat16 policy: 10,000,000 bfloat16 (0.020 GB)" in capsys.readouterr().out

    keras.mixed_precision.set_global_policy("bfloat16")
    try:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4, dtype="float32")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    path = tmp_path / "m.keras"
    model.save(path)
    assert main(["plan", "--model", str(path), "--replicas", "2", "--json", str(tmp_path / "m.json")]) == 0
    plan = json.loads((tmp_path / "m.json").read_text())
    assert plan["params_by_dtype"] == {"bfloat16": 8 * 16 + 16, "float32": 16 * 4 + 4}
    assert plan["stages"]["0"]["params"] == 2 * 144 + 4 * 68
    assert plan["stages"]["0"]["optimizer_state"] == pytest.approx(2 * 2 * 144 + 2 * 4 * 68)  # Adam's slots per dtype
    assert main(["plan", "--model", str(path), "--replicas", "2", "--dtype-policy", "bfloat16"]) == 2
    assert "--dtype-policy bfloat16 is for --params" in capsys.readouterr().err
