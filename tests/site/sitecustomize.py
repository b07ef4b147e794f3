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
