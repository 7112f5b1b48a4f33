"""The run's shared test cluster (tests/cluster.py, SharedCluster): kept for the next module when a module left
it as it found it, and told changed (so that the next module gets a new one) by what a module can leave on a
node: a process, a firewall table, a mount."""
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

pytestmark = pytest.mark.cluster


def test_a_cluster_left_as_it_was_found_is_kept(cluster, shared_cluster):
    assert shared_cluster.cluster is cluster
    assert cluster.ssh("node02", "true").returncode == 0  # a session that came and went leaves nothing
    assert shared_cluster.changes() == []


def test_a_process_left_on_a_node_is_a_change(cluster, shared_cluster):
    proc = cluster.node_popen("node02", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert shared_cluster.changes() == [f"node02: pid {proc.pid}"]
    finally:
        proc.kill()
        proc.wait()
    assert shared_cluster.changes() == []


def test_a_firewall_table_left_on_a_node_is_a_change(cluster, shared_cluster):
    nft = ["ip", "netns", "exec", cluster.netns("node03"), "nft"]
    subprocess.run(nft + ["add", "table", "inet", "pf_left_over"], check=True, timeout=30)
    try:
        assert shared_cluster.changes() == ["node03: firewall changed"]
    finally:
        subprocess.run(nft + ["delete", "table", "inet", "pf_left_over"], check=True, timeout=30)
    assert shared_cluster.changes() == []


def test_a_mount_left_on_a_node_is_a_change(cluster, shared_cluster, tmp_path):
    mount = ["nsenter", "--target", str(cluster.sshd_pid("node01")), "--mount"]
    subprocess.run(mount + ["mount", "-t", "tmpfs", "tmpfs", str(tmp_path)], check=True, timeout=30)
    try:
        assert shared_cluster.changes() == ["node01: mounts changed"]
    finally:
        subprocess.run(mount + ["umount", str(tmp_path)], check=True, timeout=30)
    assert shared_cluster.changes() == []
