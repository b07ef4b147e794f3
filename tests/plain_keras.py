"""`.keras` files as plain Keras sees them: loaded in a Python that has never imported tfdist, on one device.

Many tests check that a file written under a tfdist strategy is an ordinary Keras file. Starting a fresh Python
(TensorFlow and Keras imports) for each file cost more than the loads themselves, so one loader process per
pytest worker serves them all (the `plain_keras` fixture in conftest.py): it reads a path per line and answers
with one JSON line. It checks that tfdist was never imported, and clears Keras' session between files.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys

LOADER = r"""
import json, sys
import numpy as np
import keras  # no tfdist: the files must load in plain Keras on one device

for line in sys.stdin:
    path = line.strip()
    try:
        model = keras.models.load_model(path)
        opt = model.optimizer
        record = {
            "weights": {v.path: np.asarray(v.numpy()).tolist() for v in model.weights},
            "weight_list": [w.tolist() for w in model.get_weights()],
            "slots": {v.path: list(v.shape) for v in opt.variables},
            "slot_values": {v.path: np.asarray(v.numpy()).tolist() for v in opt.variables},
            "iterations": int(opt.iterations.numpy()), "optimizer": type(opt).__name__,
            "tfdist_imported": "tfdist" in sys.modules,
        }
        del model, opt
        keras.backend.clear_session()
    except Exception as err:  # reported to the test, which fails with it
        record = {"error": f"{type(err).__name__}: {err}"}
    print("RECORD " + json.dumps(record), flush=True)
"""


class PlainKeras:
    """One loader process, started on first use: `load(path)` returns the file's record (see LOADER)."""

    def __init__(self, timeout_s: float = 180.0):
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        return subprocess.Popen([sys.executable, "-c", LOADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env)

    def load(self, path) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        proc = self._proc
        proc.stdin.write(f"{path}\n")
        proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                if not sel.select(self.timeout_s):
                    self.close()
                    raise AssertionError(f"plain Keras did not load {path} within {self.timeout_s:.0f} s")
                line = proc.stdout.readline()
                if not line:
                    self.close()
                    raise AssertionError(f"the plain-Keras loader exited while loading {path}")
                if line.startswith("RECORD "):
                    break
        record = json.loads(line[len("RECORD "):])
        assert "error" not in record, f"plain Keras could not load {path}: {record['error']}"
        assert not record.pop("tfdist_imported"), "the plain-Keras loader imported tfdist"
        return record

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
