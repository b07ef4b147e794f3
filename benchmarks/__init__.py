"""tfdist's benchmarks: each module is one `tfdist bench NAME` (or `python -m benchmarks NAME` from the clone's
root) with NAME, HELP, add_arguments(parser) and run(args). They are not part of the installed package.

Helpers they share: common (timing, bus bandwidth, JSON/PNG output), processes (starting workers),
memory (resident set, TF allocator bytes), models (the ZeRO benchmarks' MLP and data). Results that the
docs cite are kept in results/.
"""

import os
import pathlib

# Benchmarks start copies of themselves (`python -m benchmarks.NAME --worker`, under `tfdist launch`, mpirun
# or in network namespaces): those must import this same source tree from whatever directory they start in.
_TREE = str(pathlib.Path(__file__).resolve().parents[1])
if _TREE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TREE, os.environ.get("PYTHONPATH")) if p)
