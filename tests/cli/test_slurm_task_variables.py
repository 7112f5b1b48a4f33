"""A launch's per-task SLURM variables ($SLURM_NODEID, $SLURM_PROCID, ...) as each node's task in the training
step will have them, under a real SLURM (tests/slurm_cluster.py): `preflight check --slurm` reaches the nodes
with one-node helper steps, where SLURM sets SLURM_NODEID=0 on every node; the launch plan must show the
training step's values instead."""
import json
import sys
from pathlib import Path

import pytest

from cluster import cluster, cluster_up  # noqa: F401
from slurm_cluster import slurm, slurm_up  # noqa: F401

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
PREFLIGHT = str(BIN / "preflight")


def check_launch(slurm, tmp_path, rank, *salloc):
    """`preflight check --slurm --only JOB -- accelerate launch --machine_rank RANK ...` in a 3-node allocation."""
    (tmp_path / "train.py").write_text("pass\n")
    proc = slurm.run(["salloc", "-N3", *salloc, PREFLIGHT, "check", "--slurm", "--python", sys.executable, "--json",
                      "--timeout", "20", "--only", "JOB", "--", str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_machines",
                      "3", "--num_processes", "3", "--machine_rank", rank, "--main_process_ip", "node01",
                      "--main_process_port", "29641", str(tmp_path / "train.py")], timeout=120, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def results(doc, check_id):
    return [(r["status"], r["nodes"], r["message"]) for r in doc["results"] if r["id"] == check_id]


def plan_ranks(doc):
    [plan] = [r for r in doc["results"] if r["id"] == "JOB001" and r["status"] == "pass"]
    return {row["node"]: row["machine_rank"] for row in plan["evidence"]["launch_plan"]}


def test_a_one_node_helper_step_has_slurm_nodeid_zero_on_every_node(slurm):
    # how preflight.remote.srun reaches a node: its session is not the training step's task there
    proc = slurm.run(["salloc", "-N3", "srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node03", "sh", "-c",
                      "echo $SLURMD_NODENAME $SLURM_NODEID $SLURM_NNODES"], timeout=60)
    assert proc.stdout.split() == ["node03", "0", "1"], proc.stdout


def test_slurm_nodeid_is_each_nodes_index_in_the_allocation(slurm, tmp_path):
    doc = check_launch(slurm, tmp_path, "$SLURM_NODEID")
    failing = [(r["id"], r["nodes"], r["message"]) for r in doc["results"] if r["status"] in ("fail", "error")]
    assert not failing, failing
    assert plan_ranks(doc) == {"node01": 0, "node02": 1, "node03": 2}
    assert [s for s, _, _ in results(doc, "JOB002")] == ["pass"]


def test_slurm_procid_is_each_nodes_rank_with_one_task_per_node(slurm, tmp_path):
    doc = check_launch(slurm, tmp_path, "${SLURM_PROCID}", "--ntasks-per-node=1")
    assert plan_ranks(doc) == {"node01": 0, "node02": 1, "node03": 2}
    assert [s for s, _, _ in results(doc, "JOB002")] == ["pass"]


def test_a_rank_typed_on_every_node_still_fails(slurm, tmp_path):
    doc = check_launch(slurm, tmp_path, "0")
    found = results(doc, "JOB002")
    assert any(status == "fail" and nodes == ["node01", "node02", "node03"] and "machine_rank 0 on 3 nodes" in message
               for status, nodes, message in found), found


def test_a_task_variable_with_two_tasks_per_node_is_said_not_known(slurm, tmp_path):
    doc = check_launch(slurm, tmp_path, "$SLURM_PROCID", "--ntasks-per-node=2")
    assert not [r for r in doc["results"] if r["status"] in ("fail", "error")], doc["results"]
    warned = [message for status, _, message in results(doc, "JOB001") if status == "warn"]
    assert warned and all("$SLURM_PROCID in the command is not known" in m for m in warned), warned
