"""One rank of tests/test_emulated_network.py: a Horovod/Gloo all-reduce of 8 MB across emulated nodes, timed.

Usage (under `tfdist launch -n 2 --backend horovod --link-rate RATE`): python emulated_horovod_job.py
"""
import json
import os
import socket
import time

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
x = tf.fill([2 * 2**20], float(hvd.rank() + 1))  # 8 MB of float32
hvd.allreduce(x, op=hvd.Sum, name="warmup")  # connections, kernels
start = time.perf_counter()
total = hvd.allreduce(x, op=hvd.Sum, name="timed")
seconds = time.perf_counter() - start
iface = os.environ["HOROVOD_GLOO_IFACE"]
with open("/proc/net/dev") as f:  # this network namespace's interfaces
    interfaces = [line.split(":")[0].strip() for line in f if ":" in line]
print("RESULT", json.dumps({"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
                            "value": float(total[0]), "seconds": seconds, "bytes": 8 * 2**20, "iface": iface,
                            "iface_here": iface in interfaces, "host": socket.gethostname()}), flush=True)
