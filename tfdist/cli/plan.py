"""`tfdist plan`: memory per replica for ZeRO stages 0/1/2/3, and the smallest stage that fits a device; with
`--tensor-parallel T`, the bytes each model-axis device holds when a .keras model's variables are split."""

from __future__ import annotations

import argparse
import json
import math
import re

from tfdist.cli.plan_model_file import (
    check_model_file,
    dtype_bytes,
    load_model,
    saved_optimizer_config,
    state_bytes_per_param,
)

SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
# Keras dtype policy -> the dtype of its variables (mixed policies keep float32 master weights)
POLICY_VARIABLE_DTYPE = {"float32": "float32", "mixed_bfloat16": "float32", "mixed_float16": "float32",
                         "bfloat16": "bfloat16", "float16": "float16"}


def count_argument(text: str) -> int:
    """'25M' -> 25_000_000; '1.3B' -> 1_300_000_000; '12345' -> 12345. The type of --params: a bad count is
    argparse's error (exit 2), before TensorFlow starts."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a count such as 25M, 1.3B or 125000000, got {text!r}.")
    value = float(match.group(1)) * SUFFIX[match.group(2)]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}.")
    return round(value)


def positive_int(text: str) -> int:
    """The type of --devices and --batch-size: a whole number >= 1, or argparse's error (exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}.")
    return value


def parse_count(text: str) -> int:
    """count_argument, with a ConfigError naming --params for a bad count."""
    from tfdist.errors import ConfigError

    try:
        return count_argument(text)
    except argparse.ArgumentTypeError as err:
        raise ConfigError(f"--params: {err}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory per device for each way to spread a model, and which fits",
                       description="Per-replica bytes of parameters, gradients and optimizer state for ZeRO "
                                   "stages 0, 1, 2 and 3 (by the variables' dtype), and the smallest stage that fits "
                                   "--device-memory. With --model and --devices N: every layout over N devices "
                                   "(data parallel, ZeRO-1/2/3, tensor parallel, pipeline, parameter servers) with "
                                   "the bytes per device and the bytes each device sends per step. With --model "
                                   "and --tensor-parallel T: the bytes each of T model-axis devices holds when the "
                                   "model's variables are split.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=count_argument, help="number of trainable parameters, e.g. 25M, 1.3B")
    src.add_argument("--model", help="a .keras file: its trainable parameters (and optimizer, if compiled)")
    p.add_argument("--custom-objects", default=None, metavar="FILE_OR_MODULE",
                   help="with --model: a .py file or module to import first, whose classes are registered with "
                        "@keras.saving.register_keras_serializable()")
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="with --model: compare every layout over N devices (bytes per device, bytes sent per step)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="B",
                   help="with --devices: the global batch of a step (activations and their traffic); default 32")
    p.add_argument("--replicas", type=int, default=None,
                   help="data-parallel replicas N (the ZeRO table; needed unless --devices or --tensor-parallel "
                        "is given)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="T",
                   help="with --model: split its variables over T model-axis devices (tfdist.LayoutMap.auto, or "
                        "--layout) and show the bytes per device next to replicated")
    p.add_argument("--layout", default=None,
                   help="with --tensor-parallel: a JSON file {regex: [axis or null, ...]} (a LayoutMap; the axis "
                        "name is 'model'); default: tfdist.LayoutMap.auto(model)")
    p.add_argument("--device-memory", type=float, default=None, help="memory per device in GB (1e9 bytes)")
    p.add_argument("--optimizer", default=None,
                   help="Keras optimizer name (adam, sgd, rmsprop, adagrad...); default: the model's, else adam")
    p.add_argument("--dtype-policy", default=None, choices=tuple(POLICY_VARIABLE_DTYPE),
                   help="with --params: the Keras dtype policy the model trains under (default float32); mixed "
                        "policies keep float32 variables, 'bfloat16'/'float16' halve parameters, gradients and "
                        "optimizer state. With --model its variables' own dtypes are counted")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tfdist.errors import ConfigError

    # Every check that needs no TensorFlow comes first (importing it takes seconds).
    if args.devices is not None:
        if not args.model:
            raise ConfigError("--devices needs --model (a .keras file): the layouts depend on the layers.")
        if args.tensor_parallel is not None or args.replicas is not None:
            raise ConfigError("--devices compares every layout over N devices; leave out --replicas and "
                              "--tensor-parallel (or drop --devices for their single tables).")
    elif args.replicas is None and args.tensor_parallel is None:
        raise ConfigError("--replicas: give the number of data-parallel replicas N (e.g. --replicas 4), or "
                          "--devices N or --tensor-parallel T with --model.")
    if args.replicas is not None and args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}.")
    if args.tensor_parallel is not None:
        if args.tensor_parallel < 1:
            raise ConfigError(f"--tensor-parallel must be >= 1 (model-axis devices), got {args.tensor_parallel}.")
        if not args.model:
            raise ConfigError("--tensor-parallel needs --model (a .keras file): which variables split depends on "
                              "the layers, not only on --params.")
    elif args.layout:
        raise ConfigError("--layout is used with --tensor-parallel T; add --tensor-parallel.")
    if args.device_memory is not None and not (math.isfinite(args.device_memory) and args.device_memory > 0):
        raise ConfigError(f"--device-memory must be > 0 GB, got {args.device_memory:g}.")
    if args.custom_objects and not args.model:
        raise ConfigError("--custom-objects is used with --model.")
    if args.dtype_policy and args.model:
        raise ConfigError(f"--dtype-policy {args.dtype_policy} is for --params; with --model the bytes of its "
                          "variables' own dtypes are counted (build and save the model under the policy).")
    if args.model:
        check_model_file(args.model)
        if args.devices is not None:
            from tfdist.cli.plan_layouts import run_layouts

            return run_layouts(args, saved_optimizer_config(args.model))
    import keras

    from tfdist.zero.memory import zero_formula

    optimizer = None
    if args.model:
        if args.tensor_parallel is not None:
            from tfdist.cli.plan_tensor_parallel import run_tensor_parallel

            return run_tensor_parallel(args, saved_optimizer_config(args.model))
        model = load_model(args.model, args.custom_objects)
        by_dtype: dict[str, int] = {}  # trainable parameters per variable dtype
        for v in model.trainable_variables:
            by_dtype[str(v.dtype)] = by_dtype.get(str(v.dtype), 0) + int(v.numpy().size)
        num_params = sum(by_dtype.values())
        optimizer_config = saved_optimizer_config(args.model)
        if optimizer_config and not args.optimizer:
            optimizer = keras.optimizers.deserialize(optimizer_config)
    else:
        num_params = args.params  # an int: count_argument parsed it
        by_dtype = {POLICY_VARIABLE_DTYPE[args.dtype_policy or "float32"]: num_params}
    param_bytes = sum(n * dtype_bytes(d) for d, n in by_dtype.items()) / max(1, num_params)
    if optimizer is None:
        try:
            optimizer = keras.optimizers.get(args.optimizer or "adam")
        except ValueError:
            raise ConfigError(f"--optimizer: Keras has no optimizer {args.optimizer!r}; try adam, sgd, "
                              "rmsprop, adagrad, adamw.") from None
    # Keras' slots take their variable's dtype: the state per parameter, measured per dtype and weighted by its count
    fresh = lambda: type(optimizer).from_config(optimizer.get_config())  # noqa: E731  (one build each)
    measured = ({d: state_bytes_per_param(fresh(), d) for d in by_dtype}
                or {"float32": state_bytes_per_param(fresh())})
    opt_name = next(iter(measured.values()))[0]
    state_bytes = (sum(n * measured[d][1] for d, n in by_dtype.items()) / num_params if num_params
                   else next(iter(measured.values()))[1])
    stages = {s: zero_formula(num_params, args.replicas, s, state_bytes=state_bytes, param_bytes=param_bytes,
                              grad_bytes=param_bytes) for s in (0, 1, 2, 3)}
    # Every stage creates the model replicated (a full copy per replica) and ZeRO-3 cuts it when the optimizer
    # is built: below its steady state for few replicas, above it beyond (4 with Adam's 8 bytes of state).
    creation = param_bytes * num_params
    limit = args.device_memory * 1e9 if args.device_memory else None
    fits = {s: (limit is None or max(f["total"], creation) <= limit) for s, f in stages.items()}
    smallest = next((s for s in (0, 1, 2, 3) if fits[s]), None)

    gb = lambda b: f"{b / 1e9:10.3f}"  # noqa: E731
    dtypes = ", ".join(f"{n:,} {d} ({n * dtype_bytes(d) / 1e9:.3f} GB)" for d, n in by_dtype.items())
    policy = f" under the {args.dtype_policy} policy" if args.dtype_policy else ""
    print(f"{num_params:,} trainable parameters, {args.replicas} replicas, {opt_name} "
          f"({state_bytes:g} B of optimizer state per parameter); variables{policy}: {dtypes}")
    print(f"{'stage':<8s}{'params':>10s}{'grads':>10s}{'opt state':>10s}{'total':>10s}  GB per replica")
    for s, f in stages.items():
        mark = "" if limit is None else ("  fits" if fits[s] else "  too big at start-up" if f["total"] <= limit
                                         else "  too big")
        print(f"ZeRO-{s:<3d}{gb(f['params'])}{gb(f['gradients'])}{gb(f['optimizer_state'])}{gb(f['total'])}{mark}")
    print(f"start-up: the model is created replicated, {creation / 1e9:.3f} GB per replica, before ZeRO-3 cuts it; "
          "activations and framework overhead come on top of these.")
    if limit is not None:
        if smallest is None and stages[3]["total"] <= limit < creation:
            print(f"ZeRO-3 would fit {args.device_memory:g} GB after the cut ({stages[3]['total'] / 1e9:.3f} GB per "
                  f"replica), but creating the model needs a full copy on each device ({creation / 1e9:.3f} GB), and "
                  "more replicas do not shrink that. Split the model itself: tensor parallelism creates each split "
                  "layer in pieces (`tfdist plan --model m.keras --devices N` compares the layouts); or use devices "
                  "with more memory.")
        elif smallest is None:
            print(f"no stage fits {args.device_memory:g} GB: even ZeRO-3 needs {stages[3]['total'] / 1e9:.3f} GB "
                  "per replica (more replicas, offload or model parallelism needed).")
        else:
            print(f"smallest stage that fits {args.device_memory:g} GB: ZeRO-{smallest} "
                  f"(tfdist.MirroredStrategy(zero_stage={smallest}))")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_params": num_params, "replicas": args.replicas, "optimizer": opt_name,
                       "state_bytes_per_param": state_bytes, "device_memory_gb": args.device_memory,
                       "dtype_policy": args.dtype_policy, "params_by_dtype": by_dtype, "param_bytes": param_bytes,
                       "stages": {str(s): v for s, v in stages.items()},
                       "creation_bytes_per_replica": creation,
                       "fits": {str(s): v for s, v in fits.items()}, "smallest_fitting_stage": smallest}, f, indent=2)
    return 0 if (limit is None or smallest is not None) else 1
