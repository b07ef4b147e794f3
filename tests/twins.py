"""The plain-Keras twin check: a model and optimizer built under a tfdist strategy against the same ones built in
plain Keras. Shared by tests/test_keras_twins.py (in-process strategies) and the jobs of the multi-process
strategies (MultiWorkerMirroredStrategy, HorovodStrategy, ParameterServerStrategy), which record what differs and
let their tests assert that nothing does.

Each function returns the differences as sentences (an empty list: twins), so a job can write them to its JSON.
"""

from __future__ import annotations


def serialization_differences(optimizer) -> list[str]:
    """Keras' own check on an optimizer as a strategy's scope made it (before it is built): its config round trip,
    then the names in dir() of the revived one."""
    from keras.src.testing import TestCase

    try:
        TestCase().run_class_serialization_test(optimizer)
    except AssertionError as err:
        return [f"{type(optimizer).__name__}: Keras' serialization test failed: {err}"]
    return []


def differences(twin, plain, *, sharded_variables: bool = False) -> list[str]:
    """What tells `twin` (built under a strategy) from `plain` (the same code in plain Keras), both compiled and
    trained: names in dir() of the model, its optimizer and each layer (tfdist's per-instance behaviour overrides
    methods Keras' classes define, so no name is added); configs and their round trips; the
    variables' paths, shapes and dtypes in order (not for strategies that keep a split weight as one variable per
    device: `sharded_variables`); the shapes get_weights returns."""
    found = []

    def same(what: str, mine, theirs) -> None:
        if mine != theirs:
            found.append(f"{what}: {_describe(mine, theirs)}")

    same("dir(model)", set(dir(twin)), set(dir(plain)))
    same("dir(optimizer)", set(dir(twin.optimizer)), set(dir(plain.optimizer)))
    same("model config", twin.get_config(), plain.get_config())
    same("model config round trip", type(twin).from_config(twin.get_config()).get_config(), plain.get_config())
    same("optimizer config", twin.optimizer.get_config(), plain.optimizer.get_config())
    same("layers", [layer.name for layer in twin.layers], [layer.name for layer in plain.layers])
    for mine, theirs in zip(twin.layers, plain.layers):
        same(f"dir(layer {mine.name})", set(dir(mine)), set(dir(theirs)))
        same(f"layer {mine.name} config", mine.get_config(), theirs.get_config())
        same(f"layer {mine.name} config round trip", type(mine).from_config(mine.get_config()).get_config(),
             theirs.get_config())
    if not sharded_variables:
        described = lambda variables: [(v.path, tuple(v.shape), str(v.dtype)) for v in variables]  # noqa: E731
        same("model.weights", described(twin.weights), described(plain.weights))
        same("optimizer.variables", described(twin.optimizer.variables), described(plain.optimizer.variables))
    same("get_weights shapes", [w.shape for w in twin.get_weights()], [w.shape for w in plain.get_weights()])
    return found


def _describe(mine, theirs, where: str = "") -> str:
    """The first place where two values differ (configs are nested dicts and lists)."""
    if isinstance(mine, set) and isinstance(theirs, set):
        return f"only under the strategy {sorted(mine - theirs)}, only in plain Keras {sorted(theirs - mine)}"
    if isinstance(mine, dict) and isinstance(theirs, dict) and mine.keys() == theirs.keys():
        key = next((k for k in mine if mine[k] != theirs[k]), None)
        if key is not None:
            return _describe(mine[key], theirs[key], f"{where}[{key!r}]")
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)) and len(mine) == len(theirs):
        i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if i is not None:  # (None: equal items in a list and a tuple)
            return _describe(mine[i], theirs[i], f"{where}[{i}]")
    return f"{where or 'the value'}: under the strategy {mine!r}, in plain Keras {theirs!r}"[:2000]
