"""`tfdist train`: the main job — a CNN on a shipped dataset under a chosen strategy."""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

from tfdist.cli.names import DATASET_NAMES, STRATEGY_NAMES

# Strategies whose builder takes zero_stage (tfdist.zero); extend when another one gains it.
ZERO_STRATEGIES = ("mirrored", "multiworker", "horovod")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the example CNN under a strategy",
                       description="Train tfdist's example CNN on real shipped data under a strategy.")
    p.add_argument("--strategy", default="mirrored", choices=STRATEGY_NAMES,
                   help="mirrored (local devices), multiworker (processes from TF_CONFIG), horovod (Horovod "
                        "ranks), placement (layers over devices), ps (parameter servers), or default (no "
                        "distribution); default: mirrored")
    p.add_argument("--replicas", type=int, default=None,
                   help="local replicas: that many GPUs, or logical CPUs on a machine without GPUs")
    p.add_argument("--dataset", default="mnist", choices=DATASET_NAMES,
                   help="mnist (4000 train / 1000 test) or digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (split across replicas)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-per-epoch", type=int, default=None,
                   help="steps per epoch (--strategy ps, where every worker reads its own endless pipeline; "
                        "default: one pass over the training set)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO: 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP), across replicas "
                        f"(strategies: {', '.join(ZERO_STRATEGIES)}; default 0)")
    p.add_argument("--plot", help="write training curves to this PNG")
    p.add_argument("--json", help="write a JSON record of the run to this file")
    p.add_argument("--save", help="save the trained model to this .keras file")
    p.add_argument("--backup-dir", help="checkpoint every epoch here and resume from it; on SIGUSR1/SIGTERM "
                   "(sbatch --signal) stop, keep the checkpoint and requeue the SLURM job (tfdist.training.Preemption)")
    p.add_argument("--preempt-at", choices=("epoch", "step"), default="epoch",
                   help="with --backup-dir: stop at the end of the current epoch, or after the current step")
    p.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2),
                   help="Keras verbosity (1: progress bar); TensorFlow's own log lines: tfdist --verbose train ...")
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    """What argparse's choices and types do not check; imports no TensorFlow (the strategy and dataset names
    are argparse choices)."""
    from tfdist.errors import ConfigError

    if args.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {args.epochs}.")
    if args.replicas is not None and args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1 (or left out: every local GPU, or one CPU), got {args.replicas}.")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.replicas and args.batch_size % args.replicas:
        raise ConfigError(f"--batch-size {args.batch_size} does not split evenly over --replicas {args.replicas}: "
                          f"give a multiple of {args.replicas} (the global batch is split across replicas).")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ConfigError(f"--learning-rate must be a positive number, got {args.learning_rate}.")
    if args.zero_stage and args.strategy not in ZERO_STRATEGIES:
        raise ConfigError(f"--zero-stage {args.zero_stage} is supported by --strategy {' or '.join(ZERO_STRATEGIES)}"
                          f", not {args.strategy!r}. Use one of those, or --zero-stage 0.")
    if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
        raise ConfigError(f"--steps-per-epoch must be >= 1, got {args.steps_per_epoch}.")
    if args.save and not args.save.endswith(".keras"):
        raise ConfigError(f"--save must name a .keras file, got {args.save!r}.")
    from tfdist.cli.outputs import check_output_path

    for parameter, path in (("--save", args.save), ("--json", args.json), ("--plot", args.plot)):
        check_output_path(path, parameter)
    check_output_path(args.backup_dir, "--backup-dir", directory=True)


def run(args: argparse.Namespace) -> int:
    _check(args)  # before TensorFlow starts: bad input fails fast
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.plots import plot_curves
    from tfdist.training import Throughput

    options = {"zero_stage": args.zero_stage} if args.zero_stage else {}
    strategy = tfdist.strategies.make_strategy(args.strategy, replicas=args.replicas, **options)
    keras.utils.set_random_seed(args.seed)  # after the strategy: multi-worker strategies must come first
    chief = tfdist.cluster.is_chief(strategy)  # only the chief prints progress and writes files
    replicas = strategy.num_replicas_in_sync
    data = tfdist.data.load(args.dataset, global_batch_size=args.batch_size, strategy=strategy, seed=args.seed)
    arrays = data.arrays
    where = f" [rank {tfdist.cluster.rank(strategy)}]" if tfdist.cluster.world_size(strategy) > 1 else ""
    print(f"tfdist train{where}: {args.dataset} ({len(arrays.x_train)} train / {len(arrays.x_test)} test), "
          f"strategy={args.strategy}, replicas={replicas}, global batch={args.batch_size} "
          f"({args.batch_size // replicas} per replica), epochs={args.epochs}"
          + (f", zero_stage={args.zero_stage}" if args.zero_stage else ""), flush=True)

    with strategy.scope():
        model = tfdist.models.cnn(arrays.input_shape, arrays.num_classes, seed=args.seed)
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    throughput = Throughput(len(arrays.x_train))
    callbacks = [throughput, data.order]  # epoch e's data order depends on (seed, e) only: resumable
    if args.backup_dir:  # checkpoint per epoch (chief writes, every rank restores), stop on SIGUSR1/SIGTERM
        from tfdist.training import BackupAndRestore, Preemption

        preemption = Preemption(backup=BackupAndRestore(args.backup_dir, strategy=strategy), at=args.preempt_at,
                                is_chief=chief)
        callbacks.append(preemption)
    start = time.perf_counter()
    if isinstance(strategy, tfdist.ParameterServerStrategy):
        # Asynchronous: every worker shuffles and repeats the training set in its own pipeline; the
        # chief validates on the test arrays.
        steps = args.steps_per_epoch or len(arrays.x_train) // args.batch_size
        throughput.samples_per_epoch = steps * args.batch_size

        def dataset_fn(input_context):
            ds = tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train))
            return ds.shuffle(len(arrays.x_train)).repeat().batch(args.batch_size)

        history = model.fit(dataset_fn, validation_data=(arrays.x_test, arrays.y_test), epochs=args.epochs,
                            steps_per_epoch=steps, callbacks=[c for c in callbacks if c is not data.order],
                            verbose=args.verbose)
    else:
        history = model.fit(data.train, validation_data=data.test, epochs=args.epochs, shuffle=False,
                            callbacks=callbacks, verbose=args.verbose if chief else 0)
    if args.backup_dir and preemption.preempted:
        print(f"tfdist train{where}: stopped by a signal after epochs {preemption.completed_epochs}; "
              f"{'requeued' if preemption.requeued else 'not requeued'}", flush=True)
        return 0
    train_seconds = time.perf_counter() - start
    # Every rank: a fingerprint of its final weights (only the chief writes files; compare these lines).
    print(f"tfdist train{where}: final weights sha256 {weights_digest(model)}", flush=True)
    test_data = (arrays.x_test, arrays.y_test) if isinstance(strategy, tfdist.ParameterServerStrategy) else (data.test,)
    test_loss, test_accuracy = model.evaluate(*test_data, verbose=0)
    print(f"test accuracy {test_accuracy:.4f}, test loss {test_loss:.4f}, "
          f"{throughput.images_per_sec:.0f} images/s, {train_seconds:.1f} s training", flush=True)

    record = {
        "strategy": args.strategy, "replicas": replicas, "dataset": args.dataset, "epochs": args.epochs,
        "global_batch_size": args.batch_size, "learning_rate": args.learning_rate, "seed": args.seed,
        "test_accuracy": float(test_accuracy), "test_loss": float(test_loss),
        "images_per_sec": throughput.images_per_sec, "train_seconds": train_seconds,
        "epoch_seconds": throughput.epoch_seconds,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "versions": {"tfdist": tfdist.__version__, "tensorflow": tf.__version__, "keras": keras.__version__,
                     "python": platform.python_version()},
    }
    # Paths were checked before training; a write that still fails goes to a temporary directory instead
    # (and the command exits 1), so the finished training is not lost.
    from tfdist.cli.outputs import write_or_rescue

    written = []
    if chief and args.plot:
        title = f"{args.dataset}, {args.strategy} x{replicas}"
        written.append((args.plot, write_or_rescue(args.plot, lambda p: plot_curves(record["history"], p, title=title),
                                                   "the training curves")))
    if chief and args.json:
        def write_json(p):
            with open(p, "w") as f:
                json.dump(record, f, indent=2)

        written.append((args.json, write_or_rescue(args.json, write_json, "the run record")))
    if args.save:  # every rank: with ZeRO across processes, saving gathers the optimizer shards
        with tfdist.zero.gathered_state(model):
            if chief:
                written.append((args.save, write_or_rescue(args.save, model.save, "the model")))
    for wanted, path in written:
        print(f"wrote {path}")
    if any(wanted != path for wanted, path in written):
        return 1
    return 0


def weights_digest(model) -> str:
    """First 16 hex digits of the sha256 of the model's weights (float bytes, in order): equal iff bitwise equal."""
    import hashlib

    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(w.tobytes())
    return digest.hexdigest()[:16]
