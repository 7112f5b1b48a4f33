"""The transcripts of runs that need no cluster (tests/transcripts.py: a transcript is what preflight prints
today), each command run again in a folder shown as SHOWN_ROOT: the CKPT ones on checkpoints the libraries save in
this test (DeepSpeed, accelerate, DCP and the Trainer), the lint ones on the files the README lints."""
import json
import pathlib
import shutil

import pytest

from checkpoints import save_all, save_states
from transcripts import SIZES, TRANSCRIPTS, held, names, run

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHOWN_ROOT = "/tmp/pfdocs"
ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
         "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


@pytest.fixture(scope="module")
def ckpt_inputs(tmp_path_factory):
    """The CKPT transcripts' folder: zero2/ (DeepSpeed ZeRO-2, bf16, two ranks) and ds.json, its config; acc/
    (accelerate's project folder, two saves by two ranks); dcp/ (a DCP folder of two ranks, one data file cut
    short); out/ (a Trainer's output folder, checkpoint-1 to 3)."""
    root = tmp_path_factory.mktemp("pfdocs")
    deepspeed = save_all(tmp_path_factory.mktemp("deepspeed"))
    states = save_states(tmp_path_factory.mktemp("states"))
    shutil.copytree(deepspeed / "zero2", root / "zero2")
    (root / "ds.json").write_text(json.dumps(ZERO2, indent=2) + "\n")
    shutil.copytree(states / "accelerate", root / "acc")
    shutil.copytree(states / "dcp", root / "dcp")
    data = root / "dcp" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    shutil.copytree(states / "trainer", root / "out")
    return root


@pytest.fixture(scope="module")
def lint_inputs(tmp_path_factory):
    """The lint transcripts' folder: the files the pages show (tests/fixtures/transcripts), JobSet's own PyTorch
    example (tests/fixtures/k8s) and Meta-Llama-3-8B's config.json."""
    root = tmp_path_factory.mktemp("pfdocs")
    shutil.copytree(ROOT / "tests" / "fixtures" / "transcripts", root, dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests" / "fixtures" / "models" / "llama-3-8b-instruct", root / "Meta-Llama-3-8B")
    shutil.copy(ROOT / "tests" / "fixtures" / "k8s" / "jobset_pytorch_resnet.yaml", root)
    return root


@pytest.fixture(scope="module")
def examples_inputs(tmp_path_factory):
    """docs/examples as the docs ship it."""
    root = tmp_path_factory.mktemp("pfdocs")
    shutil.copytree(ROOT / "docs" / "examples", root, dirs_exist_ok=True)
    return root


INPUTS = {"ckpt": "ckpt_inputs", "lint": "lint_inputs", "examples": "examples_inputs"}  # a name's prefix: its folder


@pytest.mark.parametrize("name", [n for prefix in INPUTS for n in names(prefix + "-")])
def test_a_transcript_is_what_preflight_prints_today(name, request):
    root = request.getfixturevalue(INPUTS[name.split("-")[0]])
    held(name, run(name, root, {root: SHOWN_ROOT})[0], varies=SIZES if name.startswith("ckpt") else ())


def test_every_transcript_is_run_by_a_test_and_shown_in_the_docs():
    """A transcript nobody runs or shows is not kept: a test runs each (INPUTS here, or a test that names it:
    those on the test cluster), and a family page, README.md or a docs page shows it (make_docs puts it there)."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")])
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("**/test_*.py"))
    for path in TRANSCRIPTS.glob("*.txt"):
        assert path.stem.split("-")[0] in INPUTS or f'"{path.stem}"' in tests, f"{path.name}: no test runs it"
        assert f"transcript:{path.stem}:" in text or path.read_text().rstrip("\n") in text, \
            f"{path.name} is in no page: python scripts/make_docs.py --write"


def test_a_file_a_page_shows_beside_its_transcript_is_the_one_the_transcript_ran_on():
    page = (ROOT / "docs" / "linting.md").read_text()
    assert "$ cat train.sbatch\n" + (ROOT / "tests" / "fixtures" / "transcripts" / "train.sbatch").read_text() in page
