"""Worker script of tests/test_mixed_precision.py: one SGD step on dyadic data (see `dyadic_step` there) with the
gradients summed in `grad_dtype`, across processes. Usage (under `tfdist launch -n 2`, one device per worker):
python grad_dtype_job.py OUT BACKEND STAGE:GRAD_DTYPE [STAGE:GRAD_DTYPE ...] with BACKEND `horovod` (one
HorovodStrategy per run, in one process), `tf` (one MultiWorkerMirroredStrategy: one run) or `mesh` (a
ModelParallelStrategy per run over a 2 x 2 mesh with a row per process: `--devices-per-worker 2`; `mesh-horovod`
the same over Horovod). Writes
OUT/rank{r}.json: per run, the kernel after the step."""

import json
import os
import sys

import tfdist

out, backend, runs = sys.argv[1], sys.argv[2], [r.split(":") for r in sys.argv[3:]]


def mesh_strategy(**options) -> tfdist.ModelParallelStrategy:
    """A 2 x 2 mesh, one row per process (two devices each), the kernel split by columns over "model"."""
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), tfdist.cluster.list_devices())
    layout_map = tfdist.LayoutMap(mesh)
    layout_map[".*dense.*/kernel"] = (None, "model")
    return tfdist.ModelParallelStrategy(layout_map, **options)


make = {"horovod": tfdist.HorovodStrategy, "tf": tfdist.MultiWorkerMirroredStrategy, "mesh": mesh_strategy,
        "mesh-horovod": lambda **options: mesh_strategy(backend="horovod", **options)}[backend]
strategies = [make(zero_stage=int(stage), grad_dtype=grad_dtype) for stage, grad_dtype in runs]
from test_mixed_precision import dyadic_step  # noqa: E402  (imports keras: after the strategies)

record = {f"{stage}:{grad_dtype}": dyadic_step(s).tolist() for (stage, grad_dtype), s in zip(runs, strategies)}
with open(os.path.join(out, f"rank{tfdist.cluster.rank(strategies[0])}.json"), "w") as f:
    json.dump(record, f)
