"""preflight.node.checkpoint on the files of a save without DeepSpeed, written by the libraries themselves in this
process (safetensors' save_file, DCP's save without a process group), then damaged as a killed save, a lost file or
a hostile folder leaves them; each verdict on a safetensors file is held against safetensors' own reader."""
import json
import os
import struct

import pytest

from preflight.node import checkpoint
from preflight.node.checkpoint import safetensors_file, saved_state

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def safetensors_reads(path):
    """What safetensors itself says of the file: None where it reads every tensor, else its error."""
    try:
        with open(path, "rb") as handle:
            safetensors_torch.load(handle.read())
        return None
    except Exception as exc:
        return type(exc).__name__


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"a.weight": torch.ones(64, 8), "b.bias": torch.zeros(8)}, str(path))
    return path


def test_a_whole_safetensors_file_is_whole(weights):
    assert safetensors_file(str(weights)) == {"bytes": weights.stat().st_size, "whole": True}
    assert safetensors_reads(weights) is None


@pytest.mark.parametrize("damage, says", [
    (lambda data: data[:-10], "cut short: "),
    (lambda data: data[:5], "shorter than a safetensors header"),
    (lambda data: struct.pack("<Q", 10 ** 9) + data[8:], "which safetensors refuses (HeaderTooLarge)"),
    (lambda data: struct.pack("<Q", len(data)) + data[8:], "its header runs past the end of the file"),
    (lambda data: data[:8] + b"\xff" + data[9:], "not a safetensors file"),
    (lambda data: data[:8] + b"[" + b" " * (struct.unpack("<Q", data[:8])[0] - 2) + b"]" + data[
        8 + struct.unpack("<Q", data[:8])[0]:], "its header is not a JSON object"),
], ids=["cut", "tiny", "huge-header", "header-past-end", "not-json", "json-list"])
def test_a_damaged_safetensors_file_is_named_and_safetensors_refuses_it_too(weights, damage, says):
    weights.write_bytes(damage(weights.read_bytes()))
    found = safetensors_file(str(weights))
    assert isinstance(found["whole"], str) and says in found["whole"], found
    assert safetensors_reads(weights) is not None


def test_a_fifo_or_nothing_in_place_of_the_weights_is_never_opened(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    assert safetensors_file(str(tmp_path / "model.safetensors"))["whole"] == "not a regular file"
    assert safetensors_file(str(tmp_path / "gone.safetensors"))["whole"] == "missing"


@pytest.fixture
def dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.ones(32, 32), "b": torch.zeros(32)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_dcp_metadata_names_each_data_file_and_the_bytes_it_holds(dcp_folder):
    facts = saved_state(str(dcp_folder))
    data = sorted(n for n in os.listdir(dcp_folder) if n.endswith(".distcp"))
    assert facts["format"] == "dcp" and facts["files"][".metadata"]["whole"] is True
    assert sorted(facts["needs"]) == data and data
    for name in data:
        need = facts["needs"][name]
        assert need["by"] == ".metadata" and need["there"] is True
        assert 32 * 32 * 4 < need["bytes"] <= (dcp_folder / name).stat().st_size


def test_a_data_file_gone_is_named_and_one_past_the_files_read_is_not(dcp_folder, monkeypatch):
    data = sorted(n for n in os.listdir(dcp_folder) if n.endswith(".distcp"))
    (dcp_folder / "__9_0.distcp").write_bytes(b"")  # listed after the first data file
    monkeypatch.setattr(checkpoint, "LISTED", 1)  # only .metadata is read: the data files are listed, not read
    facts = saved_state(str(dcp_folder))
    assert list(facts["files"]) == [".metadata"] and all(n["there"] for n in facts["needs"].values())
    monkeypatch.undo()
    (dcp_folder / data[0]).unlink()
    assert saved_state(str(dcp_folder))["needs"][data[0]]["there"] is False


def test_a_metadata_file_this_reader_does_not_follow_is_not_judged(dcp_folder):
    (dcp_folder / ".metadata").write_bytes(b"\x80\x05K\x01.")  # a pickle of 1: no storage_data in it
    facts = saved_state(str(dcp_folder))
    assert facts["format"] == "dcp" and facts["files"][".metadata"]["whole"] is None and facts["needs"] == {}


def test_a_json_file_of_the_users_own_is_not_what_the_resume_reads(tmp_path, weights):
    """accelerate's load_state reads its own files, not a note the user saved beside them: a broken one fails
    nothing. A broken weights index is read, and fails."""
    folder = weights.parent
    (folder / "random_states_0.pkl").write_bytes(b"\x80\x05N.")
    (folder / "notes.json").write_text("{not json")
    ok = lint(folder)
    assert ok["CKPT002"]["status"] == "pass", ok
    (folder / "model.safetensors.index.json").write_text("{not json")
    broken = lint(folder)["CKPT002"]
    assert broken["status"] == "fail" and "model.safetensors.index.json: not whole" in broken["message"], broken


def lint(folder):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "preflight", "lint", "--resume-from", str(folder), "--json",
                           "--only", "CKPT002"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)["results"]}
