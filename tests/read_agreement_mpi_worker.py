"""ReadAgreement over MPI messages (no rendezvous server), run as 2 ranks by tests/test_read_agreement.py:
`mpirun -np 2 python read_agreement_mpi_worker.py OUT_DIR`. Each rank writes rank{r}.json: scenario -> "ok" or
the ConfigError's text."""
import json
import sys
import time

from mpi4py import MPI

from tfdist.comm.agreement_stores import MpiStore
from tfdist.comm.read_agreement import ReadAgreement
from tfdist.errors import ConfigError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
results: dict = {}


def attempt(name: str, agreement: ReadAgreement, what: str) -> None:
    try:
        agreement.agree(what)
        results[name] = "ok"
    except ConfigError as err:
        results[name] = str(err)


# 1. every rank makes the same five reads
together = ReadAgreement(rank, size, MpiStore(), timeout_s=20, instance=1)
for i in range(5):
    attempt(f"together{i}", together, f"slot m of variable {i}")
comm.Barrier()

# 2. rank 0 reads alone (as model.save on rank 0 only would); rank 1 is busy elsewhere meanwhile
alone = ReadAgreement(rank, size, MpiStore(), timeout_s=0.5, instance=2)
if rank == 0:
    attempt("rank0_alone", alone, "weight 'dense/kernel'")
    attempt("rank0_after", alone, "weight 'dense/kernel'")
else:
    time.sleep(1.0)
comm.Barrier()

# 3. the ranks read different state
differ = ReadAgreement(rank, size, MpiStore(), timeout_s=20, instance=3)
attempt("different", differ, "slot m of variable 0" if rank == 0 else "weight 'dense/bias'")
comm.Barrier()

# 4. rank 1 reads alone: it waits twice the timeout for rank 0's verdict, then gives up naming rank 0
late = ReadAgreement(rank, size, MpiStore(), timeout_s=0.3, instance=4)
if rank == 1:
    attempt("rank1_alone", late, "weight 'dense/kernel'")
comm.Barrier()

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(results, f)
