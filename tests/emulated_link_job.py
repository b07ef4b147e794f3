"""One worker of tests/test_emulated_network.py: an all-reduce of 8 MB across emulated nodes, timed.

Usage (under `tfdist launch -n 2 --link-rate RATE`): python emulated_link_job.py
"""
import json
import os
import time

import tfdist

tfdist.comm.init(timeout_s=120)
import tensorflow as tf  # noqa: E402

x = tf.fill([2 * 2**20], float(tfdist.comm.rank() + 1))  # 8 MB of float32
tfdist.comm.all_reduce(x)  # warm-up: connections, kernels
start = time.perf_counter()
total = tfdist.comm.all_reduce(x)
seconds = time.perf_counter() - start
me = json.loads(os.environ["TF_CONFIG"])
print("RESULT", json.dumps({"rank": tfdist.comm.rank(), "value": float(total[0]), "seconds": seconds, "bytes": 8 * 2**20,
                            "address": me["cluster"]["worker"][me["task"]["index"]]}), flush=True)
