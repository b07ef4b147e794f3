"""The package's structure: private internals only in reach-in modules (tfdist/_compat and the `_name.py` modules
of a capability package, each behind the version check), imports only downward, no cycles, and plain Keras
untouched by tfdist strategies."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfdist"
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tensorflow.compiler", "tensorflow.tsl", "tensorflow.core")
# Underscore names that are public API of the standard library.
ALLOWED_PRIVATE = {("os", "_exit"), ("argparse", "_SubParsersAction")}

# package -> the tfdist packages it may import (besides itself, tfdist.errors, tfdist.lazy and tfdist._compat).
# Bottom: errors, _compat, devices, comm (the communication base) and cluster (where processes come from).
# Capabilities: one package each, over the bottom. Above them: training, then strategies; data, models, cli on top.
BOTTOM = {"tfdist.errors", "tfdist._compat", "tfdist.lazy", "tfdist.tf_logs"}
BASE = {"tfdist.devices", "tfdist.comm"}
LAYERS = {
    "tfdist.devices": set(),
    "tfdist.comm": {"tfdist.devices"},
    "tfdist.cluster": BASE,
    "tfdist.data_parallel": BASE,
    "tfdist.zero": BASE,
    "tfdist.pipeline": BASE,
    "tfdist.tensor_parallel": BASE | {"tfdist.pipeline"},
    "tfdist.training": BASE | {"tfdist.cluster", "tfdist.zero"},
    "tfdist.parameter_server": BASE | {"tfdist.cluster"},
    "tfdist.strategies": BASE | {"tfdist.cluster", "tfdist.data_parallel", "tfdist.zero", "tfdist.pipeline",
                                 "tfdist.tensor_parallel", "tfdist.parameter_server", "tfdist.training"},
    "tfdist.keras_distribution": BASE | {"tfdist.cluster", "tfdist.strategies"},
    "tfdist.plots": set(),
}
CAPABILITIES = ("tfdist.data_parallel", "tfdist.zero", "tfdist.pipeline", "tfdist.tensor_parallel",
                "tfdist.parameter_server")
TOP = ("tfdist.data", "tfdist.models", "tfdist.cli", "tfdist")  # may import anything below


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


def reach_in(name: str) -> bool:
    """A module allowed to reach into TF/Keras internals: tfdist/_compat, or a private `_name.py` of a package."""
    last = name.rpartition(".")[2]
    return name.startswith("tfdist._compat") or (last.startswith("_") and not last.startswith("__"))


def test_private_tensorflow_and_keras_imports_live_only_in_reach_in_modules():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {target}"
           for name, path in modules().items() if not reach_in(name)
           for target, line in imports_of(name, path) if target.startswith(PRIVATE_MODULES)]
    assert not bad, "private TF/Keras imports outside the reach-in modules:\n" + "\n".join(bad)


def test_reach_in_modules_of_capabilities_sit_behind_the_version_check_and_are_listed():
    """A `_name.py` reach-in outside tfdist/_compat imports tfdist._compat (its version check runs first), and
    tfdist/_compat's docstring names every reach-in module, so a TF upgrade is a known list of places."""
    listed = importlib.import_module("tfdist._compat").__doc__
    bad = []
    for name, path in modules().items():
        if not reach_in(name):
            continue
        if not name.startswith("tfdist._compat") and not any(
                target == "tfdist._compat" or target.startswith("tfdist._compat.") for target, _ in imports_of(name, path)):
            bad.append(f"{name}: does not import tfdist._compat")
        short = name.removeprefix("tfdist.")
        if name != "tfdist._compat" and short not in listed and short.removeprefix("_compat.") not in listed:
            bad.append(f"{name}: not named in tfdist/_compat/__init__.py's docstring")
    assert not bad, "\n".join(bad)


def test_no_private_attribute_of_another_object_outside_reach_in_modules():
    """`x._name` is allowed on self/cls only; getattr/setattr/hasattr with a private name string not at all."""
    bad = []
    for name, path in modules().items():
        if reach_in(name):
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
    assert not bad, "private attributes read or written outside the reach-in modules:\n" + "\n".join(bad)


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def test_no_private_tensorflow_or_keras_method_is_overridden_outside_reach_in_modules():
    bad = []
    for name in modules():
        if reach_in(name) or name == "tfdist.__main__":
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


def test_benchmarks_live_outside_the_package():
    """The wheel holds tfdist only: no tfdist module imports benchmarks/, and setup.cfg packages only tfdist."""
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {target}" for name, path in modules().items()
           for target, line in imports_of(name, path) if target == "benchmarks" or target.startswith("benchmarks.")]
    assert not bad, "tfdist imports the benchmarks:\n" + "\n".join(bad)
    setup = (ROOT.parent / "setup.cfg").read_text()
    assert "include = tfdist, tfdist.*" in setup
    assert (ROOT.parent / "benchmarks" / "__init__.py").is_file() and not (ROOT / "bench").exists()


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


def test_launcher_table_and_tf_config_parser_load_without_tensorflow():
    """The launcher table and the TF_CONFIG parser (one copy each, in tfdist.comm) load without TensorFlow, and so
    does the cluster package the launcher uses."""
    import subprocess
    import sys

    code = ("import sys, tfdist.cluster, tfdist.comm.launch_env, tfdist.comm.tf_config;"
            "print(sorted(m for m in sys.modules if m.startswith(('tensorflow', 'keras'))))")
    fresh = {**os.environ, "TFDIST_TEST_FRESH_PROCESS": "1"}  # not a fork of the suite's pre-imported zygote
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=fresh).stdout
    assert out.strip() == "[]", out
    assert not (ROOT / "cluster" / "env.py").exists() and not (ROOT / "cluster" / "tf_config.py").exists()


def test_public_names_have_one_home():
    """No compatibility aliases: the callbacks live in tfdist.training only, the mesh in tfdist.tensor_parallel
    (and at the top), and one table maps strategy names to classes."""
    import tfdist

    for name in ("BackupAndRestore", "ModelCheckpoint", "save_model", "Preemption"):
        assert not hasattr(tfdist.cluster, name), name
        assert getattr(tfdist.training, name).__module__.startswith("tfdist.training.")
    assert tfdist.DeviceMesh is tfdist.tensor_parallel.DeviceMesh
    assert tfdist.LayoutMap is tfdist.tensor_parallel.LayoutMap
    from tfdist.strategies import auto, factory

    assert auto.strategy_class is factory.strategy_class
    assert set(factory.CLASSES) | {"default"} == set(factory.strategy_names())


def test_a_process_joins_a_job_in_one_place():
    """TF's coordination service is configured only by comm/runtime.py (join_tf_job: one init-order check, one
    heartbeat policy, one peer wait), and Horovod is initialised only by comm/horovod.py (init_horovod)."""
    calls = {"configure_coordination": set(), "init": set()}
    for name, path in modules().items():
        if reach_in(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "configure_coordination":
                    calls["configure_coordination"].add(name)
                elif node.func.attr == "init" and isinstance(node.func.value, ast.Name) and node.func.value.id == "hvd":
                    calls["init"].add(name)
    assert calls == {"configure_coordination": {"tfdist.comm.runtime"}, "init": {"tfdist.comm.horovod"}}, calls


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
