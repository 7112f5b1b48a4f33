"""CFG training settings in the DeepSpeed config: the batch sizes against the world size, the ZeRO stage and its
offload, and the precision against accelerate's mixed_precision."""
from __future__ import annotations

from typing import Iterator, Mapping

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.checks.config.common import accel_doc, at, did_you_mean, dotted, ds_doc, ds_usage
from preflight.inputs.configs import AUTO, MIXED_PRECISIONS, OFFLOAD_DEVICES, autotuned, tuning_space
from preflight.inputs.numbers import is_int, is_number
from preflight.inputs.settings import megatron_data_parallel, zero_settings

FILLS = {"accelerate": 'accelerate fills in only keys set to "auto"', "deepspeed": "DeepSpeed alone fills in nothing"}


@check("CFG030", "batch-size", "config", tags=["deepspeed", "batch"])
def batch_size(ctx) -> Iterator[Finding]:
    """train_batch_size equals train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size.

    DeepSpeed asserts this equality when the engine starts, after the model is loaded on every node; when
    one of the three is missing it derives it with integer division, which can give 0 or a product that
    no longer matches. With sequence_parallel_size the world is divided by it first, and under Megatron-DeepSpeed
    (its tensor and pipeline flags) DeepSpeed takes the data-parallel world of Megatron's mpu; a file with no batch
    size at all fails under accelerate and DeepSpeed's runner, and warns when the framework that reads it
    (Lightning, the transformers Trainer) is unknown.

    Set the three so that the product holds for the planned world size (the message gives the value
    that does), or set them to "auto" under accelerate or the transformers Trainer.
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    tb, mb, gas = (ds.data.get(k) for k in keys)
    if AUTO in (tb, mb, gas):
        yield skip("batch sizes set to \"auto\" are filled in by accelerate or the transformers Trainer")
        return
    if autotuned(ds.data):  # each experiment gets its own micro batch and accumulation (autotuning/README.md)
        yield skip("DeepSpeed's autotuner runs the job (autotuning.enabled): it sets the micro batch and accumulation "
                   "of each experiment and ignores train_batch_size, so the batch is not judged here")
        return
    values = {k: v for k, v in zip(keys, (tb, mb, gas)) if v is not None}
    if any(not is_int(v) for v in values.values()):
        yield skip("a batch setting is not an integer (reported by CFG003)")
        return
    for key, value in values.items():
        if value < 1:
            yield fail(f"{ds.where(key)}: {key} is {value}, expected at least 1", f"set {key} to 1 or more",
                       **at(ds, key))
            return
    world, source = ctx.plan.world_size
    usage = ds_usage(ctx)
    if usage == "accelerate" and gas is None:
        gas = 1  # DeepSpeedPlugin sets a missing gradient_accumulation_steps to 1 before DeepSpeed derives it
    sp = ds.data.get("sequence_parallel_size")
    megatron = megatron_data_parallel(ctx.plan) if world is not None else None
    if megatron is not None:  # DeepSpeedConfig takes the world from the mpu, not from sequence_parallel_size
        if megatron[0] is None:
            yield skip(f"not judged: the data-parallel world DeepSpeed divides the batch by is not known "
                       f"({megatron[1]})")
            return
        world, source = megatron[0], f"{source} {megatron[1]}"
    elif world is not None and is_int(sp) and sp > 1:
        # Without an mpu, DeepSpeedConfig divides the world by it before the batch assertion (runtime/config.py).
        if world % sp:
            yield fail(f"{ds.where('sequence_parallel_size')}: the world size {world} ({source}) does not divide by "
                       f"sequence_parallel_size {sp}: DeepSpeed cannot form the sequence-parallel groups ('world_size "
                       f"({world}) is not divisible by sequence_parallel_size {sp}', runtime/sequence_parallel)", f"run a multiple of {sp} processes, or change "
                       "sequence_parallel_size", world_size=world, sequence_parallel_size=sp,
                       **at(ds, "sequence_parallel_size"))
            return
        world, source = world // sp, f"{source} / sequence_parallel_size {sp}"
    evidence = dict(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
                    world_size=world, world_size_from=source, used_by=usage)
    if tb is None and mb is None:
        # accelerate and the Trainer fill in only keys set to "auto"; missing ones stay missing.
        why = ("DeepSpeed asserts 'Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided'")
        if usage == "unknown":  # the program that reads it may set them (Lightning, Megatron, the autotuner)
            yield passed(f"{ds.path}: neither train_batch_size nor train_micro_batch_size_per_gpu is set: {why} "
                         "unless the program that reads the file sets them (PyTorch Lightning from its dataloader, "
                         "Megatron-DeepSpeed from its flags; the transformers Trainer and accelerate fill in only keys "
                         "set to \"auto\"): who reads it is not known here, not judged", **at(ds), **evidence)
        else:
            yield fail(f"{ds.path}: neither train_batch_size nor train_micro_batch_size_per_gpu is set; {why} "
                       f"({FILLS[usage]})",
                       'set "train_micro_batch_size_per_gpu" (or "auto" under accelerate)', **at(ds), **evidence)
        return
    if world is None:
        if tb is not None and mb is not None and gas is not None and tb % (mb * gas):
            yield fail(f"{ds.where('train_batch_size')}: train_batch_size {tb} is not a multiple of "
                       f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = {mb * gas}, so no world size "
                       "satisfies DeepSpeed's batch assertion",
                       f"set train_batch_size to {mb * gas} x the number of processes", **at(ds, 'train_batch_size'),
                       **evidence)
        else:
            yield skip(f"the world size is {source}")
        return
    # DeepSpeed's own derivation (runtime/config.py _set_batch_related_parameters), then its assertion.
    gas_eff = gas if gas is not None else (1 if mb is None or tb is None else tb // mb // world)
    mb_eff = mb if mb is not None else tb // world // gas_eff
    tb_eff = tb if tb is not None else mb_eff * gas_eff * world
    if mb_eff < 1 or gas_eff < 1 or tb_eff != mb_eff * gas_eff * world:
        derived = (mb or max(mb_eff, 1)) * (gas or max(gas_eff, 1)) * world
        given = ", ".join(f"{k} {v}" for k, v in values.items())
        hint = ""
        if tb is not None and mb is not None and tb % (mb * world) == 0:
            hint = f", or gradient_accumulation_steps: {tb // (mb * world)}"
        yield fail(f"{ds.where('train_batch_size' if tb is not None else 'train_micro_batch_size_per_gpu')}: "
                   f"{given} do not fit a world size of {world} ({source}): DeepSpeed needs train_batch_size = "
                   f"micro batch x accumulation x world size = {mb_eff} x {gas_eff} x {world} = "
                   f"{mb_eff * gas_eff * world}, not {tb_eff}",
                   f"set train_batch_size: {derived}{hint} (or \"auto\" under accelerate / transformers)",
                   expected_train_batch_size=derived, **at(ds, "train_batch_size"), **evidence)
    else:
        yield passed(f"train_batch_size {tb_eff} = {mb_eff} x {gas_eff} x world size {world} ({source})", **evidence)


@check("CFG040", "zero-stage", "config", tags=["deepspeed", "zero"])
def zero_stage(ctx) -> Iterator[Finding]:
    """The ZeRO stage is 0, 1, 2 or 3.

    DeepSpeed refuses any other stage when the engine starts. A stage of "auto" in the DeepSpeed JSON is
    filled in only by accelerate (with `accelerate launch --zero_stage`, 2 when not given); DeepSpeed on
    its own silently drops it, training at stage 0 with no sharding at all. Under DeepSpeed's autotuner
    (autotuning.enabled) a list of stages, or "all", is its search space: each experiment runs one.

    Set zero_optimization.stage (or accelerate's zero_stage) to 0, 1, 2 or 3.
    """
    found = zero_settings(ctx.plan)
    if found is None:
        yield skip("no ZeRO settings (no DeepSpeed config, no zero_stage in the accelerate config)")
        return
    doc, keys, stage, _ = found
    if stage == AUTO and keys[0] == "deepspeed_config":
        yield fail(f"{doc.where(*keys)}: {dotted(keys)} is \"auto\", expected 0, 1, 2 or 3: accelerate reads it "
                   "as a number and stops with a ValueError", f"set {dotted(keys)} to 0, 1, 2 or 3", **at(doc, *keys))
    elif stage == AUTO and ctx.plan.accelerate is not None and ctx.plan.accelerate.uses_deepspeed:
        yield passed(f"{doc.where(*keys)}: ZeRO stage \"auto\" is filled in by accelerate "
                     "(`accelerate launch --zero_stage`, 2 when not given)", stage=stage)
    elif stage == AUTO and ds_usage(ctx) == "unknown":  # who reads it (accelerate fills it) is not known here
        yield passed(f"{doc.where(*keys)}: ZeRO stage \"auto\": accelerate fills it in (`accelerate launch "
                     "--zero_stage`, 2 when not given); DeepSpeed alone would drop it and train at stage 0 (who reads "
                     "the file is not known here: not judged)", stage=stage)
    elif stage == AUTO:
        yield warn(f"{doc.where(*keys)}: {dotted(keys)} is \"auto\": accelerate and the transformers Trainer fill it "
                   "in (accelerate's zero_stage, 2 unless given), but DeepSpeed on its own drops it and trains at "
                   "stage 0", f"set {dotted(keys)} to 0, 1, 2 or 3 to say which stage the job runs",
                   **at(doc, *keys))
    elif keys[0] != "deepspeed_config" and autotuned(doc.data) and tuning_space(stage):
        shown = "all" if stage == "all" else ", ".join(map(str, stage))
        yield passed(f"{doc.where(*keys)}: ZeRO stages {shown}: the autotuner's search space (autotuning.enabled), "
                     "each experiment runs one; the stage the job keeps is the autotuner's choice, not judged here",
                     stage=stage)
        if not all(is_int(s) and 0 <= s <= 3 for s in (stage if isinstance(stage, list) else ())):
            yield fail(f"{doc.where(*keys)}: {dotted(keys)} lists {stage!r}, expected stages among 0, 1, 2 and 3",
                       f"list stages among 0, 1, 2 and 3 in {doc.setting(*keys)}", value=stage, **at(doc, *keys))
    elif not is_int(stage) or not 0 <= stage <= 3:  # text is read as its number (zero_settings; CFG003 judges it)
        yield fail(f"{doc.where(*keys)}: {dotted(keys)} is {stage!r}, expected 0, 1, 2 or 3",
                   f"set {doc.setting(*keys)} to 0, 1, 2 or 3", value=stage, **at(doc, *keys))
    else:
        yield passed(f"ZeRO stage {stage}", stage=stage)


@check("CFG041", "zero-offload", "config", tags=["deepspeed", "zero", "offload"])
def zero_offload(ctx) -> Iterator[Finding]:
    """Offload settings that the ZeRO stage actually uses: offload_param only at stage 3, offload_optimizer
    not at stage 0, a known device, and an nvme_path with the nvme device.

    DeepSpeed silently ignores offload_param below stage 3 and offload_optimizer at stage 0, so the job
    runs out of GPU memory that the config seemed to save (a warning: the job still runs); partial
    offload (ratio < 1) needs stage 3 and the cpu device; an nvme device without nvme_path fails when
    the engine starts.

    Use stage 3 for parameter offload (or remove offload_param), a stage of 1 or more for optimizer
    offload, device one of none, cpu, nvme, and set nvme_path to a local NVMe folder with the nvme device.
    """
    found = zero_settings(ctx.plan)
    if found is None:
        yield skip("no ZeRO settings (no DeepSpeed config, no zero_stage in the accelerate config)")
        return
    doc, stage_keys, stage, blocks = found
    if stage == AUTO:  # filled in at launch (CFG040 says by whom): the offload is judged then
        yield skip("the ZeRO stage is \"auto\": the offload settings are judged against the stage the job gets")
        return
    if tuning_space(stage) and autotuned(doc.data):
        yield skip("the ZeRO stage is the autotuner's choice (see CFG040): the offload settings are judged against "
                   "the stage each experiment gets")
        return
    if not is_int(stage):
        yield skip("the ZeRO stage is not a number (see CFG040)", blocked_by="CFG040")
        return
    accel_keys = stage_keys[0] == "deepspeed_config"
    for block in ("offload_param", "offload_optimizer"):
        settings = blocks.get(block)
        if not isinstance(settings, Mapping):
            continue
        device = settings.get("device")
        keys = ("deepspeed_config", f"{block}_device") if accel_keys else ("zero_optimization", block, "device")
        where = doc.where(*keys) if doc.line(*keys) else doc.where(*keys[:-1])
        name = dotted(keys)
        if device in (None, "none", AUTO):
            continue
        if device not in OFFLOAD_DEVICES:
            if accel_keys:
                continue  # CFG002
            yield fail(f"{where}: {name} is {device!r}, expected none, cpu or nvme{did_you_mean(device, OFFLOAD_DEVICES)}",
                       f"set {name} to none, cpu or nvme", **at(doc, *keys))
            continue
        if block == "offload_param" and stage < 3:
            # Not a failure: the job trains; the setting only does nothing (DeepSpeed reads offload_param at stage 3).
            yield warn(f"{where}: {name} is {device!r} at ZeRO stage {stage}; only stage 3 offloads parameters, "
                       "DeepSpeed ignores it and keeps the parameters on the GPU",
                       f"set {dotted(stage_keys)} to 3 to offload parameters, or delete the parameter offload",
                       stage=stage, device=device, **at(doc, *keys))
        if block == "offload_optimizer" and stage == 0:
            yield fail(f"{where}: {name} is {device!r} at ZeRO stage 0; optimizer offload needs stage 1, 2 or 3",
                       f"set {dotted(stage_keys)} to 1 or more, or remove the optimizer offload", stage=stage,
                       device=device, **at(doc, *keys))
        if device == "nvme" and not settings.get("nvme_path"):
            path_key = ("deepspeed_config", f"{block}_nvme_path") if accel_keys else ("zero_optimization", block, "nvme_path")
            yield fail(f"{where}: {name} is 'nvme' but {dotted(path_key)} is not set",
                       f"set {dotted(path_key)} to a folder on a local NVMe drive", **at(doc, *keys))
        ratio = settings.get("ratio")
        if block == "offload_optimizer" and is_number(ratio) and ratio < 1 and device == "nvme":
            # stage3.py: a partial offload splits the sub-groups between the GPU and 'cpu' (subgroup_to_device)
            # with DeepSpeedCPUAdam ('Hybrid Optimizer Only Supports DeepSpeedCPUAdam'); NVMe swapping has no share.
            yield fail(f"{doc.where('zero_optimization', block, 'ratio')}: partial optimizer offload (ratio {ratio}) "
                       "with device 'nvme'; DeepSpeed supports a partial offload only to the CPU",
                       'set zero_optimization.offload_optimizer.device to "cpu" for a partial offload, or ratio to 1 '
                       "to swap the whole optimizer to NVMe", **at(doc, "zero_optimization", block, "ratio"))
        elif block == "offload_optimizer" and is_number(ratio) and ratio < 1 and stage != 3:
            yield fail(f"{doc.where('zero_optimization', block, 'ratio')}: partial optimizer offload (ratio {ratio}) "
                       f"at ZeRO stage {stage}; DeepSpeed supports it only at stage 3",
                       "set ratio to 1, or use stage 3", **at(doc, "zero_optimization", block, "ratio"))


@check("CFG050", "precision", "config", tags=["deepspeed", "accelerate", "precision"])
def precision(ctx) -> Iterator[Finding]:
    """fp16 and bf16 are not both enabled, and accelerate's mixed_precision agrees with the DeepSpeed
    config's fp16 / bf16 blocks.

    DeepSpeed asserts 'bfloat16 and fp16 modes cannot be simultaneously enabled'; accelerate raises when
    mixed_precision names the other type, and silently trains in full precision when it asks for fp16 or
    bf16 that the DeepSpeed config disables.

    Enable exactly one of fp16 / bf16 (or neither), and make mixed_precision name the same one; "auto"
    in the DeepSpeed config follows mixed_precision.
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    cfg = ctx.plan.deepspeed
    fp16, bf16 = cfg.enabled("fp16"), cfg.enabled("bf16")
    bf16_key = "bf16" if "bf16" in ds.data or "bfloat16" not in ds.data else "bfloat16"
    if fp16 is True and bf16 is True:
        yield fail(f"{ds.where('bf16' if bf16_key == 'bf16' else 'bfloat16')}: fp16.enabled and {bf16_key}.enabled "
                   "are both true; DeepSpeed asserts 'bfloat16 and fp16 modes cannot be simultaneously enabled'",
                   "enable only one: bf16 on A100/H100-class GPUs, fp16 on older ones", **at(ds, bf16_key))
        return
    doc = accel_doc(ctx)
    mp = ctx.plan.accelerate.mixed_precision if doc is not None else None
    if not isinstance(mp, str) or mp not in MIXED_PRECISIONS:
        return
    wanted = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}.get(mp)
    ds_uses = "fp16" if fp16 is True else "bf16" if bf16 is True else None
    where = doc.where("mixed_precision")
    # Written in the file beside deepspeed_config_file, mixed_precision is refused as such (CFG005): the one fix that
    # clears both findings is CFG005's, and the DeepSpeed JSON then decides the precision.
    beside_file = ctx.plan.deepspeed_file_named is not None and ctx.plan.accelerate.uses_deepspeed and \
        not doc.given_by_flag("mixed_precision")
    moved = "delete mixed_precision and set the precision in the DeepSpeed JSON"
    if wanted and ds_uses and ds_uses != wanted:
        yield fail(f"{where}: mixed_precision is {mp!r} but the DeepSpeed config {ds.path} enables {ds_uses}; "
                   f"accelerate raises '`--mixed_precision` arg cannot be set to `{mp}` when `{ds_uses}` is set'",
                   moved if beside_file else
                   f"make them agree: mixed_precision: {ds_uses}, or enable {wanted} in the DeepSpeed config",
                   mixed_precision=mp, deepspeed=ds_uses, **at(doc, "mixed_precision"))
    elif wanted and (fp16 if wanted == "fp16" else bf16) is False and (wanted in ds.data or
                                                                        (wanted == "bf16" and "bfloat16" in ds.data)):
        yield fail(f"{where}: mixed_precision is {mp!r} but the DeepSpeed config {ds.path} sets {wanted}.enabled "
                   "to false: DeepSpeed trains in full precision", moved if beside_file else
                   f'set "{wanted}": {{"enabled": "auto"}} in the DeepSpeed config',
                   mixed_precision=mp, **at(doc, "mixed_precision"))
    elif mp == "no" and ds_uses:
        yield fail(f"{where}: mixed_precision is 'no' but the DeepSpeed config {ds.path} enables {ds_uses}; "
                   f"the job trains in {ds_uses}, not in full precision as the accelerate config says",
                   moved if beside_file else f"set mixed_precision: {ds_uses}, or {ds_uses}.enabled to \"auto\"",
                   mixed_precision=mp, deepspeed=ds_uses, **at(doc, "mixed_precision"))
