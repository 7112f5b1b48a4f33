"""`preflight lint --sbatch SCRIPT` on the command line: the batch script's checks in the JSON document, config-lint
results with no nodes, and bad input as exit 2 with one line that names the file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import preflight_json, run_cli
from lint_results import assert_exit_2_in_one_line, without_slurm_environment

TORCHTITAN = Path(__file__).resolve().parent.parent / "fixtures" / "sbatch" / "torchtitan_multinode_trainer.slurm"
NO_SRUN = Path(__file__).resolve().parent.parent / "fixtures" / "sbatch" / "no_srun_issue2816.sh"


@pytest.fixture(autouse=True)
def no_sbatch_environment(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    without_slurm_environment(monkeypatch)


def test_a_working_batch_script_is_ready(capsys):
    code, doc, err = run_cli(capsys, "lint", "--sbatch", TORCHTITAN, "--json")
    assert code == 0, err
    batch = [r for r in doc["results"] if r["id"] in ("CFG070", "CFG071", "CFG072", "CFG073", "CFG074")]
    assert [r["status"] for r in batch] == ["pass"] * 5
    assert all(r["nodes"] == [] for r in doc["results"])  # config lint: no node


def test_a_broken_batch_script_is_not_ready():
    doc, _ = preflight_json("lint", "--sbatch", NO_SRUN)
    assert doc["verdict"] == "fail"
    assert any(r["id"] == "CFG071" and r["status"] == "fail" for r in doc["results"])


def test_the_command_after_dashes_is_the_launch_the_cfg_checks_read(capsys):
    # `-- COMMAND` wins as the launch command (CFG007 reads it); the CFG07x checks judge the script's own line
    code, doc, err = run_cli(capsys, "lint", "--sbatch", TORCHTITAN, "--json", "--", "torchrun", "--nnodes", "4",
                             "--nproc_per_node", "8", "other.py")
    assert code == 0, err
    launch = [r for r in doc["results"] if r["id"] == "CFG007"]
    assert "'other.py'" in launch[0]["message"]
    assert [r["evidence"]["line"] for r in doc["results"] if r["id"] == "CFG071"] == [62]


@pytest.mark.parametrize("make,problem", [
    (lambda d: (d / "t.py").write_text("import torch\n") and d / "t.py", "first line must start with #!"),
    (lambda d: (d / "b.sh").write_bytes(b"#!\x00\x01") and d / "b.sh", "binary data"),
    (lambda d: (os.mkfifo(d / "p.sh"), d / "p.sh")[1], "not a regular file"),
    (lambda d: d / "missing.sh", "cannot be read"),
])
def test_bad_input_is_exit_2_in_one_line(capsys, tmp_path, make, problem):
    assert_exit_2_in_one_line(capsys, "--sbatch", make(tmp_path), problem)


def test_an_empty_path_is_exit_2(capsys):
    code, out, err = run_cli(capsys, "lint", "--sbatch", "")
    assert code == 2 and "--sbatch" in err
