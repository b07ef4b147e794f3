"""`tfdist train --zero-stage`: passed to MirroredStrategy (weights of plain data parallelism), refused elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

TFDIST = [sys.executable, "-m", "tfdist"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_zero_stage_on_a_strategy_without_it_is_a_config_error(capsys):
    from tfdist.cli import main
    from tfdist.cli.train import ZERO_STRATEGIES

    for strategy in [s for s in ("multiworker", "horovod", "default") if s not in ZERO_STRATEGIES]:
        assert main(["train", "--strategy", strategy, "--zero-stage", "1"]) == 2  # refused before any strategy
        err = capsys.readouterr().err
        assert f"--zero-stage 1 is supported by --strategy {' or '.join(ZERO_STRATEGIES)}, not '{strategy}'" in err
    with pytest.raises(SystemExit):
        main(["train", "--zero-stage", "4"])
    assert "invalid choice: 4" in capsys.readouterr().err


@pytest.mark.slow
def test_zero_stage_1_trains_to_the_weights_of_stage_0(tmp_path):
    digests = {}
    for stage in (0, 1):
        proc = subprocess.run([*TFDIST, "train", "--strategy", "mirrored", "--replicas", "2", "--dataset", "digits",
                               "--epochs", "2", "--verbose", "0", "--zero-stage", str(stage)],
                              capture_output=True, text=True, env=ENV, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert ("zero_stage=1" in proc.stdout) == (stage == 1)
        digests[stage] = re.search(r"final weights sha256 ([0-9a-f]{16})", proc.stdout).group(1)
    print(f"final weights sha256: stage 0 {digests[0]}, stage 1 {digests[1]}")
    assert digests[0] == digests[1]  # ZeRO-1 shards optimizer state; the arithmetic is the same


@pytest.mark.slow
def test_zero_stage_3_trains_from_the_command_line(tmp_path):
    proc = subprocess.run([*TFDIST, "train", "--strategy", "mirrored", "--replicas", "2", "--dataset", "digits",
                           "--epochs", "1", "--verbose", "0", "--zero-stage", "3", "--save", str(tmp_path / "m.keras")],
                          capture_output=True, text=True, env=ENV, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "zero_stage=3" in proc.stdout
    import keras

    model = keras.saving.load_model(tmp_path / "m.keras")   # full logical weights, plain Keras
    assert sum(int(w.size) for w in model.get_weights()) == model.count_params()

