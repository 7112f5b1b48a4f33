"""gpu_ids as torch reads them: accelerate exports the text unchanged as CUDA_VISIBLE_DEVICES
(accelerate/utils/launch.py), torch splits it at commas and reads up to the first item that is no index, and a
repeated index hides every GPU (torch/cuda/__init__.py _parse_visible_devices). CFG020 judges them the same way."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import run_cli

ONE_MACHINE = "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: {procs}\ngpu_ids: {ids}\n"


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def process_counts(capsys, tmp_path, procs, ids):
    (tmp_path / "accelerate.yaml").write_text(ONE_MACHINE.format(procs=procs, ids=ids))
    code, doc, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.yaml", "--json")
    assert code in (0, 1), err
    return [(r["status"], r["message"]) for r in doc["results"] if r["id"] == "CFG020"]


@pytest.mark.parametrize("text,seen", [("0,", [0]), ("0,1,", [0, 1]), (" 0 , 1 ", [0, 1]), ("0,,1", [0]),
                                       ("a", []), ("0,1,1", []), (",", [])])
def test_what_torch_reads_of_cuda_visible_devices(monkeypatch, text, seen):
    """The reading CFG020 follows, from torch itself."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the 'train' extra)")
    import torch.cuda

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", text)
    assert torch.cuda._parse_visible_devices() == seen


@pytest.mark.parametrize("procs,ids", [(1, "0,"), (1, "'0,'"), (2, "0,1,"), (2, "' 0, 1 '")])
def test_a_comma_after_the_last_gpu_names_nothing_more(capsys, tmp_path, procs, ids):
    # `0,` is how a one-GPU MULTI_GPU launch gets past accelerate's `len(gpu_ids.split(",")) < 2`
    # (commands/launch.py); torch then sees GPU 0 alone
    assert process_counts(capsys, tmp_path, procs, ids) == [("pass", "no problem found")]


def test_an_empty_item_inside_hides_the_gpus_after_it(capsys, tmp_path):
    [(status, message)] = process_counts(capsys, tmp_path, 2, "'0,,1'")
    assert status == "fail" and "gpu_ids '0,,1' holds ''" in message, message
    assert "torch stops reading CUDA_VISIBLE_DEVICES at '', and never sees the GPUs after it" in message


@pytest.mark.parametrize("ids,words", [
    ("a,b", "gpu_ids 'a,b' holds 'a', 'b'"),
    ("'0,1,1,'", "gpu_ids '0,1,1,' lists a GPU twice; torch then sees no GPU at all"),
    ("','", "gpu_ids is ',', not 'all'"),
    ("'0,1,'", "gpu_ids lists 2 GPUs but each machine runs 4 processes"),  # the trailing comma is no third GPU
])
def test_gpu_ids_torch_cannot_use_fail(capsys, tmp_path, ids, words):
    found = process_counts(capsys, tmp_path, 4, ids)
    assert [s for s, _ in found] == ["fail"] and words in found[0][1], found
