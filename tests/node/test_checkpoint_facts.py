"""preflight.node.checkpoint on real DeepSpeed checkpoints, saved by DeepSpeed itself on the CPU (gloo, two ranks,
torchrun) in one run for every layout the tests read: ZeRO-1, 2 and 3, bf16 and fp32. Then cut short, taken away
or swapped for a FIFO, as a killed save or a node without the shared filesystem leaves them."""
import os
import shutil

import pytest

from checkpoints import save_all
from preflight.node.checkpoint import deepspeed, read


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("checkpoints"))


@pytest.mark.parametrize("stage, precision, files", [
    (0, "fp32", {"mp_rank_00_model_states.pt"}),
    (1, "fp32", {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 "mp_rank_00_model_states.pt"}),
    (2, "bf16", {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 "mp_rank_00_model_states.pt"}),
    (3, "bf16", {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"}),
])
def test_a_checkpoint_deepspeed_saved_is_read_as_it_was_saved(saved, stage, precision, files):
    facts = deepspeed(str(saved / f"zero{stage}"))
    if stage == 0:  # without ZeRO the optimizer's state is in the model states
        assert facts["saved"]["optimizer_in_model_states"] is True and facts["saved"]["zero_stage"] == 0
        return
    assert facts["latest"] == facts["tag"] == "global_step1" and facts["tag_exists"]
    assert set(facts["files"]) == files and all(f["whole"] is True for f in facts["files"].values())
    # at stage 3 from rank 0's own model states
    assert facts["saved"]["dp_world_size"] == 2 and facts["saved"]["zero_stage"] == stage
    assert facts["saved"]["precision"] == precision and facts["saved"]["ds_version"]
    assert facts["saved"]["optimizer_in_model_states"] is False  # ZeRO keeps it in the shards
    # the tag folder itself, as users pass it
    assert deepspeed(str(saved / f"zero{stage}" / "global_step1"))["tag"] == "global_step1"


def test_a_cut_a_missing_and_a_fifo_shard_are_each_named(saved, tmp_path):
    copy = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", copy)
    tag = copy / "global_step1"
    cut = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(cut, cut.stat().st_size // 2)
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    os.mkfifo(tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    facts = deepspeed(str(copy))
    assert facts["files"]["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]["whole"].startswith("not a whole torch")
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" not in facts["files"]
    assert facts["files"]["zero_pp_rank_2_mp_rank_00_optim_states.pt"]["whole"] == "not a regular file"
    (copy / "latest").write_text("global_step9")
    assert deepspeed(str(copy))["tag_exists"] is False


def test_a_folder_that_holds_no_deepspeed_checkpoint_is_said_so_quickly(saved, tmp_path):
    for i in range(200):  # a big folder of anything: only its first folders are looked into
        (tmp_path / f"d{i:03d}").mkdir()
    assert read(str(tmp_path))["format"] is None
    assert read(str(tmp_path / "nowhere"))["exists"] is False
    # a root without `latest`, a tag folder inside: DeepSpeed's own (it warns, CKPT001)
    shutil.copytree(saved / "zero1" / "global_step1", tmp_path / "d000" / "global_step1")
    found = read(str(tmp_path / "d000"))
    assert found["format"] == "deepspeed" and found["tag"] is None


def test_a_node_names_its_files_only_where_they_are_not_the_heads(saved, tmp_path):
    head = deepspeed(str(saved / "zero2"))
    same = deepspeed(str(saved / "zero2"), read=False, head_digest=head["digest"])
    assert same["names"] is None and same["digest"] == head["digest"] and same["count"] == 3
    copy = tmp_path / "zero2"
    shutil.copytree(saved / "zero2", copy)
    (copy / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    other = deepspeed(str(copy), read=False, head_digest=head["digest"])
    assert other["names"] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    assert "files" not in other and "saved" not in other  # names alone: the head reads the files once


def test_a_trainer_output_folder_resumes_from_its_newest_checkpoint(saved, tmp_path):
    # as the HF Trainer with DeepSpeed lays it out: engine.save_checkpoint(output_dir/checkpoint-N) each time
    for step in (5, 40, 9):
        shutil.copytree(saved / "zero2", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-100").write_text("a file, not a checkpoint")  # get_last_checkpoint takes folders only
    facts = read(str(tmp_path))
    assert facts["picked"] == "checkpoint-40" and facts["path"] == str(tmp_path / "checkpoint-40")
    assert facts["tag"] == "global_step1" and facts["tag_exists"] and facts["saved"]["dp_world_size"] == 2
