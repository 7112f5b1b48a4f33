"""CKPT005 over real SSH sessions on the test cluster: each node's job folder is its own (a private bind mount at
the same path), as on nodes without a shared filesystem, and holds its own copy of a real DeepSpeed checkpoint
(ZeRO-2, bf16, saved by two ranks). Each node's ranks come from its own accelerate config (machine_rank)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checkpoints import save_all, save_states
from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

pytestmark = pytest.mark.cluster

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
SHARD = "global_step1/bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("checkpoints")) / "zero2"


@pytest.fixture
def job(cluster, tmp_path, saved):
    """Two nodes, one rank each; the job folder on this machine (the head's copy) and on each node, each with
    the checkpoint at ckpt/."""
    nodes = cluster.nodes[:2]
    workdir = tmp_path / "job"
    folders = {n: cluster.bind_dir(n, str(workdir)) for n in nodes}
    for index, folder in enumerate([workdir, *folders.values()]):
        config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 2,
                  "machine_rank": max(0, index - 1), "num_processes": 2, "main_process_ip": cluster.ip(nodes[0]),
                  "main_process_port": 29513, "use_cpu": True,
                  "deepspeed_config": {"deepspeed_config_file": "ds.json", "deepspeed_multinode_launcher": "standard"}}
        (folder / "accelerate.yaml").write_text(yaml.safe_dump(config))
        (folder / "ds.json").write_text(json.dumps(DS))
        (folder / "train.py").write_text("print('training')\n")
        shutil.copytree(saved, folder / "ckpt")
    return workdir, nodes, folders


def ckpt005(cluster, workdir, nodes, *resume, script_args=()):
    argv = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(nodes), "--ssh-config",
            str(cluster.ssh_config), "--python", sys.executable, "--only", "CKPT", "--json", *resume, "--",
            ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py", *script_args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=workdir)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    return {tuple(r["nodes"]): r for r in doc["results"] if r["id"] == "CKPT005"}, doc


def test_every_node_with_its_ranks_files_passes(cluster, job):
    workdir, nodes, _ = job
    for resume, script_args in ((["--resume-from", "ckpt"], ()), ((), ("--resume_from_checkpoint", "ckpt"))):
        found, doc = ckpt005(cluster, workdir, nodes, *resume, script_args=script_args)
        assert list(found) == [tuple(nodes)] and found[tuple(nodes)]["status"] == "pass", found  # one line for all
        assert "the same 3 files as this machine's" in found[tuple(nodes)]["message"], found
        assert {r["status"] for r in doc["results"]} == {"pass"}, doc["results"]


def test_a_node_without_its_ranks_shard_is_named_with_the_rank(cluster, job):
    workdir, nodes, folders = job
    (folders[nodes[1]] / "ckpt" / SHARD.format(1)).unlink()
    (folders[nodes[0]] / "ckpt" / SHARD.format(1)).unlink()  # rank 1's: node01's rank 0 does not load it
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "ckpt")
    assert found[(nodes[0],)]["status"] == "pass", found
    lacking = found[(nodes[1],)]
    assert lacking["status"] == "fail" and lacking["evidence"]["ranks"] == [1], lacking
    assert lacking["evidence"]["missing"] == [SHARD.format(1).split("/")[1]], lacking
    assert f"on {nodes[1]} lacks bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt, which rank 1 loads" \
        in lacking["message"], lacking


def test_a_module_only_load_needs_no_shard_on_the_node(cluster, job):
    """Megatron-DeepSpeed's --finetune loads the module alone: below stage 3 each rank reads the model states and
    no optimizer shard (DeepSpeed's load, held in test_ckpt_modonly.py), so a node without its rank's shard passes."""
    workdir, nodes, folders = job
    (folders[nodes[1]] / "ckpt" / SHARD.format(1)).unlink()
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "ckpt", script_args=("--load", "ckpt", "--finetune"))
    assert {r["status"] for r in found.values()} == {"pass"}, found
    assert "the 1 files rank 1 loads are there" in found[(nodes[1],)]["message"], found


def test_a_node_without_the_checkpoint_and_one_at_another_step(cluster, job):
    workdir, nodes, folders = job
    shutil.rmtree(folders[nodes[1]] / "ckpt")
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "ckpt")
    assert found[(nodes[1],)]["status"] == "fail" and "is not on" in found[(nodes[1],)]["message"], found
    shutil.copytree(folders[nodes[0]] / "ckpt", folders[nodes[1]] / "ckpt")
    (folders[nodes[1]] / "ckpt" / "global_step1").rename(folders[nodes[1]] / "ckpt" / "global_step0")
    (folders[nodes[1]] / "ckpt" / "latest").write_text("global_step0")
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "ckpt")
    odd = found[(nodes[1],)]
    assert odd["status"] == "fail" and "names 'global_step0', this machine's 'global_step1'" in odd["message"], found


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory):
    return save_states(tmp_path_factory.mktemp("states")) / "accelerate"


def test_a_save_without_deepspeed_on_each_node(cluster, job, saved_states):
    """accelerate's project folder, copied to each node: each resumes from its newest checkpoint_N, with the model
    and optimizer state (a node without them fails) and its rank's random states (without them accelerate logs it
    and goes on: a warning)."""
    workdir, nodes, folders = job
    for folder in (workdir, *folders.values()):
        shutil.copytree(saved_states, folder / "acc")
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "acc")
    assert list(found) == [tuple(nodes)] and found[tuple(nodes)]["status"] == "pass", found
    assert "checkpoint_1: the same 5 files as this machine's" in found[tuple(nodes)]["message"], found
    newest = folders[nodes[1]] / "acc" / "checkpoints" / "checkpoint_1"
    (newest / "random_states_1.pkl").unlink()  # rank 1's, on the second node
    (folders[nodes[0]] / "acc" / "checkpoints" / "checkpoint_1" / "random_states_1.pkl").unlink()  # not rank 0's
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "acc")
    assert found[(nodes[0],)]["status"] == "pass", found
    odd = found[(nodes[1],)]
    assert odd["status"] == "warn" and "lacks random_states_1.pkl: rank 1 resume without its random" in \
        odd["message"], odd
    (newest / "optimizer.bin").unlink()
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "acc")
    assert found[(nodes[1],)]["status"] == "fail" and "lacks optimizer.bin, random_states_1.pkl, which rank 1 " \
        "loads" in found[(nodes[1],)]["message"], found
    shutil.rmtree(newest)
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "acc")
    assert found[(nodes[1],)]["status"] == "fail" and f"the newest checkpoint on {nodes[1]} is " \
        "checkpoints/checkpoint_0, on this machine checkpoints/checkpoint_1" in found[(nodes[1],)]["message"], found


def test_a_pipelines_save_on_a_node_without_one_of_its_layers(cluster, job, saved):
    """A pipeline's ranks load their stage's files, and which global rank runs which stage is the training code's
    topology: a node without one of the files is warned of, not failed (its ranks may not load it)."""
    workdir, nodes, folders = job
    for folder in (workdir, *folders.values()):
        shutil.copytree(saved.parent / "pipe", folder / "pipe")
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "pipe")
    assert list(found) == [tuple(nodes)] and found[tuple(nodes)]["status"] == "pass", found
    (folders[nodes[1]] / "pipe" / "global_step1" / "layer_02-model_states.pt").unlink()
    found, _ = ckpt005(cluster, workdir, nodes, "--resume-from", "pipe")
    odd = found[(nodes[1],)]
    assert odd["status"] == "warn" and "lacks layer_02-model_states.pt: saved model or pipeline parallel" in \
        odd["message"], odd
