"""tfdist.auto_strategy: picks the strategy from how the processes were started (launcher, SLURM, TF_CONFIG).

The decision is a pure function of the environment (`decide`), so it is tested on environments;
`auto_strategy` logs it and builds the strategy, importing the chosen class only then.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tfdist.cluster.slurm import SlurmCluster, in_slurm_step
from tfdist.comm.launch_env import LAUNCHERS
from tfdist.errors import ConfigError
from tfdist.strategies.factory import strategy_class

__all__ = ["Decision", "decide", "auto_strategy"]

log = logging.getLogger("tfdist")

BACKENDS = (None, "tf", "horovod")


@dataclass(frozen=True)
class Decision:
    """What auto_strategy chose and why.

    kind: 'mirrored', 'multiworker' or 'horovod'; source: 'horovodrun', 'mpirun', 'slurm',
    'tf_config' or 'local'; num_workers: processes taking part; slurm: the SLURM step, if any;
    tf_config: the TF_CONFIG the multi-worker strategy will read (from SLURM or the environment).
    """

    kind: str
    source: str
    reason: str
    num_workers: int = 1
    slurm: SlurmCluster | None = None
    tf_config: dict | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.kind} ({self.reason})"


def decide(environ: Mapping[str, str] | None = None, backend: str | None = None,
           replicas: int | None = None) -> Decision:
    """Chooses the strategy for this process from its environment (default: os.environ).

    1. started by horovodrun or mpirun -> Horovod;
    2. an srun step with more than one task -> MultiWorker over the step's tasks (Horovod when
       backend='horovod', e.g. under `srun --mpi=pmix`);
    3. TF_CONFIG -> MultiWorker (ParameterServer when it has a 'ps' job);
    4. otherwise Mirrored over this machine's devices.
    backend='horovod' asks for Horovod and backend='tf' for TF collectives wherever both would work.

    Example:
        >>> decide({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
        ...         "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}).kind
        'multiworker'
    """
    env = os.environ if environ is None else environ
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {backend!r}.")
    for launcher in LAUNCHERS:
        source, rank_var, size_var = launcher.kind, launcher.rank_var, launcher.size_var
        if launcher.mpi_world and size_var and env.get(size_var):  # srun --mpi=pmix sets no size: SLURM below
            if backend == "tf":
                raise ConfigError(f"backend='tf' but this process was started by {source} ({size_var}="
                                  f"{env[size_var]}); TF collectives need TF_CONFIG or an srun step. Use "
                                  "backend=None or 'horovod', or start the workers with srun.")
            size = _size(env, size_var)
            return Decision("horovod", source, f"started by {source}: {size_var}={size}, {rank_var}="
                            f"{env.get(rank_var)}", num_workers=size)
    if in_slurm_step(env):
        cluster = SlurmCluster.from_environment(env)  # ConfigError names what is missing
        if replicas is not None:
            cluster.require_replicas(replicas)
        where = f"SLURM step {cluster.job_id}.{cluster.step_id}: {cluster.num_tasks} task(s) on {list(cluster.hosts)}"
        if cluster.num_tasks > 1:
            if backend == "horovod":
                return Decision("horovod", "slurm", where + ", backend='horovod'", cluster.num_tasks, cluster)
            return Decision("multiworker", "slurm", where, cluster.num_tasks, cluster, cluster.tf_config())
        if backend == "horovod":
            return Decision("horovod", "slurm", where + ", backend='horovod'", 1, cluster)
        return Decision("mirrored", "slurm", where + ": one process, local devices", 1, cluster)
    if env.get("TF_CONFIG"):
        try:
            tf_config = json.loads(env["TF_CONFIG"])
            workers = sum(len(v) for k, v in tf_config["cluster"].items() if k in ("chief", "worker"))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"TF_CONFIG is not JSON with a 'cluster' of 'chief'/'worker' lists ({err}): "
                              f"{env['TF_CONFIG'][:200]!r}") from None
        if backend == "horovod":
            raise ConfigError("backend='horovod' but only TF_CONFIG is set; start the processes with "
                              "horovodrun, mpirun or srun --mpi=pmix.")
        if tf_config["cluster"].get("ps"):  # e.g. tfdist launch --ps K: asynchronous parameter servers
            return Decision("ps", "tf_config", f"TF_CONFIG with {len(tf_config['cluster'].get('worker', []))} worker(s) and "
                            f"{len(tf_config['cluster']['ps'])} parameter server(s)", workers, tf_config=tf_config)
        return Decision("multiworker", "tf_config", f"TF_CONFIG with {workers} worker(s)", workers,
                        tf_config=tf_config)
    if backend == "horovod":
        return Decision("horovod", "local", "backend='horovod' without a launcher: one process", 1)
    if env.get("SLURM_JOB_ID"):
        return Decision("mirrored", "local", f"SLURM job {env['SLURM_JOB_ID']} without an srun step "
                        "(start workers with srun for multi-node): local devices")
    return Decision("mirrored", "local", "no launcher, SLURM step or TF_CONFIG: local devices")


def auto_strategy(zero_stage: int | None = None, backend: str | None = None, *, replicas: int | None = None,
                  environ: Mapping[str, str] | None = None, **options):
    """Returns the strategy `decide` picks for this process, and logs the choice (logger 'tfdist').

    zero_stage is passed to the strategy unchanged (the ZeRO layer defines its values); other
    keyword options too. Under SLURM the multi-worker strategy gets the step's cluster as its
    cluster resolver (the process's environment is not modified), so every task joins the same cluster.

    Example:
        >>> strategy = tfdist.auto_strategy()     # Mirrored here; MultiWorker inside `srun -N2 -n2`
    """
    decision = decide(environ, backend=backend, replicas=replicas)
    log.info("tfdist.auto_strategy: %s", decision)
    if zero_stage is not None:
        options["zero_stage"] = zero_stage
    cls = strategy_class(decision.kind)
    if decision.kind == "multiworker" and decision.slurm is not None and "cluster_resolver" not in options:
        # The step's cluster goes to the strategy directly: this process's environment is left alone.
        options["cluster_resolver"] = _resolver(decision.slurm.tf_config())
    if decision.kind == "mirrored" and replicas is not None:
        from tfdist.strategies.factory import local_replica_devices

        options["devices"] = local_replica_devices(replicas)
    try:
        return cls(**options)
    except TypeError as err:
        raise ConfigError(f"{cls.__name__} does not take the options {sorted(options)} ({err}).") from None


def _resolver(tf_config: dict):
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(tf_config["cluster"]), task_type=tf_config["task"]["type"],
        task_id=tf_config["task"]["index"], rpc_layer="grpc")


def _size(env: Mapping[str, str], name: str) -> int:
    try:
        size = int(env[name])
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {env[name]!r}.") from None
    if size < 1:
        raise ConfigError(f"{name} must be >= 1, got {size}.")
    return size
