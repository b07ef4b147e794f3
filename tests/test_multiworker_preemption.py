"""`tfdist launch -n 2 -- tfdist train --backup-dir`: SIGUSR1 to one rank stops both after the same epoch,
the chief alone writes the checkpoint, and a relaunch resumes to the weights of an uninterrupted run
(TF collectives and Horovod/Gloo)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading

import numpy as np
import pytest

from tfdist.cluster.launcher import launch

pytestmark = pytest.mark.slow

EPOCHS = 6
TFDIST = [sys.executable, "-m", "tfdist"]
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


class Watch(io.TextIOBase):
    """The launcher's output stream: keeps every line and sends SIGUSR1 to one rank after a marker line."""

    def __init__(self, marker: str | None = None, rank: int = 1):
        self.lines: list[str] = []
        self.marker, self.rank, self.procs, self.sent = marker, rank, [], threading.Event()

    def write(self, text: str) -> int:
        self.lines += text.splitlines()
        if self.marker and not self.sent.is_set() and self.marker in text and self.procs:
            self.procs[self.rank].send_signal(signal.SIGUSR1)
            self.sent.set()
        return len(text)

    def flush(self) -> None:
        pass


def train(backend: str, strategy: str, out, backup, watch: Watch) -> int:
    cmd = [*TFDIST, "train", "--strategy", strategy, "--dataset", "digits", "--epochs", str(EPOCHS),
           "--batch-size", "64", "--verbose", "0", "--backup-dir", str(backup), "--save", str(out)]
    return launch(cmd, 2, backend=backend, env=ENV, out=watch, on_start=watch.procs.extend, timeout_s=240)


def digests(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        m = re.match(r"\[(\d)\] tfdist train \[rank \d\]: final weights sha256 ([0-9a-f]{16})$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def epochs_done(lines: list[str], rank: int) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.match(rf"\[{rank}\] tfdist: epoch (\d+) complete", line))]


@pytest.mark.parametrize("backend,strategy", [("tf", "multiworker"), ("horovod", "horovod")])
def test_signal_to_one_rank_stops_both_and_resumes_exactly(tmp_path, backend, strategy):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow")
    import keras

    reference = Watch()
    assert train(backend, strategy, tmp_path / "ref.keras", tmp_path / "ref-backup", reference) == 0, reference.lines
    ref_digests = digests(reference.lines)
    assert set(ref_digests) == {"0", "1"} and ref_digests["0"] == ref_digests["1"], reference.lines

    # SIGUSR1 to rank 1 only, once the first epoch is done: both ranks agree to stop after the same epoch.
    first = Watch(marker="[0] tfdist: epoch 0 complete", rank=1)
    backup = tmp_path / "backup"
    assert train(backend, strategy, tmp_path / "run.keras", backup, first) == 0, first.lines
    assert first.sent.is_set()
    stopped = [line for line in first.lines if "stopped by a signal" in line]
    assert len(stopped) == 2, first.lines  # both ranks stopped, neither finished
    done = epochs_done(first.lines, 0)
    assert done == epochs_done(first.lines, 1) and done and done[-1] < EPOCHS - 1, first.lines
    assert any(line.startswith("[1] tfdist: received SIGUSR1") for line in first.lines)
    assert not any(line.startswith("[0] tfdist: received") for line in first.lines)
    # the checkpoint of the last complete epoch, written once (by the chief): no second copy, no temp dirs
    assert sorted(os.listdir(backup)) == [f"epoch-{done[-1] + 1}"], os.listdir(backup)
    assert not (tmp_path / "run.keras").exists()

    resumed = Watch()
    assert train(backend, strategy, tmp_path / "run.keras", backup, resumed) == 0, resumed.lines
    assert sum(f"resuming from the checkpoint at epoch {done[-1] + 1}" in line for line in resumed.lines) == 2
    assert epochs_done(resumed.lines, 0) == list(range(done[-1] + 1, EPOCHS))
    assert not backup.exists()  # finished: the chief removed it
    res_digests = digests(resumed.lines)
    assert res_digests["0"] == res_digests["1"], resumed.lines  # identical weights on both ranks
    a = keras.saving.load_model(tmp_path / "ref.keras").get_weights()
    b = keras.saving.load_model(tmp_path / "run.keras").get_weights()
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    print(f"{backend}: stopped after epoch {done[-1]}, resumed; max |w - w_ref| = {diff:.3g}, "
          f"digests {ref_digests['0']} / {res_digests['0']}")
    assert diff <= 1e-6
