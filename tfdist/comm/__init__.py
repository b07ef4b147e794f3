"""How bytes move between replicas and processes: TF collectives and (optionally) Horovod.

`tfdist.comm.init()` and the collectives after it (`all_reduce`, `broadcast`, `all_gather`, ...) are the
user-facing API; the strategies use the rest of the package. Names are imported on first use, so the
launcher table (`launch_env`) and TF_CONFIG parser (`tf_config`) load without TensorFlow.

Example:
    >>> import tfdist.comm as comm
    >>> comm.init()
    >>> comm.all_reduce(tf.ones([2]), "sum").numpy()      # a world of one process
    array([1., 1.], dtype=float32)
"""

from __future__ import annotations

from tfdist.lazy import exports

# public name -> the module that defines it
_LAZY = {
    **{name: "tfdist.comm.api" for name in ("init", "is_initialized", "get_backend", "rank", "size", "local_rank",
                                            "local_size", "new_group")},
    **{name: "tfdist.comm.collectives" for name in ("broadcast", "reduce", "all_reduce", "scatter", "gather",
                                                    "all_gather", "reduce_scatter", "all_to_all", "barrier")},
    "send": "tfdist.comm.p2p",
    "recv": "tfdist.comm.p2p",
    "Group": "tfdist.comm.process_group",
    "CollectiveError": "tfdist.comm.process_group",
    "WorkerLostError": "tfdist.comm.faults",
    "cross_device_ops_from": "tfdist.comm.tf_collectives",
}

__all__ = ["CollectiveError", "Group", "WorkerLostError", "all_gather", "all_reduce", "all_to_all", "barrier",
           "broadcast", "cross_device_ops_from", "gather", "get_backend", "init", "is_initialized", "local_rank",
           "local_size", "new_group", "rank", "recv", "reduce", "reduce_scatter", "scatter", "send", "size"]

__getattr__, __dir__ = exports(__name__, _LAZY)
