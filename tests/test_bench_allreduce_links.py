"""`tfdist bench allreduce --link-rates` for both backends: bus bandwidth on emulated nodes next to raw TCP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tfdist.cluster.emulated_network import unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

TFDIST = [sys.executable, "-m", "tfdist"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
RATE = "200mbit"


def _bench(tmp_path, backend: str) -> dict:
    path = tmp_path / f"{backend}.json"
    proc = subprocess.run([*TFDIST, "bench", "allreduce", "--backend", backend, "--sizes-mb", "4", "--iters", "2",
                           "--rounds", "1", "--link-rates", RATE, "--json", str(path)],
                          capture_output=True, text=True, env=ENV, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "raw TCP" in proc.stdout
    record = json.loads(path.read_text())
    assert (tmp_path / f"{backend}.png").stat().st_size > 10_000  # the figure beside the record
    (link,) = record["links"]
    assert link["link_rate"] == RATE
    # The shaped link is a ceiling: no engine and no TCP stream moves more than the link carries (up to the
    # token bucket's burst, 250 KB of the 4 MB here).
    assert 0.3 < link["tcp"]["goodput_over_link"] <= 1.1, link["tcp"]
    return link


def test_tf_backend_reports_bus_bandwidth_over_link_and_raw_tcp(tmp_path):
    link = _bench(tmp_path, "tf")
    (result,) = link["results"]
    assert 0 < result["busbw_over_link"] <= 1.1 and 0 < result["stock_busbw_over_link"] <= 1.1
    assert 0 < result["pieces_busbw_over_link"] <= 1.1


def test_horovod_backend_runs_gloo_ranks_on_emulated_nodes(tmp_path):
    pytest.importorskip("horovod.tensorflow")
    link = _bench(tmp_path, "horovod")
    # no mpi4py: mpirun has no node per rank
    assert set(link["results"]) == {"horovod-gloo", "horovod-step-gloo", "strategy-gloo"}
    for engine in link["results"].values():  # the ranks checked every engine's sums before writing these
        assert 0 < engine["4"]["busbw_over_link"] <= 1.1
