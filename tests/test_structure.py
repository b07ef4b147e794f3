"""The package's structure: private internals only in tfdist/_compat, imports only downward, no cycles,
and plain Keras untouched by tfdist strategies."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfdist"
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tensorflow.compiler", "tensorflow.tsl", "tensorflow.core")
# Underscore names that are public API of the standard library.
ALLOWED_PRIVATE = {("os", "_exit"), ("argparse", "_SubParsersAction")}

# package -> the tfdist packages it may import (besides itself, tfdist.errors and tfdist._compat).
BOTTOM = {"tfdist.errors", "tfdist._compat"}
LAYERS = {
    "tfdist.devices": set(),
    "tfdist.comm": {"tfdist.devices"},
    "tfdist.cluster": {"tfdist.devices", "tfdist.comm"},
    "tfdist.sharding": {"tfdist.devices", "tfdist.comm"},
    "tfdist.placement": {"tfdist.devices", "tfdist.comm"},
    "tfdist.training": {"tfdist.devices", "tfdist.comm", "tfdist.cluster", "tfdist.sharding", "tfdist.placement"},
    "tfdist.strategies": {"tfdist.devices", "tfdist.comm", "tfdist.cluster", "tfdist.sharding", "tfdist.placement",
                          "tfdist.training"},
    "tfdist.plots": set(),
}
TOP = ("tfdist.data", "tfdist.models", "tfdist.bench", "tfdist.cli", "tfdist")  # may import anything below


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """Every module named by an import statement (module level or inside functions), with its line."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def owner(module: str) -> str | None:
    """The layer (a key of LAYERS, BOTTOM or TOP) a tfdist module belongs to."""
    for layer in sorted([*LAYERS, *BOTTOM, *TOP], key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def test_private_tensorflow_and_keras_imports_live_only_in_compat():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {target}"
           for name, path in modules().items() if not name.startswith("tfdist._compat")
           for target, line in imports_of(name, path) if target.startswith(PRIVATE_MODULES)]
    assert not bad, "private TF/Keras imports outside tfdist/_compat:\n" + "\n".join(bad)


def test_no_private_attribute_of_another_object_outside_compat():
    """`x._name` is allowed on self/cls only; getattr/setattr/hasattr with a private name string not at all."""
    bad = []
    for name, path in modules().items():
        if name.startswith("tfdist._compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and (value.id in ("self", "cls") or (value.id, node.attr) in ALLOWED_PRIVATE):
                    continue
                bad.append(f"{where}: .{node.attr}")
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("getattr", "setattr", "hasattr", "delattr", "__setattr__") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                bad.append(f"{where}: {ast.unparse(node)}")
    assert not bad, "private attributes read or written outside tfdist/_compat:\n" + "\n".join(bad)


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def test_no_private_tensorflow_or_keras_method_is_overridden_outside_compat():
    bad = []
    for name in modules():
        if name.startswith(("tfdist._compat", "tfdist.__main__")):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            foreign = [base for base in cls.__mro__[1:] if base.__module__.startswith(("tensorflow", "keras"))]
            for attr in vars(cls):
                if _private(attr) and any(attr in vars(base) for base in foreign):
                    bad.append(f"{name}.{cls.__name__}.{attr}")
    assert not bad, "private TF/Keras methods overridden outside tfdist/_compat:\n" + "\n".join(bad)


def test_imports_point_only_downward():
    bad = []
    for name, path in modules().items():
        layer = owner(name)
        if layer in TOP or layer is None:
            continue
        allowed = {layer} | BOTTOM | (LAYERS.get(layer, set()) if layer in LAYERS else set())
        if layer in BOTTOM:
            allowed = {layer, "tfdist.errors"}
        for target, line in imports_of(name, path):
            if not target.startswith("tfdist.") or target in BOTTOM:  # `from tfdist import x` names x below
                continue
            if owner(target) not in allowed:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {layer} imports {target}")
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for target, _ in imports_of(name, path):
            while target and target not in mods:  # `from pkg import name`: the module is pkg
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    parents = {name: name.rpartition(".")[0] for name in mods}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == parents.get(node):
                continue  # a module importing its own package's __init__ (re-exports) is not a cycle
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif not state.get(nxt):
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [])
    cycles = [c for c in cycles if not _package_reexport(c, parents)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _package_reexport(cycle: str, parents: dict[str, str]) -> bool:
    # pkg/__init__ -> pkg.sub -> pkg: the package importing its own submodule back is how re-exports work.
    nodes = cycle.split(" -> ")
    return any(parents.get(a) == b or parents.get(b) == a for a, b in zip(nodes, nodes[1:])) and len(set(nodes)) == 2


def test_launcher_table_and_tf_config_parser_live_once_in_comm_and_load_without_tensorflow():
    """tfdist.comm.init() and the cluster layer read the same launcher table and TF_CONFIG parser
    (cluster re-exports comm's objects), and the launcher can load them without starting TensorFlow."""
    import subprocess
    import sys

    from tfdist.cluster import env, tf_config
    from tfdist.comm import launch_env
    from tfdist.comm import tf_config as comm_tf_config

    for name in env.__all__:
        assert getattr(env, name) is getattr(launch_env, name), name
    for name in tf_config.__all__:
        assert getattr(tf_config, name) is getattr(comm_tf_config, name), name
    code = ("import sys, tfdist.cluster.env, tfdist.cluster.tf_config, tfdist.comm.launch_env, tfdist.comm.tf_config;"
            "print(sorted(m for m in sys.modules if m.startswith(('tensorflow', 'keras'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_cluster_reexports_of_training_names_are_the_training_objects():
    import tfdist

    for name in ("BackupAndRestore", "ModelCheckpoint", "save_model", "Preemption"):
        assert getattr(tfdist.cluster, name) is getattr(tfdist.training, name)


@pytest.mark.slow
def test_plain_keras_is_untouched_by_tfdist_strategies(python):
    """Plain Keras in the same process, outside tfdist, trains exactly as stock after tfdist strategies
    (ZeRO and layer placement) were created and used, and its classes are the same objects."""
    proc = python("""
        import numpy as np, keras, tensorflow as tf, tfdist
        tfdist.devices.virtual_cpus(2)
        from keras.src.backend.tensorflow.optimizer import TFOptimizer
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        classes = [BaseOptimizer, TFOptimizer, keras.optimizers.Optimizer, keras.optimizers.Adam,
                   keras.optimizers.SGD, keras.layers.Layer, keras.layers.Dense, keras.Model, keras.Sequential]
        before = {c: dict(vars(c)) for c in classes}

        x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
        y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")

        def plain():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer="adam", loss="mse")
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            return [w.numpy() for w in model.weights] + [v.numpy() for v in model.optimizer.variables]

        stock = plain()
        for strategy in (tfdist.MirroredStrategy(zero_stage=2),
                         tfdist.LayerPlacementStrategy(micro_batches=2)):
            with strategy.scope():
                m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1)])
                m.compile(optimizer="adam", loss="mse")
            m.fit(x, y, batch_size=16, epochs=1, verbose=0)
        after = plain()
        changed = [f"{c.__name__}.{k}" for c in classes for k in set(before[c]) | set(vars(c))
                   if before[c].get(k, None) is not vars(c).get(k, None)]
        print("CHANGED", changed)
        print("EQUAL", all(np.array_equal(a, b) for a, b in zip(stock, after)) and len(stock) == len(after))
    """)
    assert "CHANGED []" in proc.stdout, proc.stdout
    assert "EQUAL True" in proc.stdout, proc.stdout
