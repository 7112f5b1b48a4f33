"""CKPT003 on model- and pipeline-parallel DeepSpeed checkpoints, each verdict held against DeepSpeed's own
load_checkpoint (and a training step) on the degrees the launch command names: a pipeline saved by 2 stages is
refused by 1, a tensor-parallel save by another tensor-parallel degree, with the words CKPT003 quotes; the same degrees
load and pass; converted as the fix says (ds_to_universal, checkpoint.load_universal), a pipeline loads on 1 stage."""
import json
import os
import subprocess
import sys

import pytest

from checkpoints import load_parallel, save_parallel
from preflight.inputs.settings import parallel_degrees
from preflight.plan import build_plan


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_parallel(tmp_path_factory.mktemp("parallel"))


def config(stage, universal=False):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}


def lint(tmp_path, resume, world, stage, tp=None, pp=None, universal=False, words=()):
    """The CKPT results for a job of `world` processes whose launch names these degrees (Megatron-DeepSpeed's
    flags; None: not named)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config(stage, universal)))
    flags = [w for name, n in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp))
             if n is not None for w in (name, str(n))]
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--deepspeed", str(ds), "--resume-from",
                           str(resume), "--world-size", str(world), "--json", "--only", "CKPT", "--", "torchrun",
                           "train.py", *flags, *words], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}


# (saved, the job's kind, degree and stage, the CKPT003 status, the words of DeepSpeed's that its message quotes)
ON_ONE = [
    ("pp2", "pipe", 1, 1, "fail", "The ZeRO checkpoint parameter-alignment layout does not match"),
    ("pp2-zero0", "pipe", 1, 0, "fail", "loaded state dict contains a parameter group that doesn't match the size"),
    ("tp2", "tp", 1, 1, "fail", "key: attention.dense.weight is not found in the checkpoint"),
]
ON_TWO = [  # the last one refused ends the run
    ("pp2", "pipe", 2, 1, "pass", None),
    ("tp2", "tp", 2, 1, "pass", None),
    ("pp1", "pipe", 2, 1, "fail", "The checkpoint being loaded used a DP world size of 2 but the current world size is 1"),
]


@pytest.mark.parametrize("world,cases", [(1, ON_ONE), (2, ON_TWO)], ids=["on-one-rank", "on-two-ranks"])
def test_another_degree_fails_with_deepspeeds_words_and_the_same_passes(saved, tmp_path, world, cases):
    said = load_parallel(tmp_path, [(saved / name, kind, n, stage, False) for name, kind, n, stage, *_ in cases],
                         world)
    for (name, kind, n, stage, status, words), (what, *why) in zip(cases, said):
        found = lint(tmp_path, saved / name, world, stage, tp=n if kind == "tp" else 1, pp=n if kind == "pipe" else 1)
        assert what == ("LOADED" if status == "pass" else "REFUSED"), (name, why)
        assert found["CKPT003"]["status"] == status, (name, found["CKPT003"])
        if words:
            assert words in why[0] and words in found["CKPT003"]["message"], (name, why, found["CKPT003"])
        else:
            assert not [r for r in found.values() if r["status"] in ("fail", "error")], (name, found)


def test_the_fixs_universal_conversion_loads_the_pipeline_on_one_stage(saved, tmp_path):
    import shutil

    root = tmp_path / "pp2"
    shutil.copytree(saved / "pp2", root)
    fix = lint(tmp_path, root, 1, 1, tp=1, pp=1)["CKPT003"]["remediation"]
    assert "or load the module alone" in fix, fix
    command = fix.split("convert it once: ", 1)[1].split(" (it writes", 1)[0].split()
    converted = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    found = lint(tmp_path, root, 1, 1, tp=1, pp=1, universal=True)
    assert not [r for r in found.values() if r["status"] in ("fail", "error")], found
    # Megatron-DeepSpeed's --universal-checkpoint sets checkpoint.load_universal (megatron/training.py)
    found = lint(tmp_path, root, 1, 1, tp=1, pp=1, words=("--load", str(root), "--universal-checkpoint"))
    assert not [r for r in found.values() if r["status"] in ("fail", "error")], found
    assert load_parallel(tmp_path, [(root, "pipe", 1, 1, True)], 1)[0][0] == "LOADED"


def test_a_three_layer_pipeline_is_not_told_to_convert(saved, tmp_path):
    """ds_to_universal shares the layers between the first and the last among the stages: with fewer than the stages
    it stops with ZeroDivisionError, so the fix names no conversion."""
    from checkpoints import save_all

    (tmp_path / "all").mkdir()
    pipe = save_all(tmp_path / "all") / "pipe"  # layer_00 to layer_02, two stages
    found = lint(tmp_path, pipe, 1, 1, tp=1, pp=1)["CKPT003"]
    assert found["status"] == "fail" and "ds_to_universal" not in found["remediation"], found
    converted = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                str(pipe / "global_step1"), "--output_folder", str(tmp_path / "universal"),
                                "--inject_missing_state"], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert converted.returncode != 0 and "ZeroDivisionError" in converted.stderr, converted.stderr[-2000:]


def test_degrees_the_job_does_not_name_are_not_judged(saved, tmp_path):
    found = lint(tmp_path, saved / "tp2", 2, 1)["CKPT003"]
    assert found["status"] == "skip", found
    assert "saved by 2 ranks (data parallel 1, TP 2 x PP 1)" in found["message"], found
    assert "tensor-parallel degree is not known" in found["message"], found
    found = lint(tmp_path, saved / "pp2", 4, 1, tp=1)["CKPT003"]  # the pipeline's stages are the code's
    assert found["status"] == "skip" and "pipeline degree is not known" in found["message"], found
    assert lint(tmp_path, saved / "pp2", 2, 1, pp=1)["CKPT003"]["status"] == "fail"  # one known degree differs


@pytest.mark.parametrize("words,world,config_tp,degrees", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=4"], 16, None, {"tp": 2, "pp": 4}),
    (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"], 16, None, {"tp": 8, "pp": 2}),
    (["--tensor-model-parallel-size", "$TP", "--no-pipeline-parallel"], 8, None, {"pp": 1}),
    (["--lr", "3"], 8, 4, {"tp": 4, "pp": 1}),  # AutoTP's mesh: data x tensor parallel, no pipeline
    (["--tensor-model-parallel-size", "2"], 8, 4, {"tp": 2}),  # Megatron's flag, not the config's AutoTP
    ([], 8, 1, {}),  # autotp_size 1: AutoTP off, an mpu of the code's may still split it
])
def test_the_degrees_are_read_where_the_job_names_them(tmp_path, words, world, config_tp, degrees):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(dict(config(1), **({"tensor_parallel": {"autotp_size": config_tp}} if config_tp else {}))))
    plan = build_plan(deepspeed=str(ds), world_size=world, command=("torchrun", "pretrain_gpt.py", *words))
    known, unknown = parallel_degrees(plan)
    assert {k: n for k, (n, _) in known.items()} == degrees, known
    assert set(unknown) == {"tp", "pp"} - set(degrees), unknown
