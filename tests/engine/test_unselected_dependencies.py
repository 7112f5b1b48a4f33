"""A check whose evidence another check gathers is never a pass when that check is not selected, on the real
test cluster: the all-reduce alone with the head's port dropped (NET004 saw why), NET004 alone with the port
taken on the head (NET003's), the node checks of a node that SSH001 would have found unreached."""
import os
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import preflight_json, results


def check(cluster, *extra):
    return preflight_json("check", "--hosts", ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
                          "--python", sys.executable, "--timeout", "5", *extra)


@pytest.mark.cluster
def test_col_alone_with_the_heads_port_dropped_is_not_a_pass(cluster):
    head = cluster.nodes[0]
    with cluster.dropped_port(head, 29500):
        doc, _ = check(cluster, "--only", "COL")
    assert doc["verdict"] == "fail", doc["results"]
    for r in doc["results"]:  # COL001 and COL002 could not run: an error that names NET004, which saw why
        assert r["status"] == "error" and "NET004" in r["message"] and "not selected" in r["message"], r
    with cluster.dropped_port(head, 29500):  # with NET004 selected, it fails and the COL skips point at it
        doc, _ = check(cluster, "--only", "COL,NET004")
    statuses = {(r["id"], r["status"]) for r in doc["results"]}
    assert ("NET004", "fail") in statuses and ("COL001", "skip") in statuses and ("COL002", "skip") in statuses


@pytest.mark.cluster
def test_net004_alone_with_the_port_taken_on_the_head_is_not_a_pass(cluster):
    head = cluster.nodes[0]
    holder = cluster.node_popen(head, [sys.executable, "-c", "import socket, time; s = socket.socket(); "  # as TCPStore binds: over a
                                       "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "  # TIME_WAIT
                                       "s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(60)"])
    try:
        for _ in range(50):
            if ":29500 " in cluster.netns_exec(head, ["ss", "-ltn"]).stdout:
                break
            import time
            time.sleep(0.1)
        doc, _ = check(cluster, "--only", "NET004")
    finally:
        os.killpg(holder.pid, 9)
        holder.wait()
    (r,) = doc["results"]
    assert r["status"] == "error" and "NET003" in r["message"], r


@pytest.mark.cluster
def test_an_unreached_node_is_not_a_pass_without_ssh001(cluster):
    down = cluster.nodes[2]
    with cluster.stopped_sshd(down):
        doc, _ = check(cluster, "--only", "CLK001,NET002")
        assert doc["verdict"] == "fail"
        for check_id in ("CLK001", "NET002"):
            r = results(doc, check_id)[down]
            assert r["status"] == "error" and "SSH001" in r["message"] and "refused" in r["message"], r
        doc, _ = check(cluster, "--only", "CLK")  # CLK002 (a node check) errs on it; CLK001 need not repeat it
        assert results(doc, "CLK002")[down]["status"] == "error"
        assert down not in results(doc, "CLK001")
        doc, _ = check(cluster, "--only", "SSH001,CLK")  # SSH001 says why: the others skip, as before
        assert results(doc, "SSH001")[down]["status"] == "fail"
        assert results(doc, "CLK002")[down]["status"] == "skip"
