"""CKPT: will the job resume? The checkpoint named by --resume-from, read as files (never unpickled:
preflight.node.checkpoint) on the machine preflight runs on, against the planned job, before anything loads it:
a DeepSpeed checkpoint, a DCP folder, accelerate's save_state or a Trainer's checkpoint-N. Each rule is the loading
library's own (DeepSpeed's load_checkpoint, accelerate's load_state, the Trainer's resume, DCP's load) and held
against it in tests/checks/test_ckpt.py, test_ckpt_formats.py and test_ckpt_parallel.py. Then on every node
(CKPT005): its own listing of the checkpoint against the files its ranks load."""
from __future__ import annotations

import re
from typing import Iterator, List

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.collective.options import format_size
from preflight.node.checkpoint import LAYER_FILE as LAYER, MODEL_FILE as MODEL_STATES, RNG_FILE, \
    ZERO3_MODEL_FILE as ZERO3_MODEL, ZERO_FILE as ZERO_SHARD

# the rank's number in the name of a file each rank saves and loads for itself
RANK_NUMBER = r"(?<=zero_pp_rank_)\d+|(?<=random_states_)\d+|(?<=rng_state_)\d+"
FORMATS = {"deepspeed": "a DeepSpeed checkpoint", "dcp": "a torch.distributed.checkpoint (DCP) folder",
           "accelerate": "an accelerate save_state folder", "trainer": "a Trainer checkpoint"}
# the files the Trainer resumes the model from (trainer.py _load_from_checkpoint: its WEIGHTS_NAME,
# SAFE_WEIGHTS_NAME, their indexes and the PEFT adapters'), else "Can't find a valid checkpoint"
TRAINER_WEIGHTS = ("pytorch_model.bin", "model.safetensors", "pytorch_model.bin.index.json",
                   "model.safetensors.index.json", "adapter_model.bin", "adapter_model.safetensors")
ACCELERATE_MODEL = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|pytorch_model_fsdp.*)$")
UNIVERSAL_FIX = ("or convert it once: python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag_path} "
                 "--output_folder {tag_path}_universal{inject} (it writes {root}/latest_universal) and set "
                 "checkpoint.load_universal: true in the DeepSpeed config")


def _resume(ctx, tag=False):
    """(the facts of the checkpoint this machine read, None) or (None, the skip); tag: its tag folder is there too."""
    facts = ctx.plan.resume
    if facts is None:
        return None, skip("no --resume-from given (nor a resume flag in the launch command)")
    path, named_by = facts.get("path"), facts.get("named_by")
    if facts.get("at_run_time"):
        return None, skip(f"{path} ({named_by}) is set when the job runs")
    if not facts.get("exists"):
        return None, skip(f"{path} ({named_by}) is not on this machine (each node's own copy is not read yet)")
    if facts.get("format") not in FORMATS:
        return None, skip(f"{path} ({named_by}): no checkpoint preflight reads (a DeepSpeed root or tag, a DCP "
                          "folder, an accelerate save_state folder, a Trainer checkpoint-N): the training code "
                          "loads it")
    if tag and facts["format"] == "deepspeed" and not facts.get("tag_exists"):
        return None, skip("the tag is not there (CKPT001)")
    return facts, None


def _given(ctx) -> str:
    return ctx.plan.job_path(ctx.plan.resume_from)


@check("CKPT001", "resume-tag", "config", tags=["checkpoint", "resume", "deepspeed"])
def resume_tag(ctx) -> Iterator[Finding]:
    """The checkpoint to resume from names a tag that is there.

    DeepSpeed's load_checkpoint reads the tag from `latest` in the folder it is given; without that file and
    without a tag it only warns and returns nothing, and the job trains from scratch. A `latest` naming a tag
    folder that is not there fails when the first file is opened, after the model has loaded on every node. The
    other libraries resume from a folder: DCP's, accelerate's save_state folder (its project's newest
    checkpoints/checkpoint_N under automatic checkpoint naming), a Trainer's checkpoint-N (the newest in its output
    folder, as resume_from_checkpoint=True picks it).

    Give the checkpoint root that save_checkpoint wrote (with its `latest`) or the tag folder itself.
    """
    facts, skipped = _resume(ctx)
    if skipped:
        yield skipped
        return
    root = facts["path"]
    newest = f", the newest in {_given(ctx)}" if facts.get("picked") else ""
    if facts["format"] != "deepspeed":
        step = (facts.get("trainer_state") or {}).get("global_step")
        at = f", at step {step}" if step is not None else ""
        yield passed(f"{root}: {FORMATS[facts['format']]}{newest}{at}{_by_rank(facts)}", path=root,
                     format=facts["format"], resume_files=_resume_files(facts))
        return
    if facts["tag"] is None:
        yield warn(f"{root}: no `latest` file and no tag: DeepSpeed's load_checkpoint warns \"Unable to find latest "
                   "file\" and returns (None, None), so the job starts from scratch",
                   f"give the tag folder ({root}/global_stepN), or write its name into {root}/latest", path=root)
    elif not facts["tag_exists"]:
        yield fail(f"{root}/latest names {facts['tag']!r}, which is not a folder in {root}",
                   f"point {root}/latest at a tag that is there, or give the tag folder", path=root, tag=facts["tag"])
    else:
        where = f": the newest in {_given(ctx)}," if facts.get("picked") else ":"
        stage = _module_only_stage(ctx)
        yield passed(f"{root}{where} resumes from tag {facts['tag']}{_by_rank(facts, stage)}", path=root,
                     tag=facts["tag"], resume_files=_resume_files(facts, stage))


RESUME_ROWS = 32  # rows of the table of what loads; a ZeRO save's shards are one row (rank R), whatever the world


def _module_only_stage(ctx):
    """The job's ZeRO stage where its launch asks DeepSpeed for the module alone, else None."""
    return ctx.plan.conditions[0].get("zero_stage", -1) if ctx.plan.module_only[0] else None


def _resume_files(facts, module_only=None) -> List[dict]:
    """The table of what the job loads (the terminal and the HTML show it under the results): the files of the
    save, relative to the folder CKPT001 names, a rank's own by their pattern (R for its number), each with who
    loads it, how many and their size; the files no resume reads (training_args.bin, a tokenizer's) are left
    out. module_only: the job's stage, where it loads the module alone (its shards: no rank below stage 3, every
    rank at 3)."""
    rows: dict = {}
    for name, found in sorted((facts.get("files") or {}).items()):
        who = _loaded_by(facts, name)
        shard = facts["format"] == "deepspeed" and (module_only is not None and ZERO_SHARD.match(name)
                                                    or module_only == 3 and ZERO3_MODEL.match(name))
        if shard:
            who = "every rank" if module_only == 3 else None
        if who is None:
            continue
        shown = re.sub(RANK_NUMBER, "R", name) if who == "each rank R" or shard else \
            re.sub(r"(^|/)__\d+_", r"\1__R_", name) if name.endswith(".distcp") else name  # DCP: __RANK_N.distcp
        row = rows.setdefault(shown, {"file": shown, "loaded_by": who, "files": 0, "bytes": 0})
        row["files"] += 1
        row["bytes"] += found.get("bytes") if isinstance(found.get("bytes"), int) else 0
    return [dict(row, bytes=format_size(row["bytes"])) for row in rows.values()][:RESUME_ROWS]


def _loaded_by(facts, name) -> str | None:
    """Who loads a file of the save, as its library opens it; None for a file no resume reads."""
    fmt = facts["format"]
    if fmt == "deepspeed":
        if _model_parallel(facts):
            return "its stage or model-parallel rank"
        return "each rank R" if ZERO_SHARD.match(name) or ZERO3_MODEL.match(name) else "every rank"
    if RNG_FILE.match(name):
        return "each rank R" if re.search(r"\d", name) else "one process"
    if fmt == "dcp" or name.endswith(".distcp"):
        return "every rank" if name.split("/")[-1] == ".metadata" else "the ranks their shards need"
    loaded = name in TRAINER_WEIGHTS or ACCELERATE_MODEL.match(name.split("/")[0]) or RESUMED.match(name)
    return "every rank" if loaded else None


# what accelerate's load_state and the Trainer read beside the weights: a sharded model's shards, the optimizer,
# the learning-rate schedule, the grad scaler, the Trainer's state
RESUMED = re.compile(r"^(?:(?:model|pytorch_model)-\d+-of-\d+\.(?:safetensors|bin)|(?:optimizer|scheduler)(?:_\d+)?"
                     r"\.(?:bin|pt)|scaler\.pt|trainer_state\.json)$")


def _by_rank(facts, module_only=None) -> str:
    """What every rank loads and what each rank loads for itself (its number as R), as the library names the
    files: DeepSpeed's model states and ZeRO shards (module_only: the job's stage, where it loads the module alone);
    the others' whole state and random states."""
    names = sorted(facts.get("files") or {})
    if facts["format"] == "dcp":
        return "; every rank reads .metadata and, of the data files, the bytes its own shards need"
    if facts["format"] == "deepspeed":
        if _model_parallel(facts):
            layers = any(LAYER.match(n) for n in names)
            return (f"; each {'pipeline stage' if layers else 'model-parallel rank'} loads its own "
                    f"mp_rank_NN_model_states.pt{' and its layers, layer_NN-*model_states.pt' if layers else ''}, "
                    "each data-parallel rank its own ZeRO shard of them (which global rank is which is the "
                    "training code's topology)")
        # a module-only load at stage 3 rebuilds the module from every rank's files (zero_to_fp32's
        # _get_fp32_state_dict_from_zero_checkpoint), below it reads no shard
        own = set() if module_only == 3 else \
            {n for n in names if ZERO3_MODEL.match(n) or ZERO_SHARD.match(n) and module_only is None}
        every = ", ".join([n for n in names if MODEL_STATES.match(n)] + sorted(
            {f"every {re.sub(RANK_NUMBER, 'R', n)}" for n in names
             if module_only == 3 and (ZERO_SHARD.match(n) or ZERO3_MODEL.match(n))}))
    else:
        own = {n for n in names if RNG_FILE.match(n) and re.search(r"\d", n)}
        every = "the whole model and optimizer state"
    mine = sorted({re.sub(RANK_NUMBER, "R", n) for n in own})
    return (f"; every rank loads {every}" if every else ";") + (
        f"{',' if every else ''} each rank R its own {' and '.join(mine)}" if mine else "")


@check("CKPT002", "resume-files", "config", tags=["checkpoint", "resume", "deepspeed"])
def resume_files(ctx) -> Iterator[Finding]:
    """Every file the save wrote is there and whole.

    Each data-parallel rank loads its own ZeRO shard (`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, and at
    stage 3 its own model states, `zero_pp_rank_R_mp_rank_00_model_states.pt`), every rank the model states
    (`mp_rank_00_model_states.pt`) below stage 3; a pipeline stage its own model states and its layers'
    (`layer_NN-model_states.pt`). A save that was killed leaves a file cut short (a torch file is a zip: its central
    directory, at the end, is gone), or none at all. A DCP `.metadata` names each data file and the bytes each
    holds; a sharded model's index (model.safetensors.index.json) its shards; a safetensors file says in its header
    where its tensors end. The Trainer resumes the model from model.safetensors or pytorch_model.bin (their index, a
    PEFT adapter, FSDP's folder), else stops with "Can't find a valid checkpoint"; it loads the optimizer and
    learning-rate schedule only when optimizer.pt and scheduler.pt are both there, and the step from
    trainer_state.json: without them it resumes with a new optimizer, or from step 0, without a word. accelerate's
    load_state opens the first model's weights (model.safetensors, else pytorch_model.bin). A module-only load
    (Megatron-DeepSpeed's --finetune) below stage 3 opens no optimizer shard: one missing or cut short is a warning.

    Resume from the last tag whose save finished, or save again.
    """
    facts, skipped = _resume(ctx, tag=True)
    if skipped:
        yield skipped
        return
    if facts["format"] != "deepspeed":
        yield from _state_files(facts)
        return
    tag_path = f"{facts['path']}/{facts['tag']}"
    files = facts.get("files") or {}
    broken = {name: found["whole"] for name, found in files.items() if found.get("whole") is not True}
    missing = _missing(facts)
    # a module-only load below stage 3 opens no optimizer shard: a save cut short there is said, not failed
    module_only, stage = ctx.plan.module_only[0], ctx.plan.conditions[0].get("zero_stage", -1)
    unread = (lambda name: bool(ZERO_SHARD.match(name))) if module_only and stage in (0, 1, 2) else (lambda _: False)
    for name, why in sorted(broken.items()):
        judge = warn if unread(name) else fail
        yield judge(f"{tag_path}/{name}: {why}" + (f" (not read: {module_only})" if unread(name) else ""),
                    "resume from the last tag whose save finished, or save again", path=f"{tag_path}/{name}")
    for names in ([n for n in missing if not unread(n)], [n for n in missing if unread(n)]):
        if not names:
            continue
        dp = (facts.get("saved") or {}).get("dp_world_size")
        by = f" (saved by {dp} data-parallel ranks)" if dp else ""
        judge, note = (warn, f"; not read: {module_only}") if unread(names[0]) else (fail, "")
        yield judge(f"{tag_path}: {', '.join(names)} missing{by}{note}",
                    "resume from the last tag whose save finished, or copy the missing files", path=tag_path,
                    missing=names)
    if not broken and not missing:
        yield passed(f"{tag_path}: {len(files)} file{'s' if len(files) != 1 else ''}, each whole", path=tag_path)


def _state_files(facts) -> Iterator[Finding]:
    """CKPT002 for a folder saved without DeepSpeed (DCP, accelerate, the Trainer)."""
    root, fmt = facts["path"], facts["format"]
    files, needs = facts.get("files") or {}, facts.get("needs") or {}
    broken = {name: found["whole"] for name, found in files.items()
              if isinstance(found.get("whole"), str) and _loaded(name, fmt)}
    missing = []
    for name, need in sorted(needs.items()):
        have = (files.get(name) or {}).get("bytes")
        if need.get("there") is False:
            missing.append(f"{name} (named by {need.get('by')})")
        elif isinstance(have, int) and isinstance(need.get("bytes"), int) and have < need["bytes"] \
                and name not in broken:
            broken[name] = f"cut short: {have} bytes, {need.get('by')} says its data runs to {need['bytes']}"
    fix = "resume from the last checkpoint whose save finished, or save again"
    for name, why in sorted(broken.items()):
        yield fail(f"{root}/{name}: {why}", fix, path=f"{root}/{name}")
    if missing:
        yield fail(f"{root}: {', '.join(missing)} missing", fix, path=root, missing=missing)
    failed = bool(broken or missing)
    if fmt == "trainer" and not (any(n in files for n in TRAINER_WEIGHTS) or any(
            n.startswith("pytorch_model_fsdp") or n.split("/")[-1] in TRAINER_WEIGHTS[4:] for n in files)):
        failed = True
        yield fail(f"{root}: no model weights ({', '.join(TRAINER_WEIGHTS[:2])}, an index, an adapter or FSDP's): "
                   f"the Trainer stops with \"Can't find a valid checkpoint at {root}\"", fix, path=root)
    if fmt == "accelerate" and not any(ACCELERATE_MODEL.match(n.split("/")[0]) for n in files):
        failed = True
        yield fail(f"{root}: no model weights (model.safetensors, pytorch_model.bin or FSDP's): accelerate's "
                   "load_state opens pytorch_model.bin for the first model and stops with FileNotFoundError", fix,
                   path=root)
    if fmt == "trainer":
        # its test: optimizer.pt, optimizer.bin or a folder named for the optimizer (FSDP's), and scheduler.pt
        optimizer = any(n in ("optimizer.pt", "optimizer.bin") or ("/" in n and "optimizer" in n.split("/")[0])
                        for n in files)
        lacking = [n for n, there in (("optimizer.pt", optimizer), ("scheduler.pt", "scheduler.pt" in files))
                   if not there]
        if lacking:
            failed = True
            yield warn(f"{root}: no {' and no '.join(lacking)}: the Trainer loads the optimizer and learning-rate "
                       "schedule only when both are there, and resumes with new ones without a word", fix, path=root)
        if "trainer_state.json" not in files:
            failed = True
            yield warn(f"{root}: no trainer_state.json: the Trainer loads the weights and counts from step 0, "
                       "repeating the schedule and the data already seen", fix, path=root)
    if not failed:
        checked = sum(1 for found in files.values() if found.get("whole") is True)
        whole = "each whole" if checked == len(files) else \
            f"{checked} read whole (the others' formats have no end to check)"
        yield passed(f"{root}: {len(files)} file{'s' if len(files) != 1 else ''}, {whole}"
                     + (f", every file {_needs_by(needs)} names there" if needs else ""), path=root)


def _loaded(name: str, fmt: str) -> bool:
    """Whether the library's resume reads this file: every weights, optimizer and data file; of the JSON files
    only a weights index, and the Trainer's trainer_state.json and config.json (_load_from_checkpoint) - a JSON
    file of the user's own is not read."""
    if not name.endswith(".json"):
        return True
    return name.endswith(".index.json") or (fmt == "trainer" and name in ("trainer_state.json", "config.json"))


def _needs_by(needs) -> str:
    return " and ".join(sorted({need.get("by", "?") for need in needs.values()}))


def _sharded(facts) -> bool:
    """Saved with ZeRO: each rank's optimizer state in a shard of its own, not in the model states."""
    return any(ZERO_SHARD.match(name) for name in facts.get("files") or {})


def _missing(facts) -> List[str]:
    """The files of the save's own layout that are not there (DeepSpeed's names: engine._get_ckpt_name,
    _get_rank_zero_ckpt_name), for every data-parallel and model-parallel rank that saved it."""
    names = set(facts.get("files") or {})
    saved = facts.get("saved") or {}
    dp, mp = saved.get("dp_world_size"), saved.get("mp_world_size") or 1
    zero3 = saved.get("zero_stage") == 3 or any(ZERO3_MODEL.match(n) for n in names)
    if facts.get("universal") or not isinstance(dp, int) or dp < 1:  # the layout is not known: one model file
        return [] if any("model_states" in n for n in names) else ["mp_rank_00_model_states.pt"]
    wanted = [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(dp) for m in range(mp)] if zero3 \
        else [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    missing = [name for name in wanted if name not in names]
    if _sharded(facts) or (saved.get("zero_stage") or 0) >= 1:
        prefix = "bf16_" if any(n.startswith("bf16_") for n in names) or saved.get("precision") == "bf16" else ""
        for r in range(dp):
            for m in range(mp):
                # the old name without the underscore is still read (engine._get_all_zero_checkpoint_names)
                if not {f"{prefix}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt",
                        f"{prefix}zero_pp_rank_{r}_mp_rank_{m:02d}optim_states.pt"} & names:
                    missing.append(f"{prefix}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt")
    return missing


@check("CKPT003", "resume-world", "config", tags=["checkpoint", "resume", "deepspeed", "zero"])
def resume_world(ctx) -> Iterator[Finding]:
    """The checkpoint was saved by the data-parallel world, tensor and pipeline degrees and ZeRO stage the job runs.

    DeepSpeed refuses to load ZeRO optimizer states saved by another data-parallel world size ("The checkpoint being
    loaded used a DP world size of 2 but the current world size is 3. Automatic adjustment of ZeRO's optimizer state
    partitioning with a new world size is not currently supported", runtime/engine.py), after the model has loaded
    on every node. At stage 3 each rank's parameters are in model states of its own, which the other stages do not
    look for, nor stage 3 for theirs: load_checkpoint finds no file and stops at `assert len(self.ckpt_list) > 0`
    (runtime/state_dict_factory.py). Saved with ZeRO, the optimizer is in the shards, which a job without ZeRO does
    not read; saved without, the shards a ZeRO job opens are not there. Stages 1 and 2 load each other's
    checkpoints, and a universal checkpoint (ds_to_universal, checkpoint.load_universal) loads on any world. Saved
    without DeepSpeed the world may change: DCP reshards its data to the ranks that load it; accelerate's save_state
    and the Trainer save one full model and optimizer state that every rank loads (a rank without random states of
    its own logs it and goes on). A DeepSpeed job does not read them: accelerate hands its model to DeepSpeed's
    load_checkpoint, which finds no model states and stops at `assert len(self.ckpt_list) > 0`; the Trainer with
    DeepSpeed looks for global_step folders and stops with "Can't find a valid checkpoint". A Trainer's checkpoint
    saved with DeepSpeed and resumed without it loads the weights the Trainer wrote beside the tag and starts a new
    optimizer. Saved or run model-parallel, the job's tensor- and pipeline-parallel degrees are those its launch or
    config names (Megatron-DeepSpeed's --tensor-model-parallel-size and --pipeline-model-parallel-size, DeepSpeed's
    tensor_parallel.autotp_size; its data-parallel size is the world over their product), the saved ones those the
    model states record; degrees the training code sets (its mpu, PipelineModule's num_stages) are not judged. A
    pipeline's layer files load on any number of stages, but each stage's optimizer state only on its own ("The ZeRO
    checkpoint parameter-alignment layout does not match", without ZeRO "loaded state dict contains a parameter group
    that doesn't match"); DeepSpeed merges tensor-parallel model states only by Megatron's layer names ("key:
    attention.dense.weight is not found in the checkpoint"). Saved without ZeRO, the data-parallel size may change.
    A module-only load (load_checkpoint(..., load_module_only=True): Megatron-DeepSpeed's --finetune; its
    --no-load-optim does not change DeepSpeed's load) reads no optimizer shard below stage 3, so another
    data-parallel world, pipeline or stage below 3 loads; at stage 3 each rank opens its own model states and rebuilds
    the module from every shard, so fewer ranks load, more do not; another tensor-parallel degree and the stage-3
    layout still fail. With sequence parallel (an mpu's sequence groups: Megatron-DeepSpeed's
    --ds-sequence-parallel-size, accelerate's and ALST's) ZeRO partitions over data x sequence parallel, the world
    over the tensor and pipeline degrees, whatever the sequence degree; a config with data_parallel_size and
    sequence_parallel_size builds a mesh over whose data dimension alone ZeRO partitions. AutoTP's mesh has no
    pipeline.

    Run the world, degrees and stage it was saved with, or convert it with ds_to_universal and set
    checkpoint.load_universal, or load the module alone where it loads (the optimizer starts afresh); resume a
    checkpoint saved without DeepSpeed without it.
    """
    facts, skipped = _resume(ctx, tag=True)
    if skipped:
        yield skipped
        return
    if facts["format"] != "deepspeed":
        yield from _state_world(ctx, facts)
        return
    saved = facts.get("saved") or {}
    root, tag = facts["path"], facts["tag"]
    tag_path = f"{root}/{tag}"
    known, unknown = ctx.plan.conditions
    stage = known.get("zero_stage", -1)
    if stage is None:
        beside = facts.get("beside") or []
        weights = [n for n in TRAINER_WEIGHTS if n in beside]
        if "trainer_state.json" in beside and weights:
            yield warn(f"{root}: saved by the Trainer with DeepSpeed, the job runs without it: the Trainer loads "
                       f"{weights[0]} and trainer_state.json, finds no optimizer.pt (the optimizer is in "
                       "DeepSpeed's shards) and goes on with a new optimizer and learning-rate schedule without a "
                       "word", "resume with the DeepSpeed config it was saved with, or accept a new optimizer",
                       path=root, saved_zero_stage=saved.get("zero_stage"))
            return
        yield skip("the job does not run DeepSpeed (its accelerate config uses no DeepSpeed), which this layout is for")
        return
    planned = stage if stage != -1 else None
    names = set(facts.get("files") or {})
    layout = 3 if any(ZERO3_MODEL.match(n) for n in names) else (
        "other" if any(n.startswith("mp_rank_") for n in names) else None)
    world, source = ctx.plan.world_size
    evidence = dict(saved_dp_world_size=saved.get("dp_world_size"), dp_world_size=world, world_size_from=source,
                    saved_zero_stage=saved.get("zero_stage"), zero_stage=planned, path=tag_path)
    if planned is not None and layout is not None and (layout == 3) != (planned == 3):
        was = saved.get("zero_stage") if isinstance(saved.get("zero_stage"), int) else 3 if layout == 3 else "0-2"
        saved_as = "stage 3 (each rank's model states in a file of its own)" if layout == 3 else \
            f"stage {was} (one model states file)"
        yield fail(f"{tag_path}: saved at ZeRO {saved_as}, the job runs stage {planned}: DeepSpeed's "
                   "load_checkpoint finds no model states file of its stage's name and stops at `assert "
                   "len(self.ckpt_list) > 0`", f"run ZeRO stage {was}, as it was saved", **evidence)
        return
    if facts.get("universal"):
        yield passed(f"{tag_path}: a universal checkpoint: it loads on any data-parallel world", **evidence)
        return
    dp = saved.get("dp_world_size")
    if dp is None:
        yield skip(f"{root}: how many ranks saved it is not known (its model states were not read)")
        return
    degrees, why = ctx.plan.degrees
    module_only, ignored = ctx.plan.module_only
    split = ""  # the degrees, where the checkpoint or the job is model-parallel
    if (saved.get("mp_world_size") or 1) > 1 or any(n > 1 for n, _ in degrees.values()):
        if world is None:
            yield skip(f"the world size is {source}")
            return
        was, mp = _saved_degrees(saved), saved.get("mp_world_size") or 1
        evidence.update(saved_tp_degree=was["tp"], saved_pp_degree=was["pp"],
                        **{f"{k}_degree": n for k, (n, _) in degrees.items()})
        changed, says = _degree_change(facts, was, degrees, world, module_only)
        if changed:
            yield fail(f"{tag_path}: {says}{ignored if changed == 'pp' else ''}",
                       _degree_fix(facts, changed, was, dp * mp, degrees), **evidence)
            return
        unknown = [k for k in ("tp", "pp") if k not in degrees]
        if unknown:
            yield skip(f"{tag_path}: saved by {dp * mp} ranks (data parallel {dp}, {_split(was)}); the job's "
                       + " and ".join(f"{NAMES[k]} degree is not known ({why[k]})" for k in unknown), **evidence)
            return
        tp, pp = degrees["tp"][0], degrees["pp"][0]
        if None in was.values():
            yield skip(f"{tag_path}: saved by {mp} model-parallel ranks before DeepSpeed wrote down their tensor and "
                       f"pipeline degrees (checkpoint_parallel_dimensions): whether TP {tp} x PP {pp} is their split "
                       "is not known", **evidence)
            return
        if world % (tp * pp):
            yield skip(f"the world ({world}, {source}) is not a multiple of TP {tp} x PP {pp} (Megatron-DeepSpeed "
                       "stops at its own assertion)", **evidence)
            return
        split = f" as {_split(was)} ({degrees['tp'][1]}; {degrees['pp'][1]})"
        world, source = world // (tp * pp), f"{world} processes ({source}) over TP {tp} x PP {pp}"
        evidence["dp_world_size"] = world
    if world is None:
        yield skip(f"the world size is {source}")
        return
    seq = ""  # the sequence-parallel split of the world the shards are judged against
    if ctx.plan.sequence_parallel:
        sp, fixed, where = ctx.plan.sequence_parallel
        if fixed is not None and not split:
            world, source = fixed, (f"{where}: deepspeed.initialize's data x sequence mesh, whose data dimension "
                                    "ZeRO partitions over")
        elif fixed is None and world % sp:
            yield skip(f"the data-parallel world ({world}, {source}) is not a multiple of the sequence-parallel "
                       f"degree ({where})", **evidence)
            return
        elif fixed is None:
            source += (f"; data parallel {world // sp} x sequence parallel {sp} ({where}), which ZeRO partitions "
                       "over together")
        evidence.update(sequence_parallel=sp, dp_world_size=world)
        seq = f" ({source})"
    sharded = _sharded(facts)
    if planned == 0 and sharded and known.get("precision") == "bf16":
        yield skip("saved with ZeRO, loaded at stage 0 with bf16 (DeepSpeed's bf16 optimizer): not judged")
        return
    if module_only:
        yield from _module_only(facts, module_only, planned, world, source, f" as {_split(was)}" if split else "",
                                evidence)
        return
    if planned == 0 and sharded:
        yield fail(f"{tag_path}: saved with ZeRO stage {saved.get('zero_stage')}, whose optimizer state is in each "
                   "rank's shard; the job runs without ZeRO and loads the optimizer from the model states, where "
                   "it is None (\"'NoneType' object has no attribute 'copy'\")",
                   f"run ZeRO stage {saved.get('zero_stage')} as it was saved, or load the module alone "
                   f"({MODULE_ONLY})", **evidence)
        return
    if planned == 0:
        every = "each data-parallel rank loads its model-parallel rank's model states" if split else \
            "every rank loads the same model states"
        yield passed(f"{tag_path}: saved without ZeRO{split} and loaded without it: {every}, on any data-parallel "
                     "world", **evidence)
        return
    if world != dp:
        yield fail(f"{tag_path}: saved by {dp} data-parallel ranks, the job runs {world} ({source}): DeepSpeed "
                   f"refuses ZeRO optimizer states of another world size (\"The checkpoint being loaded used a DP "
                   f"world size of {dp} but the current world size is {world}\"){ignored}",
                   f"run {dp * (saved.get('mp_world_size') or 1)} processes{' with ' + _split(was) if split else ''}"
                   + _universal_fix(facts, ", ") + (f", or load the module alone ({MODULE_ONLY}), which starts the "
                                                    "optimizer afresh" if planned in (1, 2) or planned == 3 and
                                                    world < dp else ""),
                   **evidence)
        return
    if planned is not None and not sharded:
        yield fail(f"{tag_path}: saved without ZeRO (its optimizer is in the model states), the job runs ZeRO "
                   f"stage {planned}, whose ranks open optimizer shards that are not there "
                   "(zero_pp_rank_0_mp_rank_00_optim_states.pt: FileNotFoundError)",
                   f"run without ZeRO (stage 0) as it was saved, or load the module alone ({MODULE_ONLY})",
                   **evidence)
        return
    how = f"at ZeRO stage {saved.get('zero_stage')}" if planned is None or planned == saved.get("zero_stage") else \
        f"at ZeRO stage {saved.get('zero_stage')}, which stage {planned} loads (both keep the optimizer in shards)"
    yield passed(f"{tag_path}: saved by {dp} data-parallel ranks{split} {how}, as the job runs{seq}", **evidence)


NAMES = {"tp": "tensor-parallel", "pp": "pipeline"}
MODULE_ONLY = "load_checkpoint(..., load_module_only=True); Megatron-DeepSpeed: --finetune"


def _module_only(facts, why, planned, world, source, split, evidence) -> Iterator[Finding]:
    """CKPT003 where the launch asks DeepSpeed to load the module alone (engine.load_checkpoint: no
    _load_zero_checkpoint), as DeepSpeed loads it in tests/checks/test_ckpt_modonly.py."""
    saved = facts.get("saved") or {}
    dp, tag_path = saved.get("dp_world_size"), f"{facts['path']}/{facts['tag']}"
    if planned is None:
        yield skip(f"{tag_path}: {why}: what it reads depends on the job's ZeRO stage, which is not known", **evidence)
        return
    head = f"{tag_path}: saved by {dp} data-parallel ranks{split}, the job runs {world} ({source}) with {why}"
    if planned == 3 and world > dp:  # each rank opens its own model states first (_get_all_ckpt_names)
        ranks = f"rank {dp} finds no {{}} of its own and stops" if world == dp + 1 else \
            f"ranks {dp}-{world - 1} find no {{}} of their own and stop"
        yield fail(f"{head}: data-parallel " + ranks.format(f"zero_pp_rank_{dp}_mp_rank_00_model_states.pt")
                   + " at `assert len(self.ckpt_list) > 0`",
                   f"run at most {dp} data-parallel ranks at ZeRO stage 3" + _universal_fix(facts, ", "), **evidence)
        return
    if planned == 3:
        reads = (f"each rank opens its own model states and rebuilds the whole module from all {dp} optimizer shards "
                 f"(get_fp32_state_dict_from_zero_checkpoint), on up to {dp} data-parallel ranks")
    else:
        reads = ("DeepSpeed reads the model states alone, not the ZeRO optimizer shards, on any data-parallel world, "
                 "stage below 3 and precision")
    pipeline = "; each stage reads its layers' files on any pipeline" if any(LAYER.match(n) for n in facts.get(
        "files") or {}) else ""
    yield passed(f"{head}: {reads}{pipeline}; the optimizer starts afresh", module_only=True, **evidence)


def _saved_degrees(saved) -> dict:
    """The tensor- and pipeline-parallel degrees the checkpoint was saved with (checkpoint_parallel_dimensions; 1 and 1
    for one model-parallel rank), None where DeepSpeed did not write them down."""
    if (saved.get("mp_world_size") or 1) == 1 and saved.get("tp_degree") is None and saved.get("pp_degree") is None:
        return {"tp": 1, "pp": 1}
    return {"tp": saved.get("tp_degree"), "pp": saved.get("pp_degree")}


def _split(degrees) -> str:
    return " x ".join(f"{k.upper()} {'?' if degrees[k] is None else degrees[k]}" for k in ("tp", "pp"))


def _degree_change(facts, was, degrees, world, module_only=None) -> tuple:
    """(which degree changed, what DeepSpeed says loading the save on it, with the optimizer state), or (None, "")
    where the job's known degrees are the saved ones, or where a module-only load takes the change (a pipeline's
    stages); held against DeepSpeed in tests/checks/test_ckpt_parallel.py and test_ckpt_modonly.py."""
    tp, pp = (degrees[k][0] if k in degrees else None for k in ("tp", "pp"))
    saved = facts.get("saved") or {}
    mp, dp = saved.get("mp_world_size") or 1, saved.get("dp_world_size")
    dp_now = world // (tp * pp) if tp and pp and not world % (tp * pp) else None
    if pp is not None and was["pp"] is not None and pp != was["pp"] and not module_only:
        if _sharded(facts) and dp_now is not None and dp_now != dp:  # the stages' layers load, then this
            says = (f"\"The checkpoint being loaded used a DP world size of {dp} but the current world size is "
                    f"{dp_now}\" (its data-parallel size changes too)")
        elif _sharded(facts):
            says = ("\"RuntimeError: The ZeRO checkpoint parameter-alignment layout does not match the current "
                    "zero_optimization.parameter_alignment setting\"")
            if pp > was["pp"]:
                says += (f", and a stage the save did not have finds no zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt"
                         " (FileNotFoundError)")
        else:
            says = ("\"ValueError: loaded state dict contains a parameter group that doesn't match the size of "
                    "optimizer's group\"")
        stages = f"{was['pp']} stage{'s' if was['pp'] != 1 else ''}"
        return "pp", (f"saved as a pipeline of {stages}, the job runs {pp} ({degrees['pp'][1]}): each stage's layers "
                      "load on any pipeline, its optimizer state only on the stage that saved it: DeepSpeed stops "
                      f"with {says}")
    if tp is not None and was["tp"] is not None and tp != was["tp"]:
        if tp < was["tp"]:
            says = ("merges the tensor-parallel ranks' model states only by Megatron's layer names (its inference "
                    "path): without them it stops at \"AssertionError: key: attention.dense.weight is not found in the "
                    "checkpoint\", with them at the optimizer state (\"RuntimeError: The size of tensor a (...) must "
                    "match the size of tensor b (...)\"; ZeRO-3: \"IndexError: tuple index out of range\")")
        else:
            says = ("hands each new tensor-parallel rank a whole rank's model states: without Megatron's layer names "
                    "it stops at \"RuntimeError: Error(s) in loading state_dict ... size mismatch\", with them a rank "
                    f"the save did not have finds no zero_pp_rank_0_mp_rank_{was['tp']:02d}_optim_states.pt "
                    "(FileNotFoundError)")
        return "tp", (f"saved with tensor parallel {was['tp']}, the job runs {tp} ({degrees['tp'][1]}): DeepSpeed "
                      + says)
    if tp is not None and pp is not None and None in was.values() and tp * pp != mp:
        return "mp", (f"saved by {mp} model-parallel ranks, the job runs TP {tp} x PP {pp} = {tp * pp}: DeepSpeed "
                      "loads a training checkpoint's optimizer state only on the model-parallel ranks that saved it")
    return None, ""


def _degree_fix(facts, changed, was, processes, degrees) -> str:
    """Run the saved degrees; a pipeline's stages may change for the module alone, or after a universal conversion."""
    if None in was.values():
        fix = f"run the split it was saved with, on {processes} processes"
    elif "autotp_size" in degrees.get("tp", (0, ""))[1] and was["pp"] == 1:
        fix = f"run tensor_parallel.autotp_size: {was['tp']} on {processes} processes, as it was saved"
    else:
        fix = (f"run tensor parallel {was['tp']} and pipeline {was['pp']} on {processes} processes, as it was saved "
               f"(Megatron-DeepSpeed: --tensor-model-parallel-size {was['tp']} --pipeline-model-parallel-size "
               f"{was['pp']})")
    if changed == "pp":
        fix += (f", or load the module alone ({MODULE_ONLY}, which also restarts its iteration count): each stage "
                "reads its layers' files on any pipeline")
    # converted without Megatron's universal_checkpoint_info, another tensor-parallel degree is not shown to load
    return fix + (_universal_fix(facts, ", ") if changed == "pp" or (facts.get("saved") or {}).get("universal_info")
                  else "")


def _state_world(ctx, facts) -> Iterator[Finding]:
    """CKPT003 for a folder saved without DeepSpeed (DCP, accelerate, the Trainer)."""
    root, fmt = facts["path"], facts["format"]
    files = facts.get("files") or {}
    known, _ = ctx.plan.conditions
    stage = known.get("zero_stage", -1)
    world, source = ctx.plan.world_size
    evidence = dict(path=root, format=fmt, dp_world_size=world, world_size_from=source)
    deepspeed_job = isinstance(stage, int) and not isinstance(stage, bool) and stage >= 0
    if deepspeed_job and fmt == "accelerate":
        yield fail(f"{root}: saved by accelerate without DeepSpeed, the job runs DeepSpeed (ZeRO stage {stage}): "
                   f"load_state hands the model to DeepSpeed's load_checkpoint({root}, 'pytorch_model'), which "
                   "finds no model states there and stops at `assert len(self.ckpt_list) > 0`",
                   "resume without DeepSpeed, as it was saved, or load its weights into the model before "
                   "accelerator.prepare (the optimizer state does not carry over)", **evidence)
        return
    if deepspeed_job and fmt == "trainer":
        yield fail(f"{root}: saved by the Trainer without DeepSpeed, the job runs DeepSpeed (ZeRO stage {stage}): "
                   f"the Trainer looks for global_step* folders there and stops with \"Can't find a valid "
                   f"checkpoint at {root}\" (transformers' deepspeed_load_checkpoint)",
                   f"resume without DeepSpeed, as it was saved, or start from its weights ({root} as the model "
                   "path) without resume_from_checkpoint", **evidence)
        return
    fsdp = sorted({n.split("/")[0] for n in files if n.startswith("pytorch_model_fsdp")})
    if fmt == "trainer" and fsdp and known.get("fsdp_version", -1) is None and stage is None:
        yield fail(f"{root}: saved with FSDP ({fsdp[0]}), the job runs without it: the Trainer stops with "
                   f"\"Checkpoint found at {root} is only supported when using PyTorch FSDP\"",
                   "resume with FSDP, as it was saved", **evidence)
        return
    if any(re.match(r"^pytorch_model_fsdp(_\d+)?_rank\d+\.bin$", n) for n in fsdp):
        yield skip(f"{root}: saved with FSDP's LOCAL_STATE_DICT (a file per rank): the world it loads on is not "
                   "judged")
        return
    if fmt == "dcp" or any(n.endswith("/.metadata") for n in files):
        yield passed(f"{root}: saved with torch.distributed.checkpoint (DCP), which reshards it to the ranks that "
                     "load it: any world", **evidence)
        return
    yield passed(f"{root}: one full model and optimizer state, which every rank loads: any world"
                 + _rng_note(files, world, fmt), **evidence)


def _rng_note(files, world, fmt) -> str:
    """The ranks that find no random states of their own (each loads its own by index; it logs that and goes on)."""
    indexes = (m.group(1) or m.group(2) for m in map(RNG_FILE.match, files) if m)
    saved = {int(index) for index in indexes if index}
    if not isinstance(world, int) or world < 2:
        return ""
    lacking = [r for r in range(world) if r not in saved]
    if not lacking:
        return ""
    if len(lacking) == 1:
        who = f"rank {lacking[0]} of {world} finds no random states of its own"
    else:
        who = f"ranks {_ranges(lacking)} of {world} find no random states of their own"
    by = "accelerate" if fmt == "accelerate" else "the Trainer"
    return f"; {who} ({by} logs it and goes on: the data order and random draws differ from a run not interrupted)"


def _ranges(ranks) -> str:
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def _universal_fix(facts, before="") -> str:
    """The conversion to a universal checkpoint, after `before`; "" where ds_to_universal cannot convert it: a tensor-
    parallel save without Megatron's universal_checkpoint_info (its slices are concatenated, replicated ones too: a
    TP 2 save loaded on TP 1 stops at "full param numel 8 != tensor slice numel 4"), a pipeline with fewer layers
    than its stages and two (the layers between the first and the last shared among the stages: ZeroDivisionError),
    a save without ZeRO (no shards to convert)."""
    root, tag = facts["path"], facts["tag"]
    saved = facts.get("saved") or {}
    layers = {n.split("-")[0] for n in facts.get("files") or {} if LAYER.match(n)}
    if (saved.get("tp_degree") or 1) > 1 and not saved.get("universal_info") or not _sharded(facts) or \
            layers and len(layers) < (saved.get("pp_degree") or 1) + 2:
        return ""
    return before + UNIVERSAL_FIX.format(tag_path=f"{root}/{tag}", root=root,
                                         # saved without Megatron's universal_checkpoint_info the conversion asserts
                                         inject="" if saved.get("universal_info") else " --inject_missing_state")


@check("CKPT004", "resume-precision", "config", tags=["checkpoint", "resume", "deepspeed", "precision"])
def resume_precision(ctx) -> Iterator[Finding]:
    """The job's bf16 setting matches the optimizer shards it loads.

    DeepSpeed names each rank's optimizer shard after bf16 (`bf16_zero_pp_rank_R_...` with bf16 enabled,
    `zero_pp_rank_R_...` without: engine._get_rank_zero_ckpt_name) and opens the name of the job's own setting, so
    a checkpoint saved with bf16 and loaded without it, or the reverse, stops with FileNotFoundError on the first
    shard. fp16 and fp32 share the names. A universal checkpoint loads into any precision, a module-only load
    (Megatron-DeepSpeed's --finetune) opens no shard by its name.

    Set bf16 as the checkpoint was saved, or convert it with ds_to_universal and set checkpoint.load_universal.
    """
    facts, skipped = _resume(ctx)
    if skipped:
        yield skipped
        return
    if facts["format"] != "deepspeed":
        yield skip(f"saved without DeepSpeed ({FORMATS[facts['format']]}), with no ZeRO optimizer shards named "
                   "by precision", path=facts["path"])
        return
    shards = sorted(n for n in facts.get("files") or {} if ZERO_SHARD.match(n))
    if facts.get("universal") or not shards:
        yield skip("no ZeRO optimizer shards to load" if not facts.get("universal") else
                   "a universal checkpoint loads into any precision")
        return
    known, unknown = ctx.plan.conditions
    precision, stage = known.get("precision"), known.get("zero_stage", -1)
    module_only, ignored = ctx.plan.module_only
    if module_only:  # stage 3 rebuilds the module from whichever shards are there (zero_to_fp32's glob)
        yield passed(f"{facts['path']}/{facts['tag']}: {module_only} opens no optimizer shard by its bf16 name",
                     module_only=True, saved_shard=shards[0])
        return
    if precision is None:
        yield skip(f"the job's precision is not known: {unknown.get('precision', 'no config gives it')}")
        return
    if stage == 0 or stage is None:
        yield skip("the job runs without ZeRO: it reads no shards (CKPT003)")
        return
    tag_path = f"{facts['path']}/{facts['tag']}"
    saved_bf16 = shards[0].startswith("bf16_")
    evidence = dict(precision=precision, saved_shard=shards[0], path=tag_path)
    if saved_bf16 != (precision == "bf16"):
        opens = shards[0][len("bf16_"):] if saved_bf16 else "bf16_" + shards[0]
        yield fail(f"{tag_path}: the optimizer shards were saved {'with' if saved_bf16 else 'without'} bf16 "
                   f"({shards[0]}), the job runs {precision} and opens {opens}: FileNotFoundError{ignored}",
                   f"set bf16.enabled: {'true' if saved_bf16 else 'false'} in the DeepSpeed config as it was saved"
                   + _universal_fix(facts, ", "), **evidence)
        return
    yield passed(f"{tag_path}: optimizer shards saved {'with' if saved_bf16 else 'without'} bf16, as the job "
                 f"runs ({precision})", **evidence)


# torch's optimizers that DeepSpeed builds from its config's optimizer.type (engine._configure_basic_optimizer),
# by the parameter-group or state key the first step reads that another family's saved state lacks (torch/optim:
# adam.py `state["step"]`, sgd.py `group["momentum"]`, adagrad.py `state["sum"]`); Adam and AdamW share theirs
FIRST_STEP_READS = {"adam": "step", "adamw": "step", "sgd": "momentum", "adagrad": "sum"}
FAMILY = {"adam": "Adam", "adamw": "Adam", "sgd": "SGD", "adagrad": "Adagrad"}


@check("CKPT007", "resume-optimizer", "config", tags=["checkpoint", "resume", "deepspeed", "optimizer"])
def resume_optimizer(ctx) -> Iterator[Finding]:
    """The job's optimizer is the one whose state the checkpoint holds.

    load_checkpoint hands the saved optimizer state to the job's optimizer (torch's Optimizer.load_state_dict),
    which takes the saved parameter groups in place of its own without looking at what wrote them: Adam's state
    loads into SGD or Adagrad without a word, and the first step stops with KeyError: 'momentum' (SGD) or 'sum'
    (Adagrad), the key its own step reads ('step' for Adam on SGD's state); at ZeRO stage 3 Adagrad refuses it in
    load_checkpoint ("loaded state dict contains a parameter group that doesn't match the size of optimizer's
    group"). The types come from the DeepSpeed config saved in the model states and the job's; an optimizer the
    training code builds is not known. A module-only load (Megatron-DeepSpeed's --finetune) loads no optimizer
    state.

    Resume with the optimizer type the checkpoint was saved with, or load the module alone
    (load_checkpoint(..., load_optimizer_states=False)) and start the optimizer afresh.
    """
    facts, skipped = _resume(ctx, tag=True)
    if skipped:
        yield skipped
        return
    if facts["format"] != "deepspeed":
        yield skip(f"saved without DeepSpeed ({FORMATS[facts['format']]}), whose optimizer the training code builds",
                   path=facts["path"])
        return
    known, unknown = ctx.plan.conditions
    planned, saved = known.get("optimizer"), (facts.get("saved") or {}).get("optimizer")
    module_only, ignored = ctx.plan.module_only
    if module_only:
        yield passed(f"{facts['path']}/{facts['tag']}: {module_only} loads no optimizer state: the job's optimizer "
                     "starts afresh", module_only=True, saved_optimizer=saved, optimizer=planned)
        return
    if facts.get("universal"):
        yield skip("a universal checkpoint: its optimizer state is loaded by parameter, not judged here")
        return
    if saved is None:
        yield skip("the checkpoint's DeepSpeed config names no optimizer type (its training code gave one), or its "
                   "model states were not read")
        return
    if planned is None:
        yield skip(f"the job's optimizer is not known: {unknown.get('optimizer', 'the job does not run DeepSpeed')}")
        return
    tag_path = f"{facts['path']}/{facts['tag']}"
    evidence = dict(saved_optimizer=saved, optimizer=planned, path=tag_path)
    if saved not in FAMILY or planned not in FAMILY:
        other = saved if saved not in FAMILY else planned
        yield skip(f"{other}: an optimizer whose saved state preflight does not judge", **evidence)
        return
    if FAMILY[saved] == FAMILY[planned]:
        yield passed(f"{tag_path}: saved with {saved}, the job runs {planned}: the same parameter groups and "
                     "state", **evidence)
        return
    stage = known.get("zero_stage", -1)
    if planned == "adagrad" and stage == 3:
        stops = ("load_checkpoint stops with ValueError (\"loaded state dict contains a parameter group that "
                 "doesn't match the size of optimizer's group\")")
    else:
        stops = (f"{FAMILY[planned]} loads it without a word, and its first step stops with KeyError: "
                 f"'{FIRST_STEP_READS[planned]}'")
    yield fail(f"{tag_path}: the optimizer state was saved by {FAMILY[saved]} ({saved}), the job runs "
               f"{FAMILY[planned]} ({planned}): {stops}{ignored}",
               f"set optimizer.type: {saved} as it was saved, or load the module alone ({MODULE_ONLY})", **evidence)


@check("CKPT005", "resume-on-node", "node", tags=["checkpoint", "resume", "deepspeed", "filesystem"])
def resume_on_node(ctx) -> Iterator[Finding]:
    """This node sees the checkpoint, the tag and the files its own ranks load.

    Every rank opens the checkpoint on its own node: with DeepSpeed `latest` for the tag, the model states (below
    stage 3 one file for all, at stage 3 its own), and its own ZeRO optimizer shard (engine._load_zero_checkpoint
    loads the shard of its data-parallel rank alone; a module-only load, Megatron-DeepSpeed's --finetune, the model
    states alone below stage 3 and every shard at stage 3); saved without DeepSpeed, the newest checkpoint-N, the whole
    model and optimizer state and its own random states (any rank reads any DCP data file). A node without the
    shared filesystem, or with a copy of its own, lacks them or resumes from another step: DeepSpeed warns "Unable
    to find latest file" and that rank starts from scratch beside the others, or it stops with FileNotFoundError
    after the model has loaded everywhere.

    Mount the checkpoint's filesystem on this node, or copy the tag folder (and `latest`) to the same path.
    """
    job = ctx.fact.get("job") if isinstance(ctx.fact.get("job"), dict) else {}
    seen = job.get("checkpoint")
    if not isinstance(seen, dict):
        yield skip("no --resume-from given (nor a resume flag in the launch command)")
        return
    path = seen.get("path")
    if "$" in str(path):
        yield skip(f"{path} is set when the job runs")
        return
    head = ctx.plan.resume if ctx.plan.resume and ctx.plan.resume.get("exists") else None
    ranks = _node_ranks(ctx)
    whose = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}" if ranks else "its ranks"
    load = "loads" if len(ranks) == 1 else "load"
    if not seen.get("exists"):
        yield fail(f"{path} is not on {ctx.node}, which {whose} {load} from", FIX_ON_NODE, path=path, ranks=ranks)
        return
    # a node sends anything: what is not text is not known
    tag, picked, fmt = (seen.get(k) if isinstance(seen.get(k), str) else None for k in ("tag", "picked", "format"))
    if head is not None and picked != head.get("picked") and head.get("picked"):
        yield fail(f"{path}: the newest checkpoint on {ctx.node} is {picked or 'none'}, on this machine "
                   f"{head['picked']}: {whose} would resume from another step than the other ranks", FIX_ON_NODE,
                   path=path, picked=picked, head_picked=head.get("picked"))
        return
    if head is not None and head.get("format") == "deepspeed" and head.get("tag") and tag != head.get("tag"):
        yield fail(f"{path}: {ctx.node}'s `latest` names {tag!r}, this machine's {head['tag']!r}: {whose} would "
                   "resume from another step than the other ranks", FIX_ON_NODE, path=path, tag=tag,
                   head_tag=head.get("tag"))
        return
    if fmt == "deepspeed" and not tag or fmt not in FORMATS:
        yield skip(f"{path} on {ctx.node}: no checkpoint to load that preflight reads (CKPT001 judges this "
                   "machine's)")
        return
    if tag and not seen.get("tag_exists"):
        yield fail(f"{path}/{tag} is not on {ctx.node}, which {whose} {load} from", FIX_ON_NODE, path=path, tag=tag)
        return
    folder = f"{seen.get('path')}/{tag}" if tag else seen.get("path")
    names = seen.get("names")
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else None  # a node sends anything
    if head is None or head.get("tag") != tag or head.get("format") != fmt:
        yield passed(f"{folder}: there ({seen.get('count')} files; this machine has no copy to compare)")
        return
    if names is None:  # the head's listing, or past LISTED names: a node sends their digest alone
        if seen.get("digest") != head.get("digest"):
            yield warn(f"{folder} on {ctx.node}: {seen.get('count')} files, not the {head.get('count')} this "
                       "machine sees", FIX_ON_NODE, path=path)
        else:
            yield passed(f"{folder}: the same {seen.get('count')} files as this machine's")
        return
    stage = ctx.plan.conditions[0].get("zero_stage", -1)
    wanted = _files_of_ranks(head, ranks, stage if ctx.plan.module_only[0] else None) if ranks else \
        set(head.get("files") or {})
    lacking = sorted(wanted - set(names))
    if lacking:
        shown = ", ".join(lacking[:4]) + (f" and {len(lacking) - 4} more" if len(lacking) > 4 else "")
        if _model_parallel(head):
            yield warn(f"{folder} on {ctx.node} lacks {shown}: saved model or pipeline parallel, which of them "
                       f"{whose} load is the training code's topology, not known here", FIX_ON_NODE, path=path,
                       missing=lacking, ranks=ranks)
        elif all(RNG_FILE.match(n) for n in lacking):  # accelerate and the Trainer log it and go on
            their = "their" if len(ranks) > 1 else "its"
            yield warn(f"{folder} on {ctx.node} lacks {shown}: {whose} resume without {their} random states (the "
                       "data order and random draws differ from a run not interrupted)",
                       FIX_ON_NODE, path=path, missing=lacking, ranks=ranks)
        else:
            yield fail(f"{folder} on {ctx.node} lacks {shown}, which {whose} {load}", FIX_ON_NODE, path=path,
                       missing=lacking, ranks=ranks)
        return
    yield passed(f"{folder}: the {len(wanted)} files {whose} {load} are there", path=path, ranks=ranks)


FIX_ON_NODE = ("mount the checkpoint's filesystem on this node, or copy the checkpoint (DeepSpeed's: the tag folder "
               "and `latest`) to the same path")


def _node_ranks(ctx) -> List[int]:
    """The global ranks the node's launch runs (its machine rank times the processes per node, as accelerate and
    torchrun number them), or [] where its launch is not known."""
    view = (((ctx.probes or {}).get("job") or {}).get("nodes") or {}).get(ctx.node) or {}
    rank, per_node = view.get("machine_rank"), view.get("processes")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, per_node)) or per_node < 1 or rank < 0:
        return []
    return list(range(rank * per_node, (rank + 1) * per_node))


def _files_of_ranks(head, ranks, module_only=None) -> set:
    """The files of the head's copy that these ranks open, by the save's layout: DeepSpeed's names; saved
    without DeepSpeed every file but the other ranks' random states (DCP: any rank may read any data file).
    module_only: the job's ZeRO stage, where it loads the module alone: below stage 3 the model states alone, at
    stage 3 its own model states and every rank's optimizer shard (get_fp32_state_dict_from_zero_checkpoint)."""
    names = set(head.get("files") or {})
    if _model_parallel(head) or module_only == 3:  # the code's coordinates; stage 3: every file
        return names
    if module_only is not None and module_only != -1 and head.get("format") == "deepspeed":
        return {n for n in names if n.startswith("mp_rank_")}
    if head.get("format") != "deepspeed":
        own = {str(r) for r in ranks}
        return {n for n in names for m in [RNG_FILE.match(n)] if not m or (m.group(1) or m.group(2)) in own}
    wanted = {n for n in names if n.startswith("mp_rank_")}  # the model states every rank loads below stage 3
    for rank in ranks:
        wanted |= {n for n in names if re.match(rf"^(bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_", n)}
    return wanted


def _model_parallel(facts) -> bool:
    """Saved by a model- or pipeline-parallel DeepSpeed job: a model states file per model-parallel rank, or a
    pipeline's layer files."""
    names = facts.get("files") or {}
    return facts.get("format") == "deepspeed" and (sum(1 for n in names if MODEL_STATES.match(n)) > 1
                                                   or any(LAYER.match(n) for n in names))


@check("CKPT006", "resume-room", "node", tags=["checkpoint", "resume", "deepspeed", "filesystem"])
def resume_room(ctx) -> Iterator[Finding]:
    """The filesystem that holds the checkpoint, on this node, has room for the next save and lets the job write.

    DeepSpeed's save_checkpoint writes a whole new tag (accelerate and the Trainer a new folder: the same files as
    the last one, of the same size) before anything is removed: the Trainer's save_total_limit and scripts that
    keep the last N delete old tags only after the new one is written. With less free than one tag, the first save
    fails with "No space left on device" hours into the run, and the tag it leaves is cut short.

    Free space on the checkpoint's filesystem (or save elsewhere), or make the folder writable by the job's user.
    """
    job = ctx.fact.get("job") if isinstance(ctx.fact.get("job"), dict) else {}
    seen = job.get("checkpoint")
    room = seen.get("room") if isinstance(seen, dict) else None
    head = ctx.plan.resume if ctx.plan.resume and ctx.plan.resume.get("exists") else None
    if not isinstance(room, dict) or not isinstance(room.get("free_bytes"), int):
        yield skip("no checkpoint on this node to measure (CKPT005)" if isinstance(seen, dict) else
                   "no --resume-from given (nor a resume flag in the launch command)")
        return
    sizes = [f.get("bytes") for f in ((head or {}).get("files") or {}).values() if isinstance(f, dict)]
    tag_bytes = sum(b for b in sizes if isinstance(b, int)) if sizes else None
    path, free = seen.get("path"), room["free_bytes"]
    evidence = dict(path=path, free_bytes=free, tag_bytes=tag_bytes)
    if room.get("writable") is False:
        yield fail(f"{path} on {ctx.node} is not writable by this session's user: the job cannot save there",
                   "make the checkpoint folder writable by the job's user, or save elsewhere", **evidence)
        return
    if not tag_bytes:
        yield skip("the size of a save is not known (this machine has no copy of the checkpoint)")
        return
    if free < tag_bytes:
        yield fail(f"{path} on {ctx.node}: {format_size(free)} free, the next save needs {format_size(tag_bytes)} "
                   "(the last save's size): it fails with \"No space left on device\"",
                   "free space on the checkpoint's filesystem, or save to another", **evidence)
        return
    saves = free // tag_bytes
    yield passed(f"{path}: {format_size(free)} free, room for {saves} save{'s' if saves != 1 else ''} of "
                 f"{format_size(tag_bytes)}", **evidence)

