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
