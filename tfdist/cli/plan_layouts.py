"""`tfdist plan --model m.keras --devices N`: every way tfdist can spread the model over N devices, with the bytes
each device holds and the bytes each device sends per training step, so the choice is a reading, not a guess.

Weights, gradients and optimizer state are counted from the model and a built optimizer; a tensor-parallel split
is made for real on N logical CPUs and its exchanges are read from a traced step; a pipeline is balanced as
LayerPlacementStrategy balances it. Activations are an estimate: the layers' outputs per sample (what backward
keeps) times the samples a device holds.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

__all__ = ["Candidate", "candidates", "run_layouts"]

FLOAT = 4  # bytes of an fp32 Keras variable and of its gradient


@dataclass
class Candidate:
    """One way to spread the model: bytes per device (the largest device) and bytes sent per device per step."""

    layout: str
    strategy: str
    params: float
    gradients: float
    optimizer_state: float
    activations: float
    sent_per_step: float
    note: str = ""
    created: float | None = None  # bytes while the model is created, before any cut (None: `params`)

    @property
    def total(self) -> float:
        return self.params + self.gradients + self.optimizer_state + self.activations

    def fits(self, limit: float | None) -> bool:
        """Whether a device of `limit` bytes holds it in training and while the model is created."""
        return limit is None or max(self.total, self.params if self.created is None else self.created) <= limit


def _ring(n: int) -> float:
    """Bytes a device sends in a ring all-reduce, per byte reduced: 2(n-1)/n."""
    return 2 * (n - 1) / n


def data_parallel_candidates(num_params: int, n: int, state_bytes: float, act_per_sample: float,
                             batch: int) -> list[Candidate]:
    from tfdist.zero.memory import zero_formula

    act = act_per_sample * batch / n
    grads = FLOAT * num_params
    rows = [Candidate("data parallel", "MirroredStrategy / MultiWorkerMirroredStrategy / HorovodStrategy",
                      **_bytes(zero_formula(num_params, n, 0, state_bytes=state_bytes)), activations=act,
                      sent_per_step=_ring(n) * grads, note="all-reduce of the gradients")]
    # Stage 1 stays bit-identical to stage 0: past two replicas it keeps the all-reduce and adds the parameters'
    # all-gather (docs/design.md, "Why stage 1 reduce-scatters only with two replicas").
    exact = n > 2
    for stage, factor, note in (
            (1, 1.5 if exact else 1.0, "all-reduce + all-gather of the parameters (bit-identical to stage 0)"
             if exact else "reduce-scatter + all-gather: the traffic of an all-reduce"),
            (2, 1.0, "gradients reduce-scattered into shards: the traffic of an all-reduce"),
            (3, 1.5, "parameters gathered for forward and backward: 1.5x data parallel's traffic; the model is "
                     "created whole before it is cut")):
        rows.append(Candidate(f"ZeRO-{stage}" + (" (FSDP)" if stage == 3 else ""), f"zero_stage={stage}",
                              **_bytes(zero_formula(num_params, n, stage, state_bytes=state_bytes)),
                              activations=act, sent_per_step=factor * _ring(n) * grads, note=note,
                              created=FLOAT * num_params))
    return rows


def _bytes(formula: dict) -> dict:
    return {"params": formula["params"], "gradients": formula["gradients"],
            "optimizer_state": formula["optimizer_state"]}


def pipeline_candidate(model, n: int, state_bytes: float, batch: int) -> Candidate | None:
    """The model cut into n contiguous stages balanced by parameters, as LayerPlacementStrategy(placement="auto")
    cuts it; None when it has fewer layers than n or no layer graph."""
    from tfdist.errors import ConfigError
    from tfdist.pipeline.plan import describe_model, make_plan

    try:
        layers = describe_model(model)
        plan = make_plan(layers, "auto", [[f"/device:{k}" for k in range(n)]], balance="params")
    except (ConfigError, TypeError):
        return None
    totals = plan.stage_totals()
    heaviest = max(t["params"] for t in totals)
    stored = [sum(i.activation_bytes for i in layers if plan.stage_of[i.name] == k) for k in range(n)]
    received = [0] * n
    for t in totals[:-1]:
        received[t["stage"] + 1] += t["sent_bytes"]
    # forward: a stage sends its boundary activations; backward: it sends their gradients back
    sent = max(totals[k]["sent_bytes"] + received[k] for k in range(n)) * batch
    return Candidate(f"pipeline, {n} stages", "LayerPlacementStrategy(devices, micro_batches=M)",
                     params=FLOAT * heaviest, gradients=FLOAT * heaviest, optimizer_state=state_bytes * heaviest,
                     activations=max(stored) * batch, sent_per_step=sent,
                     note="activations of the boundary layers, point to point; GPipe keeps every micro-batch's "
                          "activations until backward")


def parameter_server_candidate(num_params: int, n: int, act_per_sample: float, batch: int) -> Candidate:
    return Candidate(f"parameter servers, {n} workers", "ParameterServerStrategy",
                     params=FLOAT * num_params, gradients=FLOAT * num_params, optimizer_state=0.0,
                     activations=act_per_sample * batch / n, sent_per_step=FLOAT * num_params,
                     note="a worker reads the variables and sends gradients each step; the optimizer state lives "
                          "on the servers (CPU hosts)")


def tensor_parallel_candidate(model_path: str, custom_objects: str | None, optimizer_config: dict | None,
                              optimizer_name: str | None, n: int, batch: int, devices: list[str]) -> Candidate:
    """The model split over n model-axis devices by LayoutMap.auto, measured: bytes per device from the placed
    variables, exchanged bytes from a traced training step."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.cli.plan_model_file import load_model
    from tfdist.tensor_parallel import collective_bytes

    mesh = tfdist.DeviceMesh((1, n), ("batch", "model"), devices)
    layout_map = tfdist.LayoutMap(mesh)
    strategy = tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch")
    with strategy.scope():
        model = load_model(model_path, custom_objects)
        for key, axes in tfdist.LayoutMap.auto(model, mesh).items():
            layout_map[key] = axes
        optimizer = (keras.optimizers.deserialize(optimizer_config) if optimizer_config and not optimizer_name
                     else keras.optimizers.get(optimizer_name or "adam"))
        model.compile(optimizer=optimizer)
        strategy.shard(model)
        optimizer.build(model.trainable_variables)
    report = strategy.memory_report(model)
    largest = max(report.rows, key=lambda r: r.total)

    def replica_step(*xs):
        with tf.GradientTape() as tape:
            outputs = model(list(xs) if len(xs) > 1 else xs[0], training=True)
            loss = tf.add_n([tf.reduce_mean(tf.cast(o, "float32")) for o in tf.nest.flatten(outputs)])
        return tape.gradient(loss, model.trainable_variables)

    inputs = [tf.constant(np.zeros((batch, *t.shape[1:]), t.dtype)) for t in model.inputs]
    step = tf.function(lambda *xs: strategy.run(replica_step, args=xs))
    exchanged = collective_bytes(step.get_concrete_function(*inputs).graph)
    sent = _ring(n) * exchanged["tp_all_reduce"] + (n - 1) / n * exchanged["tp_all_gather"]
    split = [s.name for s in strategy.shard_plan(model).layers]
    act = sum(info.activation_bytes for info in _layers(model)) * batch
    return Candidate(f"tensor parallel, {n} ways", "ModelParallelStrategy(LayoutMap.auto(model, mesh))",
                     params=largest.params, gradients=largest.gradients or largest.params,
                     optimizer_state=largest.optimizer_state, activations=act, sent_per_step=sent,
                     note=(f"{len(split)} layer(s) split; activations all-reduced per step (fast links wanted)"
                           if split else "no layer splits: every device holds the whole model"))


def _layers(model):
    from tfdist.pipeline.plan import describe_model

    try:
        return describe_model(model)
    except TypeError:
        return []


def candidates(args: argparse.Namespace, optimizer_config: dict | None) -> tuple[int, str, list[Candidate]]:
    """(parameters, optimizer name, candidates) for `args.model` over `args.devices` devices."""
    import keras

    from tfdist.cli.plan_model_file import load_model
    from tfdist.cli.plan_tensor_parallel import planning_devices
    from tfdist.errors import ConfigError

    n, batch = args.devices, args.batch_size
    devices = planning_devices(n) if n > 1 else None  # before the first TensorFlow op: logical CPUs to split on
    model = load_model(args.model, args.custom_objects)
    num_params = int(sum(int(v.numpy().size) for v in model.trainable_variables))
    try:
        optimizer = (keras.optimizers.deserialize(optimizer_config) if optimizer_config and not args.optimizer
                     else keras.optimizers.get(args.optimizer or "adam"))
    except ValueError:
        raise ConfigError(f"--optimizer: Keras has no optimizer {args.optimizer!r}; try adam, sgd, rmsprop, "
                          "adagrad, adamw.") from None
    from tfdist.cli.plan_model_file import state_bytes_per_param

    opt_name, state_bytes = state_bytes_per_param(optimizer)
    act_per_sample = sum(info.activation_bytes for info in _layers(model))
    rows = data_parallel_candidates(num_params, n, state_bytes, act_per_sample, batch)
    if n > 1:
        rows.append(tensor_parallel_candidate(args.model, args.custom_objects, optimizer_config, args.optimizer, n,
                                              batch, devices))
        piped = pipeline_candidate(model, n, state_bytes, batch)
        if piped is not None:
            rows.append(piped)
        rows.append(parameter_server_candidate(num_params, n, act_per_sample, batch))
    return num_params, opt_name, rows


def run_layouts(args: argparse.Namespace, optimizer_config: dict | None) -> int:
    num_params, opt_name, rows = candidates(args, optimizer_config)
    limit = args.device_memory * 1e9 if args.device_memory else None
    mb = lambda b: f"{b / 1e6:11.1f}"  # noqa: E731
    print(f"{args.model}: {num_params:,} trainable parameters, {opt_name}, fp32 variables; {args.devices} devices, "
          f"global batch {args.batch_size}")
    head = (f"{'layout':30s}{'weights':>11s}{'grads':>11s}{'opt state':>11s}{'activ.*':>11s}{'total':>11s}"
            f"{'sent/step':>11s}  MB per device")
    print(head)
    print("-" * len(head))
    for row in rows:
        mark = "" if limit is None else ("  fits" if row.fits(limit) else "  too big at start-up"
                                         if row.total <= limit else "  too big")
        print(f"{row.layout[:30]:30s}{mb(row.params)}{mb(row.gradients)}{mb(row.optimizer_state)}"
              f"{mb(row.activations)}{mb(row.total)}{mb(row.sent_per_step)}{mark}")
    print("* activations: an estimate (the layers' outputs per sample x the samples a device holds); the framework's "
          "own memory comes on top.")
    for row in rows:
        print(f"  {row.layout}: {row.strategy}" + (f" -- {row.note}" if row.note else ""))
    fitting = [row for row in rows if row.fits(limit)]
    if limit is not None:
        if fitting:
            # the first that fits, in the order of the table: the simplest strategy, then the least traffic
            print(f"first layout that fits {args.device_memory:g} GB: {fitting[0].layout} ({fitting[0].strategy})")
        else:
            print(f"nothing fits {args.device_memory:g} GB on {args.devices} devices: more devices, offload=True "
                  "(optimizer state in host memory), or a mesh that combines tensor parallelism with ZeRO.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "devices": args.devices, "batch_size": args.batch_size,
                       "num_params": num_params, "optimizer": opt_name, "device_memory_gb": args.device_memory,
                       "candidates": [{**asdict(r), "total": r.total,
                                       "fits": r.fits(limit)} for r in rows],
                       "first_fitting": fitting[0].layout if (fitting and limit is not None) else None}, f, indent=2)
    return 0 if (limit is None or fitting) else 1
