"""CLK: clock offsets against the head (CLK001), the kernel's synchronisation state (CLK002) and absolute
offsets against an NTP server (CLK003), from recorded node facts and on the real test cluster (a faked clock,
a test NTP server)."""

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check, not_passing
from conftest import results
from node_facts import NODES, by_node, facts, run
from preflight.node import host
from preflight.plan import Limits, Plan
from preflight.result import Status


# --- the real test cluster -----------------------------------------------------------------------------------

@pytest.mark.cluster
def test_clock_sync_reports_what_the_kernel_says(cluster):
    doc, _ = check(cluster, "--only", "CLK002", skip=None)
    expected = "pass" if host.clock()["synchronised"] else "warn"
    assert {r["status"] for r in results(doc, "CLK002").values()} == {expected}


@pytest.mark.cluster
def test_a_clock_five_seconds_ahead_is_named(cluster):
    with cluster.faked_time("node02", "+5s"):
        doc, _ = check(cluster)
    clock = results(doc, "CLK001")
    assert clock["node02"]["status"] == "fail"
    assert 4.5 < clock["node02"]["evidence"]["offset_s"] < 5.5
    assert clock["node02"]["evidence"]["bound_s"] < 0.5
    assert clock["node03"]["status"] == "pass"
    assert [i for i, *_ in not_passing(doc)] == ["CLK001"]


@pytest.mark.cluster
def test_ntp_server_gives_absolute_offsets(cluster):
    with cluster.ntp_server("node03") as address:
        doc, _ = check(cluster, "--ntp-server", address)
        assert {r["status"] for r in results(doc, "CLK003").values()} == {"pass"}
        with cluster.faked_time("node02", "+5s"):
            doc, _ = check(cluster, "--ntp-server", address, "--only", "CLK003")
    ntp = results(doc, "CLK003")
    assert ntp["node02"]["status"] == "fail" and 4.5 < ntp["node02"]["evidence"]["offset_s"] < 5.5


# --- CLK001 and CLK002 over recorded facts -------------------------------------------------------------------

def test_clock_offsets_against_the_head():
    def ahead(seconds):
        def shift(state):
            state["clock"]["offset_s"] = seconds
        return shift

    results = by_node(run("CLK001", facts(n02=ahead(5.0), n03=ahead(0.25))))
    assert results["n02"].status == Status.FAIL and "+5.000 s" in results["n02"].message
    assert results["n02"].evidence["offset_s"] == pytest.approx(5.0)
    assert results["n02"].evidence["bound_s"] == pytest.approx(0.001)
    assert results["n03"].status == Status.WARN
    limits = Limits(clock_warn_s=0.5, clock_fail_s=10)
    results = by_node(run("CLK001", facts(n02=ahead(5.0), n03=ahead(0.25)), plan=Plan(nodes=NODES, remote=True,
                                                                                       limits=limits)))
    assert results["n02"].status == Status.WARN and results["n03"].status == Status.PASS


def test_unsynchronised_kernel_clock_warns():
    def unsync(state):
        state["facts"]["clock"]["synchronised"] = False

    results = by_node(run("CLK002", facts(n01=unsync)))
    assert results["n01"].status == Status.WARN and results["n02"].status == Status.PASS
