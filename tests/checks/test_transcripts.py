"""The transcripts the docs show (docs/transcripts/NAME.txt: `$ preflight ...`, then what it printed) are what
preflight prints today: each command is run again, on inputs the libraries made in this test (DeepSpeed, accelerate,
DCP and the Trainer saving real checkpoints), in a folder shown as SHOWN_ROOT. Only what a run measures may differ
(MEASURED: its duration, sizes). PREFLIGHT_WRITE_TRANSCRIPTS=1 writes the transcripts from these runs instead
(then `python scripts/make_docs.py --write` puts them in the pages)."""
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from checkpoints import save_all, save_states

TRANSCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transcripts"
SHOWN_ROOT = "/tmp/pfdocs"
WRITE = os.environ.get("PREFLIGHT_WRITE_TRANSCRIPTS") == "1"
# what differs from run to run: the duration, and the sizes of files that hold measured values (a Trainer's
# trainer_state.json holds its losses)
MEASURED = [(re.compile(r" in \d+\.\d+ s$", re.M), " in N s"), (re.compile(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b"), "N B")]
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


INPUTS = {"ckpt": "ckpt_inputs"}  # a transcript's name prefix: the fixture that lays out its folder


def shown(text, root):
    return text.replace(str(root), SHOWN_ROOT)


@pytest.mark.parametrize("path", sorted(TRANSCRIPTS.glob("*.txt")), ids=lambda p: p.stem)
def test_a_transcript_is_what_preflight_prints_today(path, request):
    fixture = INPUTS.get(path.stem.split("-")[0])
    assert fixture, f"{path.name}: no inputs for it here (INPUTS)"
    root = request.getfixturevalue(fixture)
    command = path.read_text().splitlines()[0]
    assert command.startswith("$ preflight "), f"{path.name}: its first line is not `$ preflight ...`"
    argv = [sys.executable, "-m", "preflight", *shlex.split(command[len("$ preflight "):])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root,
                          env=dict(os.environ, COLUMNS="120", NO_COLOR="1"))
    assert "Traceback" not in proc.stderr and proc.returncode != 3, proc.stdout + proc.stderr  # 3: our own bug
    said = shown(f"{command}\n{proc.stdout}{proc.stderr}", root)
    if WRITE:
        path.write_text(said)
    assert measured(said) == measured(path.read_text()), said


def measured(text):
    for pattern, shown in MEASURED:
        text = pattern.sub(shown, text)
    return text


def test_every_transcript_is_in_the_docs():
    """A transcript nobody shows is not kept: each is in a family page or README.md (make_docs puts it there)."""
    docs = pathlib.Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [docs / "README.md", *(docs / "docs" / "checks").glob("*.md")])
    for path in TRANSCRIPTS.glob("*.txt"):
        assert path.read_text().rstrip("\n") in text, f"{path.name} is in no page: python scripts/make_docs.py --write"
