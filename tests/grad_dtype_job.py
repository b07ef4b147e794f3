"""Worker script of tests/test_mixed_precision.py: one SGD step on dyadic data (see `dyadic_step` there) with the
gradients summed in `grad_dtype`, across processes. Usage (under `tfdist launch -n 2`, one device per worker):
python grad_dtype_job.py OUT BACKEND STAGE:GRAD_DTYPE [STAGE:GRAD_DTYPE ...] with BACKEND `horovod` (one
HorovodStrategy per run, in one process) or `tf` (one MultiWorkerMirroredStrategy: one run). Writes
OUT/rank{r}.json: per run, the kernel after the step."""

import json
import os
import sys

import tfdist

out, backend, runs = sys.argv[1], sys.argv[2], [r.split(":") for r in sys.argv[3:]]
make = tfdist.HorovodStrategy if backend == "horovod" else tfdist.MultiWorkerMirroredStrategy
strategies = [make(zero_stage=int(stage), grad_dtype=grad_dtype) for stage, grad_dtype in runs]
from test_mixed_precision import dyadic_step  # noqa: E402  (imports keras: after the strategies)

record = {f"{stage}:{grad_dtype}": dyadic_step(s).tolist() for (stage, grad_dtype), s in zip(runs, strategies)}
with open(os.path.join(out, f"rank{tfdist.cluster.rank(strategies[0])}.json"), "w") as f:
    json.dump(record, f)
