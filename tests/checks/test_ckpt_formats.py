"""CKPT on the other libraries' checkpoints, saved by the libraries themselves (accelerate's save_state and a DCP
folder by two CPU ranks, a Trainer's output folder by one process), as they are and as a killed save or a lost file
leaves them. Each verdict is held against the library's own load on the planned world: accelerate's load_state and
DCP's load on three ranks, accelerate of a DeepSpeed job on two, the Trainer's train(resume_from_checkpoint=...)."""
import json
import shutil
import subprocess
import sys

import pytest

from checkpoints import TRAINER_DS_CONFIG, load_states, save_states, trainer_deepspeed, trainer_resumes

ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}


def cut(path, keep):
    """The file cut short as a killed save leaves it: its first `keep` bytes (a negative keep: all but those)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The libraries' saves, and copies of them cut short or with a file gone."""
    root = save_states(tmp_path_factory.mktemp("states"))
    damaged = {
        "accelerate-cut": (root / "accelerate" / "checkpoints" / "checkpoint_1", "model.safetensors", 600),
        "dcp-cut": (root / "dcp", "__1_0.distcp", -100),
        "dcp-gone": (root / "dcp", "__0_0.distcp", None),
        "trainer-cut": (root / "trainer" / "checkpoint-3", "model.safetensors", -1000),
        "trainer-no-weights": (root / "trainer" / "checkpoint-3", "model.safetensors", None),
        "trainer-no-optimizer": (root / "trainer" / "checkpoint-3", "optimizer.pt", None),
    }
    for name, (source, file, keep) in damaged.items():
        shutil.copytree(source, root / name)
        if keep is None:
            (root / name / file).unlink()
        else:
            cut(root / name / file, keep)
    return root


@pytest.fixture(scope="module")
def libraries_say(saved, tmp_path_factory):
    """What each library's own load says of each save, on the planned world (3 ranks; a Trainer's one process)."""
    runs = tmp_path_factory.mktemp("loads")
    on_three = ["accelerate/checkpoints/checkpoint_1", "dcp", "accelerate-cut", "dcp-cut", "dcp-gone"]
    said = dict(zip(on_three, load_states(runs, [("dcp" if n.startswith("dcp") else "accelerate", saved / n)
                                                for n in on_three], 3)))
    [said["accelerate-as-deepspeed"]] = load_states(runs, [("accelerate", saved / on_three[0])], 2, deepspeed=True)
    trainer = ["trainer/checkpoint-3", "trainer-cut", "trainer-no-weights", "trainer-no-optimizer"]
    said.update(zip(trainer, trainer_resumes(runs / "trainer", [saved / n for n in trainer])))
    return said


def lint(tmp_path, resume, *extra):
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--resume-from", str(resume), "--world-size",
                           "3", "--json", "-v", "--only", "CKPT", *extra], capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}


# (the save as given, the library's case, what the library says, {check: status} where not pass or skip)
CASES = [
    ("accelerate", "accelerate/checkpoints/checkpoint_1", "LOADED", {}),  # the project folder: its newest
    ("dcp", "dcp", "LOADED", {}),  # DCP reshards two ranks' save to three
    ("accelerate-cut", "accelerate-cut", "REFUSED", {"CKPT002": "fail"}),
    ("dcp-cut", "dcp-cut", "REFUSED", {"CKPT002": "fail"}),
    ("dcp-gone", "dcp-gone", "REFUSED", {"CKPT002": "fail"}),
    ("trainer", "trainer/checkpoint-3", "LOADED", {}),  # the output folder: its newest checkpoint-N
    ("trainer-cut", "trainer-cut", "REFUSED", {"CKPT002": "fail"}),
    ("trainer-no-weights", "trainer-no-weights", "REFUSED", {"CKPT002": "fail"}),
    ("trainer-no-optimizer", "trainer-no-optimizer", "LOADED", {"CKPT002": "warn"}),  # loads, with a new optimizer
]


@pytest.mark.parametrize("given, case, says, judged", CASES, ids=[c[0] for c in CASES])
def test_ckpt_fails_where_the_library_refuses_to_load_and_only_there(saved, libraries_say, tmp_path, given, case,
                                                                      says, judged):
    found = lint(tmp_path, saved / given)
    said = libraries_say[case]
    assert said[0] == says, said
    assert {i: r["status"] for i, r in found.items() if r["status"] not in ("pass", "skip")} == judged, found
    assert found["CKPT001"]["status"] == "pass", found


def test_the_newest_save_of_a_folder_of_saves_is_the_one_judged(saved, tmp_path):
    accelerate = lint(tmp_path, saved / "accelerate")["CKPT001"]
    assert accelerate["message"].startswith(f"{saved}/accelerate/checkpoints/checkpoint_1: an accelerate save_state")
    trainer = lint(tmp_path, saved / "trainer")["CKPT001"]
    assert trainer["message"] == (f"{saved}/trainer/checkpoint-3: a Trainer checkpoint, the newest in "
                                  f"{saved}/trainer, at step 3; every rank loads the whole model and optimizer state")


def test_what_a_failure_names(saved, tmp_path):
    dcp = lint(tmp_path, saved / "dcp-cut")["CKPT002"]
    assert "__1_0.distcp: cut short" in dcp["message"] and ".metadata says its data runs to" in dcp["message"]
    assert "__0_0.distcp (named by .metadata) missing" in lint(tmp_path, saved / "dcp-gone")["CKPT002"]["message"]
    trainer = lint(tmp_path, saved / "trainer-no-weights")["CKPT002"]
    assert "Can't find a valid checkpoint" in trainer["message"]
    world = lint(tmp_path, saved / "accelerate")["CKPT003"]
    assert world["message"].endswith("rank 2 of 3 finds no random states of its own (accelerate logs it and goes "
                                     "on: the data order and random draws differ from a run not interrupted)")


def test_a_deepspeed_job_does_not_resume_a_save_without_deepspeed(saved, libraries_say, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ZERO2))
    accelerate = lint(tmp_path, saved / "accelerate", "--deepspeed", str(ds))["CKPT003"]
    said = libraries_say["accelerate-as-deepspeed"]
    assert said[0] == "REFUSED" and said[1].startswith("AssertionError"), said
    assert accelerate["status"] == "fail" and "assert len(self.ckpt_list) > 0" in accelerate["message"], accelerate
    trainer = lint(tmp_path, saved / "trainer", "--deepspeed", str(ds))["CKPT003"]
    assert trainer["status"] == "fail" and "Can't find a valid checkpoint" in trainer["message"], trainer
    # the Trainer with DeepSpeed resumes through transformers' own deepspeed_load_checkpoint: run as it is, with the
    # checkpoint the Trainer saved without DeepSpeed, it refuses before it touches the engine
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        deepspeed_load_checkpoint(None, str(saved / "trainer" / "checkpoint-3"))
    # a DCP folder is read by the job's own dcp.load, not by DeepSpeed's load_checkpoint: it reshards either way
    assert lint(tmp_path, saved / "dcp", "--deepspeed", str(ds))["CKPT003"]["status"] == "pass"


def test_the_trainer_with_deepspeed_resumes_on_the_world_that_saved_it_and_only_there(tmp_path):
    """Each checkpoint-N of a Trainer with DeepSpeed is a DeepSpeed root: its newest is judged as DeepSpeed loads
    it, and the Trainer resumes on the two ranks that saved it and refuses three."""
    saved = tmp_path / "out"
    assert trainer_deepspeed(saved, 2) == ("LOADED",)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(TRAINER_DS_CONFIG))
    on_two = lint(tmp_path, saved, "--deepspeed", str(ds), "--world-size", "2")
    assert [r for r in on_two.values() if r["status"] in ("fail", "warn")] == [], on_two
    assert on_two["CKPT001"]["message"].startswith(f"{saved}/checkpoint-3: the newest in {saved}, resumes from tag "
                                                   "global_step3"), on_two
    assert trainer_deepspeed(saved, 2, resume=saved / "checkpoint-3") == ("LOADED",)
    on_three = lint(tmp_path, saved, "--deepspeed", str(ds), "--world-size", "3")["CKPT003"]
    assert on_three["status"] == "fail" and "saved by 2 data-parallel ranks, the job runs 3" in on_three["message"]
    said = trainer_deepspeed(saved, 3, resume=saved / "checkpoint-3")
    assert said[0] == "REFUSED" and "used a DP world size of 2 but the current world size is 3" in said[1], said
    # resumed without DeepSpeed (an accelerate config without it): the Trainer loads the weights beside the tag
    # and, without optimizer.pt, goes on with a new optimizer
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
                          "num_processes: 2\nmixed_precision: 'no'\n")
    plain = lint(tmp_path, saved, "--config", str(accelerate))["CKPT003"]
    assert plain["status"] == "warn" and "loads model.safetensors and trainer_state.json, finds no optimizer.pt" \
        in plain["message"], plain
    assert trainer_resumes(tmp_path / "plain", [saved / "checkpoint-3"]) == [("LOADED",)]


def test_what_the_job_resumes_from_is_a_table_in_the_terminal_and_the_html(saved, tmp_path):
    """CKPT001 carries the files the resume reads, a rank's own by their pattern, with who loads them: the
    terminal and the HTML page show it under the results."""
    rows = lint(tmp_path, saved / "accelerate")["CKPT001"]["evidence"]["resume_files"]
    assert [(r["file"], r["loaded_by"], r["files"]) for r in rows] == [
        ("model.safetensors", "every rank", 1), ("optimizer.bin", "every rank", 1),
        ("random_states_R.pkl", "each rank R", 2), ("scheduler.bin", "every rank", 1)], rows
    page = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--resume-from", str(saved / "dcp"),
                           "--world-size", "3", "--only", "CKPT", "--html", str(page)], capture_output=True, text=True,
                          timeout=120)
    assert "what the job resumes from:" in proc.stdout and "__R_0.distcp  the ranks their shards need  2" in \
        proc.stdout, proc.stdout
    html = page.read_text()
    assert "<h2>What the job resumes from</h2>" in html and "<td>.metadata</td><td>every rank</td>" in html, html


HOSTILE = [  # what a node may send in place of its listing of the checkpoint
    {"exists": True, "format": ["deepspeed"], "picked": ["x"], "tag": {"a": 1}, "names": "abc", "count": "many"},
    {"exists": True, "format": {"dcp": 1}, "tag": None, "names": [1, None, "x"], "room": {"free_bytes": "lots"}},
    {"exists": True, "format": "deepspeed", "tag": ["global_step1"], "tag_exists": True, "names": None,
     "digest": ["x"], "room": {"free_bytes": 10, "writable": "yes"}},
    {"exists": True, "format": "accelerate", "picked": 7, "names": [["a"]], "room": []},
    "not a mapping", None, [],
]


@pytest.mark.parametrize("sent", HOSTILE, ids=range(len(HOSTILE)))
def test_a_node_that_sends_a_listing_of_another_shape_is_never_our_error(saved, sent):
    """CKPT005 and CKPT006 read what each node sends key by key: a wrong shape is judged or skipped, never
    raises (a check that raises is preflight's own bug, exit 3)."""
    from preflight import registry, runner
    from preflight.plan import build_plan
    from preflight.result import Status

    plan = build_plan(nodes=("n1",))
    save = saved / "accelerate" / "checkpoints" / "checkpoint_1"  # the save itself: no newest to pick first
    plan = plan.__class__(**{**plan.__dict__, "remote": True, "resume_from": str(save)})
    ctx = runner.CheckContext(plan, {"n1": {"facts": {"job": {"checkpoint": sent}}, "error": None}}, {})
    for check_id in ("CKPT005", "CKPT006"):
        found = runner.run_check(registry.load().get(check_id), ctx)
        assert found and all(r.status is not Status.ERROR for r in found), (check_id, found)
