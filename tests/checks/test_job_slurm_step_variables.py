"""A SLURM step variable in the launch command ($SLURM_NODEID, $SLURM_PROCID, ...) is, on each node, the value
its task in the job's srun step will have: not the value of the session that reads the node's facts (a one-node
helper step has SLURM_NODEID=0 on every node, an SSH session none). From the collector's own answers, made here
in such sessions."""
import os

import pytest

from preflight import registry, runner
from preflight.inputs import allocation
from preflight.job import view as jobview
from preflight.node import launchfiles
from preflight.plan import build_plan
from preflight.result import Status

NODES = ("node01", "node02", "node03")
ADDRESSES = {"node01": "10.0.0.1", "node02": "10.0.0.2", "node03": "10.0.0.3"}
# The batch step of `salloc -N3` (or sbatch --nodes=3): one task per node.
ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_JOB_NUM_NODES": "3",
              "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "1(x3)", "SLURM_NODEID": "0", "SLURM_PROCID": "0"}
TWO_EACH = dict(ALLOCATION, SLURM_TASKS_PER_NODE="2(x3)", SLURM_NTASKS="6", SLURM_NTASKS_PER_NODE="2")


def helper_step(node):
    """What SLURM sets in a one-node step on `node` (srun --nodes=1 --ntasks=1 -w NODE, preflight.remote.srun)."""
    return dict(ALLOCATION, SLURMD_NODENAME=node, SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
                SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1", SLURM_NODELIST=node, SLURM_TASKS_PER_NODE="1")


def command(rank, *rest):
    return ("accelerate", "launch", "--multi_gpu", "--num_machines", "3", "--num_processes", "3", "--machine_rank", rank,
            "--main_process_ip", ADDRESSES["node01"], "--main_process_port", "29500", "train.py", *rest)


def context(argv, head_env, session, monkeypatch, tmp_path, launching=False):
    """The JOB checks' context: the head in `head_env`, each node's facts read in session(node)'s environment."""
    plan = build_plan(nodes=NODES, command=argv, launching=launching)
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    request = jobview.request(plan, head_env)
    facts = {}
    for node in NODES:
        with monkeypatch.context() as m:
            m.setattr(os, "environ", dict(session(node), HF_HOME=str(tmp_path), PATH=os.environ["PATH"]))
            job = launchfiles.facts(request)
        host = {"interfaces": {"lo": ["127.0.0.1"], "eth0": [ADDRESSES[node]]}}
        facts[node] = {"facts": {"job": job, "host": host, "env": {}, "gpus": {"available": False}}, "error": None,
                       "clock": None}
    probes = {"job": jobview.launches(plan, facts, ADDRESSES["node01"], head_env),
              "head": {"address": ADDRESSES["node01"]}}
    return runner.CheckContext(plan, facts, probes)


def run(check_id, ctx):
    return runner.run_check(registry.load().get(check_id), ctx)


def ranks(ctx):
    return {node: view["machine_rank"] for node, view in ctx.probes["job"]["nodes"].items()}


@pytest.mark.parametrize("rank", ["$SLURM_NODEID", "${SLURM_PROCID}"])
def test_each_nodes_rank_is_its_tasks_in_the_allocations_step(rank, monkeypatch, tmp_path):
    ctx = context(command(rank), ALLOCATION, helper_step, monkeypatch, tmp_path)
    assert ranks(ctx) == {"node01": 0, "node02": 1, "node03": 2}
    for check_id in ("JOB001", "JOB002", "JOB003", "JOB004"):
        assert {r.status for r in run(check_id, ctx)} == {Status.PASS}, (check_id, run(check_id, ctx))


def test_over_ssh_from_the_allocation_the_steps_values_are_filled_in(monkeypatch, tmp_path):
    ssh_session = lambda node: {}  # noqa: E731: no SLURM_* in an SSH session on the node
    ctx = context(command("$SLURM_NODEID", "--nodes", "$SLURM_NNODES"), ALLOCATION, ssh_session, monkeypatch,
                  tmp_path)
    assert ranks(ctx) == {"node01": 0, "node02": 1, "node03": 2}
    assert {r.status for r in run("JOB001", ctx)} == {Status.PASS}
    assert ctx.probes["job"]["nodes"]["node02"]["script"] == "train.py"


def test_the_gate_over_ssh_gives_torchrun_each_nodes_own_step_value(monkeypatch, tmp_path):
    # `preflight launch --slurm -- torchrun --node_rank $SLURM_NODEID ...`: the gate reaches the nodes over SSH
    torchrun = ("torchrun", "--nnodes", "3", "--nproc_per_node", "1", "--node_rank", "$SLURM_NODEID", "--master_addr",
                ADDRESSES["node01"], "--master_port", "29500", "train.py")
    ctx = context(torchrun, ALLOCATION, lambda node: {}, monkeypatch, tmp_path, launching=True)
    assert ranks(ctx) == {"node01": 0, "node02": 1, "node03": 2}
    for check_id in ("JOB001", "JOB002", "JOB003"):
        assert {r.status for r in run(check_id, ctx)} == {Status.PASS}, (check_id, run(check_id, ctx))


def test_the_gate_sets_accelerates_ranks_itself(monkeypatch, tmp_path):
    ctx = context(command("$SLURM_PROCID"), ALLOCATION, lambda node: {}, monkeypatch, tmp_path, launching=True)
    assert ranks(ctx) == {"node01": 0, "node02": 1, "node03": 2}  # preflight.gate.launcher's --machine_rank


def test_a_rank_typed_on_every_node_still_fails(monkeypatch, tmp_path):
    ctx = context(command("0"), ALLOCATION, helper_step, monkeypatch, tmp_path)
    [twice] = [r for r in run("JOB002", ctx) if r.status == Status.FAIL and "machine_rank 0 on 3 nodes" in r.message]
    assert set(twice.nodes) == set(NODES)


def test_a_task_variable_with_several_tasks_per_node_is_said_not_known(monkeypatch, tmp_path):
    ctx = context(command("$SLURM_PROCID"), TWO_EACH, helper_step, monkeypatch, tmp_path)
    job001 = run("JOB001", ctx)
    assert {r.status for r in job001} == {Status.WARN, Status.PASS}, job001
    assert all("$SLURM_PROCID in the command is not known: it depends on which of the node's tasks" in r.message
               for r in job001 if r.status == Status.WARN)
    for check_id in ("JOB002", "JOB003"):  # through the runner: a skip JOB001 does not fail is not an error
        found = runner.run([registry.load().get(check_id)], ctx)
        assert [r.status for r in found] == [Status.SKIP] and "not known" in found[0].message, found
    # the node's index does not depend on its tasks
    assert ranks(context(command("$SLURM_NODEID"), TWO_EACH, helper_step, monkeypatch, tmp_path)) == \
        {"node01": 0, "node02": 1, "node03": 2}


def test_outside_an_allocation_each_session_expands_its_own(monkeypatch, tmp_path):
    own = lambda node: {"RANK_OF_NODE": str(NODES.index(node)), "SLURM_NODEID": str(NODES.index(node))}  # noqa: E731
    ctx = context(command("$SLURM_NODEID"), {}, own, monkeypatch, tmp_path)
    assert ranks(ctx) == {"node01": 0, "node02": 1, "node03": 2}
    assert jobview.request(ctx.plan, {})["keep"] == []


def test_step_variables_follow_slurms_node_order_and_task_layout():
    alloc = allocation.read({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[09-10],cpu01",
                             "SLURM_TASKS_PER_NODE": "1(x3)"})
    assert allocation.step_variables(alloc, "cpu01") == {
        "SLURM_NODEID": "2", "SLURMD_NODENAME": "cpu01", "SLURM_STEP_NUM_NODES": "3", "SLURM_NNODES": "3",
        "SLURM_STEP_NODELIST": "gpu[09-10],cpu01", "SLURM_NODELIST": "gpu[09-10],cpu01", "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0", "SLURM_GTIDS": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3",
        "SLURM_NPROCS": "3", "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_TASKS_PER_NODE": "1(x3)"}
    assert allocation.step_variables(alloc, "elsewhere") == {}
    two = allocation.step_variables(allocation.read(TWO_EACH), "node02")
    assert two["SLURM_NODEID"] == "1" and two["SLURM_PROCID"] is None and two["SLURM_LOCALID"] is None


def test_the_collector_leaves_the_kept_names_as_written(monkeypatch):
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("OTHER_VALUE", "x")
    job = {"argv": ["--machine_rank", "$SLURM_NODEID", "${OTHER_VALUE}/$SLURM_NODEID"], "expand": True,
           "keep": ["SLURM_NODEID"], "default_config": False}
    assert launchfiles.facts(job)["argv"] == ["--machine_rank", "$SLURM_NODEID", "x/$SLURM_NODEID"]
    assert launchfiles.facts(dict(job, keep=[]))["argv"] == ["--machine_rank", "0", "x/0"]


@pytest.mark.parametrize("text", ["$HOME/x", "${HOME}y", "$NOPE ${NOPE}", "${", "$", "a$$b", "${HOME", "$HOME$HOME"])
def test_the_collectors_expansion_is_os_path_expandvars(text):
    assert launchfiles.expand(text, os.environ) == os.path.expandvars(text)
