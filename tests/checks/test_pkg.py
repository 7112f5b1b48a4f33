"""PKG: software and environment consistency across nodes: versions by majority (PKG001), other
distributions (PKG002), the interpreter and working folder (PKG003), environment differences by meaning
(PKG004), from recorded node facts and on the real test cluster (a shadowed package, a missing interpreter);
the driver stack (an NCCL net plugin PKG006, torch's CUDA build against the driver PKG007, known-bad versions
PKG008) over recorded fabric trees. PKG003 and old interpreters: test_pkg_interpreter.py; pins (PKG005):
engine/test_profile.py."""
import copy
import json
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check
from conftest import results
from fabric_nodes import recorded_nodes, run_on
from node_facts import BASE, NODES, by_node, env, facts, linked_facts, run
from preflight.node import collector, gpus as gpu_facts
from preflight.result import Status
from sysfs_tree import fabric_facts

# --- PKG001-004 over recorded facts -------------------------------------------------------------------

def test_the_odd_version_is_named_by_majority():
    def old(state):
        state["facts"]["packages"]["versions"]["accelerate"] = "0.34.2"

    results = [r for r in run("PKG001", facts(n03=old)) if r.status == Status.FAIL]
    assert len(results) == 1 and results[0].nodes == ("n03",)
    assert "0.34.2" in results[0].message and BASE["packages"]["versions"]["accelerate"] in results[0].message


def test_other_distributions_that_differ_warn():
    def extra(state):
        state["facts"]["packages"]["distributions"]["flash-attn"] = "2.5.0"

    results = by_node(run("PKG002", facts(n02=extra)))
    assert results["n02"].status == Status.WARN and "flash-attn" in results["n02"].message


def test_missing_interpreter_and_workdir_fail():
    def no_python(state):
        state.update(facts=None, error={"kind": "python-missing", "message": "the interpreter /opt/py does not exist",
                                        "remediation": "pass --python"})

    def no_workdir(state):
        state["facts"]["storage"]["workdir"] = {"path": "/home/me/job", "exists": False}

    results = by_node(run("PKG003", facts(n02=no_python, n03=no_workdir)))
    assert results["n02"].status == Status.FAIL and "/opt/py" in results["n02"].message
    assert results["n03"].status == Status.FAIL and "/home/me/job" in results["n03"].message
    assert results["n01"].status == Status.PASS


def test_environment_differences():
    def nccl(state):
        state["facts"]["env"]["NCCL_IB_DISABLE"] = "1"

    def omp(state):
        state["facts"]["env"]["OMP_NUM_THREADS"] = "4"

    results = run("PKG004", facts(n02=nccl, n03=omp))
    statuses = {(r.nodes, r.status) for r in results}
    assert (("n02",), Status.FAIL) in statuses and (("n03",), Status.WARN) in statuses



# --- PKG004: per-node variables are not compared by text ----------------------------------------------

def test_per_node_variables_that_differ_do_not_fail_the_environment_check():
    states = linked_facts(n01=env(NCCL_SOCKET_IFNAME="=eth0", NCCL_IB_HCA="mlx5_0:1", NCCL_IB_GID_INDEX="3",
                           NCCL_TOPO_FILE="/etc/nccl/n01.xml", NCCL_DEBUG_FILE="/tmp/nccl.%h.%p"),
                   n02=env(NCCL_SOCKET_IFNAME="=ens5", NCCL_IB_HCA="mlx5_2:1", NCCL_IB_GID_INDEX="0",
                           GLOO_SOCKET_IFNAME="ens5", NCCL_TOPO_FILE="/etc/nccl/n02.xml"),
                   n03=env(NCCL_SOCKET_IFNAME="eth", CUDA_VISIBLE_DEVICES="4,5"))
    found = run("PKG004", states)
    assert [r.status for r in found] == [Status.PASS], [(r.status, r.message) for r in found]
    [ok] = found
    assert set(ok.nodes) == set(NODES)
    assert "GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_SOCKET_IFNAME checked by meaning in NET005" in ok.message
    assert "CUDA_VISIBLE_DEVICES checked by meaning in GPU001" in ok.message
    assert "NCCL_DEBUG_FILE, NCCL_IB_GID_INDEX, NCCL_TOPO_FILE may differ per node" in ok.message
    assert ok.evidence["by_meaning"]["NCCL_SOCKET_IFNAME"] == "NET005"
    assert ok.evidence["by_meaning"]["NCCL_IB_GID_INDEX"] is None


def test_other_nccl_variables_that_differ_still_fail_beside_the_per_node_ones():
    states = linked_facts(n02=env(NCCL_SOCKET_IFNAME="ens5", NCCL_IB_DISABLE="1"))
    found = by_node(run("PKG004", states))
    assert found["n02"].status == Status.FAIL and found["n02"].evidence["variable"] == "NCCL_IB_DISABLE"
    assert "NCCL_SOCKET_IFNAME" not in found["n02"].message
    assert found["n01"].status == Status.PASS
    assert "NCCL_SOCKET_IFNAME checked by meaning in NET005" in found["n01"].message


def test_cuda_visible_devices_may_differ_and_gpu001_checks_what_each_names():
    from nvml_fake import fake  # the recorded 8 x H100 of tests/fixtures/nvml
    from unittest import mock

    with mock.patch.object(gpu_facts, "Nvml", fake("h100x8.json")):
        gpus = json.loads(json.dumps(gpu_facts.facts()))

    def with_gpus(visible):
        def change(state):
            state["facts"]["gpus"] = copy.deepcopy(gpus)
            state["facts"]["env"]["CUDA_VISIBLE_DEVICES"] = visible
        return change

    states = linked_facts(n01=with_gpus("0,1"), n02=with_gpus("4,5"), n03=with_gpus("0,9"))
    assert [r.status for r in run("PKG004", states)] == [Status.PASS]
    gpu = by_node(run("GPU001", states))
    assert gpu["n03"].status == Status.FAIL and "'9'" in gpu["n03"].message
    assert gpu["n01"].status == Status.PASS and gpu["n02"].status == Status.PASS


# --- the driver stack (PKG006-008) over recorded fabric trees -------------------------------------------

def test_an_nccl_net_plugin_on_one_node_only(tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "libnccl-net.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    states = recorded_nodes(tmp_path, "ib-node")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(plugins))
    states["n02"]["facts"]["fabric"] = fabric_facts(tmp_path / "n02b", "ib-node")
    results = run_on("PKG006", states, tmp_path)
    warned = [r for r in results if r.status == Status.WARN]
    assert [r.nodes for r in warned] == [("n02",)] and "libnccl-net.so (64 bytes)" in warned[0].message


@pytest.mark.parametrize("build,status", [("13.0", Status.FAIL), ("12.8", Status.WARN), ("12.4", Status.PASS),
                                          ("11.8", Status.PASS)])
def test_torch_cuda_build_against_the_driver(tmp_path, build, status):
    states = recorded_nodes(tmp_path, "ib-node", versions={"cuda": build})  # h100x8: the driver runs CUDA 12.4
    results = run_on("PKG007", states, tmp_path)
    assert {r.status for r in results} == {status}, [r.message for r in results]


def test_cuda_forward_compatibility_turns_the_refusal_into_a_warning(tmp_path, monkeypatch):
    compat = tmp_path / "cuda-13.0" / "compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.580.65.06").write_bytes(b"\x7fELF")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(compat))
    states = recorded_nodes(tmp_path, "ib-node", versions={"cuda": "13.0"})
    results = run_on("PKG007", states, tmp_path)
    assert {r.status for r in results} == {Status.WARN} and "forward compatibility" in results[0].message


def test_known_bad_versions(tmp_path):
    states = recorded_nodes(tmp_path, "ib-node", versions={"nccl": "2.25.1", "torch": "2.7.1+cu126"},
                            env={"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"})
    results = run_on("PKG008", states, tmp_path)
    named = [(r.nodes, r.evidence["defect"]) for r in results if r.status is Status.WARN]
    assert sorted(named) == sorted((node, defect) for node in (("n01",), ("n02",)) for defect in (
        "nccl-2.25.1-abort-hang", "nccl-nonblocking-comm-create-race", "torch-nonblocking-watchdog-thread-safety"))
    assert any("https://github.com/pytorch/pytorch/issues/169484" in r.message for r in results)
    workaround = recorded_nodes(tmp_path / "w", "ib-node", versions={"nccl": "2.19.3"},
                                env={"NCCL_CUMEM_ENABLE": "0"})
    found = run_on("PKG008", workaround, tmp_path)
    assert {r.status for r in found} == {Status.PASS}
    assert any("nccl-2.19-cumem-alltoall-deadlock is worked around: NCCL_CUMEM_ENABLE=0" in r.message for r in found)


# --- the real test cluster -----------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_shadowed_accelerate_is_the_odd_one_out(cluster):
    with cluster.shadowed_package("node03", "accelerate", "0.20.0"):
        doc, _ = check(cluster)
    [odd] = [r for r in doc["results"] if r["id"] == "PKG001" and r["status"] == "fail"]
    assert odd["nodes"] == ["node03"]
    assert "0.20.0" in odd["message"] and collector.collect({})["packages"]["versions"]["accelerate"] in odd["message"]


@pytest.mark.cluster
def test_a_missing_interpreter_names_node_and_path_and_runs_nothing_else(cluster, tmp_path):
    marker = tmp_path / "pwned"
    hostile = f"/nonexistent/python3; touch {marker}"
    args = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
            str(cluster.ssh_config), "--python", hostile, "--json", "--only", "PKG003"]
    doc = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120).stdout)
    interp = results(doc, "PKG003")
    assert {r["status"] for r in interp.values()} == {"fail"} and set(interp) == set(cluster.nodes)
    assert "/nonexistent/python3" in interp["node02"]["message"]
    assert not marker.exists()
