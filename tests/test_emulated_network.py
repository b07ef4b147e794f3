"""Emulated nodes on one machine (tfdist.cluster.emulated_network): network namespaces whose links are
shaped with tc, and `tfdist launch --link-rate` running each worker on a node of its own."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from tfdist.cluster.emulated_network import (
    EmulatedNetwork,
    parse_rate,
    unavailable_reason,
)
from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError

JOB = os.path.join(os.path.dirname(__file__), "emulated_link_job.py")
HOROVOD_JOB = os.path.join(os.path.dirname(__file__), "emulated_horovod_job.py")
needs_root = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_rates_are_parsed_like_tc():
    assert parse_rate("1gbit") == 10**9 and parse_rate("200mbit") == 2 * 10**8 and parse_rate("25Gbit") == 25 * 10**9
    for bad in ("fast", "10gb", "100kbit", ""):
        with pytest.raises(ConfigError, match="rate"):
            parse_rate(bad)


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="nodes must be"):
        EmulatedNetwork(0)
    with pytest.raises(ConfigError, match="--link-rate .* no --ps"):
        launch([sys.executable, "-c", "pass"], 1, ps=1, link_rate="1gbit")
    with pytest.raises(ConfigError, match="--ps needs --backend tf"):
        launch([sys.executable, "-c", "pass"], 2, backend="horovod", ps=1, link_rate="1gbit")
    with pytest.raises(ConfigError, match="rate"):
        launch([sys.executable, "-c", "pass"], 2, link_rate="quick")


@needs_root
def test_nodes_are_namespaces_with_shaped_links():
    with EmulatedNetwork(2, "300mbit") as net:
        names = [net.netns[0], net.netns[1]]
        assert "rate 300Mbit" in net.qdisc(0) and "rate 300Mbit" in net.qdisc(1)
        inside = subprocess.run(net.command(1, ["ip", "-4", "-o", "addr"]), capture_output=True, text=True,
                                check=True).stdout
        assert net.address(1) in inside and net.address(0) not in inside  # each node has only its own address
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(name in listed for name in names)  # removed on exit


@pytest.mark.slow
@needs_root
def test_an_all_reduce_between_emulated_nodes_runs_at_the_link_rate(tmp_path):
    log = io.StringIO()
    rate = "200mbit"
    assert launch([sys.executable, JOB], 2, link_rate=rate, out=log, timeout_s=240,
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"}) == 0, log.getvalue()[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in log.getvalue().splitlines() if "RESULT " in line]
    assert sorted(r["value"] for r in results) == [3.0, 3.0]
    hosts = {r["address"].rsplit(":", 1)[0] for r in results}
    assert len(hosts) == 2 and all(h.startswith("10.214.") for h in hosts)  # one node each, not loopback
    # The link is a floor no noise can beat: an all-reduce sends at least 2(n-1)/n of its bytes over each
    # node's link (ring), so it cannot finish faster than that at 200 Mbit/s (loopback takes ~5 ms).
    floor = 2 * (2 - 1) / 2 * results[0]["bytes"] * 8 / parse_rate(rate)
    assert all(r["seconds"] >= 0.9 * floor for r in results), (results, floor)


@pytest.mark.slow
@needs_root
def test_horovod_gloo_ranks_run_on_emulated_nodes_at_the_link_rate():
    pytest.importorskip("horovod.tensorflow")
    log = io.StringIO()
    rate = "200mbit"
    assert launch([sys.executable, HOROVOD_JOB], 2, backend="horovod", link_rate=rate, out=log, timeout_s=240,
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"}) == 0, log.getvalue()[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in log.getvalue().splitlines() if "RESULT " in line]
    assert sorted(r["value"] for r in results) == [3.0, 3.0]
    assert all(r["size"] == 2 and r["local_size"] == 1 for r in results)  # one rank per node, as on 2 machines
    assert len({r["iface"] for r in results}) == 2 and all(r["iface_here"] for r in results)  # each binds its node's link
    floor = 2 * (2 - 1) / 2 * results[0]["bytes"] * 8 / parse_rate(rate)  # see the TF test above
    assert all(r["seconds"] >= 0.9 * floor for r in results), (results, floor)


@needs_root
def test_a_network_left_by_a_killed_job_is_removed_by_the_next_one():
    from tfdist.cluster import emulated_network

    tag = next(t for t in range(99999, 0, -1) if not emulated_network._alive(t))  # no live process has it
    subprocess.run(["ip", "netns", "add", f"tfdnode{tag}-0"], check=True)
    subprocess.run(["ip", "link", "add", f"tfdnb{tag}", "type", "bridge"], check=True)
    try:
        with EmulatedNetwork(nodes=1, rate=None) as net:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"tfdnode{tag}-0" not in names and net.netns[0] in names
            links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
            assert f"tfdnb{tag}:" not in links and f"{net.bridge}:" in links
    finally:
        subprocess.run(["ip", "netns", "del", f"tfdnode{tag}-0"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"tfdnb{tag}"], capture_output=True)
