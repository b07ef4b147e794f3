"""tfdist.comm.read_agreement: ranks agree on each read of sharded state through Horovod's rendezvous store, or
through MPI messages under mpirun.

Threads stand in for the ranks, against Horovod's own RendezvousHTTPServer (the one `tfdist launch --backend horovod`
runs); the MPI store runs as 2 real ranks under mpirun (tests/read_agreement_mpi_worker.py). The 2-process runs with
HorovodStrategy are in tests/test_zero_horovod.py, test_zero3_procs.py and test_custom_loop_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from tfdist.comm.agreement_stores import HttpStore
from tfdist.comm.read_agreement import ReadAgreement
from tfdist.errors import ConfigError


@pytest.fixture
def store():
    http = pytest.importorskip("horovod.runner.http.http_server")
    server = http.RendezvousHTTPServer(("127.0.0.1", 0), http.RendezvousHandler, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def ranks(store: str, size: int = 2, timeout_s: float = 0.3) -> list[ReadAgreement]:
    # One process per rank in a job; here threads of one process, so the instance is given (as each process counts).
    return [ReadAgreement(r, size, HttpStore(store), timeout_s, instance=1) for r in range(size)]


def in_threads(calls: dict) -> dict:
    """Runs rank -> callable concurrently; returns rank -> None or the exception it raised."""
    out: dict = {}

    def run(rank, call):
        try:
            call()
            out[rank] = None
        except Exception as err:  # noqa: BLE001 - the test inspects it
            out[rank] = err

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_every_rank_making_the_same_reads_goes_ahead(store):
    agreements = ranks(store, size=3)
    for i in range(5):  # consecutive reads, each agreed separately (old keys cleaned up on the way)
        out = in_threads({r: (lambda a=a: a.agree(f"slot m of variable {i}")) for r, a in enumerate(agreements)})
        assert out == {0: None, 1: None, 2: None}


def test_a_read_on_rank_0_alone_names_the_missing_rank_and_then_refuses_further_reads(store):
    zero, _ = ranks(store)
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] did not make this read within 0.3 s.*every rank must "
                                          r"take part.*tfdist.training.save_model"):
        zero.agree("weight 'dense/kernel'")
    with pytest.raises(ConfigError, match="no longer in step: restart the job"):
        zero.agree("weight 'dense/kernel'")


def test_a_read_on_another_rank_alone_waits_for_rank_0_then_fails(store):
    _, one = ranks(store)
    with pytest.raises(ConfigError, match="rank 0 did not make this read within 0.6 s"):
        one.agree("weight 'dense/kernel'")


def test_a_late_rank_is_told_what_rank_0_decided(store):
    zero, one = ranks(store)
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\]"):
        zero.agree("slot m of variable 0")
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] did not make this read"):  # not a gather on its own
        one.agree("slot m of variable 0")


def test_ranks_reading_different_state_both_fail_naming_the_reads(store):
    zero, one = ranks(store)
    out = in_threads({0: lambda: zero.agree("slot m of variable 0"), 1: lambda: one.agree("weight 'dense/bias'")})
    for rank in (0, 1):
        assert isinstance(out[rank], ConfigError), out
        assert "rank 0 'slot m of variable 0', rank 1 \"weight 'dense/bias'\"" in str(out[rank]), out[rank]


def test_the_store_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)
    assert ReadAgreement.from_environment(0, 2, 60) is None  # neither a rendezvous server nor MPI
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "1")
    assert ReadAgreement.from_environment(0, 1, 60) is None  # one process: nothing to agree on
    assert ReadAgreement.from_environment(0, 2, 60).store.address == "127.0.0.1:1"


def test_an_unreachable_store_is_a_clear_error():
    lonely = ReadAgreement(0, 2, HttpStore("127.0.0.1:9"), 0.1)  # discard port: nothing listens
    with pytest.raises(ConfigError, match="rendezvous store at 127.0.0.1:9.*cannot be reached"):
        lonely.agree("weight 'w'")


@pytest.mark.slow
def test_over_mpi_messages_under_mpirun(tmp_path):
    """Two real ranks, no rendezvous server: the same outcomes as through the HTTP store."""
    pytest.importorskip("mpi4py", reason="mpi4py comes with the horovod extra (make horovod)")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("OpenMPI's mpirun is installed by `make test` (apt openmpi-bin)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ["PYTHONPATH"]])}
    for var in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)
    proc = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable,
                           os.path.join(here, "read_agreement_mpi_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for i in range(5):
        assert zero[f"together{i}"] == one[f"together{i}"] == "ok"
    assert "rank(s) [1] did not make this read within 0.5 s" in zero["rank0_alone"], zero
    assert "every rank must take part" in zero["rank0_alone"]
    assert "no longer in step: restart the job" in zero["rank0_after"]
    for got in (zero, one):
        assert "rank 0 'slot m of variable 0', rank 1 \"weight 'dense/bias'\"" in got["different"], got
    assert "rank 0 did not make this read within 0.6 s" in one["rank1_alone"], one
