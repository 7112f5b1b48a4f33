"""MEM: the memory estimate for the job as it really shards: FSDP's strategies and offload, DDP (nothing sharded),
and DeepSpeed's runner starting only the slots its host filter leaves. A job without DeepSpeed is never told to
take a ZeRO stage."""
import json
import os

import pytest
import yaml

from conftest import run_cli
from preflight.inputs import models
from preflight.job import memory
from preflight.job.memory import Setup
from preflight.plan import build_plan
from test_gpu import node
from test_mem import MODELS, by_node, run

LLAMA_8B = os.path.join(MODELS, "llama-3-8b-instruct")  # 8,030,261,248 parameters


def accelerate(tmp_path, distributed_type="FSDP", fsdp=None, machines=1, per_node=8, name="accelerate.yaml", **more):
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed_type, "machine_rank": 0,
              "num_machines": machines, "num_processes": per_node * machines, "main_process_ip": "10.0.0.1",
              "main_process_port": 29500, "mixed_precision": "bf16", **more}
    if fsdp is not None:
        config["fsdp_config"] = fsdp
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def lint(capsys, config, model=LLAMA_8B, *more):
    code, doc, _ = run_cli(capsys, "lint", "--config", config, "--only", "MEM001", "--json", "--model", model,
                           "--gpu-memory", "80GB", *more)
    (result,) = doc["results"]
    return code, result


def setup_of(config, command=()):
    from preflight.checks.mem import job_setup
    from preflight import runner

    plan = build_plan(config=config, command=tuple(command), memory=models.Inputs(model=models.resolve("8B")))
    setup, note, _ = job_setup(runner.CheckContext(plan, {}, {}))
    return setup, note


# --- the estimate ------------------------------------------------------------------------------------------

def test_fsdp_full_shard_spreads_16_bytes_a_parameter_over_every_rank():
    model = models.Model(8 * 10**9, 4 * 10**8, "8B", "given")
    need = memory.estimate(model, Setup(sharding="FULL_SHARD", gpus_per_node=8, nodes=2))
    # fp32 weights, gradients and Adam's two states over 16 ranks, the largest layer gathered with its gradient
    assert need.gpu == 16 * 8 * 10**9 // 16 + 2 * 2 * 4 * 10**8
    assert need.host == need.certain == need.load == 8 * 8 * 10**9 * 2  # every rank loads a 16-bit copy


def test_each_fsdp_strategy_shards_over_its_ranks():
    model = models.Model(8 * 10**9, 4 * 10**8, "8B", "given")
    gpu = {s: memory.estimate(model, Setup(sharding=s, gpus_per_node=8, nodes=4)).gpu for s in memory.FSDP_STRATEGIES}
    gathered, whole = 2 * 2 * 4 * 10**8, 2 * 8 * 10**9  # the largest layer and its gradient; all gathered weights
    assert gpu["FULL_SHARD"] == 16 * 8 * 10**9 // 32 + gathered
    assert gpu["HYBRID_SHARD"] == 16 * 8 * 10**9 // 8 + gathered  # shards within a node, replicates across
    assert gpu["SHARD_GRAD_OP"] == 16 * 8 * 10**9 // 32 + gathered + whole  # kept from forward to backward
    assert gpu["_HYBRID_SHARD_ZERO2"] == 16 * 8 * 10**9 // 8 + gathered + whole
    assert gpu["NO_SHARD"] == 16 * 8 * 10**9 + gathered
    assert gpu["FULL_SHARD"] < gpu["HYBRID_SHARD"] < gpu["_HYBRID_SHARD_ZERO2"] < gpu["NO_SHARD"]


def test_fsdp_parameter_offload_moves_the_sharded_states_to_the_host():
    model = models.Model(70 * 10**9, 2 * 10**9, "70B", "given")
    need = memory.estimate(model, Setup(sharding="FULL_SHARD", offload_param="cpu", gpus_per_node=8, nodes=2))
    assert need.gpu == 2 * 2 * 2 * 10**9
    assert need.offloaded == 16 * 70 * 10**9 // 16 * 8  # this node's 8 ranks' shards
    efficient = memory.estimate(model, Setup(sharding="FULL_SHARD", gpus_per_node=8, one_copy_per_node=True))
    assert efficient.load == 70 * 10**9 * 2  # cpu_ram_efficient_loading: local rank 0 alone loads


def test_ddp_replicates_weights_gradients_buckets_and_adam_on_every_gpu():
    model = models.Model(10**9, 5 * 10**7, "1B", "given")
    need = memory.estimate(model, Setup(sharding="ddp", gpus_per_node=8, nodes=4))
    assert need.gpu == 20 * 10**9 and need.load == 8 * 2 * 10**9 and need.host == need.load


def test_the_changes_for_fsdp_and_ddp_are_never_a_zero_stage():
    for setup in (Setup(sharding="ddp", gpus_per_node=8), Setup(sharding="NO_SHARD", gpus_per_node=8, nodes=2),
                  Setup(sharding="SHARD_GRAD_OP", gpus_per_node=8, fsdp_version=2)):
        names = [what for what, changed in memory.changes(setup)]
        assert names and not any("ZeRO" in n or "stage" in n for n in names), names
        assert all(changed.sharding != "zero" for _, changed in memory.changes(setup))
    fsdp2 = [what for what, _ in memory.changes(Setup(sharding="SHARD_GRAD_OP", gpus_per_node=8, fsdp_version=2))]
    assert fsdp2[0] == "fsdp_reshard_after_forward: true" and not any("HYBRID" in n for n in fsdp2)
    one_node = [what for what, _ in memory.changes(Setup(sharding="NO_SHARD", gpus_per_node=8))]
    assert not any("HYBRID" in n for n in one_node)  # within one node a hybrid is the plain strategy
    two = [what for what, _ in memory.changes(Setup(sharding="NO_SHARD", gpus_per_node=8, nodes=2))]
    assert "fsdp_sharding_strategy: HYBRID_SHARD_ZERO2" in two  # as accelerate spells it


# --- the job's settings, as accelerate hands them to FullyShardedDataParallelPlugin --------------------------

@pytest.mark.parametrize("written,strategy", [
    ("FULL_SHARD", "FULL_SHARD"), ("shard_grad_op", "SHARD_GRAD_OP"), ("NO_SHARD", "NO_SHARD"),
    ("HYBRID_SHARD", "HYBRID_SHARD"), ("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"),
    ("_HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"), (1, "FULL_SHARD"), ("2", "SHARD_GRAD_OP"), (3, "NO_SHARD"),
    (4, "HYBRID_SHARD"), (5, "_HYBRID_SHARD_ZERO2"), (None, "FULL_SHARD")])
def test_fsdp_sharding_strategy_by_name_or_old_number(tmp_path, written, strategy):
    fsdp = {"fsdp_version": 1} if written is None else {"fsdp_sharding_strategy": written}
    setup, _ = setup_of(accelerate(tmp_path, fsdp=fsdp))
    assert setup.sharding == strategy and setup.stage == 0


def test_fsdp2_shards_by_reshard_after_forward_and_offloads_by_offload_params(tmp_path):
    setup, _ = setup_of(accelerate(tmp_path, fsdp={"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                                   "fsdp_offload_params": True}))
    assert (setup.sharding, setup.fsdp_version, setup.offload_param) == ("SHARD_GRAD_OP", 2, "cpu")
    setup, _ = setup_of(accelerate(tmp_path, fsdp={"version": 2, "cpu_ram_efficient_loading": "true"}))  # no prefix
    assert (setup.sharding, setup.offload_param, setup.one_copy_per_node) == ("FULL_SHARD", "none", True)


def test_an_accelerate_launch_flag_wins_over_fsdp_config(tmp_path):
    config = accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "NO_SHARD"})
    setup, _ = setup_of(config, ["accelerate", "launch", "--fsdp_sharding_strategy", "FULL_SHARD",
                                 "--fsdp_offload_params", "true", "train.py"])
    assert (setup.sharding, setup.offload_param) == ("FULL_SHARD", "cpu")


def test_a_strategy_fsdp_does_not_have_is_said_not_estimated(tmp_path, capsys):
    code, result = lint(capsys, accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "HALF_SHARD"}))
    assert result["status"] == "skip" and "HALF_SHARD" in result["message"]


@pytest.mark.parametrize("kind", ["MULTI_GPU", "NO"])
def test_a_job_without_deepspeed_or_fsdp_is_ddp(tmp_path, kind):
    setup, _ = setup_of(accelerate(tmp_path, kind))
    assert setup.sharding == "ddp"
    setup, _ = setup_of(accelerate(tmp_path, "DEEPSPEED", deepspeed_config={"zero_stage": 2}))
    assert (setup.sharding, setup.stage) == ("zero", 2)


# --- the command line: what fits passes, what does not names the FSDP change ---------------------------------

def test_fsdp_full_shard_8b_on_8x80gb_fits(tmp_path, capsys):
    code, result = lint(capsys, accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "FULL_SHARD"}))
    assert code == 0 and result["status"] == "pass", result
    assert "FSDP FULL_SHARD" in result["message"] and "ZeRO" not in result["message"]
    assert result["evidence"]["gpu_bytes"] < 20 * 2**30  # 16 bytes a parameter over 8 GPUs and one gathered layer


def test_fsdp_8b_fits_every_node_of_a_check(tmp_path):
    plan = build_plan(config=accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "FULL_SHARD"}, machines=2),
                      nodes=("n01", "n02"), memory=models.Inputs(model=models.resolve(LLAMA_8B)))
    states = {"n01": node("h100x8.json"), "n02": node("h100x8.json")}
    for state in states.values():
        state["facts"]["memory"]["available_bytes"] = 512 * 2**30
    found = by_node(run("MEM002", plan, states))
    assert {r.status.value for r in found.values()} == {"pass"}, [r.message for r in found.values()]
    assert {r.status.value for r in run("MEM003", plan, states)} == {"pass"}


def test_fsdp_that_does_not_fit_is_told_an_fsdp_change(tmp_path, capsys):
    code, result = lint(capsys, accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "NO_SHARD"}))
    assert code == 1 and result["status"] == "fail"  # 16 bytes a parameter on every GPU: 120 GiB
    assert result["remediation"].startswith("fsdp_sharding_strategy: SHARD_GRAD_OP fits"), result["remediation"]
    assert "ZeRO" not in result["remediation"] and "stage" not in result["remediation"]
    code, result = lint(capsys, accelerate(tmp_path, fsdp={"fsdp_sharding_strategy": "FULL_SHARD"}), "70B")
    assert result["status"] == "fail" and result["remediation"].startswith("fsdp_offload_params: true fits")


def test_ddp_small_model_fits_and_a_large_one_is_told_fsdp(tmp_path, capsys):
    config = accelerate(tmp_path, "MULTI_GPU")
    code, result = lint(capsys, config, os.path.join(MODELS, "qwen2-0.5b"))
    assert code == 0 and result["status"] == "pass" and "DDP" in result["message"], result
    code, result = lint(capsys, config)  # 20 bytes a parameter: 150 GiB
    assert code == 1 and result["status"] == "fail"
    assert result["remediation"].startswith("FSDP (distributed_type: FSDP, fsdp_sharding_strategy: SHARD_GRAD_OP) fits")
    assert "ZeRO" not in result["remediation"]


# --- DeepSpeed's runner starts the slots its filter leaves ------------------------------------------------------

@pytest.fixture
def four_by_eight(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"n0{i} slots=8\n" for i in range(1, 5)))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                              "train_micro_batch_size_per_gpu": 1}))
    return ["--deepspeed", ds, "--hostfile", hostfile]


@pytest.mark.parametrize("flags,gpus,nodes", [
    (["--num_nodes", "1", "--num_gpus", "2"], 2, 1), (["--include", "n01:0,1"], 2, 1),
    (["-i", "n02@n03"], 8, 2), (["--exclude", "n01@n02@n03"], 8, 1), ([], 8, 4)])
def test_deepspeeds_host_filter_decides_the_gpus_the_model_is_spread_over(capsys, four_by_eight, flags, gpus, nodes):
    code, doc, _ = run_cli(capsys, "lint", *four_by_eight, "--only", "MEM001", "--json", "--model", "7B",
                           "--gpu-memory", "80GB", "--", "deepspeed", *flags, "train.py")
    (result,) = doc["results"]
    assert (result["evidence"]["gpus_per_node"], result["evidence"]["nodes"]) == (gpus, nodes), result
    # ZeRO-3, 7B: 18 bytes a parameter over the GPUs started, and the largest layer
    expected = memory.zero3_needs(7 * 10**9, int(7 * 10**9 * 0.05), gpus, nodes, False, False, True)[1]
    assert result["evidence"]["gpu_bytes"] == expected


def test_two_gpus_of_a_4x8_hostfile_do_not_fit_what_32_would(capsys, four_by_eight):
    code, doc, _ = run_cli(capsys, "lint", *four_by_eight, "--only", "MEM001", "--json", "--model", "13B",
                           "--gpu-memory", "80GB", "--", "deepspeed", "--num_nodes", "1", "--num_gpus", "2", "train.py")
    assert code == 1 and doc["results"][0]["status"] == "fail", doc["results"][0]  # 18 x 13B / 2: 109 GiB
    code, doc, _ = run_cli(capsys, "lint", *four_by_eight, "--only", "MEM001", "--json", "--model", "13B",
                           "--gpu-memory", "80GB", "--", "deepspeed", "train.py")
    assert code == 0 and doc["results"][0]["status"] == "pass"  # every one of the 32 slots: 10.3 GiB


def test_accelerates_inclusion_filter_reaches_deepspeeds_runner(tmp_path, four_by_eight):
    config = accelerate(tmp_path, "DEEPSPEED", machines=4, deepspeed_config={
        "deepspeed_config_file": str(four_by_eight[1]), "deepspeed_hostfile": str(four_by_eight[3]),
        "deepspeed_multinode_launcher": "pdsh", "deepspeed_inclusion_filter": "n01@n02"})
    setup, _ = setup_of(config)
    assert (setup.gpus_per_node, setup.nodes) == (8, 2)


def test_without_a_hostfile_deepspeeds_num_gpus_is_the_gpu_count(capsys, four_by_eight):
    code, doc, _ = run_cli(capsys, "lint", *four_by_eight[:2], "--only", "MEM001", "--json", "--model", "7B",
                           "--gpu-memory", "80GB", "--", "deepspeed", "--num_gpus", "4", "train.py")
    (result,) = doc["results"]
    assert (result["evidence"]["gpus_per_node"], result["evidence"]["nodes"]) == (4, 1), result
    assert "assumed" not in result["message"]
