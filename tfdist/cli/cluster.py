"""`tfdist cluster`: what this process would join — the SLURM step, TF_CONFIG, auto_strategy's choice — the
devices it would train on, and the versions and build of what it trains with."""

from __future__ import annotations

import argparse
import json
import os
import socket


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="show the cluster this process belongs to (SLURM step, TF_CONFIG)",
                       description="Print the cluster detected from the environment, as JSON. Run it under "
                                   "srun to see every task's view: srun -N2 -n2 tfdist cluster")
    p.add_argument("--tf-config", action="store_true",
                   help="print only the TF_CONFIG of this SLURM task (for `export TF_CONFIG=$(tfdist cluster "
                        "--tf-config)` inside srun)")
    p.add_argument("--ps", type=int, default=None, metavar="K",
                   help="a parameter-server step: task 0 is the chief, tasks 1..K parameter servers, the rest "
                        "workers (what slurm/ps.sbatch passes as TFDIST_NUM_PS)")
    p.add_argument("--backend", choices=("tf", "horovod"), default=None, help="as for tfdist.auto_strategy")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.ps is not None and args.ps < 0:
        from tfdist.errors import ConfigError

        raise ConfigError(f"--ps must be >= 0 (the number of parameter servers), got {args.ps}.")
    from tfdist.cluster.slurm import SlurmCluster, in_slurm_step

    if args.tf_config:  # no TensorFlow import: this runs before every worker starts
        print(json.dumps(SlurmCluster.from_environment(num_ps=args.ps).tf_config()))
        return 0
    from tfdist.strategies.auto import decide

    decision = decide(backend=args.backend)
    report = {"strategy": decision.kind, "source": decision.source, "reason": decision.reason,
              "num_workers": decision.num_workers, "hostname": socket.gethostname()}
    if in_slurm_step():
        cluster = SlurmCluster.from_environment(num_ps=args.ps)
        report["slurm"] = cluster.describe()
        report["addresses"] = {host: _resolve(host) for host in cluster.hosts}
    if os.environ.get("PMIX_RANK"):  # started by srun --mpi=pmix (or another PMIx launcher)
        report["pmix_rank"] = os.environ["PMIX_RANK"]
    if decision.tf_config:
        report["tf_config"] = decision.tf_config
    report["devices"] = devices_report()
    report["software"] = software_report(bool(report["devices"]["visible_gpus"]))
    print(json.dumps(report, indent=2))
    return 2 if "error" in report["devices"] else 0


def devices_report(environ=None) -> dict:
    """This process's place on its machine and the devices the multi-process strategies would give it, read
    from the launcher's environment and the GPUs the machine shows, without starting TensorFlow."""
    from tfdist.cluster.local_gpus import visible_gpus
    from tfdist.comm.launch_env import local_device_count, local_process
    from tfdist.devices import gpu_share
    from tfdist.errors import ConfigError

    env = os.environ if environ is None else environ
    local, count, gpus = local_process(env), local_device_count(env), visible_gpus(env)
    out = {"local_rank": local.local_rank, "local_size": local.local_size, "own_devices": local.own_devices,
           "visible_gpus": gpus}
    if not gpus:
        out["trains_on"] = f"{count or 1} logical CPU(s)"
        return out
    try:
        share = gpu_share(count, len(gpus), local)
    except ConfigError as err:
        out["error"] = str(err)
        return out
    out["trains_on"] = [f"GPU {gpus[i]}" for i in share]
    return out


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def software_report(gpus: bool) -> dict:
    """Versions and build of what this process trains with, and the collectives a multi-worker job would use."""
    import platform
    from importlib import metadata

    import keras
    import tensorflow as tf

    build = tf.sysconfig.get_build_info()

    def installed(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    cuda = bool(build.get("is_cuda_build"))
    return {"python": platform.python_version(), "tfdist": installed("tfdist"), "tensorflow": tf.__version__,
            "keras": keras.__version__, "horovod": installed("horovod"), "cuda_build": cuda,
            "cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version"),
            "nccl": installed("nvidia-nccl-cu12", "nvidia-nccl-cu11"),
            "multi_worker_collectives": "NCCL" if cuda and gpus else "TF's ring over gRPC (CPU)"}
