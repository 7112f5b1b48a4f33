"""CKPT on real DeepSpeed checkpoints, each verdict held against DeepSpeed's own load_checkpoint on the planned
world: a checkpoint saved by 2 ranks is refused on 3 (CKPT003 fails with DeepSpeed's words); converted as the fix
says (ds_to_universal, checkpoint.load_universal), CKPT passes and DeepSpeed loads it on 3."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from checkpoints import load, save_all

BF16_ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("checkpoints"))


def lint(tmp_path, config, resume, *extra):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--deepspeed", str(ds), "--resume-from",
                           str(resume), "--json", "-v", "--only", "CKPT", *extra], capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}


def test_another_world_fails_as_deepspeed_refuses_it_and_the_fix_loads(saved, tmp_path):
    root = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", root)
    found = lint(tmp_path, BF16_ZERO2, root, "--world-size", "3")
    assert found["CKPT003"]["status"] == "fail", found
    assert "saved by 2 data-parallel ranks, the job runs 3" in found["CKPT003"]["message"]
    said, line = load(tmp_path, str(root), BF16_ZERO2, 3)
    assert said == "REFUSED" and "DP world size of 2 but the current world size is 3" in line, line
    fix = found["CKPT003"]["remediation"]
    command = fix.split("convert it once: ", 1)[1].split(" (it writes", 1)[0].split()
    assert command[:3] == ["python", "-m", "deepspeed.checkpoint.ds_to_universal"], fix
    converted = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    universal = dict(BF16_ZERO2, checkpoint={"load_universal": True})
    found = lint(tmp_path, universal, root, "--world-size", "3")
    assert {r["status"] for r in found.values()} == {"pass"}, found
    said, line = load(tmp_path, str(root), universal, 3)
    assert said == "LOADED", line


def test_the_same_world_passes_and_deepspeed_loads_it(saved, tmp_path):
    found = lint(tmp_path, BF16_ZERO2, saved / "zero2", "--world-size", "2")
    assert {r["status"] for r in found.values()} == {"pass"}, found
    assert load(tmp_path, str(saved / "zero2"), BF16_ZERO2, 2)[0] == "LOADED"


def test_a_tag_that_is_not_there_and_a_root_without_latest(saved, tmp_path):
    root = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", root)
    (root / "latest").write_text("global_step9")
    assert lint(tmp_path, BF16_ZERO2, root, "--world-size", "2")["CKPT001"]["status"] == "fail"
    (root / "latest").unlink()
    found = lint(tmp_path, BF16_ZERO2, root, "--world-size", "2")["CKPT001"]
    assert found["status"] == "warn" and "starts from scratch" in found["message"]


def test_a_shard_cut_short_is_named(saved, tmp_path):
    root = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", root)
    shard = root / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    found = lint(tmp_path, BF16_ZERO2, root, "--world-size", "2")["CKPT002"]
    assert found["status"] == "fail" and str(shard) in found["message"], found
