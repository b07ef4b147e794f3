"""`tfdist plan --model m.keras --tensor-parallel T`: the bytes each model-axis device holds when the model's
variables are split, measured by splitting the model (and building its optimizer) on T logical CPUs."""

from __future__ import annotations

import argparse
import json

__all__ = ["planning_devices", "run_tensor_parallel"]


def planning_devices(count: int) -> list[str]:
    """`count` logical CPUs to split on (planning never touches GPUs): made now if TensorFlow has not started,
    else the first `count` of those it has."""
    import tensorflow as tf

    import tfdist
    from tfdist.errors import ConfigError, InitOrderError

    try:
        return tfdist.devices.virtual_cpus(count)
    except InitOrderError:
        have = [d.name for d in tf.config.list_logical_devices("CPU")]
        if len(have) < count:
            raise ConfigError(f"--tensor-parallel {count}: TensorFlow already runs with {len(have)} logical CPU(s) "
                              "in this process; run `tfdist plan` in a fresh process.") from None
        return have[:count]


def _layout_map(path: str | None, mesh, model):
    import tfdist
    from tfdist.errors import ConfigError

    if path is None:
        return tfdist.LayoutMap.auto(model, mesh)
    try:
        with open(path) as f:
            rules = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--layout: cannot read {path!r} as JSON ({err}); expected {{\"regex\": [null, "
                          "\"model\"], ...}.") from None
    if not isinstance(rules, dict):
        raise ConfigError(f"--layout: {path!r} must hold a JSON object {{regex: [axis or null, ...]}}, got "
                          f"{type(rules).__name__}.")
    layout_map = tfdist.LayoutMap(mesh)
    for key, axes in rules.items():
        layout_map[key] = tuple(axes) if isinstance(axes, list) else axes
    return layout_map


def run_tensor_parallel(args: argparse.Namespace, saved_optimizer: dict | None) -> int:
    """`saved_optimizer`: the optimizer config the .keras file was compiled with, or None."""
    import keras

    import tfdist
    from tfdist.cli.plan_model_file import load_model
    from tfdist.errors import ConfigError

    parts = args.tensor_parallel
    mesh = tfdist.DeviceMesh((1, parts), ("batch", "model"), planning_devices(parts))
    # The strategy holds this very LayoutMap: its rules are filled in below from the model loaded in the scope
    # (LayoutMap.auto reads the model's layers), before the model is split: the model is loaded once.
    layout_map = tfdist.LayoutMap(mesh)
    strategy = tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch")
    with strategy.scope():
        model = load_model(args.model, args.custom_objects)
        for key, axes in _layout_map(args.layout, mesh, model).items():
            layout_map[key] = axes
        config = None if args.optimizer else saved_optimizer
        try:
            optimizer = (keras.optimizers.deserialize(config) if config
                         else keras.optimizers.get(args.optimizer or "adam"))
        except ValueError:
            raise ConfigError(f"--optimizer: Keras has no optimizer {args.optimizer!r}; try adam, sgd, rmsprop, "
                              "adagrad, adamw.") from None
        model.compile(optimizer=optimizer)
        strategy.shard(model)
        optimizer.build(model.trainable_variables)  # slots next to the shards, as fit() makes them
    report = strategy.memory_report(model)
    plan = strategy.shard_plan(model)
    limit = args.device_memory * 1e9 if args.device_memory else None
    fits = limit is None or report.largest() <= limit
    print(f"{type(optimizer).__name__}, fp32 variables as stored in {args.model}; "
          f"{len(plan.layers)} layer(s) split: {', '.join(f'{s.name} ({s.kind})' for s in plan.layers) or 'none'}")
    print(report)
    if args.replicas:
        print(f"--replicas {args.replicas}: each data-parallel row holds the bytes above (rows hold whole copies).")
    print("activations and framework overhead come on top of these.")
    if limit is not None:
        print(f"largest device {report.largest() / 1e9:.3f} GB: " + ("fits" if fits else "too big for") +
              f" {args.device_memory:g} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tensor_parallel": parts, "optimizer": type(optimizer).__name__,
                       "split_layers": {s.name: s.kind for s in plan.layers}, "device_memory_gb": args.device_memory,
                       "fits": fits, **report.to_dict()}, f, indent=2)
    return 0 if fits else 1
