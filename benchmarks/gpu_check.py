"""`tfdist bench gpu-check` (`make gpu-check`): tfdist on this machine's GPUs, each strategy against one device.

On one machine with NVIDIA GPUs and `tensorflow[and-cuda]` (what `make setup` installs where `nvidia-smi` exists)
it trains the same MLP on the same global batches under each configuration below, checks that the weights end
where one device's do (under the same precision policy), then times it: samples per second and the step time
relative to one device, printed as one table and written as JSON.

- one GPU (the reference);
- `MirroredStrategy` over every visible GPU with NCCL;
- ZeRO stages 1 and 2 with the optimizer shards offloaded to the host, and stage 3;
- tensor parallelism (a 1 x N mesh, Megatron's column/row split of the MLP);
- a pipeline (`LayerPlacementStrategy`, one stage per GPU, 4 micro-batches);
- `MirroredStrategy` under `mixed_bfloat16` and `mixed_float16` (Keras' loss scaling); ZeRO-3, tensor parallelism
  and the pipeline under `mixed_bfloat16`;
- in a second process, `MirroredStrategy` over two logical GPUs of one card with a non-NCCL all-reduce.

Without a GPU it says so and exits 2 before TensorFlow starts. `--cpu N` runs the same checks on N logical CPUs
(TF's default all-reduce instead of NCCL, the logical-device check in the same process): how the test suite keeps
this script working where no GPU is at hand. Its timings then say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

NAME = "gpu-check"
HELP = "every strategy on this machine's GPUs against one GPU, then throughput (refuses without GPUs)"

# Bounds on |w - w_one_device| / |w_one_device - w_initial| over all weights: the difference relative to how far
# training moved them, so a configuration that did not train cannot pass.
FLOAT32_TOLERANCE = 1e-4  # summation order only
MIXED_TOLERANCE = 2e-2    # bfloat16/float16 compute: rounding differs with the reduction order
# On logical CPUs without native bfloat16 (AVX-512 BF16 or AMX), TF's bfloat16 matmul rounds partial sums to
# bfloat16 (Eigen, and oneDNN too on AVX2), so splitting a sum (tensor parallelism) changes more bits than on GPUs
# or on CPUs that accumulate bfloat16 products in float32.
EIGEN_BFLOAT16_TOLERANCE = 1e-1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", type=int, default=None, metavar="N",
                   help="run the checks on N logical CPUs instead of GPUs (no NCCL; timings are not GPU figures)")
    p.add_argument("--width", type=int, default=None, help="MLP width (default 2048 on GPUs, 32 with --cpu)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 1024 on GPUs, 16 with --cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 50, 3 with --cpu)")
    p.add_argument("--json", default="gpu_check.json", help="where to write the JSON record")
    p.add_argument("--logical-child", action="store_true", help=argparse.SUPPRESS)  # the second process


def run(args: argparse.Namespace) -> int:
    from tfdist.cluster.local_gpus import visible_gpus

    if args.cpu is None and not visible_gpus():
        print("gpu-check: this machine shows no NVIDIA GPU (no /dev/nvidia*, or CUDA_VISIBLE_DEVICES hides them). "
              "Run it on a machine with GPUs and tensorflow[and-cuda] (make setup TF_EXTRA=gpu), or pass --cpu N "
              "to run the same checks on N logical CPUs.", file=sys.stderr)
        return 2
    cpu = args.cpu is not None
    width = args.width or (32 if cpu else 2048)
    batch = args.batch_size or (16 if cpu else 1024)
    steps = args.steps or (3 if cpu else 50)

    import tensorflow as tf

    import tfdist

    if cpu:
        devices = _logical_cpus(args.cpu)
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            print("gpu-check: TensorFlow sees no GPU although the machine has NVIDIA devices: this TensorFlow is "
                  "the CPU wheel or lacks CUDA. Install tensorflow[and-cuda] (make setup TF_EXTRA=gpu).",
                  file=sys.stderr)
            return 2
        if args.logical_child:
            tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(1024)] * 2)
            devices = ["/gpu:0", "/gpu:1"]
        else:
            devices = [f"/gpu:{i}" for i in range(len(gpus))]
    check = Check(devices, width, batch, steps, cpu)
    if args.logical_child:
        check.run("one logical GPU", lambda: tf.distribute.OneDeviceStrategy(devices[0]))  # the reference
        rows = [check.run("logical GPUs, non-NCCL",
                          lambda: tfdist.MirroredStrategy(devices, cross_device_ops="reduce_to_one"))]
        print(json.dumps(rows))
        return 0
    rows = check.all_configurations()
    if not cpu:
        rows += _logical_gpus_in_a_second_process(args, width, batch, steps)
    return _report(rows, devices, cpu, args.json)


class Check:
    """Trains the check's MLP under a strategy, compares it with one device, and times it."""

    def __init__(self, devices: list[str], width: int, batch: int, steps: int, cpu: bool):
        import numpy as np

        self.devices, self.width, self.batch, self.steps, self.cpu = devices, width, batch, steps, cpu
        rng = np.random.RandomState(0)
        self.x = rng.rand(batch * 4, width).astype("float32")
        self.y = rng.randint(0, 10, size=batch * 4)
        self.references: dict[str, dict] = {}

    def all_configurations(self) -> list[dict]:
        import tensorflow as tf

        import tfdist

        d, n = self.devices, len(self.devices)
        mesh = tfdist.DeviceMesh((1, n), ("batch", "model"), d)
        layout = tfdist.LayoutMap(mesh)
        layout["up.*/kernel"] = (None, "model")  # Megatron's column split, then the row split
        layout["up.*/bias"] = ("model",)
        layout["down.*/kernel"] = ("model", None)
        configs = [
            ("one device", lambda: tf.distribute.OneDeviceStrategy(d[0]), "float32"),
            ("Mirrored, all-reduce " + ("default" if self.cpu else "NCCL"),
             lambda: tfdist.MirroredStrategy(d, cross_device_ops=None if self.cpu else "nccl"), "float32"),
            ("ZeRO-1, offload", lambda: tfdist.MirroredStrategy(d, zero_stage=1, offload=True), "float32"),
            ("ZeRO-2, offload", lambda: tfdist.MirroredStrategy(d, zero_stage=2, offload=True), "float32"),
            ("ZeRO-3", lambda: tfdist.MirroredStrategy(d, zero_stage=3), "float32"),
            ("tensor parallel 1 x N", lambda: tfdist.ModelParallelStrategy(layout, batch_dim_name="batch"), "float32"),
            ("pipeline, N stages", lambda: tfdist.LayerPlacementStrategy(d, micro_batches=4), "float32"),
            ("one device, bfloat16", lambda: tf.distribute.OneDeviceStrategy(d[0]), "mixed_bfloat16"),
            ("Mirrored, bfloat16", lambda: tfdist.MirroredStrategy(d), "mixed_bfloat16"),
            ("ZeRO-3, bfloat16", lambda: tfdist.MirroredStrategy(d, zero_stage=3), "mixed_bfloat16"),
            ("tensor parallel, bfloat16", lambda: tfdist.ModelParallelStrategy(layout, batch_dim_name="batch"),
             "mixed_bfloat16"),
            ("pipeline, bfloat16", lambda: tfdist.LayerPlacementStrategy(d, micro_batches=4), "mixed_bfloat16"),
            ("one device, float16", lambda: tf.distribute.OneDeviceStrategy(d[0]), "mixed_float16"),
            ("Mirrored, float16", lambda: tfdist.MirroredStrategy(d), "mixed_float16"),
        ]
        if self.cpu:  # the logical-device check needs no second process on CPUs
            configs.append(("logical devices, non-NCCL",
                            lambda: tfdist.MirroredStrategy(d, cross_device_ops="reduce_to_one"), "float32"))
        return [self.run(name, make, policy) for name, make, policy in configs]

    def run(self, name: str, make, policy: str = "float32") -> dict:
        import keras
        import numpy as np

        from benchmarks.common import StepTimer, median_ms

        keras.mixed_precision.set_global_policy(policy)
        try:
            strategy = make()
            with strategy.scope():
                model = self.model()
                model.compile(optimizer=keras.optimizers.Adam(1e-3),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            initial = np.concatenate([np.ravel(np.asarray(w, "float64")) for w in model.get_weights()])
            model.fit(self.x, self.y, batch_size=self.batch, epochs=1, shuffle=False, verbose=0)  # 4 steps
            weights = [np.asarray(w, "float64") for w in model.get_weights()]
            timer = StepTimer()
            model.fit(np.tile(self.x, (self.steps // 4 + 2, 1)), np.tile(self.y, self.steps // 4 + 2),
                      batch_size=self.batch, epochs=1, steps_per_epoch=self.steps + 1, shuffle=False, verbose=0,
                      callbacks=[timer])
        finally:
            keras.mixed_precision.set_global_policy("float32")
        flat = np.concatenate([np.ravel(w) for w in weights])
        reference = self.references.setdefault(policy, {"weights": flat, "initial": initial,
                                                        "step_ms": median_ms(timer.step_seconds)})
        moved = float(np.linalg.norm(reference["weights"] - reference["initial"]))
        diff = float(np.linalg.norm(flat - reference["weights"])) / moved
        step_ms = median_ms(timer.step_seconds)
        tolerance = FLOAT32_TOLERANCE if policy == "float32" else MIXED_TOLERANCE
        if policy == "mixed_bfloat16" and self.cpu:
            from tfdist._compat.tf_runtime import onednn_enabled

            native = onednn_enabled() and _cpu_has_native_bfloat16()
            tolerance = MIXED_TOLERANCE if native else EIGEN_BFLOAT16_TOLERANCE
        return {"configuration": name, "policy": policy, "replicas": strategy.num_replicas_in_sync,
                "relative_diff": diff, "max_abs_diff": float(np.max(np.abs(flat - reference["weights"]))),
                "tolerance": tolerance, "equal": diff <= tolerance, "step_ms": step_ms,
                "samples_per_s": self.batch / (step_ms / 1000.0), "vs_one_device": step_ms / reference["step_ms"]}

    def model(self):
        import keras

        keras.utils.set_random_seed(7)
        inputs = keras.Input((self.width,))
        x = keras.layers.Dense(self.width, activation="relu", name="up1")(inputs)
        x = keras.layers.Dense(self.width, name="down1")(x)
        x = keras.layers.Dense(self.width, activation="relu", name="up2")(x)
        x = keras.layers.Dense(self.width, name="down2")(x)
        return keras.Model(inputs, keras.layers.Dense(10, name="head", dtype="float32")(x))


def _logical_cpus(n: int) -> list[str]:
    """N logical CPUs, with any GPU hidden first (the checks run on CPUs even on a GPU machine); in a process whose
    TensorFlow already started with at least N (a test's), its first N."""
    import tensorflow as tf

    import tfdist

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # TensorFlow has started: its devices stay, and the CPUs are named explicitly below
    have = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    if have is not None and len(have) >= n:
        return [f"/device:CPU:{i}" for i in range(n)]
    return tfdist.devices.virtual_cpus(n)


def _logical_gpus_in_a_second_process(args: argparse.Namespace, width: int, batch: int, steps: int) -> list[dict]:
    """Logical GPUs must be configured before TF starts: a fresh process, with its own one-device reference."""
    cmd = [sys.executable, "-m", "benchmarks", NAME, "--logical-child", "--width", str(width),
           "--batch-size", str(batch), "--steps", str(steps), "--json", ""]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return [{"configuration": "logical GPUs, non-NCCL", "equal": False, "error": done.stderr[-2000:]}]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(rows: list[dict], devices: list[str], cpu: bool, path: str | None) -> int:
    from benchmarks.common import machine, write_json

    print(f"gpu-check on {len(devices)} {'logical CPUs (not a GPU figure)' if cpu else 'GPUs'}: each configuration "
          "against one device under its precision policy (rel. diff: |w - w_one| / |w_one - w_initial|)")
    print(f"{'configuration':30s} {'policy':15s} {'replicas':>8s} {'rel. diff':>11s} {'equal':>6s} "
          f"{'step ms':>9s} {'samples/s':>10s} {'vs one':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['configuration']:30s} failed: {r['error'].strip().splitlines()[-1]}")
            continue
        print(f"{r['configuration']:30s} {r['policy']:15s} {r['replicas']:8d} {r['relative_diff']:11.2e} "
              f"{'yes' if r['equal'] else 'NO':>6s} {r['step_ms']:9.2f} {r['samples_per_s']:10.0f} "
              f"{r['vs_one_device']:7.2f}")
    write_json(path, {"devices": devices, "cpu": cpu, "machine": machine(), "rows": rows})
    bad = [r["configuration"] for r in rows if not r.get("equal")]
    if bad:
        print(f"gpu-check: {len(bad)} configuration(s) differ from one device or failed: {bad}", file=sys.stderr)
    return 1 if bad else 0


def _cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 with float32 accumulation in hardware (AVX-512 BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
