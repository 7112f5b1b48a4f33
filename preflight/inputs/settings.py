"""What the job's configs add up to, worked out as accelerate and DeepSpeed do: the processes each machine
runs, the GPUs gpu_ids lists, and where the ZeRO stage and offload come from. The CFG, GPU and MEM checks
all read the configs through these."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from preflight.inputs.configs import gpu_id_items
from preflight.inputs.documents import Document
from preflight.inputs.numbers import is_int, text_number


def processes_per_machine(data: Mapping[str, Any]) -> Optional[int]:
    procs, machines = text_number(data.get("num_processes")), text_number(data.get("num_machines", 1))
    if is_int(procs) and is_int(machines) and procs > 0 and machines > 0:
        return procs // machines
    return None


def gpu_id_list(value: Any) -> Optional[List[str]]:
    """gpu_ids as a list, as torch reads it (configs.gpu_id_items), or None for 'all' and unset."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("all", "")):
        return None
    return gpu_id_items(str(value))


def zero_settings(plan) -> Optional[Tuple[Document, Tuple[str, ...], Any, Mapping[str, Any]]]:
    """Where the ZeRO settings come from: (doc, path of the stage key, stage, offload devices).

    The DeepSpeed JSON when there is one; else accelerate's own keys, which accelerate turns into one.
    """
    ds = plan.deepspeed.doc if plan.deepspeed is not None else None
    if ds is not None:
        zero = ds.data.get("zero_optimization")
        if isinstance(zero, bool):  # the old boolean form: true is stage 1
            return ds, ("zero_optimization",), int(zero), {}
        if zero == "all":  # the autotuner's every stage (configs.autotuned; the loader takes it only then)
            return ds, ("zero_optimization",), zero, {}
        if not isinstance(zero, Mapping):
            return ds, ("zero_optimization",), 0, {}
        return ds, ("zero_optimization", "stage"), text_number(zero.get("stage", 0)), zero
    # accelerate's deepspeed_config section, read only when accelerate uses DeepSpeed
    doc = plan.accelerate.doc if plan.accelerate is not None else None
    section = doc.section("deepspeed_config") if doc is not None and plan.accelerate.uses_deepspeed else None
    if section is None or "zero_stage" not in section.data:
        return None
    stage = section.data["zero_stage"]  # null: DeepSpeedPlugin's default, 2 (utils/dataclasses.py)
    return doc, ("deepspeed_config", "zero_stage"), 2 if stage is None else text_number(stage), \
        accelerate_offload(section)


def accelerate_offload(section: Document) -> Mapping[str, Any]:
    """The offload devices of accelerate's deepspeed_config section, as DeepSpeed's blocks name them."""
    def lower(value: Any) -> Any:  # accelerate lower-cases the devices (str(...).lower(), utils/launch.py)
        return value.lower() if isinstance(value, str) else value

    return {
        "offload_param": {"device": lower(section.data.get("offload_param_device")),
                          "nvme_path": section.data.get("offload_param_nvme_path")},
        "offload_optimizer": {"device": lower(section.data.get("offload_optimizer_device")),
                              "nvme_path": section.data.get("offload_optimizer_nvme_path")},
    }


def job_environment(plan) -> Dict[str, str]:
    """The variables the job's own files set for it, over the node's: a manifest's main container's env (the values
    written in it; one from a field or a secret is not known here), what a batch script exports to its launch
    (through srun's --export), then the launch's `VAR=v` words."""
    env: Dict[str, str] = {}
    main = plan.manifest.main if plan.manifest is not None else None
    if main is not None:
        env.update((k, v) for k, v in main[2].env.items() if isinstance(v, str))
    step = plan.batch.main if plan.batch is not None else None
    if step is not None:
        env.update(step.env)
    if plan.launch is not None:
        env.update(plan.launch.env)
    return env


def job_variables(plan) -> Tuple[Dict[str, str], Dict[str, str]]:
    """job_environment, and the variables the job's files set to a value known only when it runs: name -> the
    value as written, or where it comes from (a manifest's field or secret)."""
    later: Dict[str, str] = {}
    main = plan.manifest.main if plan.manifest is not None else None
    if main is not None:
        later.update((k, "a field, a secret or a template of the manifest") for k, v in main[2].env.items()
                     if not isinstance(v, str))
    step = plan.batch.main if plan.batch is not None else None
    if step is not None:
        later.update(step.env_at_run_time)
    known = job_environment(plan)
    return known, {k: v for k, v in later.items() if k not in known}


def job_conditions(plan) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The job's answers to the conditions of the known-defects table (preflight.inputs.versions.CONDITIONS) that
    its configs and launch command give, and why each other one is not known: ({name: value}, {name: reason}).
    A value is only what the files say as DeepSpeed and accelerate read them; a value one of them leaves to the
    training code ("auto", which the HF Trainer fills in) or to a command preflight was not given is unknown."""
    known: Dict[str, Any] = {}
    unknown: Dict[str, str] = {}
    ds = plan.deepspeed
    accel = plan.accelerate
    command = plan.launch
    flags = command.options if command is not None and command.launcher == "accelerate" else {}
    with_ds = accel is not None and accel.uses_deepspeed
    if ds is None and accel is None:
        for name in ("precision", "zero_stage", "offload_optimizer", "offload_param", "gradient_clipping", "optimizer"):
            unknown[name] = f"no DeepSpeed or accelerate config was given, so the job's {name.replace('_', ' ')} is not known"
    elif ds is None and not with_ds and (command is None or command.launcher != "deepspeed"):
        # accelerate without DeepSpeed (MULTI_GPU, FSDP, ...): no ZeRO, no DeepSpeed optimizer or clipping
        known.update(zero_stage=None, offload_optimizer=False, offload_param=False, gradient_clipping=False,
                     optimizer=None)
    else:
        _zero_conditions(plan, flags, known, unknown)
        _deepspeed_conditions(ds, accel if with_ds else None, known, unknown)
    precision, why = _precision(ds, accel, with_ds, flags)
    if precision is not None:
        known["precision"] = precision
    elif "precision" not in unknown:
        unknown["precision"] = why
    if command is not None and command.launcher in ("accelerate", "deepspeed", "torchrun", "python"):
        step = plan.batch.main if plan.batch is not None else None
        starter = (step.starter,) if step is not None and step.starter in ("srun", "mpirun") else ()
        known["launcher"] = starter + (command.launcher,)
    else:
        unknown["launcher"] = "no launch command was given, so what starts the ranks is not known"
    _container_conditions(plan, known)
    _launch_conditions(command, accel, with_ds, flags, known, unknown)
    _fsdp_condition(ds, accel, with_ds, flags, known, unknown)
    model = plan.memory.model if plan.memory is not None else None
    if model is not None and model.experts is not None:
        known["moe"] = model.experts > 1
    else:
        unknown["moe"] = "the model's layers are not known (--model names its config), so whether it has experts (MoE) is not known"
    return known, unknown


def _fsdp_condition(ds, accel, with_ds: bool, flags: Mapping[str, Any], known: Dict[str, Any],
                    unknown: Dict[str, str]) -> None:
    """The FSDP version accelerate trains with (its flag, else fsdp_config's, else 1), None for no FSDP."""
    if accel is not None and not with_ds:
        section = accel.data.get("fsdp_config")
        given = text_number(flags.get("fsdp_version") or (section.get("fsdp_version", 1) if isinstance(
            section, Mapping) else 1))
        if accel.data.get("distributed_type") != "FSDP":
            known["fsdp_version"] = None
        elif given in (1, 2):
            known["fsdp_version"] = given
        else:
            unknown["fsdp_version"] = f"fsdp_version is {given!r}, not 1 or 2"
    elif ds is not None or with_ds:
        known["fsdp_version"] = None  # a DeepSpeed job
    else:
        unknown["fsdp_version"] = "no accelerate config was given, so whether the job trains with FSDP is not known"


def _launch_conditions(command, accel, with_ds: bool, flags: Mapping[str, Any], known: Dict[str, Any],
                       unknown: Dict[str, str]) -> None:
    """The rendezvous backend torchrun's agent uses (torchrun's and accelerate's flag, accelerate's config key;
    "static" by default in both) and the DeepSpeed multinode launcher accelerate hands a DEEPSPEED job over
    several machines to (its flag, else deepspeed_config's key, else pdsh: configs.deepspeed_runner)."""
    if command is not None and command.launcher in ("torchrun", "accelerate"):
        backend = command.options.get("rdzv_backend") or (accel.data.get("rdzv_backend") if accel is not None and
                                                          command.launcher == "accelerate" else None) or "static"
        if isinstance(backend, str) and "$" not in backend:
            known["rdzv_backend"] = backend
        else:
            unknown["rdzv_backend"] = "the rendezvous backend is left to the node's shell"
    elif command is not None and command.launcher in ("deepspeed", "python"):
        known["rdzv_backend"] = None  # no torchrun agent
    else:
        unknown["rdzv_backend"] = "no launch command was given, so the rendezvous backend is not known"
    if accel is None:
        unknown["deepspeed_multinode_launcher"] = "no accelerate config was given, so the DeepSpeed multinode " \
                                                  "launcher accelerate hands the job to is not known"
    elif with_ds and accel.runner is not None:
        section = accel.deepspeed_section
        known["deepspeed_multinode_launcher"] = flags.get("deepspeed_multinode_launcher") or (
            section.data.get("deepspeed_multinode_launcher") if section is not None else None) or "pdsh"
    else:
        known["deepspeed_multinode_launcher"] = None  # accelerate hands nothing to DeepSpeed's runner


def _container_conditions(plan, known: Dict[str, Any]) -> None:
    """Whether the job runs in a container and with CAP_SYS_NICE, where the plan says so: a manifest's main
    container has the runtime's default capabilities (which leave SYS_NICE out) plus what its securityContext
    adds; a batch step's image (pyxis, apptainer) says only that it is a container. Elsewhere the nodes tell."""
    main = plan.manifest.main if plan.manifest is not None else None
    if main is not None:
        container = main[2]
        known.update(container=True, sys_nice=container.privileged or any(
            str(c).upper().removeprefix("CAP_") == "SYS_NICE" for c in container.capabilities))
    step = plan.batch.main if plan.batch is not None else None
    if step is not None and step.container is not None:
        known["container"] = True


def _zero_conditions(plan, flags: Mapping[str, Any], known: Dict[str, Any], unknown: Dict[str, str]) -> None:
    found = zero_settings(plan)
    if found is not None:
        stage, devices = found[2], found[3]
    else:  # accelerate's section without zero_stage: DeepSpeedPlugin's stage 2
        section = plan.accelerate.deepspeed_section if plan.accelerate is not None else None
        stage, devices = 2, accelerate_offload(section) if section is not None else {}
    if "zero_stage" in flags:
        stage = text_number(flags["zero_stage"])
    if not is_int(stage) or not 0 <= stage <= 3:
        why = f"the ZeRO stage is {stage!r}" + (" (filled in by the training code)" if stage == "auto" else "")
        for name in ("zero_stage", "offload_optimizer", "offload_param"):
            unknown[name] = why
        return
    known["zero_stage"] = stage
    blocks = devices if isinstance(devices, Mapping) else {}
    for block in ("offload_optimizer", "offload_param"):
        entry = blocks.get(block)
        device = flags.get(f"{block}_device") or (entry.get("device") if isinstance(entry, Mapping) else None)
        device = device.lower() if isinstance(device, str) else device
        if device == "auto":
            unknown[block] = f"{block}.device is \"auto\" (filled in by the training code)"
        else:  # DeepSpeed reads offload_param at stage 3 only (zero/config.py; stage_1_and_2 never looks)
            known[block] = device in ("cpu", "nvme") and (block == "offload_optimizer" or stage == 3)


def _deepspeed_conditions(ds, section_of, known: Dict[str, Any], unknown: Dict[str, str]) -> None:
    """gradient_clipping and the optimizer, from the DeepSpeed JSON, else accelerate's deepspeed_config section."""
    if ds is not None:
        clip = ds.get("gradient_clipping")
        optimizer = ds.get("optimizer", "type")
    else:
        section = section_of.deepspeed_section if section_of is not None else None
        clip = section.data.get("gradient_clipping") if section is not None else None
        optimizer = None
    clip = text_number(clip)
    if clip == "auto":
        unknown["gradient_clipping"] = "gradient_clipping is \"auto\" (the HF Trainer fills in its max_grad_norm)"
    else:
        known["gradient_clipping"] = isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0
    if isinstance(optimizer, str) and optimizer.lower() != "auto":
        known["optimizer"] = optimizer.lower()
    else:
        unknown["optimizer"] = "the DeepSpeed config names no optimizer type: the training code gives the optimizer"


def _precision(ds, accel, with_ds: bool, flags: Mapping[str, Any]) -> Tuple[Optional[str], str]:
    """(fp16, bf16 or fp32, or None, why not known). DeepSpeed's fp16/bf16 blocks decide where there is a JSON;
    "auto" there is accelerate's mixed_precision when accelerate runs DeepSpeed (it fills "auto" in), else the
    training code's; accelerate's mixed_precision (its flag first) decides without one."""
    mixed = flags.get("mixed_precision") or (accel.mixed_precision if accel is not None else None)
    mixed = mixed.lower() if isinstance(mixed, str) else mixed
    from_accelerate = {"fp16": "fp16", "bf16": "bf16", "no": "fp32"}.get(mixed) if accel is not None else None
    if accel is not None and mixed is None:
        from_accelerate = "fp32"  # accelerate's default mixed_precision is "no"
    if ds is not None:
        enabled = {block: ds.enabled(block) for block in ("bf16", "fp16")}
        on = [block for block, value in enabled.items() if value is True]
        if on:
            return on[0], ""
        if "auto" in enabled.values():
            if with_ds and from_accelerate:
                return from_accelerate, ""
            return None, "fp16/bf16 \"enabled\" is \"auto\" in the DeepSpeed config (the training code fills it in)"
        return "fp32", ""
    if from_accelerate:
        return from_accelerate, ""
    return None, f"mixed_precision {mixed!r} is not fp16, bf16 or no"


# Megatron-DeepSpeed's flags for the degrees (megatron/arguments.py, _add_distributed_args; argparse, the last one
# given wins); --no-pipeline-parallel asserts a pipeline of 1 (validate_args)
MEGATRON_DEGREES = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size"}
NO_PIPELINE = "--no-pipeline-parallel"


def _flag_value(args, flag) -> Optional[str]:
    """The value of the script's last `flag V` or `flag=V` (argparse: the last one given wins), None if not given."""
    value = None
    for i, word in enumerate(args):
        given, eq, text = word.partition("=")
        if given == flag:
            value = text if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def megatron_data_parallel(plan) -> Optional[Tuple[Optional[int], str]]:
    """Where the launch is Megatron-DeepSpeed's (it names --tensor-model-parallel-size or
    --pipeline-model-parallel-size): (the data-parallel world DeepSpeed's batch assertion uses, None where it is not
    known; where it comes from, or why not). Megatron-DeepSpeed hands deepspeed.initialize its mpu
    (--no-pipeline-parallel) or a PipelineModule built on its topology, whose mpu() DeepSpeed takes
    (megatron/training.py setup_model_and_optimizer, deepspeed/__init__.py), and DeepSpeedConfig then uses that
    mpu's data-parallel world (runtime/config.py): the world over TP x PP (megatron/core/parallel_state.py; a degree
    whose flag is absent is Megatron's default, 1). None where the launch is not Megatron-DeepSpeed's."""
    args = plan.launch.script_args if plan.launch is not None else ()
    flags = {name: _flag_value(args, flag) for name, flag in MEGATRON_DEGREES.items()}
    if all(value is None for value in flags.values()):
        return None
    if not all(value is None or re.fullmatch(r"\d{1,6}", value.strip()) and int(value) > 0 for value in flags.values()):
        return None, "Megatron-DeepSpeed's tensor or pipeline degree is set when the job runs"
    sp = _flag_value(args, "--ds-sequence-parallel-size")
    if sp is not None and sp.strip() != "1":  # the pipeline's topology and parallel_state's groups: not read here
        return None, f"--ds-sequence-parallel-size {sp} with Megatron-DeepSpeed's mpu"
    tp, pp = (int(flags[name]) if flags[name] is not None else 1 for name in ("tp", "pp"))
    world, _ = plan.world_size
    if world is None or world % (tp * pp):
        return None, f"the world is not known, or not a multiple of TP {tp} x PP {pp}"
    return world // (tp * pp), f"over TP {tp} x PP {pp}: the data-parallel world of Megatron-DeepSpeed's mpu"


# Megatron-DeepSpeed's load_checkpoint (megatron/checkpointing.py) hands DeepSpeed's load_checkpoint
# load_optimizer_states=False, load_module_only=True for --finetune alone; its --no-load-optim and --no-load-rng act
# on its path without DeepSpeed (and the random states), so DeepSpeed still loads the optimizer shards with them
FINETUNE, NO_LOAD_OPTIM, MEGATRON_LOAD = "--finetune", "--no-load-optim", "--load"


def megatron_switch(plan, flag: str) -> bool:
    """Megatron-DeepSpeed's switch `flag` is in the launch command, read as its own where the same command names the
    checkpoint with its --load (another script's --finetune may mean anything)."""
    args = plan.launch.script_args if plan.launch is not None else ()
    return flag in args and _flag_value(args, MEGATRON_LOAD) is not None


def module_only_load(plan) -> Tuple[Optional[str], str]:
    """(where the launch asks DeepSpeed for a module-only load, None for the default load; a note where the launch
    names a flag that does not change DeepSpeed's load): Megatron-DeepSpeed's --finetune."""
    if megatron_switch(plan, FINETUNE):
        return (f"{FINETUNE} in the launch command (Megatron-DeepSpeed: load_checkpoint(..., "
                "load_optimizer_states=False, load_module_only=True), from iteration 0)"), ""
    if megatron_switch(plan, NO_LOAD_OPTIM):
        return None, (f"; {NO_LOAD_OPTIM} in the launch command does not change it (Megatron-DeepSpeed skips "
                      f"DeepSpeed's optimizer state for {FINETUNE} alone)")
    return None, ""


def sequence_parallel(plan) -> Optional[Tuple[int, Optional[int], str]]:
    """(the sequence-parallel degree, the data-parallel size ZeRO partitions over where the DeepSpeed config fixes
    it, where they are set), or None. With an mpu of sequence groups (Megatron-DeepSpeed's --ds-sequence-parallel-size,
    accelerate's and ALST's parallel_state_sp) ZeRO partitions over the sequence-data-parallel group, data x
    sequence parallel: the world over the tensor and pipeline degrees, whatever the sequence degree. A config with
    data_parallel_size and sequence_parallel_size makes deepspeed.initialize build a data x sequence mesh, and ZeRO
    partitions over its data dimension alone (utils/groups.py: _get_sequence_data_parallel_group without an mpu)."""
    args = plan.launch.script_args if plan.launch is not None else ()
    value = _flag_value(args, "--ds-sequence-parallel-size")
    if value is not None and re.fullmatch(r"\d{1,6}", value.strip()) and int(value) > 1:
        return int(value), None, f"--ds-sequence-parallel-size {int(value)} in the launch command"
    ds = plan.deepspeed
    sp = ds.get("sequence_parallel_size") if ds is not None else None
    if not is_int(sp) or sp < 1:
        return None
    dp = ds.get("data_parallel_size")
    if is_int(dp) and dp > 0:
        return sp, dp, f"data_parallel_size {dp} and sequence_parallel_size {sp} in {ds.doc.path}"
    return (sp, None, f"sequence_parallel_size {sp} in {ds.doc.path}") if sp > 1 else None


def parallel_degrees(plan) -> Tuple[Dict[str, Tuple[int, str]], Dict[str, str]]:
    """The job's tensor- and pipeline-parallel degrees where what preflight reads names them, and why the others are
    not known: ({"tp"|"pp": (degree, where it is set)}, {"tp"|"pp": why not}). The launch command's
    Megatron-DeepSpeed flags, as its validate_args clamps them to the world (tp = min(tp, world), pp = min(pp,
    world // tp)); DeepSpeed's AutoTP (tensor_parallel.autotp_size above 1: the engine's own tensor-parallel groups).
    A degree the training code sets (an mpu it hands to deepspeed.initialize, PipelineModule's num_stages: the
    DeepSpeed config's pipeline block does not set it) is not known."""
    known: Dict[str, Tuple[int, str]] = {}
    unknown: Dict[str, str] = {}
    args = plan.launch.script_args if plan.launch is not None else ()
    for name, flag in MEGATRON_DEGREES.items():
        value = _flag_value(args, flag)
        if value is None:
            continue
        if re.fullmatch(r"\d{1,6}", value.strip()) and int(value) > 0:
            known[name] = (int(value), f"{flag} {int(value)} in the launch command")
        else:
            unknown[name] = f"{flag} {value} in the launch command is set when the job runs"
    if NO_PIPELINE in args and "pp" not in known and "pp" not in unknown:
        known["pp"] = (1, f"{NO_PIPELINE} in the launch command")
    autotp = plan.deepspeed.get("tensor_parallel", "autotp_size") if plan.deepspeed is not None else None
    if "tp" not in known and "tp" not in unknown and is_int(autotp) and autotp > 1:
        known["tp"] = (autotp, f"tensor_parallel.autotp_size in {plan.deepspeed.doc.path}")
        if "pp" not in known and "pp" not in unknown:  # AutoTP's groups: a data x tensor mesh, no pipeline
            known["pp"] = (1, "AutoTP (engine._configure_tensor_parallel_states: a data x tensor-parallel mesh)")
    world, _ = plan.world_size
    if world and "tp" in known and known["tp"][0] > world:
        known["tp"] = (world, known["tp"][1] + f", at most the world ({world})")
    if world and "pp" in known and known["pp"][0] > world // known.get("tp", (1,))[0]:
        most = world // known.get("tp", (1,))[0]
        known["pp"] = (most, known["pp"][1] + f", at most the world over the tensor-parallel degree ({most})")
    if "tp" not in known:
        unknown.setdefault("tp", f"no {MEGATRON_DEGREES['tp']} in the launch command nor tensor_parallel.autotp_size "
                                 "in the DeepSpeed config: the training code sets it (the mpu it hands to DeepSpeed)")
    if "pp" not in known:
        unknown.setdefault("pp", f"no {MEGATRON_DEGREES['pp']} in the launch command: the training code sets it "
                                 "(PipelineModule's num_stages; the DeepSpeed config's pipeline block does not)")
    return known, unknown
