"""Every Python the suite starts: Keras without its optional scikit-learn, pandas and matplotlib integrations.

When those packages are installed (the `examples` extra installs them: mlxtend depends on them), `import keras`
imports all three for integrations the suite never reaches (its scikit-learn wrappers, pandas inputs to `fit`,
`keras.visualization`), which is about a third of the import: 1.5 to 2 CPU-seconds of each process start, measured
with `python -X importtime`. The suite starts hundreds of processes, so tests/conftest.py puts this directory on
PYTHONPATH: in those processes an import of one of the three made directly by a Keras module fails as if the
package were missing, and Keras carries on without that integration, as it does on a machine without them. Every
other import of them (tfdist's charts, the 'digits' dataset, mlxtend) is untouched.
"""

import sys

_OPTIONAL = ("sklearn", "pandas", "matplotlib")
_KERAS_IMPORTERS = ("keras.src.wrappers", "keras.src.trainers.data_adapters.array_slicing",
                    "keras.src.visualization")


class _KerasWithoutOptionalIntegrations:
    """A meta-path finder that refuses the three packages to Keras' own modules, and answers nothing else."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in _OPTIONAL:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
            frame = frame.f_back  # the import machinery's own frames: the importer is above them
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(_KERAS_IMPORTERS):
            raise ModuleNotFoundError(f"No module named {name!r} (left out of Keras in tfdist's test suite: "
                                      f"tests/site/sitecustomize.py)", name=name)
        return None


sys.meta_path.insert(0, _KerasWithoutOptionalIntegrations())


# `TFDIST_TEST_PROC_LOG=FILE make test`: one JSON line per Python process the suite starts, written as it exits
# normally: the test that started it (pytest's PYTEST_CURRENT_TEST, inherited), its own CPU seconds and those spent
# importing TensorFlow and Keras. The suite is CPU-bound; this says how much of it is process starts.
_PROC_LOG = __import__("os").environ.get("TFDIST_TEST_PROC_LOG")


class _ImportClock:
    """A meta-path finder that times the CPU of the first import of a few top-level packages, and finds nothing."""

    def __init__(self, names):
        self.names, self.cpu = set(names), {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or name in self.cpu:
            return None
        import importlib.machinery
        import time

        self.cpu[name] = None  # while it is found below, this finder stays out of the way
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, clock = spec.loader.exec_module, self.cpu

        def exec_module(module):
            start = time.process_time()
            try:
                run(module)
            finally:
                clock[name] = round(time.process_time() - start, 2)

        spec.loader.exec_module = exec_module
        return spec


def _log_process(clock) -> None:
    import json
    import os
    import time

    record = {"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
              "argv": sys.argv[:3], "cpu_s": round(time.process_time(), 2),
              "import_s": {k: v for k, v in clock.cpu.items() if v is not None}}
    with open(_PROC_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


if _PROC_LOG:
    import atexit

    _clock = _ImportClock(("tensorflow", "keras"))
    sys.meta_path.insert(0, _clock)
    atexit.register(_log_process, _clock)


# A process the suite starts runs its program in a fork of its pytest worker's zygote, which has imported
# TensorFlow and Keras already (tfdist_test_zygote.py says how, and when a process starts fresh instead).
if __import__("os").environ.get("TFDIST_TEST_ZYGOTE"):
    import tfdist_test_zygote

    tfdist_test_zygote.stand_in()
