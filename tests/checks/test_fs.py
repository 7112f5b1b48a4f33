"""FS: /dev/shm, the checkpoint and offload folders, disks and the shared filesystem, from recorded node facts
and on the real test cluster."""
import json
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check
from conftest import results, run_cli
from node_facts import SPECS, by_node, facts, run, NODES
from preflight import runner
from preflight.plan import Plan
from preflight.result import Status


@pytest.mark.parametrize("size,status", [(64 * 2**20, Status.FAIL), (768 * 2**20, Status.WARN),
                                         (2 * 2**30, Status.PASS)])
# --- FS001 and FS002 over recorded facts ---------------------------------------------------------------------

def test_dev_shm_size(size, status):
    def shm(state):
        state["facts"]["storage"]["shm"].update(total_bytes=size, free_bytes=size)

    assert by_node(run("FS001", facts(n02=shm)))["n02"].status == status


def test_checkpoint_dir_missing_or_read_only_fails():
    def missing(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": False}

    def read_only(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": True, "writable": False,
                                                       "free_bytes": 2**40, "total_bytes": 2**40}

    def fine(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": True, "writable": True,
                                                       "free_bytes": 2**40, "total_bytes": 2**40}

    plan = Plan(nodes=NODES, remote=True, checkpoint_dir="/ckpt")
    results = by_node(run("FS002", facts(n01=fine, n02=missing, n03=read_only), plan=plan))
    assert [results[n].status for n in NODES] == [Status.PASS, Status.FAIL, Status.FAIL]


# --- the real test cluster -----------------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_small_dev_shm_fails(cluster):
    with cluster.small_shm_fault("node02", "64m"):
        doc, _ = check(cluster)
    shm = results(doc, "FS001")
    assert shm["node02"]["status"] == "fail" and "64 MiB" in shm["node02"]["message"]
    assert shm["node01"]["status"] == "pass"


@pytest.mark.cluster
def test_shared_dir_seen_by_every_node_and_one_that_is_not(cluster, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    doc, _ = check(cluster, "--shared-dir", shared, "--only", "FS004")
    assert set(results(doc, "FS004")) == set(cluster.nodes) and doc["verdict"] == "pass"
    # node03 gets its own empty tmpfs over the folder, in its own mount namespace: not shared any more.
    mount = ["nsenter", "--target", str(cluster.sshd_pid("node03")), "--mount"]
    subprocess.run(mount + ["mount", "-t", "tmpfs", "tmpfs", str(shared)], check=True, timeout=30)
    try:
        doc, _ = check(cluster, "--shared-dir", shared, "--only", "FS004")
    finally:
        subprocess.run(mount + ["umount", str(shared)], check=True, timeout=30)
    shared_results = results(doc, "FS004")
    assert shared_results["node03"]["status"] == "fail" and shared_results["node02"]["status"] == "pass"
    assert list(shared.iterdir()) == []  # the token is removed


@pytest.mark.cluster
def test_relative_folders_are_read_from_the_jobs_working_directory_on_every_node(cluster, tmp_path):
    import uuid

    run_dir = tmp_path / "run"
    names = {what: f"{what}-{uuid.uuid4().hex[:8]}" for what in ("ckpt", "shared", "nvme")}
    for name in names.values():  # nowhere but in the job's directory (not in the sessions' home)
        (run_dir / name).mkdir(parents=True)
    (run_dir / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": names["nvme"]}}}))
    proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                           str(cluster.ssh_config), "--python", sys.executable, "--timeout", "10",
                           "--checkpoint-dir", names["ckpt"], "--shared-dir", names["shared"], "--deepspeed", "ds.json",
                           "--only", "FS002,FS003,FS004", "--json"], cwd=run_dir, capture_output=True, text=True,
                          timeout=120)
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "pass", doc["results"]
    for check_id, name in (("FS002", "ckpt"), ("FS003", "nvme")):
        by_node = results(doc, check_id)
        assert set(by_node) == set(cluster.nodes)
        for r in by_node.values():
            assert r["status"] == "pass" and r["evidence"]["path"] == str(run_dir / names[name]), r
    assert results(doc, "FS004")[cluster.nodes[1]]["message"] == f"{run_dir / names['shared']} is shared"
    assert list((run_dir / names["shared"]).iterdir()) == []


# --- FS003 on this machine: the real collector reads the real folders -----------------------------------------

def test_offload_paths_that_are_missing_fail_and_those_that_are_writable_pass(tmp_path, capsys):
    swap = tmp_path / "nvme"
    swap.mkdir()
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "no-such-drive")},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}}}))
    code, doc, _ = run_cli(capsys, "node", "--deepspeed", ds, "--only", "FS003", "--json")
    found = {r["evidence"]["path"]: r for r in doc["results"]}
    assert code == 1 and set(found) == {str(tmp_path / "no-such-drive"), str(swap)}, doc["results"]
    missing = found[str(tmp_path / "no-such-drive")]
    assert missing["status"] == "fail" and "offload_param.nvme_path" in missing["message"], missing
    assert missing["message"].endswith("does not exist") and "create" in missing["remediation"]
    assert found[str(swap)]["status"] == "pass" and "writable" in found[str(swap)]["message"]


@pytest.mark.parametrize("total,free,status,said", [
    (16 * 2**30, 160 * 2**20, Status.FAIL, "/dev/shm has 160 MiB free of 16.0 GiB, expected at least 512 MiB free"),
    (16 * 2**30, 700 * 2**20, Status.WARN, "/dev/shm has 700 MiB free of 16.0 GiB, under the recommended 1.0 GiB free"),
    (16 * 2**30, 15 * 2**30, Status.PASS, "/dev/shm is 16.0 GiB (15.0 GiB free)"),
    (64 * 2**20, 0, Status.FAIL, "/dev/shm is 64 MiB, expected at least 512 MiB"),  # too small: its size says it
])
def test_dev_shm_free_space_is_judged_beside_its_size(total, free, status, said):
    def shm(state):
        state["facts"]["storage"]["shm"].update(total_bytes=total, free_bytes=free)

    result = by_node(run("FS001", facts(n02=shm)))["n02"]
    assert result.status == status and result.message.startswith(said), result.message
    assert result.evidence == {"total_bytes": total, "free_bytes": free}
    if status is Status.FAIL and free:
        assert "ls -la /dev/shm" in result.remediation


@pytest.mark.cluster
def test_a_large_dev_shm_that_is_nearly_full_fails(cluster):
    """A 1.2 GiB /dev/shm (over the 1 GiB that passes by size) holding a 1.1 GiB file left behind: 100 MiB free."""
    node = "node02"
    with cluster.small_shm_fault(node, "1200m"):
        fill = cluster.node_popen(node, ["fallocate", "-l", "1100M", "/dev/shm/left-behind"])
        assert fill.wait(60) == 0
        try:
            doc, _ = check(cluster, "--only", "FS001")
        finally:
            assert cluster.node_popen(node, ["rm", "-f", "/dev/shm/left-behind"]).wait(60) == 0
        emptied, _ = check(cluster, "--only", "FS001")
    shm = results(doc, "FS001")
    assert shm[node]["status"] == "fail", shm[node]
    assert shm[node]["message"].startswith("/dev/shm has 100 MiB free of 1.2 GiB"), shm[node]
    assert shm[node]["evidence"]["total_bytes"] == 1200 * 2**20
    assert shm["node01"]["status"] == "pass" and shm["node03"]["status"] == "pass"
    assert results(emptied, "FS001")[node]["status"] == "pass"  # the same /dev/shm, emptied


HOSTILE = ({}, [], None, "x", float("inf"), float("nan"), -1, 0, 2**63, 2**200, True, [{}], {"x": {}})


def test_hostile_storage_values_are_refused_or_judged_never_a_check_defect():
    """Each field of /dev/shm's and the checkpoint folder's entries replaced by each hostile value: the shapes
    refuse it (that node's failed section), or FS001 and FS002 judge it without raising."""
    from preflight.remote import gather, shapes

    entry = {"path": "/ckpt", "exists": True, "writable": True, "free_bytes": 2**40, "total_bytes": 2**40}
    plan = Plan(nodes=NODES, remote=True, checkpoint_dir="/ckpt")
    judged, defects = 0, []
    for name in ("shm", "checkpoint_dir"):
        for key in ("path", "exists", "total_bytes", "free_bytes", "writable"):
            for value in HOSTILE:
                def change(state):
                    storage = state["facts"]["storage"]
                    storage["checkpoint_dir"] = dict(entry)
                    storage[name] = dict(storage[name], **{key: value})
                    if shapes.problem(storage, shapes.SECTIONS["storage"], "storage") is not None:
                        state["facts"] = gather.checked_facts(state["facts"])  # as it arrives: refused

                states = facts(n02=change)
                judged += not isinstance(states["n02"]["facts"]["storage"].get("error"), str)
                for check_id in ("FS001", "FS002"):
                    for r in runner.run([SPECS[check_id]], runner.CheckContext(plan, states, {})):
                        if "raised" in r.message or r.nodes != ("n02",) and r.status is not Status.PASS:
                            defects.append((name, key, value, r.id, r.nodes, r.message))
    assert not defects, defects[:5]
    assert judged >= 20


def test_without_a_deepspeed_config_the_offload_check_says_none_was_given():
    from preflight import registry, runner
    from preflight.plan import build_plan

    plan = build_plan(nodes=("n1",))
    ctx = runner.CheckContext(plan, {"n1": {"facts": {"host": {}, "storage": {}}, "error": None}}, {})
    [result] = runner.run_check(registry.load().get("FS003"), ctx)
    assert result.status.value == "skip" and result.message.startswith("no DeepSpeed config given"), result
