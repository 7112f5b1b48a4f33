"""What a new user meets in the first hour (the issue "The first hour"): each obstacle held by a test that failed
before it was fixed."""
from conftest import run_cli

CONFIG = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n"


def test_a_profiles_skip_of_a_check_lint_does_not_run_is_not_an_error(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(CONFIG)
    (tmp_path / "preflight.toml").write_text('[checks]\nskip = ["CLK002", "SYS"]\n')  # the README's profile
    code, _, err = run_cli(capsys, "lint", "--config", tmp_path / "a.yaml", "--profile", tmp_path / "preflight.toml")
    assert code in (0, 1) and "matches no check" not in err, err


def test_only_what_a_command_does_not_run_is_one_line_saying_so(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(CONFIG)
    code, _, err = run_cli(capsys, "lint", "--config", tmp_path / "a.yaml", "--only", "CLK002")
    assert code == 2 and "--only CLK002 selects no check this command runs" in err


def test_a_selector_that_names_no_check_at_all_is_still_an_error(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(CONFIG)
    code, _, err = run_cli(capsys, "lint", "--config", tmp_path / "a.yaml", "--skip", "CLK999")
    assert code == 2 and "selector 'CLK999' matches no check ID" in err


def test_mixed_precision_beside_a_deepspeed_file_gets_one_fix_and_following_it_passes(capsys, tmp_path):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true}, '
                                      '"zero_optimization": {"stage": 2}}')
    accelerate = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                  "num_machines: 1\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    (tmp_path / "acc.yaml").write_text(accelerate)
    code, doc, _ = run_cli(capsys, "lint", "--config", tmp_path / "acc.yaml", "--json")
    found = [r for r in doc["results"] if r["status"] in ("warn", "fail")]
    assert {r["id"] for r in found} == {"CFG005", "CFG050"}
    assert {r["remediation"] for r in found} == {"delete mixed_precision and set the precision in the DeepSpeed JSON"}
    (tmp_path / "acc.yaml").write_text(accelerate.replace("mixed_precision: bf16\n", ""))
    code, doc, _ = run_cli(capsys, "lint", "--config", tmp_path / "acc.yaml", "--json")
    assert code == 0 and not [r for r in doc["results"] if r["status"] in ("warn", "fail")], doc["results"]


def test_a_misspelt_option_gets_the_spelling_it_may_mean_and_the_commands_own_help(capsys, tmp_path):
    code, _, err = run_cli(capsys, "lint", "--confg", tmp_path / "a.yaml")
    assert code == 2
    assert "unrecognized arguments: --confg (did you mean --config?)" in err and "`preflight lint --help`" in err


def test_one_of_something_is_said_in_the_singular(capsys, tmp_path):
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n"
                                     "#SBATCH --gpus-per-node=1\nsrun python train.py\n")
    code, doc, _ = run_cli(capsys, "lint", "--sbatch", tmp_path / "job.sh", "--json", "-v")
    [line] = [r["message"] for r in doc["results"] if r["id"] == "CFG070" and r["status"] == "pass"]
    assert "3 directives; 1 node, 1 task per node, 1 GPU per node" in line, line


def test_the_skip_line_folds_the_inputs_an_accelerate_user_never_gave(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(CONFIG)
    code, out, _ = run_cli(capsys, "lint", "--config", tmp_path / "a.yaml")
    [line] = [x for x in out.splitlines() if " skipped: " in x]
    assert "for inputs not given (" in line and "--k8s" in line and "--sbatch" in line, line
    assert "no Kubernetes manifest given" not in line and "no batch script given" not in line, line


def test_a_not_given_skip_without_a_flag_is_folded_too():
    from preflight.report import render
    from preflight.result import Result, Status

    skips = [Result("CFG001", "a", Status.SKIP, (), "no launch command given", None, {}, 0.0),
             Result("CFG002", "b", Status.SKIP, (), "no batch script given (--sbatch)", None, {}, 0.0)]
    assert render.skip_line(skips) == "2 skipped: 2 for inputs not given (--sbatch)"


def test_the_train_extra_asks_for_a_range_of_torch_and_the_tests_pin_theirs():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    torch = next(Requirement(r) for r in extra if Requirement(r).name == "torch")
    assert not any(s.operator in ("==", "===") for s in torch.specifier), torch  # no replacing a training env's torch
    assert torch.specifier.contains("2.4.1") and torch.specifier.contains("2.13.0")
    assert "'torch==2.13.0'" in (root / "scripts" / "test").read_text()


def test_lint_deep_without_the_library_says_so_in_the_report(capsys, tmp_path, monkeypatch):
    import sys

    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}')
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` fails: not installed where lint runs
    code, out, _ = run_cli(capsys, "lint", "--deep", "--deepspeed", tmp_path / "ds.json")
    assert "WARN  CFG091" in out and "--deep: deepspeed is not importable here" in out, out


def test_slurm_scripts_writes_the_gate_scripts_naming_this_preflight_and_never_overwrites(capsys, tmp_path):
    import os

    code, out, err = run_cli(capsys, "slurm-scripts", tmp_path, "--preflight", "/envs/train/bin/preflight")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert code == 0 and names == ["preflight-epilog.sh", "preflight-healthcheck.sh", "preflight-prolog.sh"]
    prolog = (tmp_path / "preflight-prolog.sh").read_text()
    assert prolog.startswith("#!/bin/sh") and "PREFLIGHT=${PREFLIGHT:-/envs/train/bin/preflight}" in prolog
    assert '"$PREFLIGHT" node --budget 20 --drain' in prolog and os.access(tmp_path / "preflight-prolog.sh", os.X_OK)
    assert run_cli(capsys, "slurm-scripts", tmp_path, "--preflight", "/envs/train/bin/preflight")[0] == 0  # same
    (tmp_path / "preflight-epilog.sh").write_text("#!/bin/sh\n# the admin's own\n")
    (tmp_path / "preflight-prolog.sh").unlink()
    code, _, err = run_cli(capsys, "slurm-scripts", tmp_path, "--preflight", "/envs/train/bin/preflight")
    assert code == 2 and "preflight-epilog.sh: exists with other content; not overwritten" in err
    assert (tmp_path / "preflight-epilog.sh").read_text() == "#!/bin/sh\n# the admin's own\n"
    assert not (tmp_path / "preflight-prolog.sh").exists()  # nothing is written when one cannot be
    code, _, err = run_cli(capsys, "slurm-scripts", tmp_path / "nope")
    assert code == 2 and "is not a folder" in err
