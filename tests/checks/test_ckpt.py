"""CKPT on real DeepSpeed checkpoints, each verdict held against DeepSpeed's own load_checkpoint on the planned
world: a checkpoint saved by 2 ranks is refused on 3 (CKPT003 fails with DeepSpeed's words); converted as the fix
says (ds_to_universal, checkpoint.load_universal), CKPT passes and DeepSpeed loads it on 3."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from checkpoints import PIPE_CONFIG, load_each, load_pipeline, save_all

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


def config(stage, bf16, **more):
    return dict(BF16_ZERO2, zero_optimization={"stage": stage}, bf16={"enabled": bf16}, **more)


# (saved as, planned stage, planned bf16, the CKPT check that fails or None): every save by 2 ranks, loaded by 2
ON_TWO = [
    ("zero1", 2, False, None),  # stages 1 and 2 keep the optimizer in shards alike
    ("zero2", 1, True, None),
    ("zero3", 3, True, None),
    ("zero0", 0, False, None),
    ("zero2", 3, True, "CKPT003"),  # the model states of the other layout: an assertion
    ("zero3", 2, True, "CKPT003"),
    ("zero1", 0, False, "CKPT003"),  # the optimizer is in the shards, the job reads the model states'
    ("zero0", 1, False, "CKPT003"),  # no shards to open
    ("zero2", 2, False, "CKPT004"),  # bf16_zero_pp_rank_* saved, zero_pp_rank_* opened
    ("zero1", 1, True, "CKPT004"),
]


@pytest.fixture(scope="module")
def deepspeed_on_two(saved, tmp_path_factory):
    cases = [(saved / name, config(stage, bf16)) for name, stage, bf16, _ in ON_TWO]
    return dict(zip(range(len(ON_TWO)), load_each(tmp_path_factory.mktemp("load2"), cases, 2)))


@pytest.mark.parametrize("case", range(len(ON_TWO)), ids=[f"{n}-as-stage{s}-{'bf16' if b else 'fp32'}"
                                                          for n, s, b, _ in ON_TWO])
def test_ckpt_fails_where_deepspeed_refuses_to_load_and_only_there(saved, deepspeed_on_two, tmp_path, case):
    name, stage, bf16, failing = ON_TWO[case]
    found = lint(tmp_path, config(stage, bf16), saved / name, "--world-size", "2")
    said, line = deepspeed_on_two[case]
    assert said == ("REFUSED" if failing else "LOADED"), line
    assert {i for i, r in found.items() if r["status"] == "fail"} == ({failing} if failing else set()), found
    assert not {i for i, r in found.items() if r["status"] in ("warn", "error")}, found


def test_another_world_fails_as_deepspeed_refuses_it_and_the_fix_loads(saved, tmp_path):
    root = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", root)
    found = lint(tmp_path, BF16_ZERO2, root, "--world-size", "3")
    assert found["CKPT003"]["status"] == "fail", found
    assert "saved by 2 data-parallel ranks, the job runs 3" in found["CKPT003"]["message"]
    without_zero = lint(tmp_path, config(0, False), saved / "zero0", "--world-size", "3")
    assert {r["status"] for r in without_zero.values()} == {"pass", "skip"}, without_zero
    (said, line), (said0, line0) = load_each(tmp_path, [(root, BF16_ZERO2), (saved / "zero0", config(0, False))], 3)
    assert said == "REFUSED" and "DP world size of 2 but the current world size is 3" in line, line
    assert said0 == "LOADED", line0  # saved without ZeRO: any world
    fix = found["CKPT003"]["remediation"]
    command = fix.split("convert it once: ", 1)[1].split(" (it writes", 1)[0].split()
    assert command[:3] == ["python", "-m", "deepspeed.checkpoint.ds_to_universal"], fix
    converted = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    # the universal checkpoint loads on another world and into another precision, not at stage 3
    universal = [config(2, True), config(1, False), config(3, True)]
    universal = [dict(c, checkpoint={"load_universal": True}) for c in universal]
    verdicts = [lint(tmp_path, c, root, "--world-size", "3") for c in universal]
    assert [{i for i, r in v.items() if r["status"] == "fail"} for v in verdicts] == [set(), set(), {"CKPT003"}], \
        verdicts
    said = load_each(tmp_path, [(root, c) for c in universal], 3)
    assert [s[0] for s in said] == ["LOADED", "LOADED", "REFUSED"], said


def test_the_same_world_passes_and_deepspeed_loads_it(saved, tmp_path):
    found = lint(tmp_path, BF16_ZERO2, saved / "zero2", "--world-size", "2")
    assert {r["status"] for r in found.values()} == {"pass"}, found


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


def test_a_pipelines_layer_cut_short_fails_as_deepspeed_refuses_it(saved, tmp_path):
    """A two-stage pipeline's save: each stage loads its own model states and layer files, which global rank is
    which stage is the training code's; a layer file cut short stops the stage that loads it."""
    whole = lint(tmp_path, PIPE_CONFIG, saved / "pipe", "--world-size", "2")
    assert [i for i, r in whole.items() if r["status"] in ("fail", "warn")] == [], whole
    assert whole["CKPT002"]["message"].endswith("7 files, each whole"), whole  # 2 model states, 3 layers, 2 shards
    assert "each pipeline stage loads its own" in whole["CKPT001"]["message"], whole
    assert load_pipeline(tmp_path, saved / "pipe")[0] == "LOADED"
    root = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", root)
    layer = root / "global_step1" / "layer_02-model_states.pt"
    os.truncate(layer, layer.stat().st_size - 200)
    found = lint(tmp_path, PIPE_CONFIG, root, "--world-size", "2")["CKPT002"]
    assert found["status"] == "fail" and str(layer) in found["message"], found
    said = load_pipeline(tmp_path, root)
    assert said[0] == "REFUSED" and "failed finding central directory" in said[1], said


SGD = {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}
OPTIMIZERS = [  # (saved, the job's config, what DeepSpeed says, CKPT007's status, what its message says)
    ("zero2", config(2, True, optimizer=SGD, zero_allow_untested_optimizer=True), "KeyError 'momentum'", "fail",
     "KeyError: 'momentum'"),
    ("zero2", config(2, True, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}), None,
     "pass", "the same parameter groups"),
    ("zero3", config(3, True, optimizer={"type": "Adagrad", "params": {"lr": 1e-3}},
                     zero_allow_untested_optimizer=True), "ValueError loaded state dict contains a parameter group",
     "fail", "loaded state dict contains a parameter group"),
    ("zero1", config(1, False, optimizer={"type": "Adagrad", "params": {"lr": 1e-3}},
                     zero_allow_untested_optimizer=True), "KeyError 'sum'", "fail", "KeyError: 'sum'"),
    ("zero1-sgd", config(1, False, optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}),
     "KeyError 'step'", "fail", "KeyError: 'step'"),
]


def test_another_optimizer_fails_where_its_first_step_does_and_only_there(saved, tmp_path):
    """Held against DeepSpeed's own load_checkpoint and the first step after it, on the world that saved it."""
    said = load_each(tmp_path, [(saved / name, job) for name, job, *_ in OPTIMIZERS], 2, step=True)
    for (name, job, refused, status, message), (what, why) in zip(OPTIMIZERS, said):
        assert (what == "LOADED") == (refused is None) and (refused is None or why.startswith(refused)), (name, why)
        found = lint(tmp_path, job, saved / name, "--world-size", "2")["CKPT007"]
        assert found["status"] == status and message in found["message"], (name, found)


def test_a_stage_3_save_without_one_ranks_model_states_is_named(saved, tmp_path):
    root = tmp_path / "zero3"
    shutil.copytree(saved / "zero3", root)
    (root / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    found = lint(tmp_path, config(3, True), root, "--world-size", "2")
    assert found["CKPT002"]["status"] == "fail", found
    assert found["CKPT002"]["evidence"]["missing"] == ["zero_pp_rank_1_mp_rank_00_model_states.pt"], found


def lint_command(tmp_path, config, *command):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--deepspeed", str(ds), "--json", "-v",
                           "--only", "CKPT", "--", *command], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}


@pytest.mark.parametrize("flag", ["--resume_from_checkpoint", "--resume-from-checkpoint", "--load", "--resume"])
def test_the_training_scripts_own_resume_flag_names_the_checkpoint(saved, tmp_path, flag):
    for words in ([flag, str(saved / "zero2")], [f"{flag}={saved / 'zero2'}"]):
        found = lint_command(tmp_path, BF16_ZERO2, "accelerate", "launch", "--num_processes", "3", "train.py",
                             "--lr", "1e-4", *words)
        assert found["CKPT003"]["status"] == "fail", found
        assert "saved by 2 data-parallel ranks, the job runs 3" in found["CKPT003"]["message"]


@pytest.mark.parametrize("words,why", [
    (["--resume", "--lr", "3"], "no --resume-from given (nor a resume flag in the launch command)"),
    (["--resume_from_checkpoint", "True"], "no --resume-from given (nor a resume flag in the launch command)"),
    (["--load", "$CKPT_DIR"], "$CKPT_DIR (--load) is set when the job runs"),
    (["--load", "/nowhere/ckpt"], "/nowhere/ckpt (--load) is not on this machine"),
])
def test_a_resume_flag_that_names_no_checkpoint_here_is_not_judged(tmp_path, words, why):
    found = lint_command(tmp_path, BF16_ZERO2, "python", "train.py", *words)
    assert {r["status"] for r in found.values()} == {"skip"}, found
    assert all(r["message"].startswith(why) for r in found.values()), found


def test_a_node_without_room_for_the_next_save_fails(saved, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "pf-ckpt-test", str(small)], check=True)
    try:
        shutil.copytree(saved / "zero2", small / "zero2")
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps(BF16_ZERO2))

        def room():
            proc = subprocess.run([sys.executable, "-m", "preflight", "node", "--deepspeed", str(ds), "--resume-from",
                                   str(small / "zero2"), "--only", "CKPT006", "--json"], capture_output=True,
                                  text=True, timeout=120)
            [found] = json.loads(proc.stdout)["results"]
            return found

        assert room()["status"] == "pass", room()
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        (small / "filler").write_bytes(b"\0" * (free - 8192))  # less left than one tag (14 KiB)
        found = room()
        assert found["status"] == "fail" and "No space left on device" in found["message"], found
        assert found["evidence"]["tag_bytes"] > found["evidence"]["free_bytes"], found
    finally:
        subprocess.run(["umount", str(small)], check=True)
