"""Healthy multi-node jobs of the kinds users write, run for real on the test cluster: `preflight check` before
the start, the verdict of `preflight launch`, and `preflight doctor` on the running job must each find nothing
wrong and blame nobody. Launchers (accelerate with its torchrun and DeepSpeed launchers, torchrun static and
elastic, DeepSpeed's runner), configs (one shared, one per node in each node's own folder, DeepSpeed JSON in a
.json and in a .yaml), the spellings users type, two jobs on the same nodes, and a rank with DataLoader workers.

Every look is run to the end before the cell's one assert, so that a cell shows all its false alarms at once.
"""
import json
import shutil

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from healthy_jobs import ACCELERATE, DEEPSPEED, DEEPSPEED_CONFIG, PATH, TORCHRUN, Job, accelerate_config, alarms

pytestmark = pytest.mark.cluster

TWO = ("node01", "node02")


@pytest.fixture
def jobs(cluster, tmp_path):
    """Jobs made in the test; each ended by PID when the test ends, pass or fail."""
    made = []

    def make(name, port, nodes=TWO, per_node=False):
        job = Job(cluster, tmp_path, name, nodes, port, per_node=per_node)
        made.append(job)
        return job

    try:
        yield make
    finally:
        for job in made:
            job.stop()


def node_ranks(cluster, nodes):
    """Each node's SSH sessions as a user's: the training environment first on PATH (accelerate runs DeepSpeed's
    runner by name, utils/launch.py prepare_deepspeed_cmd_env: cmd = ["deepspeed"]), and $NODE_RANK, as a batch
    system sets it, so that the command is the same on every node."""
    for rank, node in enumerate(nodes):
        cluster.set_env(node, NODE_RANK=str(rank), PATH=PATH)


def said(looks, *jobs):
    """Every alarm of the looks, and what went wrong with the jobs themselves (a rank started twice, a launcher
    that exited), one line each."""
    lines = [line for look in looks for line in alarms(look)]
    return "\n".join(lines + [line for job in jobs for line in job.problems()])


# --- accelerate launch (the gate starts it on every node, with each node's rank) -----------------------------

def accelerate_cell(job, check_command, gate_command, world, options=()):
    """check with the command each node runs by hand, then the gate starts `accelerate launch` on every node
    (it sets each node's rank itself), then doctor. A refused launch is started by hand on each node with its
    rank, so that doctor still gets its look at the job."""
    looks = [job.check(check_command, options)]
    gate = job.gate(gate_command, options)
    looks.append(gate)
    if gate["refused"] or gate["proc"].poll() is not None:
        job.retired.append(gate["proc"])
        for rank, node in enumerate(job.nodes):
            job.start(node, [gate_command[0], "launch", "--machine_rank", str(rank), *gate_command[2:]])
    job.wait_running(world)
    looks.append(job.doctor("--port", str(job.port)))
    return looks


def shared_config_cell(job, cluster, config, options=()):
    """One accelerate config for every node, in the shared folder: each node gives its rank on the command line."""
    node_ranks(cluster, job.nodes)
    job.write("accelerate.yaml", config)
    launch = [ACCELERATE, "launch", "--config_file=accelerate.yaml"]
    return accelerate_cell(job, [*launch, "--machine_rank=$NODE_RANK", "train.py", str(job.marks)],
                           [*launch, "train.py", str(job.marks)], len(job.nodes), options)


def per_node_config_cell(job, configs, options=()):
    """Each node's accelerate config in its own job folder (the same path on every node)."""
    for node, config in zip(job.nodes, configs):
        job.write("accelerate.yaml", config, node=node)
    command = [ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py", str(job.marks)]
    return accelerate_cell(job, command, command, len(job.nodes), options)


def test_accelerate_static_launcher_with_one_shared_config(jobs, cluster):
    job = jobs("shared-config", 29711)
    looks = shared_config_cell(job, cluster, accelerate_config(2, 0, cluster.ip("node01"), 29711),
                               options=["--config", "accelerate.yaml"])
    assert not said(looks, job), said(looks, job)


def test_accelerate_with_a_config_per_node_in_each_nodes_own_folder(jobs, cluster):
    job = jobs("per-node-config", 29712, per_node=True)
    looks = per_node_config_cell(job, [accelerate_config(2, rank, cluster.ip("node01"), 29712) for rank in (0, 1)])
    assert not said(looks, job), said(looks, job)


def test_accelerate_with_the_main_address_a_name_on_one_node_and_the_address_on_another(jobs, cluster):
    job = jobs("name-and-address", 29713, per_node=True)
    looks = per_node_config_cell(job, [accelerate_config(2, 0, "node01", 29713),
                                       accelerate_config(2, 1, cluster.ip("node01"), 29713)])
    assert not said(looks, job), said(looks, job)


def test_accelerate_with_values_spelled_as_users_write_them(jobs, cluster):
    # mixed_precision: BF16 is bf16 (accelerate/utils/launch.py, prepare_multi_gpu_env:
    # PrecisionType(args.mixed_precision.lower())); YAML reads `gpu_ids: 0,` as the string "0,", which accelerate
    # passes on as CUDA_VISIBLE_DEVICES (same function), where CUDA ignores the empty entry.
    job = jobs("user-spellings", 29714)
    config = accelerate_config(2, 0, cluster.ip("node01"), 29714, mixed_precision="BF16") + "gpu_ids: 0,\n"
    looks = shared_config_cell(job, cluster, config, options=["--config", "accelerate.yaml"])
    assert not said(looks, job), said(looks, job)


def deepspeed_config(cluster, job, launcher, ds_file):
    # no mixed_precision beside deepspeed_config_file: accelerate raises (utils/dataclasses.py, DeepSpeedPlugin,
    # ACCELERATE_CONFIG_DS_FIELDS), as CFG005 says; the hostfile only where the launcher reads it (CFG021):
    # prepare_deepspeed_cmd_env passes it to DeepSpeed's runner, which 'standard' (torchrun) is not
    section = {"deepspeed_config_file": ds_file, "deepspeed_multinode_launcher": launcher, "zero3_init_flag": False}
    if launcher != "standard":
        section["deepspeed_hostfile"] = "hostfile"
    return accelerate_config(2, 0, cluster.ip("node01"), job.port, distributed_type="DEEPSPEED", mixed_precision=None,
                             deepspeed_config=section)


def test_accelerate_with_deepspeed_and_the_standard_multinode_launcher(jobs, cluster):
    # accelerate/utils/launch.py, prepare_deepspeed_cmd_env: 'standard' is torchrun on every node
    job = jobs("deepspeed-standard", 29716)
    job.write("ds.json", json.dumps(DEEPSPEED_CONFIG, indent=1))
    looks = shared_config_cell(job, cluster, deepspeed_config(cluster, job, "standard", "ds.json"),
                               options=["--config", "accelerate.yaml"])
    assert not said(looks, job), said(looks, job)


def test_accelerate_with_deepspeed_nossh_and_its_config_a_yaml_file_holding_json(jobs, cluster):
    # prepare_deepspeed_cmd_env: 'nossh' is DeepSpeed's runner with --node_rank and --no_ssh on every node;
    # DeepSpeed reads its config file as JSON whatever its name (deepspeed/runtime/config.py, DeepSpeedConfig:
    # json.load of the path), and so does accelerate (utils/deepspeed.py, HfDeepSpeedConfig)
    job = jobs("deepspeed-nossh", 29717)
    job.write("ds.yaml", json.dumps(DEEPSPEED_CONFIG, indent=1))
    job.write("hostfile", job.hostfile())
    looks = shared_config_cell(job, cluster, deepspeed_config(cluster, job, "nossh", "ds.yaml"),
                               options=["--config", "accelerate.yaml"])
    assert not said(looks, job), said(looks, job)


def test_accelerate_with_deepspeed_and_the_pdsh_multinode_launcher(jobs, cluster, tmp_path):
    """prepare_deepspeed_cmd_env: any other launcher is DeepSpeed's runner with --launcher: accelerate runs on the
    head alone, and pdsh starts every node of deepspeed_hostfile."""
    if not shutil.which("pdsh"):
        pytest.skip("pdsh is not installed here: DeepSpeed's pdsh launcher cannot run")
    job = jobs("accelerate-pdsh", 29718)
    shim = ssh_reading_the_cluster_config(cluster, tmp_path)
    for node in job.nodes:
        cluster.set_env(node, PATH=f"{shim}:{PATH}")
    job.write("ds.json", json.dumps(DEEPSPEED_CONFIG, indent=1))
    job.write("hostfile", job.hostfile())
    job.write("accelerate.yaml", deepspeed_config(cluster, job, "pdsh", "ds.json"))
    command = [ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py", str(job.marks)]
    looks = [job.check(command, ["--config", "accelerate.yaml"])]
    gate = job.gate(command, ["--config", "accelerate.yaml"])
    looks.append(gate)
    if gate["refused"] or gate["proc"].poll() is not None:
        job.retired.append(gate["proc"])
        job.start("node01", command, PATH=f"{shim}:{PATH}")
    job.wait_running(2)
    looks.append(job.doctor("--port", "29718"))
    assert not said(looks, job), said(looks, job)


def ssh_reading_the_cluster_config(cluster, tmp_path):
    """A folder for PATH whose `ssh` reads the test cluster's ssh_config, as a user's reads ~/.ssh/config."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {cluster.ssh_config} \"$@\"\n")
    (shim / "ssh").chmod(0o755)
    return shim


# --- torchrun and DeepSpeed's runner (the gate runs the head's launcher there; the others start by hand) -------

def head_gated_cell(job, cluster, argv_of, world, options=(), doctor=True):
    """check, then `preflight launch` on the head, both with the command every node runs (`$NODE_RANK` each
    node's own, as the contract reads `-- COMMAND`), then the other nodes' launchers, then doctor. A head launcher
    that was refused or did not come up is started by hand, so that doctor still gets its look at the job."""
    looks = [job.check(argv_of("$NODE_RANK"), options)]
    gate = job.gate(argv_of("$NODE_RANK"), options, on=job.nodes[0], NODE_RANK="0")
    looks.append(gate)
    for rank, node in enumerate(job.nodes[1:], 1):
        job.start(node, argv_of(str(rank)))

    def by_hand():
        if not gate["refused"]:
            gate["exited"] = job.tail()
        job.retired.append(gate["proc"])
        job.start(job.nodes[0], argv_of("0"))

    job.wait_running(world, head=gate["proc"], instead=by_hand)
    if doctor:
        looks.append(job.doctor("--port", str(job.port)))
    return looks


def test_torchrun_static_with_flags_spelled_flag_equals_value(jobs, cluster):
    job = jobs("torchrun-equals", 29721)
    node_ranks(cluster, job.nodes)

    def argv(rank):
        return [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node_rank={rank}", "--master_addr=node01",
                "--master-port=29721", "--max-restarts=0", "train.py", str(job.marks)]

    looks = head_gated_cell(job, cluster, argv, 2)
    assert not said(looks, job), said(looks, job)


def test_torchrun_static_with_flags_spelled_apart_and_abbreviated(jobs, cluster):
    # torch/distributed/run.py, get_args_parser: an ArgumentParser with argparse's allow_abbrev (its default):
    # --nproc_per is --nproc_per_node, --node_r --node_rank, --master_a --master_addr, --master_p --master_port
    job = jobs("torchrun-abbreviated", 29722)
    node_ranks(cluster, job.nodes)

    def argv(rank):
        return [TORCHRUN, "--nnodes", "2", "--nproc_per", "1", "--node_r", rank, "--master_a", "node01",
                "--master_p", "29722", "train.py", str(job.marks)]

    looks = head_gated_cell(job, cluster, argv, 2)
    assert not said(looks, job), said(looks, job)


def test_torchrun_elastic_with_a_range_of_nodes_and_a_c10d_rendezvous(jobs, cluster):
    # torch/distributed/run.py, parse_min_max_nnodes: --nnodes 1:3; all three join, the rendezvous is full at once
    job = jobs("torchrun-elastic", 29723, nodes=cluster.nodes)
    command = [TORCHRUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
               "node01:29723", "--rdzv_id", "healthy", "--max-restarts", "0", "train.py", str(job.marks)]
    looks = [job.check(command)]
    gate = job.gate(command, on="node01")
    looks.append(gate)
    for node in job.nodes[1:] if not gate["refused"] else job.nodes:
        job.start(node, command)
    job.wait_running(3)
    looks.append(job.doctor("--port", "29723"))
    assert not said(looks, job), said(looks, job)


def test_deepspeed_runner_without_ssh_each_node_with_its_rank(jobs, cluster):
    # deepspeed/launcher/runner.py, main: --no_ssh with --node_rank runs this node's share of the hostfile
    job = jobs("deepspeed-no-ssh", 29724)
    job.write("hostfile", job.hostfile())
    node_ranks(cluster, job.nodes)

    def argv(rank):
        return [DEEPSPEED, "--hostfile", "hostfile", "--no_ssh", "--node_rank", rank, "--master_addr", "node01",
                "--master_port", "29724", "train.py", str(job.marks)]

    looks = head_gated_cell(job, cluster, argv, 2, options=["--hostfile", "hostfile"])
    assert not said(looks, job), said(looks, job)


def test_deepspeed_runner_over_pdsh_from_a_hostfile(jobs, cluster, tmp_path):
    """DeepSpeed's runner on the head alone starts every node of the hostfile over pdsh
    (deepspeed/launcher/multinode_runner.py, PDSHRunner: `pdsh -w HOSTS ... --node_rank=%n`)."""
    if not shutil.which("pdsh"):
        pytest.skip("pdsh is not installed here: DeepSpeed's pdsh launcher cannot run")
    job = jobs("deepspeed-pdsh", 29725)
    job.write("hostfile", job.hostfile())
    shim = ssh_reading_the_cluster_config(cluster, tmp_path)
    command = [DEEPSPEED, "--hostfile", "hostfile", "--master_addr", "node01", "--master_port", "29725", "train.py",
               str(job.marks)]
    looks = [job.check(command, ["--hostfile", "hostfile"])]
    gate = job.gate(command, ["--hostfile", "hostfile"], on="node01", PATH=f"{shim}:{PATH}")
    looks.append(gate)

    def by_hand():
        if not gate["refused"]:
            gate["exited"] = job.tail()
        job.retired.append(gate["proc"])
        job.start("node01", command, PATH=f"{shim}:{PATH}")

    job.wait_running(2, head=gate["proc"], instead=by_hand)
    looks.append(job.doctor("--port", "29725"))
    assert not said(looks, job), said(looks, job)


def test_two_healthy_jobs_on_the_same_nodes_on_different_ports(jobs, cluster):
    first, second = jobs("first-job", 29726), jobs("second-job", 29727)
    node_ranks(cluster, TWO)
    looks = []
    for job in (first, second):  # the second is checked and started while the first runs

        def argv(rank, port=job.port, job=job):
            return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node_rank", rank, "--master_addr",
                    "node01", "--master_port", str(port), "train.py", str(job.marks)]

        looks += head_gated_cell(job, cluster, argv, 2, doctor=False)
    both = first.doctor()
    both["statuses"] = ("fail", "error")  # without --port, a warning that two jobs run there is the truth
    looks += [both, first.doctor("--port", "29726"), second.doctor("--port", "29727")]
    assert not said(looks, first, second), said(looks, first, second)


def test_a_rank_with_dataloader_workers(jobs, cluster):
    job = jobs("dataloader-workers", 29728)
    node_ranks(cluster, job.nodes)

    def argv(rank):
        return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node_rank", rank, "--master_addr", "node01",
                "--master_port", "29728", "train.py", str(job.marks), "2"]

    looks = head_gated_cell(job, cluster, argv, 2)
    assert len(list(job.marks.glob("*-worker*.pid"))) == 4  # two workers on each rank
    assert not said(looks, job), said(looks, job)
