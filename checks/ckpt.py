"""CKPT: will the job resume? The DeepSpeed checkpoint named by --resume-from, read as files (never unpickled:
preflight.node.checkpoint) on the machine preflight runs on, against the planned job, before anything loads it.
Each node's own view of it (a node without the shared filesystem) is not read yet."""
from __future__ import annotations

from typing import Iterator

from preflight.api import Finding, check, fail, passed, skip, warn

UNIVERSAL_FIX = ("or convert it once: python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag_path} "
                 "--output_folder {tag_path}_universal{inject} (it writes {root}/latest_universal) and set "
                 "checkpoint.load_universal: true in the DeepSpeed config")


def _resume(ctx):
    facts = ctx.plan.resume
    if facts is None:
        return None, skip("no --resume-from given")
    if facts.get("format") != "deepspeed":
        return None, skip(f"{facts.get('path')}: not a DeepSpeed checkpoint (the other formats are not read yet)")
    return facts, None


@check("CKPT001", "resume-tag", "config", tags=["checkpoint", "resume", "deepspeed"])
def resume_tag(ctx) -> Iterator[Finding]:
    """The checkpoint to resume from names a tag that is there.

    DeepSpeed's load_checkpoint reads the tag from `latest` in the folder it is given; without that file and
    without a tag it only warns and returns nothing, and the job trains from scratch. A `latest` naming a tag
    folder that is not there fails when the first file is opened, after the model has loaded on every node.

    Give the checkpoint root that save_checkpoint wrote (with its `latest`) or the tag folder itself.
    """
    facts, skipped = _resume(ctx)
    if skipped:
        yield skipped
        return
    root = facts["path"]
    if facts["tag"] is None:
        yield warn(f"{root}: no `latest` file and no tag: DeepSpeed's load_checkpoint warns \"Unable to find latest "
                   "file\" and returns (None, None), so the job starts from scratch",
                   f"give the tag folder ({root}/global_stepN), or write its name into {root}/latest", path=root)
    elif not facts["tag_exists"]:
        yield fail(f"{root}/latest names {facts['tag']!r}, which is not a folder in {root}",
                   f"point {root}/latest at a tag that is there, or give the tag folder", path=root, tag=facts["tag"])
    else:
        yield passed(f"{root}: resumes from tag {facts['tag']}", path=root, tag=facts["tag"])


@check("CKPT002", "resume-files", "config", tags=["checkpoint", "resume", "deepspeed"])
def resume_files(ctx) -> Iterator[Finding]:
    """Every file the ranks load is there and whole.

    Each data-parallel rank loads its own ZeRO shard (`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, and at
    stage 3 its model states), rank 0 the model states. A save that was killed leaves a file cut short (a torch
    file is a zip: its central directory, at the end, is gone), or none at all.

    Resume from the last tag whose save finished, or save again.
    """
    facts, skipped = _resume(ctx)
    if skipped:
        yield skipped
        return
    if not facts.get("tag_exists"):
        yield skip("the tag is not there (CKPT001)")
        return
    tag_path = f"{facts['path']}/{facts['tag']}"
    files = facts.get("files") or {}
    broken = {name: found["whole"] for name, found in files.items() if found.get("whole") is not True}
    saved = facts.get("saved") or {}
    dp = saved.get("dp_world_size")
    missing = []
    if isinstance(dp, int) and dp > 0 and not facts.get("universal"):
        names = set(files)
        for rank in range(dp):
            if not any(n.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for n in names):
                missing.append(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    if not any(n.startswith("mp_rank_") or "_model_states" in n for n in files):
        missing.append("mp_rank_00_model_states.pt")
    for name, why in sorted(broken.items()):
        yield fail(f"{tag_path}/{name}: {why}", "resume from the last tag whose save finished, or save again",
                   path=f"{tag_path}/{name}")
    if missing:
        yield fail(f"{tag_path}: {', '.join(missing)} missing (saved by {dp} data-parallel ranks)",
                   "resume from the last tag whose save finished, or copy the missing files", path=tag_path,
                   missing=missing)
    if not broken and not missing:
        yield passed(f"{tag_path}: {len(files)} file{'s' if len(files) != 1 else ''}, each whole", path=tag_path)


@check("CKPT003", "resume-world", "config", tags=["checkpoint", "resume", "deepspeed", "zero"])
def resume_world(ctx) -> Iterator[Finding]:
    """The checkpoint was saved by the data-parallel world and ZeRO stage the job will load it with.

    DeepSpeed refuses to load ZeRO optimizer states saved by another data-parallel world size ("The checkpoint
    being loaded used a DP world size of 2 but the current world size is 3. Automatic adjustment of ZeRO's
    optimizer state partitioning with a new world size is not currently supported", runtime/engine.py), after the
    model has loaded on every node. A universal checkpoint (ds_to_universal, checkpoint.load_universal) loads on
    any world.

    Run the world it was saved with, or convert it with ds_to_universal and set checkpoint.load_universal.
    """
    facts, skipped = _resume(ctx)
    if skipped:
        yield skipped
        return
    saved = facts.get("saved") or {}
    dp, stage = saved.get("dp_world_size"), saved.get("zero_stage")
    if facts.get("universal"):
        yield passed(f"{facts['path']}: a universal checkpoint: it loads on any data-parallel world")
        return
    if dp is None:
        yield skip(f"{facts['path']}: how many ranks saved it is not known (its model states were not read)")
        return
    if (saved.get("tp_degree") or 1) > 1 or (saved.get("pp_degree") or 1) > 1:
        yield skip(f"saved with tensor parallel {saved.get('tp_degree')} and pipeline {saved.get('pp_degree')}: the "
                   "job's degrees are set by its training code, not judged")
        return
    world, source = ctx.plan.world_size
    if world is None:
        yield skip(f"the world size is {source}")
        return
    root, tag = facts["path"], facts["tag"]
    tag_path = f"{root}/{tag}"
    planned_stage = _planned_stage(ctx)
    evidence = dict(saved_dp_world_size=dp, dp_world_size=world, world_size_from=source, saved_zero_stage=stage,
                    zero_stage=planned_stage, path=tag_path)
    if world != dp:
        yield fail(f"{tag_path}: saved by {dp} data-parallel ranks, the job runs {world} ({source}): DeepSpeed "
                   f"refuses ZeRO optimizer states of another world size (\"The checkpoint being loaded used a DP "
                   f"world size of {dp} but the current world size is {world}\")",
                   f"run {dp} processes, " + UNIVERSAL_FIX.format(
                       tag_path=tag_path, root=root,
                       # saved without Megatron's universal_checkpoint_info: the conversion asserts without this
                       inject="" if saved.get("universal_info") else " --inject_missing_state"), **evidence)
        return
    if isinstance(stage, int) and isinstance(planned_stage, int) and (stage == 3) != (planned_stage == 3):
        yield fail(f"{tag_path}: saved at ZeRO stage {stage}, the job runs stage {planned_stage}: stage 3 keeps "
                   "each rank's parameters in files of their own, which the other stages do not read (nor the "
                   "reverse)", f"run ZeRO stage {stage}, or convert the checkpoint with ds_to_universal",
                   **evidence)
        return
    yield passed(f"{tag_path}: saved by {dp} data-parallel ranks at ZeRO stage {stage}, as the job runs",
                 **evidence)


def _planned_stage(ctx):
    ds = ctx.plan.deepspeed
    stage = ds.get("zero_optimization", "stage") if ds is not None else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None
