"""CFG075 (checks/config/allocation.py): the launch against the SLURM allocation it runs in, as SLURM reports it
(preflight.inputs.allocation reads SLURM_* and `scontrol show job`). The environments are as SLURM 22.05 sets them
in the batch step (tests/fixtures/slurm_allocation: recorded on the test cluster's slurmctld/slurmd; sbatch(1)'s
own example `2(x3),1`); the real allocation is in tests/cli/test_slurm.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_cli
from preflight import registry, runner
from preflight.inputs import allocation, batchscript
from preflight.plan import build_plan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "slurm_allocation"


def env(nodelist="node[01-02]", tasks="1(x2)", **more):
    nodes = len(allocation.counts(tasks) or [])
    found = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(nodes),
             "SLURM_NNODES": str(nodes), "SLURM_TASKS_PER_NODE": tasks}  # SLURM_NTASKS: with -n, --ntasks-per-node
    found.update({k: str(v) for k, v in more.items()})
    return found


def judge(tmp_path, alloc_env, body=None, command=(), scontrol=None, directives="#SBATCH --nodes=2\n", facts=None,
          config=None):
    """CFG075's results, through the runner: the batch script `body` (or the command after `--`) in the
    allocation of alloc_env (None: outside one)."""
    batch = None
    if body is not None:
        batch = batchscript.parse(str(tmp_path / "job.sh"), "#!/bin/bash\n" + directives + body, {})
        command = tuple(batch.main.command.argv) if batch.main else ()
    plan = build_plan(command=tuple(command), batch=batch, config=config)
    alloc = allocation.read(alloc_env, scontrol) if alloc_env is not None else None
    ctx = runner.CheckContext(plan, facts or {}, {"allocation": alloc})
    spec = registry.load().get("CFG075")
    return [(r.status.value, r.message) for r in runner.run([spec], ctx)]


def statuses(results):
    return [s for s, _ in results]


RANKED = "srun bash -c 'accelerate launch --num_machines 2 --num_processes 8 --machine_rank $SLURM_NODEID " \
         "--main_process_ip {head} --main_process_port 29500 train.py'\n"


# ---- what SLURM writes -------------------------------------------------------------------------------------------

def test_tasks_per_node_are_read_in_slurms_repeat_syntax():
    assert allocation.counts("2(x3),1") == [2, 2, 2, 1]  # sbatch(1)'s example
    assert allocation.counts("8") == [8]
    assert allocation.counts("2(x3),x") is None and allocation.counts("") is None
    assert allocation.fold_counts([2, 2, 2, 1]) == "2(x3),1"


def recorded(name):
    """A batch step's environment and `scontrol show job` recorded on the test cluster (fixtures' README)."""
    lines = (FIXTURES / f"{name}.env").read_text().splitlines()
    found = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return found, (FIXTURES / f"{name}.scontrol").read_text()


def test_gpus_per_node_come_from_scontrols_gres_of_each_node():
    alloc = allocation.read(*recorded("tasks_per_node_2_gpus_per_node_2"))
    assert alloc.gpus == (2, 2) and "scontrol" in alloc.gpus_from
    assert alloc.batch_host == "node01" and alloc.tasks == (2, 2) and alloc.ntasks == 4
    gres = allocation.read(*recorded("nodelist_node03_node01_gres_gpu_1"))  # --gres=gpu:1: no SLURM_GPUS_PER_NODE
    assert gres.nodes == ("node01", "node03") and gres.gpus == (1, 1)
    assert allocation.read(*recorded("ntasks_5_on_3_nodes")).gpus == ()  # `GRES=` on every node: none


def test_gpus_per_node_from_the_variables_when_scontrol_says_nothing():
    environ, _ = recorded("tasks_per_node_2_gpus_per_node_2")
    alloc = allocation.read(environ)
    assert alloc.gpus == (2, 2) and alloc.gpus_from == "SLURM_GPUS_PER_NODE=2"
    assert allocation.read(env(SLURM_GPUS_PER_NODE="a100:4")).gpus == (4, 4)
    environ, _ = recorded("nodelist_node03_node01_gres_gpu_1")
    first_only = allocation.read(environ)  # the batch step's own GPUs, on the first node alone: not assumed elsewhere
    assert first_only.gpus == () and "only the first node's GPUs" in first_only.gpus_from
    assert allocation.read(env()).gpus == ()


def test_an_srun_step_takes_the_jobs_task_count_as_srun_does():
    three = allocation.read(*recorded("ntasks_5_on_3_nodes"))
    assert allocation.step_layout(three, {}).tasks == (2, 2, 1)
    # SLURM_NTASKS=5 is srun's -n: --ntasks-per-node=1 does not match it and srun ignores it (fixtures' README)
    ignored = allocation.step_layout(three, {"ntasks-per-node": "1"})
    assert ignored.tasks == (2, 2, 1) and "--ntasks-per-node=1 ignored" in ignored.source
    helper = allocation.step_layout(three, {"nodes": "1", "ntasks": "1"})
    assert helper.nodes == ("node01",) and helper.tasks == (1,)
    two = allocation.read(*recorded("tasks_per_node_2_gpus_per_node_2"))
    assert allocation.step_layout(two, {"ntasks-per-node": "1"}).tasks == (2, 2)
    assert allocation.step_layout(two, {"ntasks": "2", "ntasks-per-node": "1"}).tasks == (1, 1)
    untold = allocation.read(*recorded("nodelist_node03_node01_gres_gpu_1"))  # no SLURM_NTASKS: the option holds
    assert allocation.step_layout(untold, {"ntasks-per-node": "2"}).tasks == (2, 2)
    assert allocation.step_layout(three, {"nodelist": "node03"}) is None  # said not read, never guessed
    assert allocation.step_layout(three, None).tasks == (1,)  # the batch step itself: one, on the first node


def test_outside_an_allocation_it_is_skipped(tmp_path):
    assert statuses(judge(tmp_path, None, "srun accelerate launch train.py\n")) == ["skip"]


# ---- launchers per node ------------------------------------------------------------------------------------------

def test_eight_tasks_per_node_start_eight_launchers_on_every_node(tmp_path):
    # The script says one task per node; `sbatch --ntasks-per-node=8` on the command line gave the job eight.
    eight = env(tasks="8(x2)", SLURM_NTASKS=16, SLURM_NTASKS_PER_NODE=8)
    results = judge(tmp_path, eight, RANKED.format(head="node01"),
                    directives="#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n")
    [(status, message)] = [r for r in results if r[0] == "fail"]
    assert "srun starts 8(x2) tasks on node[01-02]" in message and "SLURM_NTASKS_PER_NODE=8" in message


def test_srun_ntasks_per_node_1_under_the_jobs_task_count_still_starts_two_launchers(tmp_path):
    environ, text = recorded("tasks_per_node_2_gpus_per_node_2")
    body = RANKED.format(head="node01").replace("srun bash", "srun --ntasks-per-node=1 bash")
    results = judge(tmp_path, environ, body.replace("--num_processes 8", "--num_processes 4"), scontrol=text)
    (status, message), (_, gpus) = results  # and two launchers of 2 processes each on the 2 GPUs of a node
    assert status == "fail" and "srun starts 2(x2) tasks on node[01-02]" in message, results
    assert "--ntasks-per-node=1 ignored" in message and "starts 4 processes on node[01-02]" in gpus
    healthy = body.replace("--ntasks-per-node=1", "--ntasks=$SLURM_NNODES --ntasks-per-node=1")  # as the fix says
    results = judge(tmp_path, environ, healthy.replace("--num_processes 8", "--num_processes 4"), scontrol=text)
    assert statuses(results) == ["pass"], results


def test_the_command_after_the_dashes_is_read_with_its_srun_options(tmp_path):
    results = judge(tmp_path, env(), command=["srun", "--ntasks-per-node=2", "accelerate", "launch", "train.py"])
    assert statuses(results) == ["fail"] and "srun --ntasks-per-node=2" in results[0][1]
    healthy = judge(tmp_path, env(), command=["srun", "--ntasks-per-node=1", "accelerate", "launch", "train.py"])
    assert statuses(healthy) == ["pass"], healthy


def test_heterogeneous_tasks_with_srun_as_the_launcher_are_clean(tmp_path):
    # `#SBATCH --ntasks=5` over 3 nodes: SLURM_TASKS_PER_NODE=2(x2),1, one rank per task
    results = judge(tmp_path, env("node[01-03]", "2(x2),1", SLURM_NTASKS=5), "srun python train.py\n",
                    directives="#SBATCH --nodes=3\n#SBATCH --ntasks=5\n")
    assert statuses(results) == ["pass"], results
    assert "2(x2),1 task(s) per node" in results[0][1]


def test_heterogeneous_tasks_with_one_launcher_per_node_are_clean(tmp_path):
    # The job's SLURM_NTASKS=5 is srun's -n: one launcher per node needs a task count that says so. The directives
    # do not name the nodes (the reader takes one): $SLURM_NNODES is the allocation's 3 when the step runs.
    launch = "torchrun --nnodes=$SLURM_NNODES --rdzv_backend c10d --rdzv_endpoint node01:29500 train.py\n"
    alloc = env("node[01-03]", "2(x2),1", SLURM_NTASKS=5)
    results = judge(tmp_path, alloc, "srun -n $SLURM_NNODES --ntasks-per-node=1 " + launch,
                    directives="#SBATCH --ntasks=5\n")
    assert statuses(results) == ["pass"], results
    assert "3 node(s), 1(x3) task(s) per node" in results[0][1]
    crowded = judge(tmp_path, alloc, "srun --ntasks-per-node=1 " + launch, directives="#SBATCH --ntasks=5\n")
    assert statuses(crowded) == ["fail"] and "2(x2) tasks on node[01-02]" in crowded[0][1]


def test_a_helper_step_that_fetches_the_heads_address_is_not_the_launch(tmp_path):
    body = ("export MASTER=$(srun --nodes=1 --ntasks=1 hostname)\nsrun --nodes=1 --ntasks=1 nvidia-smi -L\n"
            + RANKED.format(head="$MASTER"))
    results = judge(tmp_path, env(SLURM_GPUS_PER_NODE=4), body)
    assert statuses(results) == ["pass"], results
    assert "computed at run time" in results[0][1]


# ---- GPUs per node, nodes ----------------------------------------------------------------------------------------

def test_one_task_per_node_with_gpus_per_node_is_clean(tmp_path):
    results = judge(tmp_path, env(SLURM_NTASKS_PER_NODE=1, SLURM_GPUS_PER_NODE=4), RANKED.format(head="node01"),
                    directives="#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n")
    assert statuses(results) == ["pass"], results
    assert "4(x2) GPUs per node (SLURM_GPUS_PER_NODE=4)" in results[0][1]


def test_more_processes_than_the_allocations_gpus_fail(tmp_path):
    environ, text = recorded("tasks_per_node_1_gpus_per_node_1")
    results = judge(tmp_path, environ, RANKED.format(head="node01"), scontrol=text)
    [(_, message)] = [r for r in results if r[0] == "fail"]
    assert "starts 4 processes on node[01-02] (num_processes 8 / num_machines 2), which have 1 GPU in" in message
    healthy = judge(tmp_path, environ, RANKED.format(head="node01").replace("8", "2"), scontrol=text)
    assert statuses(healthy) == ["pass"], healthy


def test_fewer_processes_than_gpus_leave_gpus_idle(tmp_path):
    results = judge(tmp_path, env(SLURM_GPUS_PER_NODE=8), RANKED.format(head="node01"))
    assert statuses(results) == ["warn"] and "the others stay idle" in results[0][1]


def test_torchrun_with_slurms_own_node_count_is_clean_whatever_the_directives_said(tmp_path):
    # #SBATCH --nodes=3, overridden by `sbatch -N2`: $SLURM_NNODES is 2 in the job
    body = ("srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend c10d --rdzv_endpoint node01:29500 "
            "x.py\n")
    results = judge(tmp_path, env(SLURM_GPUS_PER_NODE=4), body, directives="#SBATCH --nodes=3\n")
    assert statuses(results) == ["pass"], results


def test_num_machines_other_than_the_allocations_nodes_fails(tmp_path):
    results = judge(tmp_path, env("node[01-03]", "1(x3)"), command=["accelerate", "launch", "--num_machines", "2",
                                                                      "train.py"])
    assert statuses(results) == ["fail"] and "--num_machines 2 on 3 nodes (node[01-03])" in results[0][1]
    healthy = judge(tmp_path, env("node[01-03]", "1(x3)"), command=["accelerate", "launch", "--num_machines", "3",
                                                                      "train.py"])
    assert statuses(healthy) == ["pass"], healthy


# ---- rank 0 and the node order -----------------------------------------------------------------------------------

def test_a_head_address_naming_another_node_than_rank_zeros_fails(tmp_path):
    # sbatch --nodelist=node03,node01: SLURM orders them node[01,03], task 0 (SLURM_NODEID 0) on node01
    environ, text = recorded("nodelist_node03_node01_gres_gpu_1")
    body = RANKED.format(head="node03").replace("--num_processes 8", "--num_processes 2")
    results = judge(tmp_path, environ, body, scontrol=text, directives="#SBATCH --nodelist=node03,node01\n")
    [(_, message)] = [r for r in results if r[0] == "fail"]
    assert "names node03, but rank 0 starts on node01" in message and "SLURM_JOB_NODELIST=node[01,03]" in message
    assert statuses(judge(tmp_path, environ, body.replace("node03", "node01"), scontrol=text)) == ["pass"]


def test_a_head_given_as_an_address_is_matched_to_its_node_by_the_facts(tmp_path):
    facts = {"node01": {"facts": {"host": {"interfaces": {"eth0": ["10.0.0.1"]}}}, "error": None},
             "node02": {"facts": {"host": {"interfaces": {"eth0": ["10.0.0.2"]}}}, "error": None}}
    assert statuses(judge(tmp_path, env(), RANKED.format(head="10.0.0.1"), facts=facts)) == ["pass"]
    results = judge(tmp_path, env(), RANKED.format(head="10.0.0.2"), facts=facts)
    assert statuses(results) == ["fail"] and "names node02" in results[0][1]
    outside = judge(tmp_path, env(), RANKED.format(head="login01"), facts=facts)
    assert statuses(outside) == ["warn"] and "is not one of this allocation's nodes" in outside[0][1]


# ---- the engine reads the allocation ------------------------------------------------------------------------------

def without_slurm_environment(monkeypatch):
    """None of the SLURM variables of the shell the tests run in."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SBATCH_")):
            monkeypatch.delenv(name)


def fake_scontrol(tmp_path, text, monkeypatch):
    """A `scontrol` on PATH that answers `show job --details JOBID` with a recorded text (and logs its argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "scontrol.txt").write_text(text)
    tool = bin_dir / "scontrol"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >>{tmp_path}/scontrol.argv\ncat {tmp_path}/scontrol.txt\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


@pytest.fixture
def in_recorded_allocation(tmp_path, monkeypatch):
    """The batch step's SLURM environment of `sbatch -N2 --ntasks-per-node=2 --gpus-per-node=2`, and its scontrol."""
    monkeypatch.chdir(tmp_path)
    without_slurm_environment(monkeypatch)
    environ, text = recorded("tasks_per_node_2_gpus_per_node_2")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    fake_scontrol(tmp_path, text.replace("gpu:2(IDX:0-1)", "gpu:4(IDX:0-3)"), monkeypatch)  # scontrol's, not the env's
    return tmp_path


@pytest.mark.parametrize("command", ["check", "node"])
def test_a_batch_script_is_judged_against_the_allocation_slurm_reports(capsys, in_recorded_allocation, command):
    tmp_path = in_recorded_allocation
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" + RANKED.format(head="node01"))
    code, doc, err = run_cli(capsys, command, "--sbatch", job, "--only", "CFG075", "--json")
    [(status, message)] = [(r["status"], r["message"]) for r in doc["results"] if r["status"] == "fail"][:1]
    assert code == 1 and "srun starts 2(x2) tasks on node[01-02]" in message, doc["results"]
    [evidence] = [r["evidence"] for r in doc["results"]][:1]
    assert evidence["gpus_per_node"] == [4, 4] and evidence["job"] == "1"  # read from scontrol show job
    assert (tmp_path / "scontrol.argv").read_text().split() == ["show", "job", "--details", "1"]


def test_check_with_a_batch_script_outside_an_allocation_skips_the_allocation(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    without_slurm_environment(monkeypatch)
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n#SBATCH --nodes=2\n" + RANKED.format(head="node01"))
    code, doc, err = run_cli(capsys, "check", "--sbatch", job, "--only", "CFG075", "--json")
    assert [r["status"] for r in doc["results"]] == ["skip"] and code == 0


def test_torchruns_elastic_node_range_must_hold_the_allocations_nodes(tmp_path):
    launch = "srun torchrun --nnodes {} --rdzv_backend c10d --rdzv_endpoint node01:29500 train.py\n"
    assert statuses(judge(tmp_path, env(), launch.format("1:4"))) == ["pass"]
    results = judge(tmp_path, env(), launch.format("3:4"))
    assert statuses(results) == ["fail"] and "--nnodes 3:4 on 2 nodes" in results[0][1]
