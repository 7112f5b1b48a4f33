"""`preflight check` over the real test cluster from the command line: a healthy cluster passes run after run,
each kind of TARGET (--hosts, --hostfile, --slurm) names the same nodes, and Ctrl-C ends a run that waits on
a hung node."""
import json
import os
import subprocess
import sys
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check, not_passing
from conftest import results, signalled_child


@pytest.mark.cluster
def test_a_healthy_cluster_passes_five_times_in_a_row(cluster):
    for _ in range(5):
        doc, _ = check(cluster)
        assert doc["verdict"] == "pass", not_passing(doc)
        assert not_passing(doc) == []
        assert doc["nodes"] == list(cluster.nodes)
        assert set(results(doc, "SSH001")) == set(cluster.nodes)
        assert set(results(doc, "NET004")) == set(cluster.nodes[1:])
        clock = results(doc, "CLK001")
        assert set(clock) == set(cluster.nodes[1:])
        assert abs(clock[cluster.nodes[1]]["evidence"]["offset_s"]) < 0.1
        assert results(doc, "PKG001")[cluster.nodes[0]]["status"] == "pass"


@pytest.mark.cluster
def test_hostfile_as_target(cluster, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in cluster.nodes))
    args = [sys.executable, "-m", "preflight", "check", "--hostfile", str(hostfile), "--ssh-config",
            str(cluster.ssh_config), "--python", sys.executable, "--json", "--only", "SSH001"]
    doc = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120).stdout)
    assert doc["nodes"] == list(cluster.nodes) and doc["verdict"] == "pass"


@pytest.mark.cluster
def test_slurm_nodelist_as_target(cluster):
    args = [sys.executable, "-m", "preflight", "check", "--slurm", "--ssh-config", str(cluster.ssh_config),
            "--python", sys.executable, "--json", "--only", "SSH001"]
    env = dict(os.environ, SLURM_JOB_NODELIST="node[01-03]")
    doc = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120, env=env).stdout)
    assert doc["nodes"] == ["node01", "node02", "node03"] and doc["verdict"] == "pass"


@pytest.mark.cluster
def test_ctrl_c_stops_a_run_waiting_on_a_hung_node(cluster):
    import signal

    args = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
            str(cluster.ssh_config), "--python", sys.executable, "--timeout", "30", "--skip", "deep"]
    with cluster.frozen_sshd("node02"):
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=signalled_child)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert time.monotonic() - started < 3
    assert "Traceback" not in err
