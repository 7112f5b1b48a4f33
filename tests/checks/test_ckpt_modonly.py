"""CKPT003, CKPT004 and CKPT007 where the launch asks DeepSpeed for the module alone (Megatron-DeepSpeed's --finetune:
load_checkpoint(..., load_optimizer_states=False, load_module_only=True)), with sequence parallel and with AutoTP,
each verdict held against DeepSpeed's own load_checkpoint and a step on CPU ranks: a module-only load takes another
data-parallel world, pipeline, stage below 3, precision and optimizer; at stage 3 fewer ranks, not more; another
tensor-parallel degree still fails. Sequence parallel leaves the shards' world the world over the model-parallel
degrees, unless the config's data x sequence mesh fixes it; an AutoTP save passes on the same degree."""
import json
import shutil
import subprocess
import sys

import pytest

from checkpoints import load_parallel, save_all, save_parallel, save_sequence

MODULE_ONLY = {"load_optimizer_states": False, "load_lr_scheduler_states": False, "load_module_only": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modonly")
    for kind, save in (("all", save_all), ("par", save_parallel), ("seq", save_sequence)):
        (folder / kind).mkdir()
        save(folder / kind)
    shutil.copytree(folder / "all/zero2", folder / "cut/zero2")  # without rank 0's optimizer shard
    (folder / "cut/zero2/global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    return folder


def lint(tmp_path, resume, world, stage, *words, **config):
    """The CKPT results for a job of `world` processes at ZeRO `stage`, its launch's script words `words`."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(dict({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                                   "zero_optimization": {"stage": stage}}, **config)))
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--deepspeed", str(ds), "--resume-from",
                           str(resume), "--world-size", str(world), "--json", "--only", "CKPT", "--", "torchrun",
                           "pretrain_gpt.py", *words], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}


FINETUNE = ("--load", "ckpt", "--finetune")
DEGREES = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1")
# (saved, the job's kind, stage and degree flags, the CKPT003 status, the words of DeepSpeed's it quotes): each saved
# by 2 ranks; zero2 with bf16 loaded in fp32 (CKPT004), zero1-sgd by Adam (CKPT007), cut/zero2 without a shard (CKPT002)
ON_ONE = [
    ("cut/zero2", "tp", 2, (), "pass", None),
    ("all/zero1", "tp", 1, (), "pass", None),
    ("all/zero2", "tp", 2, (), "pass", None),
    ("all/zero3", "tp", 3, (), "pass", None),
    ("all/zero1-sgd", "tp", 1, (), "pass", None),
    ("par/pp2", "pipe", 1, DEGREES, "pass", None),
    ("par/pp2-zero0", "pipe", 0, DEGREES, "pass", None),
    ("par/tp2", "tp", 1, DEGREES, "fail", "key: attention.dense.weight is not found in the checkpoint"),
]
ON_THREE = [  # the last one refused ends the run
    ("all/zero1", "tp", 1, (), "pass", None),
    ("all/zero3", "tp", 3, (), "fail", "assert len(self.ckpt_list) > 0"),
]


@pytest.mark.parametrize("world,cases", [(1, ON_ONE), (3, ON_THREE)], ids=["on-one-rank", "on-three-ranks"])
def test_a_module_only_load_is_judged_as_deepspeed_loads_it(saved, tmp_path, world, cases):
    said = load_parallel(tmp_path, [(saved / name, kind, 1, stage, False, MODULE_ONLY)
                                    for name, kind, stage, *_ in cases], world)
    for (name, kind, stage, words, status, quoted), (what, *why) in zip(cases, said):
        found = lint(tmp_path, saved / name, world, stage, *FINETUNE, *words)
        assert what == ("LOADED" if status == "pass" else "REFUSED"), (name, why)
        assert found["CKPT003"]["status"] == status, (name, found["CKPT003"])
        if quoted:  # DeepSpeed's assertion says no more than its line
            assert quoted in found["CKPT003"]["message"] and (quoted in why[0] or why[0] == "AssertionError "), \
                (name, why, found["CKPT003"])
        else:
            assert not [r for r in found.values() if r["status"] in ("fail", "error", "warn") and not (
                name.startswith("cut/") and r["id"] == "CKPT002" and r["status"] == "warn")], (name, found)
            assert "the optimizer starts afresh" in found["CKPT003"]["message"], found["CKPT003"]
            if kind == "tp":  # what CKPT001 says the ranks load: below stage 3 no shard, at 3 every rank's
                rows = {row["file"]: row["loaded_by"] for row in found["CKPT001"]["evidence"]["resume_files"]}
                if stage < 3:
                    assert rows == {"mp_rank_00_model_states.pt": "every rank"}, found["CKPT001"]
                    assert "optim" not in found["CKPT001"]["message"], found["CKPT001"]
                else:
                    assert len(rows) == 2 and set(rows.values()) == {"every rank"}, found["CKPT001"]
    if world == 1:  # the shard a module-only load does not open: said, not failed
        cut = lint(tmp_path, saved / "cut/zero2", 1, 2, *FINETUNE)["CKPT002"]
        assert cut["status"] == "warn" and "missing" in cut["message"] and "not read: --finetune" in cut["message"]
    # the same loads without --finetune: DeepSpeed loads the optimizer shards, and these fail
    found = lint(tmp_path, saved / "all/zero1", world, 1, "--load", "ckpt")
    assert found["CKPT003"]["status"] == "fail" and "--finetune" in found["CKPT003"]["remediation"], found


def test_no_load_optim_does_not_change_deepspeeds_load(saved, tmp_path):
    """Megatron-DeepSpeed hands DeepSpeed load_module_only for --finetune alone (megatron/checkpointing.py
    load_checkpoint); its --no-load-optim acts on its path without DeepSpeed. Another script's --finetune (without
    Megatron's --load) is not read as Megatron's."""
    found = lint(tmp_path, saved / "all/zero1", 1, 1, "--load", "ckpt", "--no-load-optim")
    assert found["CKPT003"]["status"] == "fail", found
    assert "--no-load-optim in the launch command does not change it" in found["CKPT003"]["message"], found
    assert lint(tmp_path, saved / "all/zero1", 1, 1, "--finetune")["CKPT003"]["status"] == "fail"


MESH = {"data_parallel_size": 1, "sequence_parallel_size": 2}


@pytest.mark.parametrize("name,kind,config,words", [
    # saved by 2 data-parallel ranks, loaded by sequence parallel 2 (ALST's mpu; Megatron-DeepSpeed's flag): the
    # same world of shards (data x sequence parallel)
    ("all/zero1", "alst", {"sequence_parallel_size": 2}, ()),
    ("all/zero1", "alst", {}, ("--ds-sequence-parallel-size", "2")),
    ("seq/mesh", "mesh", MESH, ()),  # the config's mesh: ZeRO partitions over its data dimension (1)
    ("seq/autotp2", "autotp", {"tensor_parallel": {"autotp_size": 2}}, ()),
], ids=["sequence-parallel-config", "sequence-parallel-megatron", "data-sequence-mesh", "autotp"])
def test_sequence_parallel_and_autotp_saves_pass_where_deepspeed_loads_them(saved, tmp_path, name, kind, config,
                                                                            words):
    if not words:  # the flag's case is the config's load
        assert load_parallel(tmp_path, [(saved / name, kind, 2, 1, False)], 2)[0][0] == "LOADED"
    found = lint(tmp_path, saved / name, 2, 1, *words, **config)
    assert found["CKPT003"]["status"] == "pass", found["CKPT003"]
    if kind == "alst":
        assert "data parallel 1 x sequence parallel 2" in found["CKPT003"]["message"], found["CKPT003"]
    assert not [r for r in found.values() if r["status"] in ("fail", "error", "warn")], found


def test_a_mesh_over_another_data_parallel_size_and_autotp_on_another_degree_fail(saved, tmp_path):
    """What DeepSpeed refuses (the DP world size, a tensor-parallel degree) with the fix in the job's own terms."""
    found = lint(tmp_path, saved / "all/zero1", 2, 1, **MESH)["CKPT003"]
    assert found["status"] == "fail" and "DP world size of 2 but the current world size is 1" in found["message"]
    found = lint(tmp_path, saved / "seq/autotp2", 1, 1, tensor_parallel={"autotp_size": 2})["CKPT003"]
    assert found["status"] == "fail" and "run tensor_parallel.autotp_size: 2 on 2 processes" in found["remediation"]
