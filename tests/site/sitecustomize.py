"""Every Python the suite starts: Keras without its optional scikit-learn, pandas and matplotlib integrations.

When those packages are installed (the `examples` extra installs them: mlxtend depends on them), `import keras`
imports all three for integrations the suite never reaches (its scikit-learn wrappers, pandas inputs to `fit`,
`keras.visualization`), which is about a third of the import: 1.5 to 2 CPU-seconds of each process start, measured
with `python -X importtime`. The suite starts hundreds of processes, so tests/conftest.py puts this directory on
PYTHONPATH: in those processes an import of one of the three made directly by a Keras module fails as if the
package were missing, and Keras carries on without that integration, as it does on a machine without them. Every
other import of them (tfdist's charts, the 'digits' dataset, mlxtend) is untouched.

Also: once Keras is imported, the objects the imports created are frozen out of the garbage collector's scans
(`_freeze_after_keras`), and with `TFDIST_TEST_PROC_LOG` each process's CPU is logged as it exits.
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


class _AfterImport:
    """A meta-path finder that finds nothing itself: the first import of each of a few top-level packages is timed
    (CPU seconds in `cpu`) and followed by `then(name)`."""

    def __init__(self, names, then):
        self.names, self.then, self.cpu = set(names), then, {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or name in self.cpu:
            return None
        import importlib.machinery
        import time

        self.cpu[name] = None  # while it is found below, this finder stays out of the way
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, clock, then = spec.loader.exec_module, self.cpu, self.then

        def exec_module(module):
            start = time.process_time()
            try:
                run(module)
            finally:
                clock[name] = round(time.process_time() - start, 2)
            then(name)

        spec.loader.exec_module = exec_module
        return spec


def _freeze_after_keras(name: str) -> None:
    """Once Keras (and the TensorFlow it imports) is imported, what the imports created goes to the collector's
    permanent generation, as the zygote does before it forks (tfdist_test_zygote.py): the program's collections no
    longer scan those module objects, and its exit no longer ends with a last collection over them (more than a
    CPU-second of every fresh process that imported TensorFlow). What the program creates is collected as always."""
    if name == "keras":
        import gc

        gc.freeze()


def _log_process(clock) -> None:
    import json
    import os
    import time

    record = {"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
              "argv": sys.argv[:3], "cpu_s": round(time.process_time(), 2),
              "import_s": {k: v for k, v in clock.cpu.items() if v is not None}}
    with open(_PROC_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


_clock = _AfterImport(("tensorflow", "keras"), _freeze_after_keras)
sys.meta_path.insert(0, _clock)
if _PROC_LOG:
    import atexit

    atexit.register(_log_process, _clock)


# A process the suite starts runs its program in a fork of its pytest worker's zygote, which has imported
# TensorFlow and Keras already (tfdist_test_zygote.py says how, and when a process starts fresh instead).
if __import__("os").environ.get("TFDIST_TEST_ZYGOTE"):
    import tfdist_test_zygote

    tfdist_test_zygote.stand_in()
