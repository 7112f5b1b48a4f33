"""The examples in docs/examples, as the README shows them: a batch script whose first srun step is the gate
(`preflight node` on every node) and a PyTorchJob whose init container is (`preflight check`). Each is linted
clean as a user lints it, so an example can never rot."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lint_results import lint, without_slurm_environment
from preflight.inputs import batchscript, manifests

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "docs" / "examples"


@pytest.fixture(autouse=True)
def in_the_examples_folder(monkeypatch):
    monkeypatch.chdir(EXAMPLES)  # the launch names accelerate.yaml beside the script, as the README runs it
    without_slurm_environment(monkeypatch)


def not_clean(found):
    return [(r["id"], r["status"], r["message"]) for rs in found.values() for r in rs
            if r["status"] in ("fail", "warn", "error")]


def test_the_batch_script_example_lints_clean(capsys):
    code, found = lint(capsys, "--sbatch", "train.slurm")
    assert code == 0 and not not_clean(found), not_clean(found)
    for check_id in ("CFG070", "CFG071", "CFG072", "CFG073", "CFG074", "CFG001", "CFG020"):
        assert [r["status"] for r in found[check_id]] == ["pass"], (check_id, found[check_id])


def test_the_batch_scripts_first_srun_step_is_the_gate():
    read = batchscript.load("train.slurm")
    (gate_line, gate), *_ = read.helpers
    assert gate.startswith("preflight node --config accelerate.yaml") and gate_line < read.main.line
    assert read.main.command.launcher == "accelerate"


def test_the_manifest_example_lints_clean(capsys):
    code, found = lint(capsys, "--k8s", "pytorchjob.yaml")
    assert code == 0 and not not_clean(found), not_clean(found)
    for check_id in ("CFG080", "CFG081", "CFG082", "CFG083", "CFG084", "CFG085"):
        assert {r["status"] for r in found[check_id]} == {"pass"}, (check_id, found[check_id])


def test_the_manifests_init_container_is_the_gate():
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    read = manifests.load("pytorchjob.yaml")
    for role in ("Master", "Worker"):
        pod = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        assert [c["command"][:2] for c in pod["initContainers"]] == [["preflight", "check"]]
        assert pod["initContainers"][0]["image"] == pod["containers"][0]["image"]  # the training image's software
    assert [(g.role, g.pods) for g in read.trainings[0].groups] == [("Master", 1), ("Worker", 1)]


def test_the_gate_lines_config_checks_pass_on_every_node(capsys):
    # `preflight node --config accelerate.yaml --budget 60`, as train.slurm runs it on each node: the launch line
    # that follows gives --main_process_ip, which the gate cannot know, so the file's lack of it is not judged
    from conftest import run_cli

    code, doc, err = run_cli(capsys, "node", "--config", "accelerate.yaml", "--budget", "60", "--only", "CFG",
                             "--json")
    bad = [(r["id"], r["status"], r["message"]) for r in doc["results"] if r["status"] in ("fail", "warn", "error")]
    assert not bad and code == 0, bad
    said = [r["message"] for r in doc["results"] if r["id"] == "CFG010"]
    assert any("the launch command must give --main_process_ip" in m for m in said), said
