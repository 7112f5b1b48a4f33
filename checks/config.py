"""CFG: lint of the accelerate config, the DeepSpeed config and the hostfile, before any node is touched.

Every finding names the file and line, says what was found against what was expected, and how
to fix it. The facts behind each rule are those of accelerate 1.x and DeepSpeed 0.1x.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import ipaddress
import logging
import os
import sys
import re
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

from preflight.inputs.documents import Document, shorten
from preflight.inputs.configs import (
    ACCELERATE_DS_KEYS,
    ACCELERATE_DS_KEYS_CONFLICTING_WITH_FILE,
    ACCELERATE_KEYS,
    ACCELERATE_REMOVED_KEYS,
    AUTO,
    COMPUTE_ENVIRONMENTS,
    DISTRIBUTED_TYPES,
    DS_NUMERIC,
    DYNAMO_BACKENDS,
    MIXED_PRECISIONS,
    MULTINODE_LAUNCHERS,
    OFFLOAD_DEVICES,
    RDZV_BACKENDS,
    SAGEMAKER_DISTRIBUTED_TYPES,
    SAGEMAKER_KEYS,
    TRUTH_WORDS,
    accelerate_launcher,
    ds_text_number_stops,
    fsdp_problems,
    is_int,
    is_numeric_string,
    multinode_launcher_problem,
    runner_resources,
    text_number,
    text_number_stops_launch,
)
from preflight.registry import check
from preflight.result import Finding, fail, passed, skip, warn

# DeepSpeed's top-level keys (deepspeed/runtime/config.py); unknown ones are ignored by DeepSpeed.
DS_TOP_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps managed_gradient_accumulation
steps_per_print wall_clock_breakdown memory_breakdown dump_state disable_python_gc log_level
communication_data_type seq_parallel_communication_data_type seq_parallel_comm_data_type gradient_allreduce_op
prescale_gradients gradient_predivide_factor disable_allgather gradient_clipping zero_optimization
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer optimizer scheduler fp16 bf16 bfloat16 torch_autocast
flops_profiler comms_logger tensorboard wandb csv_monitor comet activation_checkpointing aio autotuning pipeline
data_efficiency dataloader_drop_last hybrid_engine compile tensor_parallel expert_parallel
use_data_before_expert_parallelism datastates_ckpt weight_quantization timers vocabulary_size checkpoint
data_types sequence_parallel_size
""".split())
# Those of them whose value is a block (a mapping), not a number, text or switch.
DS_TOP_BLOCKS = frozenset("""
zero_optimization optimizer scheduler fp16 bf16 bfloat16 torch_autocast flops_profiler comms_logger tensorboard
wandb csv_monitor comet activation_checkpointing aio autotuning pipeline data_efficiency hybrid_engine compile
tensor_parallel expert_parallel datastates_ckpt weight_quantization timers checkpoint data_types
""".split())
# Accepted by older DeepSpeed releases, rejected since 0.19.8.
DS_REMOVED_KEYS = frozenset("""
nebula compression_training amp quantize_training sparse_gradients eigenvalue sparse_attention elasticity
graph_harvesting curriculum_learning progressive_layer_drop
""".split())
# zero_optimization keys of older DeepSpeed releases, rejected since 0.19.8.
DS_REMOVED_ZERO_KEYS = frozenset("mics_shard_size mics_hierarchical_params_gather zeropp_loco_param".split())
# Blocks that DeepSpeed validates with pydantic models that forbid unknown keys.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
STRICT_BLOCKS = {
    ("zero_optimization",): frozenset("""
stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce allgather_partitions
allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint offload_param offload_optimizer
sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save
ignore_unused_parameters legacy_stage1 round_robin_gradients zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param mics_shard_size
mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint override_module_apply
log_trace_cache_warnings enable_sanity_checks compute_grad_norm parameter_alignment
save_muon_momentum_buffer_in_memory zenflow leaf_module
""".split()) | frozenset(ZERO_ALIASES) | frozenset(ZERO_ALIASES.values()),
    ("zero_optimization", "offload_param"): frozenset(
        "device nvme_path buffer_count buffer_size max_in_cpu pin_memory".split()),
    ("zero_optimization", "offload_optimizer"): frozenset("""
device nvme_path buffer_count pin_memory pipeline_read pipeline_write fast_init ratio super_offload
cpuadam_cores_perc
""".split()),
    ("fp16",): frozenset("""
enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis consecutive_hysteresis
min_loss_scale fp16_master_weights_and_grads
""".split()),
    ("bf16",): frozenset(
        "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads bf16_optimizer_states".split()),
}
# Deprecated spellings DeepSpeed still converts (zero/config.py, new_param): never suggested as a fix.
DS_DEPRECATED_ZERO_KEYS = frozenset(
    "cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save".split())
# Keys of DeepSpeed's JSON at any level, as found pasted into accelerate's deepspeed_config section.
DS_JSON_KEYS = (DS_TOP_KEYS | frozenset().union(*STRICT_BLOCKS.values())) - frozenset(ACCELERATE_DS_KEYS)
# Numbers in accelerate's own config (top level and its sections).
ACCELERATE_NUMERIC = (
    ("num_processes",), ("machine_rank",), ("num_machines",), ("main_process_port",),
    ("deepspeed_config", "zero_stage"), ("deepspeed_config", "gradient_accumulation_steps"),
    ("deepspeed_config", "gradient_clipping"), ("fsdp_config", "fsdp_min_num_params"),
)
HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


# --- helpers -----------------------------------------------------------------------------------

def at(doc: Document, *keys: Any) -> dict:
    """Evidence that points at a file and line."""
    return {"file": doc.path, "line": doc.line(*keys)}


def dotted(keys: Sequence[Any]) -> str:
    return ".".join(str(k) for k in keys)


def did_you_mean(value: Any, options: Sequence[str]) -> str:
    if not isinstance(value, str):
        return ""
    exact = [o for o in options if o.lower() == value.lower()]
    close = exact or difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


MAX_SUGGESTED = 20  # unknown keys of a section looked at one by one; past them, one finding says how many more


def unknown(keys: Iterator[Any], known) -> Tuple[List[Any], List[Any]]:
    """The keys not in `known`: the first MAX_SUGGESTED (each matched against the known spellings) and the rest
    (counted only: a config with tens of thousands of keys stays linear)."""
    found = [k for k in keys if k not in known]
    return found[:MAX_SUGGESTED], found[MAX_SUGGESTED:]


def more_unknown(doc: Document, keys: Sequence[Any], rest: List[Any], make, consequence: str) -> Finding:
    """One finding for the unknown keys past the first MAX_SUGGESTED, at the first of them."""
    first = keys + (rest[0],)
    shown = ", ".join(repr(dotted(keys + (k,))) for k in rest[:3])
    return make(f"{doc.where(*first)}: {len(rest)} more unknown keys ({shown}, ...), not matched against the known "
                f"spellings; {consequence}", "delete the keys that are not for another tool", count=len(rest),
                **at(doc, *first))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def yaml_word(value: Any) -> str:
    """A value as YAML writes it, for a message: null, true, false, or the value quoted (and shortened)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else shorten(value)


def accel_doc(ctx) -> Optional[Document]:
    return ctx.plan.accelerate.doc if ctx.plan.accelerate is not None else None


def ds_doc(ctx) -> Optional[Document]:
    return ctx.plan.deepspeed.doc if ctx.plan.deepspeed is not None else None


def live_ds_section(ctx) -> Optional[Document]:
    """accelerate's deepspeed_config section when accelerate reads it (distributed_type DEEPSPEED), else None."""
    doc = accel_doc(ctx)
    if doc is None or not ctx.plan.accelerate.uses_deepspeed:
        return None
    return doc.section("deepspeed_config")


def accelerate_command(ctx):
    """The launch command when it is `accelerate launch` (preflight.inputs.launchcmd.LaunchCommand), else None."""
    command = ctx.plan.launch
    return command if command is not None and command.launcher == "accelerate" else None


def dynamo_backend_read(ctx, doc: Document) -> Optional[Tuple[Tuple[str, ...], Any]]:
    """The dynamo backend accelerate launch reads from the config, as (key path, value), or None: the top-level
    dynamo_backend, else dynamo_config's (config_args.py moves the first into the second); a --dynamo_backend flag
    wins, and DeepSpeed's launcher never reads it (utils/launch.py upper()s it in the simple, multi-GPU and TPU
    launchers only)."""
    command = accelerate_command(ctx)
    if command is not None and "dynamo_backend" in command.options:
        return None
    if ctx.plan.accelerate.uses_deepspeed and not ctx.plan.accelerate.cpu:
        return None
    for keys in (("dynamo_backend",), ("dynamo_config", "dynamo_backend")):
        holder = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if holder is not None and holder.data.get(keys[-1]) is not None:
            return keys, holder.data[keys[-1]]
    return None


# The types that make accelerate launch a multi-GPU job from the config file (commands/launch.py).
MULTI_TYPES = ("MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
               "MULTI_NEURON")
TYPE_FLAGS = ("cpu", "multi_gpu", "tpu", "use_deepspeed", "use_fsdp")  # accelerate takes one of them at most


FILLS = {"accelerate": 'accelerate fills in only keys set to "auto"', "deepspeed": "DeepSpeed alone fills in nothing"}


def ds_usage(ctx) -> str:
    """Who reads the DeepSpeed JSON: "accelerate" (an accelerate config or command names it), "deepspeed"
    (DeepSpeed's runner alone), or "unknown" (only --deepspeed: the HF Trainer, Lightning, a script)."""
    plan = ctx.plan
    if plan.accelerate is not None and plan.accelerate.uses_deepspeed and plan.deepspeed_file_named:
        return "accelerate"
    if plan.launch is not None:
        launcher = plan.launch.launcher
        if launcher == "accelerate" and plan.accelerate is not None and plan.accelerate.uses_deepspeed:
            return "accelerate"
        if launcher == "deepspeed":
            return "deepspeed"
    return "unknown"


# Addresses written as a stand-in for the head's real one (documentation and templates).
PLACEHOLDER_IP = re.compile(r"^(x{1,3}(\.x{1,3}){3}|<[^>]*>|\{\{.*\}\}|your[_-]?\w*|ip[_-]?addr(ess)?|ip[0-9]*|"
                            r"main[_-]?(process[_-]?)?ip|master[_-]?(addr|ip)|head[_-]?ip|changeme|0\.0\.0\.0)$", re.I)


def processes_per_machine(data: Mapping[str, Any]) -> Optional[int]:
    procs, machines = text_number(data.get("num_processes")), text_number(data.get("num_machines", 1))
    if is_int(procs) and is_int(machines) and procs > 0 and machines > 0:
        return procs // machines
    return None


def gpu_id_list(value: Any) -> Optional[List[str]]:
    """gpu_ids as a list, or None for 'all' and unset."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("all", "")):
        return None
    return [part.strip() for part in str(value).split(",")]


# --- accelerate config -------------------------------------------------------------------------

@check("CFG001", "accelerate-keys", "config", tags=["accelerate"])
def accelerate_keys(ctx) -> Iterator[Finding]:
    """The accelerate config has only keys that accelerate knows.

    accelerate refuses to start with a ValueError naming the unknown keys, on every node, after the
    job has been queued and the nodes allocated; a misspelt key never takes effect.

    Remove the key, or correct its spelling to the one suggested; `accelerate config` writes a
    correct file.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    schema = SAGEMAKER_KEYS if ctx.plan.accelerate.is_sagemaker else ACCELERATE_KEYS
    first, rest = unknown(doc.data, schema)
    for key in first:
        if key in ACCELERATE_REMOVED_KEYS:
            yield fail(f"{doc.where(key)}: key {key!r} is {ACCELERATE_REMOVED_KEYS[key]}; accelerate rejects the file",
                       f"delete the line `{key}: ...`", key=key, **at(doc, key))
        else:
            yield fail(f"{doc.where(key)}: unknown key {key!r}{did_you_mean(key, list(schema))}; "
                       "accelerate rejects the file with 'had unknown keys'",
                       f"correct or delete {key!r}; the keys accelerate knows are listed by `preflight explain CFG001`",
                       key=key, **at(doc, key))
    if rest:
        yield more_unknown(doc, (), rest, fail, "accelerate rejects the file with 'had unknown keys'")


@check("CFG002", "accelerate-values", "config", tags=["accelerate"])
def accelerate_values(ctx) -> Iterator[Finding]:
    """compute_environment, distributed_type, mixed_precision, rdzv_backend and the DeepSpeed launcher and
    offload devices hold values that accelerate accepts.

    accelerate reads these as enumerations: a misspelt value fails at launch (mixed_precision only when
    `accelerate launch` runs, long after the config was written). Case matters except where a library
    normalises it: accelerate lower-cases the offload devices and mixed_precision, and DeepSpeed's runner its
    launchers, but 'STANDARD' and 'NOSSH' miss accelerate's own; the launcher is read only over several machines.
    rdzv_backend in the config is never read (the flag's default, 'static', wins): a value there is a warning.
    dynamo_backend is read in any case, by every launcher but DeepSpeed's, unless a flag gives it. Under
    FSDP, fsdp_config's enumerations and booleans are read back by accelerate's FSDP plugin when the script
    starts (names in any case or their number; true/false words).

    Use one of the listed values, spelt exactly; the message suggests the closest.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    data = doc.data
    sagemaker = ctx.plan.accelerate.is_sagemaker
    if "distributed_type" not in data and not ctx.plan.accelerate.from_command:
        yield fail(f"{doc.path}: distributed_type is missing; accelerate refuses a config without it",
                   "add `distributed_type: MULTI_GPU` (or DEEPSPEED, FSDP, NO, ...)", **at(doc))
    rules = [
        (("compute_environment",), COMPUTE_ENVIRONMENTS),
        (("distributed_type",), SAGEMAKER_DISTRIBUTED_TYPES if sagemaker else DISTRIBUTED_TYPES),
        (("mixed_precision",), MIXED_PRECISIONS),
        (("rdzv_backend",), RDZV_BACKENDS),
        (("deepspeed_config", "deepspeed_multinode_launcher"), MULTINODE_LAUNCHERS),
        (("deepspeed_config", "offload_optimizer_device"), OFFLOAD_DEVICES),
        (("deepspeed_config", "offload_param_device"), OFFLOAD_DEVICES),
    ]
    section = live_ds_section(ctx)
    if section is not None and section.data.get("gradient_accumulation_steps") == AUTO and not ctx.plan.accelerate.cpu:
        # DeepSpeedPlugin keeps "auto", but Accelerator() then reads the environment's copy with int() unless the
        # script hands it an accumulation plugin of its own, as the transformers Trainer does (accelerator.py).
        keys = ("deepspeed_config", "gradient_accumulation_steps")
        yield warn(f"{doc.where(*keys)}: deepspeed_config.gradient_accumulation_steps is \"auto\": the transformers "
                   "Trainer fills it in, but a script that calls Accelerator() itself stops on int('auto')",
                   f"set {doc.setting(*keys)} to a number, unless the transformers Trainer runs the job",
                   **at(doc, *keys))
    fsdp = doc.section("fsdp_config")
    if data.get("distributed_type") == "FSDP" and not ctx.plan.accelerate.cpu and fsdp is not None:
        command = accelerate_command(ctx)
        for key, why, fix in fsdp_problems(fsdp.data):
            if command is not None and key in command.options:
                continue  # the flag's value is what runs (CFG007 reads it)
            shown = yaml_word(fsdp.data[key]) if key in fsdp.data else "not set"
            yield fail(f"{doc.where('fsdp_config', key)}: fsdp_config.{key} is {shown}, {why}",
                       f"fsdp_config.{key}: {fix}", key=key, **at(doc, "fsdp_config", key))
    dynamo = dynamo_backend_read(ctx, doc)
    if dynamo is not None and isinstance(dynamo[1], str) and dynamo[1].upper() not in DYNAMO_BACKENDS:
        keys, value = dynamo
        yield fail(f"{doc.where(*keys)}: {dotted(keys)} is {shorten(value)}, expected one of "
                   f"{', '.join(DYNAMO_BACKENDS)} (in any case){did_you_mean(value.upper(), DYNAMO_BACKENDS)}; "
                   "accelerate launch stops with 'Unknown dynamo backend'",
                   f"set {doc.setting(*keys)} to one of: {', '.join(DYNAMO_BACKENDS)}", value=value, **at(doc, *keys))
    for keys, allowed in rules:
        if len(keys) > 1 and not ctx.plan.accelerate.uses_deepspeed:
            continue  # accelerate never reads deepspeed_config under other types (CFG004 says so)
        section = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if section is None or keys[-1] not in section.data:
            continue
        value = section.data[keys[-1]]
        if keys == ("distributed_type",) and not isinstance(value, (str, bool)):
            # accelerate keeps it as it is (config_args.py converts strings only), and launch then runs the script
            # as one plain process (commands/launch.py: no type flag matches null, a number or a list).
            yield warn(f"{doc.where(*keys)}: distributed_type is {yaml_word(value)}; accelerate launches the script "
                       "as one process with no distributed setup, as with 'NO'",
                       "write `distributed_type: 'NO'`, or the distributed type you meant (MULTI_GPU, DEEPSPEED, ...)",
                       **at(doc, *keys))
            continue
        if value is None or isinstance(value, bool):  # bool: a YAML trap, reported by CFG003
            continue
        if (keys[-1].endswith("_device") or keys == ("mixed_precision",)) and str(value).lower() in allowed:
            continue  # accelerate lower-cases them before use (utils/launch.py: offload devices, mixed_precision)
        if keys[-1] == "deepspeed_multinode_launcher" and isinstance(value, str):
            yield from multinode_launcher(ctx, doc, keys, value)
            continue
        if keys == ("rdzv_backend",):
            yield from rdzv_backend_in_file(ctx, doc, value)
            continue
        if value not in allowed:
            yield fail(f"{doc.where(*keys)}: {dotted(keys)} is {value!r}, expected one of "
                       f"{', '.join(allowed)}{did_you_mean(value, allowed)}",
                       f"set {doc.setting(*keys)} to one of: {', '.join(allowed)}", value=value, **at(doc, *keys))


def rdzv_backend_in_file(ctx, doc: Document, value: Any) -> Iterator[Finding]:
    """accelerate launch never copies rdzv_backend from its config: its --rdzv_backend flag has a default
    ('static'), and _validate_launch_command copies a file's value only over a flag left at None
    (commands/launch.py). The file's value is then dead, whatever it says."""
    command = accelerate_command(ctx)
    if value == "static" or command is not None and "rdzv_backend" in command.options:
        return
    fix = f"pass --rdzv_backend {value} to accelerate launch" if value in RDZV_BACKENDS else \
        "delete rdzv_backend (or pass --rdzv_backend to accelerate launch)"
    runner = ctx.plan.accelerate.runner is not None  # DeepSpeed's runner starts the job: no torchrun at all
    yield warn(f"{doc.where('rdzv_backend')}: rdzv_backend is {shorten(value)}, but accelerate launch never reads it "
               "from the config (its --rdzv_backend flag defaults to 'static', and the flag wins), so "
               + ("DeepSpeed's runner starts the job and no rendezvous backend is used" if runner else
                  "torchrun uses 'static'"),
               "delete rdzv_backend: DeepSpeed's runner does not use it" if runner else fix, value=value,
               **at(doc, "rdzv_backend"))


def multinode_launcher(ctx, doc: Document, keys: Tuple[str, ...], value: str) -> Iterator[Finding]:
    """deepspeed_multinode_launcher as accelerate and DeepSpeed's runner read it: only over several machines (and
    not with --cpu), where the runner takes its launchers in any case."""
    problem = multinode_launcher_problem(value)
    if problem is None:
        return
    found = f"{doc.where(*keys)}: {dotted(keys)} is {value!r}{did_you_mean(value, MULTINODE_LAUNCHERS)}"
    fix = f"set {doc.setting(*keys)} to one of: {', '.join(MULTINODE_LAUNCHERS)}"
    machines = ctx.plan.accelerate.integer("num_machines", 1)
    if ctx.plan.accelerate.cpu or machines is None or machines <= 1:
        yield warn(f"{found}; accelerate reads it only when num_machines > 1, and there {problem}", fix,
                   value=value, **at(doc, *keys))
    else:
        yield fail(f"{found} over {machines} machines: {problem}", fix, value=value, **at(doc, *keys))


@check("CFG003", "yaml-traps", "config", tags=["accelerate", "deepspeed", "yaml", "json"])
def yaml_traps(ctx) -> Iterator[Finding]:
    """Numbers written so that the parser reads them as strings, and NO / no read as false.

    YAML 1.1 (PyYAML, which accelerate uses) reads `5e8` and `1e-5` as strings, and an unquoted `NO` or
    `no` as false; a quoted number in JSON is a string too. DeepSpeed then fails comparing a string with
    a number, or accelerate launch crashes on `False.lower()` (mixed_precision, dynamo_backend), at
    start-up on every node. An unquoted `distributed_type: NO` (or yes) happens to launch as 'NO' (a
    warning). In accelerate's config, only text that accelerate compares or computes with stops it:
    num_machines, num_processes over several machines or in the simple launcher, the head's
    main_process_port, a zero_stage or gradient_accumulation_steps that int() cannot read back in the
    script; text it passes on (machine_rank, num_processes on one machine, gradient_clipping) works. In the
    DeepSpeed JSON, DeepSpeed's models read integer text in zero_optimization and fp16 (a quoted ZeRO stage
    still misleads accelerate and transformers: a warning), while text in the batch keys,
    gradient_clipping, steps_per_print and the optimizer's and scheduler's params stops the job.

    Write numbers with a dot and a signed exponent (`5.0e+8`) or in full (`500000000`), never in quotes;
    quote words such as 'NO' and 'no'.
    """
    docs = [d for d in (accel_doc(ctx), ds_doc(ctx)) if d is not None]
    if not docs:
        yield skip("no config given (--config, --deepspeed)")
        return
    accel = accel_doc(ctx)
    if accel is not None:
        dynamo = dynamo_backend_read(ctx, accel)
        for key in ("distributed_type", "mixed_precision", "dynamo_backend"):
            if not isinstance(accel.data.get(key), bool):
                continue
            word = str(accel.data[key]).lower()
            if key == "dynamo_backend" and dynamo is None:  # a --dynamo_backend flag, or DeepSpeed's launcher
                yield warn(f"{accel.where(key)}: dynamo_backend is {word} (YAML 1.1 reads an unquoted NO / no as "
                           "false); this launch does not read it, but another would stop on it",
                           "quote it: `dynamo_backend: 'NO'`", key=key, **at(accel, key))
                continue
            if key == "distributed_type":
                # accelerate only tests it against its types (commands/launch.py): true or false launches as 'NO'.
                read = "NO as false" if word == "false" else "yes / on as true"
                yield warn(f"{accel.where(key)}: distributed_type is {word} (YAML 1.1 reads an unquoted {read}); "
                           "accelerate launches it as 'NO': one process, no distributed setup",
                           "quote it: `distributed_type: 'NO'` (or write the distributed type you meant)",
                           key=key, **at(accel, key))
                continue
            # mixed_precision.lower() and dynamo_backend.upper() in accelerate's launch: AttributeError on a bool.
            yield fail(f"{accel.where(key)}: {key} is {word}, expected a word such as 'NO': YAML 1.1 reads an "
                       "unquoted NO / no as false (and yes as true), and accelerate launch stops on it",
                       f"quote it: `{key}: '{'no' if key == 'mixed_precision' else 'NO'}'`", key=key, **at(accel, key))
        if dynamo is not None and dynamo[0] != ("dynamo_backend",) and not isinstance(dynamo[1], str):
            keys, value = dynamo  # dynamo_config's own: the same .upper() on it
            yield fail(f"{accel.where(*keys)}: {dotted(keys)} is {yaml_word(value)}, expected a word such as 'NO'"
                       + (": YAML 1.1 reads an unquoted NO / no as false" if isinstance(value, bool) else "")
                       + "; accelerate launch stops on it (AttributeError)", f"quote it: `dynamo_backend: 'NO'`",
                       key=dotted(keys), **at(accel, *keys))
        # (DeepSpeed-JSON keys pasted into the section are never read: CFG004 says they are ignored.)
        launch = ctx.plan.accelerate.launch

        def judge_accelerate(keys: Tuple[str, ...], text: str) -> Optional[Tuple[bool, str]]:
            why = text_number_stops_launch(keys, text, launch)
            return (True, why) if why else None

        yield from _numeric_strings(accel, ACCELERATE_NUMERIC, judge_accelerate)
    ds = ds_doc(ctx)
    if ds is not None:
        usage = ds_usage(ctx)
        yield from _numeric_strings(ds, list(DS_NUMERIC), lambda keys, text: ds_text_number_stops(keys, text, usage))
        yield from _boolean_strings(ds, ())


def _boolean_strings(doc: Document, keys: Tuple[str, ...]) -> Iterator[Finding]:
    """"true" / "false" in quotes. DeepSpeed's pydantic models coerce them, so DeepSpeed alone trains as
    meant; but accelerate's and transformers' HfDeepSpeedConfig.is_true() take bool("false"), which is True,
    and the transformers Trainer compares fp16/bf16.enabled with its own flag by != and stops with 'Please
    correct the following DeepSpeed config values that mismatch TrainingArguments'."""
    section = doc.section(*keys) if keys else doc
    if section is None:
        return
    for key, value in section.data.items():
        path = keys + (key,)
        if isinstance(value, Mapping):
            yield from _boolean_strings(doc, path)
            continue
        if not (isinstance(value, str) and value.strip().lower() in ("true", "false")):
            continue
        word = value.strip().lower()
        precision = key == "enabled" and keys in (("fp16",), ("bf16",), ("bfloat16",))
        common = (f"{doc.where(*path)}: {dotted(path)} is the string {value!r}, expected {word} without quotes: "
                  "DeepSpeed's own models coerce it")
        if precision and word == "false":
            yield fail(f"{common}, but accelerate's and transformers' HfDeepSpeedConfig.is_true() read the text "
                       f"'false' as true (bool of a non-empty string) and pick {keys[0]}",
                       f'write "{key}": false, without quotes', key=dotted(path), value=value, **at(doc, *path))
        elif precision:
            yield warn(f"{common}, but the transformers Trainer compares it with its own --{keys[0].replace('bfloat16', 'bf16')} "
                       "flag by != and stops ('values that mismatch TrainingArguments')",
                       f'write "{key}": true, without quotes (or "auto" under the Trainer)', key=dotted(path),
                       value=value, **at(doc, *path))
        else:
            yield warn(f"{common}; accelerate's and transformers' is_true() read the text 'false' as true",
                       f'write "{key}": {word}, without quotes', key=dotted(path), value=value, **at(doc, *path))


def _numeric_strings(doc: Document, paths: Sequence[Tuple[str, ...]],
                     judge: Callable[[Tuple[str, ...], str], Optional[Tuple[bool, str]]]) -> Iterator[Finding]:
    """Numbers written as text at `paths`, as judge(keys, text) sees them: None where every reader takes the
    text as its number, else (whether the job stops: a failure, else a warning, and why)."""
    for keys in paths:
        section = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if section is None:
            continue
        value = section.data.get(keys[-1])
        if not is_numeric_string(value):
            continue
        verdict = judge(keys, value)
        if verdict is None:
            continue
        stops, stop = verdict
        number = float(value)
        shown = str(int(number)) if number.is_integer() else repr(number)
        if doc.kind == "yaml" and doc.is_plain_string(*keys):
            why = f"YAML 1.1 reads {value} (no dot in the mantissa, or no sign in the exponent) as a string"
        else:
            why = "the number is quoted, so it is a string"
        fix = f'write "{keys[-1]}": {shown}, without quotes' if doc.kind == "json" else f"write {keys[-1]}: {shown}"
        yield (fail if stops else warn)(f"{doc.where(*keys)}: {dotted(keys)} is the string {value!r}, expected a "
                                        f"number: {why}; {stop}", fix, key=dotted(keys), value=value, **at(doc, *keys))


@check("CFG004", "deepspeed-section-keys", "config", tags=["accelerate", "deepspeed"])
def deepspeed_section_keys(ctx) -> Iterator[Finding]:
    """The `deepspeed_config` section of the accelerate config holds only accelerate's own DeepSpeed keys.

    accelerate reads only its own keys there (zero_stage, offload_optimizer_device, ...). DeepSpeed-JSON
    keys pasted into it (train_batch_size, zero_optimization, fp16, ...) are silently ignored: the job
    runs with other settings than the file shows.

    Move DeepSpeed-JSON settings into a JSON file named by `deepspeed_config_file`, or express them with
    accelerate's keys (zero_stage, offload_optimizer_device, offload_param_device, gradient_clipping,
    gradient_accumulation_steps).
    """
    doc = accel_doc(ctx)
    written = doc.data.get("deepspeed_config") if doc is not None else None
    if written is not None and not isinstance(written, dict) and ctx.plan.accelerate.uses_deepspeed:
        # Only with --use_deepspeed over another type (under DEEPSPEED the file is refused as bad input):
        # launch_command reads defaults.deepspeed_config.keys() before it starts DeepSpeed.
        yield fail(f"{doc.where('deepspeed_config')}: deepspeed_config is {shorten(written)}, not a section, and the "
                   "launch uses DeepSpeed: accelerate launch stops on it (AttributeError: no attribute 'keys')",
                   f"write deepspeed_config: {{deepspeed_config_file: {written}}}" if isinstance(written, str) else
                   "make deepspeed_config a section of accelerate's DeepSpeed keys (zero_stage, deepspeed_config_file, "
                   "...), or delete it", **at(doc, "deepspeed_config"))
        return
    if not written:
        yield skip("the accelerate config has no deepspeed_config section")
        return
    if not ctx.plan.accelerate.uses_deepspeed:
        dtype = doc.data.get("distributed_type")
        shown = f"is {yaml_word(dtype)}" if "distributed_type" in doc.data else "not set"
        named = isinstance(written, str)  # a JSON's path where the section belongs: DeepSpeed was meant
        yield warn(f"{doc.where('deepspeed_config')}: distributed_type {shown}, so accelerate never reads "
                   + (f"deepspeed_config ({shorten(written)}): the job runs without DeepSpeed" if named else
                      "this deepspeed_config section: its settings are ignored")
                   + " (accelerate launch uses DeepSpeed only with distributed_type DEEPSPEED or --use_deepspeed)",
                   f"to run with that DeepSpeed JSON, set distributed_type: DEEPSPEED and deepspeed_config: "
                   f"{{deepspeed_config_file: {written}}}; else delete the deepspeed_config line" if named else
                   "delete the deepspeed_config section, or set distributed_type: DEEPSPEED if the job is meant to "
                   "use DeepSpeed", distributed_type=dtype, **at(doc, "deepspeed_config"))
        return
    section = doc.section("deepspeed_config")
    ds_keys = [k for k in section.data if k in DS_JSON_KEYS]
    if ds_keys:
        first = ds_keys[0]
        # The job runs (accelerate copies them into launch arguments no launcher reads): a warning, not a refusal.
        yield warn(f"{doc.where('deepspeed_config', first)}: deepspeed_config holds DeepSpeed-JSON keys "
                   f"({', '.join(ds_keys)}) that accelerate ignores; expected only accelerate's keys",
                   "put these settings in a DeepSpeed JSON file and name it with deepspeed_config_file, or use "
                   "accelerate's keys: zero_stage, offload_optimizer_device, offload_param_device, "
                   "gradient_accumulation_steps, gradient_clipping", keys=ds_keys, **at(doc, "deepspeed_config", first))
    for key in section.data:
        if key not in ACCELERATE_DS_KEYS and key not in DS_JSON_KEYS:
            yield warn(f"{doc.where('deepspeed_config', key)}: deepspeed_config.{key} is not a key accelerate "
                       f"knows{did_you_mean(key, list(ACCELERATE_DS_KEYS))}; it has no effect",
                       f"correct or delete deepspeed_config.{key}", key=key, **at(doc, "deepspeed_config", key))


@check("CFG005", "deepspeed-config-file", "config", tags=["accelerate", "deepspeed"])
def deepspeed_config_file(ctx) -> Iterator[Finding]:
    """The DeepSpeed JSON named by `deepspeed_config_file` exists, and nothing beside it contradicts it.

    With `deepspeed_config_file`, accelerate raises a ValueError on every node when the script starts if
    the config also sets mixed_precision (any value, even 'no') or one of zero_stage, offload_*,
    gradient_accumulation_steps, gradient_clipping, zero3_save_16bit_model; and it requires a
    zero_optimization block in the file. A DeepSpeed config given with an accelerate config that does
    not use DeepSpeed is not used at all.

    Keep those settings in the DeepSpeed JSON only and delete them (and mixed_precision) from the
    accelerate config; make deepspeed_config_file a path that exists on every node.
    """
    doc = accel_doc(ctx)
    plan = ctx.plan
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    section = live_ds_section(ctx)
    named = section.data.get("deepspeed_config_file") if section is not None else None
    if named is None:
        if plan.deepspeed is not None and not ctx.plan.accelerate.uses_deepspeed:
            yield warn(f"{doc.where('distributed_type')}: distributed_type is {doc.data.get('distributed_type')!r}, "
                       f"so the DeepSpeed config {plan.deepspeed.doc.path} is not used by this accelerate config",
                       "set distributed_type: DEEPSPEED and deepspeed_config.deepspeed_config_file to the JSON's path",
                       **at(doc, "distributed_type"))
        elif plan.deepspeed is not None:
            yield warn(f"{doc.where('deepspeed_config')}: this accelerate config names no deepspeed_config_file: "
                       f"accelerate builds the DeepSpeed settings from its own keys, and {plan.deepspeed.doc.path} "
                       "is not used", "name the JSON in deepspeed_config.deepspeed_config_file (and remove "
                       "accelerate's own zero_stage, offload_* and mixed_precision)", **at(doc, "deepspeed_config"))
        elif plan.deepspeed is None:
            yield skip("the accelerate config names no deepspeed_config_file")
        return
    where = doc.where("deepspeed_config", "deepspeed_config_file")
    if plan.deepspeed is None or plan.deepspeed_file_named is None:
        yield fail(f"{where}: deepspeed_config_file {named!r} does not exist (looked in the working directory "
                   f"and beside {doc.path}); accelerate reads the config without opening it, then stops when the "
                   "script starts and its DeepSpeedPlugin opens the file", "correct the path; it must exist on every node",
                   **at(doc, "deepspeed_config", "deepspeed_config_file"))
    elif not _same_path(plan.deepspeed.doc.path, plan.deepspeed_file_named):
        yield warn(f"{where}: the accelerate config uses {plan.deepspeed_file_named}, "
                   f"but the DeepSpeed config checked is {plan.deepspeed.doc.path}",
                   "lint the file the job will use: drop --deepspeed, or point deepspeed_config_file at it",
                   **at(doc, "deepspeed_config", "deepspeed_config_file"))
    # accelerate raises for the keys the config file writes (a flag over one does not hide it), and for its
    # mixed_precision unless a flag gives that (commands/launch.py, launch_command); flags alone never
    conflicting = [k for k in ACCELERATE_DS_KEYS_CONFLICTING_WITH_FILE if section.in_file(k)]
    if doc.data.get("mixed_precision") is not None and not doc.given_by_flag("mixed_precision"):
        conflicting.append("mixed_precision")
    for key in conflicting:
        keys = ("mixed_precision",) if key == "mixed_precision" else ("deepspeed_config", key)
        yield fail(f"{doc.where(*keys)}: {dotted(keys)} is set beside deepspeed_config_file; accelerate raises "
                   "'When using `deepspeed_config_file`, the following accelerate config variables will be "
                   "ignored' when the script starts", f"delete {dotted(keys)} and set it in the DeepSpeed JSON",
                   key=dotted(keys), **at(doc, *keys))
    ds = ds_doc(ctx)
    if ds is not None and "zero_optimization" not in ds.data:
        yield fail(f"{ds.path}: no zero_optimization block; accelerate requires one in the file it is given "
                   "('Please specify the ZeRO optimization config in the DeepSpeed config')",
                   'add "zero_optimization": {"stage": 0} (or the stage you want)', **at(ds))


def _same_path(a: str, b: str) -> bool:
    """The same file, however the two were spelt (./x, x, a/../x); no I/O."""
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


@check("CFG006", "duplicate-keys", "config", tags=["accelerate", "deepspeed", "yaml", "json"])
def duplicate_keys(ctx) -> Iterator[Finding]:
    """No key is given twice in the same mapping.

    DeepSpeed refuses a JSON file with repeated keys ('Duplicate keys in DeepSpeed config'); YAML and
    accelerate silently keep the last one, so an edit to the first occurrence does nothing.

    Delete one of the two occurrences.
    """
    docs = [d for d in (accel_doc(ctx), ds_doc(ctx)) if d is not None]
    if not docs:
        yield skip("no config given (--config, --deepspeed)")
        return
    for doc in docs:
        for keys, line in doc.duplicates:
            where = f"{doc.path}:{line}"
            if doc.kind == "json":
                yield fail(f"{where}: key {dotted(keys)!r} is given twice; DeepSpeed refuses the file "
                           "('Duplicate keys in DeepSpeed config')", "delete one of the two", key=dotted(keys),
                           file=doc.path, line=line)
            else:
                yield warn(f"{where}: key {dotted(keys)!r} is given twice; only this last one takes effect",
                           "delete one of the two", key=dotted(keys), file=doc.path, line=line)


def from_shell(text: str) -> bool:
    """Whether a value of the launch command is left for the node's shell to fill in ($VAR, `cmd`)."""
    return "$" in text or "`" in text


def _reads_as(kind: type, text: str) -> bool:
    """Whether argparse's type=int (or float) takes the text."""
    try:
        kind(text)
    except ValueError:
        return False
    return True


LAUNCHER_NAMES = {"accelerate": "accelerate launch", "torchrun": "torchrun", "deepspeed": "DeepSpeed's runner"}
# A word meant as a switch's value (`--same_network false`): the launcher takes it for the script.
SWITCH_VALUE = re.compile(r"^(true|false|yes|no|on|off|[01])$", re.I)


@check("CFG007", "launch-command", "config", tags=["accelerate", "torchrun", "deepspeed"])
def launch_command(ctx) -> Iterator[Finding]:
    """The launch command after `--` reads as its launcher's argument parser reads it: a training script,
    option values of the right kind (a whole number where it takes int(), one of its choices in their
    case), at most one of accelerate's type switches, --multi_gpu with two processes or more, options
    the launcher takes together; and the file it opens first (accelerate's --config_file, DeepSpeed's
    --hostfile) is there.

    The launcher stops with a usage error before anything starts; a value given to a switch
    (`--same_network false train.py`) is worse: the launcher runs a script named 'false' on every node.
    torchrun's --standalone over several nodes leaves each node waiting alone.

    Write each option as the launcher's --help shows it: drop the value after a switch (give the switch
    for true, leave it out for false), and put the script after the launcher's options.
    """
    command = ctx.plan.launch
    if command is None:
        yield skip("no launch command given (after `--`)")
        return
    from preflight.inputs import launchcmd

    name = LAUNCHER_NAMES.get(command.launcher)
    if name is None:
        yield skip(f"{command.program or 'the command'} is not a launcher whose options preflight reads")
        return
    found = []
    if command.problem:
        found.append(fail(f"the launch command cannot be read as {name} reads it: {command.problem}; it stops with "
                          "a usage error", f"write the option as `{command.program} --help` shows it"))
    for key, value in dict.fromkeys(command.given):  # argparse converts every value given, not only the last
        if not isinstance(value, str) or from_shell(value):  # a switch, or the node's shell fills it in
            continue
        choices = launchcmd.CHOICES[command.launcher].get(key)
        if key in launchcmd.INT_OPTIONS[command.launcher] and not _reads_as(int, value):
            found.append(fail(f"flag --{key} is {shorten(value)}, expected a whole number; {name} stops with "
                              "'invalid int value'", f"give --{key} a number", flag=key, value=value))
        elif key in launchcmd.FLOAT_OPTIONS[command.launcher] and not _reads_as(float, value):
            found.append(fail(f"flag --{key} is {shorten(value)}, expected a number; {name} stops with 'invalid "
                              "float value'", f"give --{key} a number", flag=key, value=value))
        elif key in launchcmd.TRUTH_OPTIONS[command.launcher] and value.lower() not in TRUTH_WORDS:
            found.append(fail(f"flag --{key} is {shorten(value)}, expected true or false; {name} stops on it "
                              "(str_to_bool: invalid truth value)", f"give --{key} true or false", flag=key,
                              value=value))
        elif choices and value not in choices:
            found.append(fail(f"flag --{key} is {shorten(value)}, expected one of {', '.join(choices)}"
                              f"{did_you_mean(value, choices)}; {name} stops with 'invalid choice'",
                              f"give --{key} one of: {', '.join(choices)}", flag=key, value=value))
    if command.launcher == "accelerate":  # checked before any config is read (commands/launch.py)
        given = [f"--{f}" for f in TYPE_FLAGS if command.flag(f)]
        if len(given) > 1:
            found.append(fail(f"the launch command passes {' and '.join(given)}; accelerate launch stops with 'You "
                              "can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`, `--use_fsdp` at "
                              "a time'", f"keep one of {', '.join(given)}", flags=given))
        if command.flag("use_parallelism_config") and not command.flag("use_fsdp"):
            found.append(fail("the launch command passes --use_parallelism_config without --use_fsdp; accelerate "
                              "launch stops with 'You cannot use `--use_parallelism_config` without `--use_fsdp` and "
                              "`--fsdp_version=2`'",
                              "add --use_fsdp --fsdp_version 2, or drop --use_parallelism_config"))
        procs = command.integer("num_processes")
        if command.flag("multi_gpu") and procs is not None and procs < 2:
            found.append(fail(f"flag --num_processes is {procs} with --multi_gpu; accelerate launch stops with 'You "
                              "need to use at least 2 processes to use `--multi_gpu`'",
                              "pass --num_processes 2 or more, or drop --multi_gpu", num_processes=procs))
    if command.launcher == "deepspeed":  # the runner, before it starts anything (deepspeed/launcher/runner.py)
        counts = [f"--{k}" for k in ("num_nodes", "num_gpus") if (command.integer(k) or 0) >= 0 and command.get(k)]
        filters = [f"--{k}" for k in ("include", "exclude") if command.get(k)]
        if counts and filters:
            found.append(fail(f"the launch command passes {' and '.join(counts)} with {' and '.join(filters)}; "
                              "DeepSpeed's runner stops with 'Cannot specify num_nodes/gpus with include/exclude'",
                              f"keep {' and '.join(filters)} (it names the GPUs), or drop it for "
                              f"{' and '.join(counts)}", flags=counts + filters))
    nnodes = command.get("nnodes") if command.launcher == "torchrun" else None
    if isinstance(nnodes, str) and not from_shell(nnodes) and \
            not (nnodes.count(":") <= 1 and all(_reads_as(int, part) for part in nnodes.split(":"))):
        found.append(fail(f"flag --nnodes is {shorten(nnodes)}, expected N or MIN:MAX (whole numbers); torchrun stops "
                          "on it (parse_min_max_nnodes)", "give --nnodes N, or MIN:MAX for an elastic job",
                          flag="nnodes", value=nnodes))
    if command.launcher == "torchrun" and command.flag("standalone"):
        most = nnodes.split(":", 1)[-1] if isinstance(nnodes, str) else None
        if most is not None and _reads_as(int, most) and int(most) > 1:
            found.append(fail(f"the launch command passes --standalone with --nnodes {shorten(nnodes)}: torchrun "
                              "then meets on localhost only (torch/distributed/run.py), so each node waits alone "
                              "for the others until the rendezvous times out", "drop --standalone and give "
                              "--rdzv_endpoint HEAD:PORT (or --master_addr and --master_port)", nnodes=nnodes))
    # The files the launcher opens first, as named here (lint has no nodes to ask: they are this machine's).
    named_file = {"accelerate": "config_file", "deepspeed": "hostfile"}.get(command.launcher)
    named = command.get(named_file) if named_file else None
    if isinstance(named, str) and named and not from_shell(named) and not ctx.plan.remote and not os.path.isfile(named):
        stops = ("accelerate launch stops ('The passed configuration file ... does not exist')"
                 if named_file == "config_file" else "DeepSpeed's runner warns 'Unable to find hostfile' and trains "
                 "on this machine alone (with --num_nodes over 1 it stops)")
        found.append(fail(f"flag --{named_file} names {shorten(named)}, which is not a file here (looked from "
                          f"the working directory); {stops}",
                          f"correct --{named_file}; the file must exist on every node", flag=named_file, path=named))
    at_script = len(command.argv) - len(command.script_args) - 1
    before = command.argv[at_script - 1] if command.script is not None and at_script >= 1 else ""
    if command.script is None and not command.problem:
        found.append(fail(f"the launch command names no training script; {name} stops ('the following arguments "
                          "are required')", "put the training script after the launcher's options"))
    elif before.startswith("--") and "=" not in before and SWITCH_VALUE.match(command.script or "") and \
            launchcmd.canonical(before) in launchcmd.FLAGS[command.launcher]:
        after = f", with {shorten(command.script_args[0])} as its argument" if command.script_args else ""
        found.append(fail(f"{before} takes no value: {name} reads the {command.script!r} after it as the training "
                          f"script, and runs a script named {command.script!r}{after}",
                          f"drop {command.script!r} after {before} (give {before} for true, leave it out for false)",
                          flag=before, script=command.script))
    yield from found
    if not found:
        yield passed(f"{name} reads the command: script {shorten(command.script)}, {len(command.options)} options")


@check("CFG008", "json-comments", "config", tags=["deepspeed", "json"])
def json_comments(ctx) -> Iterator[Finding]:
    """The DeepSpeed config is plain JSON, without comments, where a reader other than DeepSpeed opens it.

    DeepSpeed reads a config file with hjson, which takes // # and /* */ comments. accelerate's
    DeepSpeedPlugin and the transformers Trainer read the same file with json.load, which stops on the
    first comment ('Expecting property name enclosed in double quotes') on every node as the script starts.

    Delete the comments (keep the notes in a README beside the file), or keep the commented file only
    for scripts that hand it to deepspeed.initialize themselves.
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    if not ds.commented:
        yield passed(f"{ds.path} is plain JSON")
        return
    stops = ("accelerate's DeepSpeedPlugin and the transformers Trainer read it with json.load and stop on the first "
             "comment ('Expecting property name enclosed in double quotes')")
    if ds_usage(ctx) == "accelerate":
        yield fail(f"{ds.path}: the DeepSpeed config holds comments, and accelerate launches the job: {stops}",
                   "delete the comments", **at(ds))
    else:
        yield warn(f"{ds.path}: the DeepSpeed config holds comments: DeepSpeed reads it with hjson and takes them, "
                   f"but {stops}", "delete the comments, unless the script hands the file to deepspeed.initialize "
                   "itself", **at(ds))


@check("CFG010", "main-process-address", "config", tags=["accelerate", "multinode", "network"])
def main_process_address(ctx) -> Iterator[Finding]:
    """With several machines, main_process_ip and main_process_port are set, and are a host and a port.

    Every worker connects to the head at this address to rendezvous: without it accelerate stops with
    an assertion; with `user@host`, a URL or `host:port` in main_process_ip the workers wait until the
    rendezvous times out; a port above 65535 cannot be bound, one under 1024 needs root, and 0 (any
    free port) is picked by each machine on its own. On one machine torchrun reads only the port, and one
    process alone neither: a bad value there is a warning.

    Set main_process_ip to the head's address or host name as the workers resolve it (no user, scheme
    or port) and main_process_port to a free port above 1024, such as 29500.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    data = doc.data
    machines = text_number(data.get("num_machines", 1))
    launcher = "simple" if ctx.plan.accelerate.cpu else accelerate_launcher(data.get("distributed_type"))
    # DeepSpeed's runner on the head is given no address for an empty one (utils/launch.py: `if main_process_ip:`)
    runner_finds_ip = ctx.plan.accelerate.head_runner and data.get("main_process_ip") in (None, "")
    if is_int(machines) and machines > 1:
        if runner_finds_ip:
            yield warn(f"{doc.where('main_process_ip')}: num_machines is {machines} and main_process_ip is "
                       f"{'empty' if data.get('main_process_ip') == '' else 'not set'}: "
                       "DeepSpeed's runner meets at the first address `hostname -I` prints on the first host, "
                       "which may not be on the training network", f"set {doc.setting('main_process_ip')} to the "
                       "head node's address on the training network", **at(doc, "main_process_ip"))
        elif data.get("main_process_ip") is None:
            yield fail(f"{doc.where('main_process_ip')}: num_machines is {machines} but main_process_ip is not set; "
                       "the workers cannot find the head" + (" ('When using multiple machines, you need to specify "
                       "the main process IP')" if launcher == "simple" else ""),
                       f"set {doc.setting('main_process_ip')} to the head node's address, such as 10.0.0.1",
                       **at(doc, "main_process_ip"))
        if data.get("main_process_port") is None:
            # The torchrun and DeepSpeed launches fall back to 29500; the simple one asserts (utils/launch.py)
            simple_one = launcher == "simple"
            yield (fail if simple_one else warn)(
                f"{doc.where('main_process_port')}: num_machines is {machines} but main_process_port is not set; "
                + ("accelerate launch stops with 'you need to specify the main process port'" if simple_one else
                   "accelerate falls back to 29500"),
                f"set {doc.setting('main_process_port')} to 29500 (or another free port)",
                **at(doc, "main_process_port"))
    ip = data.get("main_process_ip")
    several = is_int(machines) and machines > 1
    # On one machine only some launches read the head's address and port (accelerate/utils/launch.py): torchrun
    # (which DEEPSPEED also runs there) reads the port alone; MULTI_CPU's processes meet through MASTER_ADDR and
    # MASTER_PORT when there are several; 'NO', --cpu and XLA start one process that meets no one.
    procs = text_number(data.get("num_processes"))
    cpu_group = launcher == "simple" and data.get("distributed_type") == "MULTI_CPU" and is_int(procs) and procs > 1
    ip_read = several or cpu_group
    port_read = several or cpu_group or launcher in ("torchrun", "deepspeed")
    unread = "unused on one machine by this launch, but the workers cannot reach the head once num_machines grows"
    wildcard = isinstance(ip, str) and ip.strip() == "0.0.0.0"
    if isinstance(ip, str) and PLACEHOLDER_IP.match(ip.strip()) and (several or not wildcard):
        why = ("0.0.0.0 is the address a server listens on, not one a worker on another machine can connect to"
               if wildcard else "it is a placeholder from a template, not an address")
        yield (fail if ip_read else warn)(
            f"{doc.where('main_process_ip')}: main_process_ip is {ip!r}: {why}; "
            + ("the workers cannot reach the head and wait until the rendezvous times out" if several else
               "the processes cannot reach the rendezvous address" if ip_read else unread),
            f"set {doc.setting('main_process_ip')} to the head node's (machine_rank 0) address as the workers resolve "
            "it: `hostname -I` on the head, or its host name", value=ip, **at(doc, "main_process_ip"))
    elif isinstance(ip, str) and not _is_host(ip) and not runner_finds_ip:
        yield (fail if ip_read else warn)(
            f"{doc.where('main_process_ip')}: main_process_ip is {ip!r}, expected a host name or an IP address; "
            + ("accelerate passes it on unchecked, and the workers cannot reach the head at it" if ip_read else unread),
            _host_fix(ip, doc.setting("main_process_ip")), value=ip, **at(doc, "main_process_ip"))
    port = text_number(data.get("main_process_port"))
    if isinstance(port, str):  # not a number at all ('PORT1'); numbers written as text are CFG003's
        yield (fail if port_read else warn)(
            f"{doc.where('main_process_port')}: main_process_port is {shorten(port)}, expected a port number"
            + ("; the launcher stops on it" if port_read else "; unused on one machine by this launch"),
            f"set {doc.setting('main_process_port')} to 29500 (or another free port)", value=port,
            **at(doc, "main_process_port"))
    elif is_int(port):
        if port == 0:  # accelerate launch picks a free port: fine on one machine, not agreed on between several
            if is_int(machines) and machines > 1:
                yield warn(f"{doc.where('main_process_port')}: main_process_port is 0 with {machines} machines: "
                           "accelerate picks a free port on each machine, and only a launcher that starts every "
                           "node from the head (DeepSpeed's pdsh) passes that port on to the others",
                           f"set {doc.setting('main_process_port')} to 29500 (or another port free on the head)",
                           value=port, **at(doc, "main_process_port"))
        elif not 1 <= port <= 65535:
            yield (fail if port_read else warn)(
                f"{doc.where('main_process_port')}: main_process_port is {port}, expected 1-65535"
                + ("" if port_read else "; unused on one machine by this launch"),
                f"set {doc.setting('main_process_port')} to 29500", value=port, **at(doc, "main_process_port"))
        elif port < 1024:
            yield warn(f"{doc.where('main_process_port')}: main_process_port is {port}, a privileged port under 1024 "
                       "that only root may bind", "use a port above 1024, such as 29500", value=port,
                       **at(doc, "main_process_port"))


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        # Digits and dots only is a mistyped IPv4 address ('10.0.0.256', '1234'), not a host name: the
        # resolver reads '1234' as the address 0.0.4.210.
        return bool(HOSTNAME.match(text)) and not re.fullmatch(r"[0-9.]+", text)


def _host_fix(ip: str, name: str) -> str:
    """The address inside what was written, when there is a valid one: never the invalid value itself."""
    host = _host_part(ip)
    if host != ip and _is_host(host) and not PLACEHOLDER_IP.match(host):
        return f"set {name} to {host!r} (no user@, scheme, path or :port)"
    return (f"set {name} to the head node's address or host name as the workers resolve it, "
            "such as 10.0.0.1 (no user@, scheme, path or :port)")


def _host_part(text: str) -> str:
    text = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", text.strip())
    text = text.split("/")[0].split("@")[-1]
    if text.count(":") == 1:
        text = text.split(":")[0]
    return text.strip("[]") or "10.0.0.1"


@check("CFG011", "machine-rank", "config", tags=["accelerate", "multinode"])
def machine_rank(ctx) -> Iterator[Finding]:
    """num_machines is at least 1 and machine_rank lies in [0, num_machines).

    A rank outside the range makes that node wait for a rendezvous that can never complete; the other
    nodes hang until the timeout. A num_machines below 1 launches on one machine, and on one machine the
    rank is not read (warnings).

    Give each machine its own rank from 0 to num_machines - 1 (0 on the head); `preflight launch`
    sets it per node for you.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    machines, rank = text_number(doc.data.get("num_machines", 1)), text_number(doc.data.get("machine_rank", 0))
    if is_int(machines) and machines < 1:
        if machines == 0 and doc.data.get("use_cpu") is True:  # commands/launch.py, unless OMP_NUM_THREADS is set
            yield fail(f"{doc.where('num_machines')}: num_machines is 0 with use_cpu: accelerate launch divides "
                       "num_processes by it to share the CPU threads and stops (ZeroDivisionError)",
                       f"set {doc.setting('num_machines')} to the number of nodes (1 for one)", value=machines,
                       **at(doc, "num_machines"))
            return
        # Every launcher tests `num_machines > 1` (utils/launch.py): below 1 is the one-machine launch.
        yield warn(f"{doc.where('num_machines')}: num_machines is {machines}; accelerate launches the job on this "
                   "machine alone, as with num_machines: 1", f"set {doc.setting('num_machines')} to the number of "
                   "nodes (1 for one)",
                   value=machines, **at(doc, "num_machines"))
        return
    unranked = "machine_rank" in doc.data and doc.data["machine_rank"] is None or \
        ctx.plan.accelerate.from_command and "machine_rank" not in doc.data  # the flag's default is None
    launcher = "simple" if ctx.plan.accelerate.cpu else accelerate_launcher(doc.data.get("distributed_type"))
    if is_int(machines) and machines > 1 and unranked and launcher != "simple":
        given = "not given" if ctx.plan.accelerate.from_command else "null"
        yield fail(f"{doc.where('machine_rank')}: machine_rank is {given} over {machines} machines; accelerate launch "
                   "stops on int(None) (TypeError)",
                   f"set {doc.setting('machine_rank')} to this machine's rank, 0 to {machines - 1}",
                   **at(doc, "machine_rank"))
    elif is_int(machines) and is_int(rank) and not 0 <= rank < machines and machines == 1:
        # Read only over several machines (utils/launch.py): a per-node copy that left num_machines at 1
        yield warn(f"{doc.where('machine_rank')}: machine_rank is {rank} with num_machines 1: accelerate reads it "
                   "only over several machines, so this machine runs the job alone",
                   f"if this is one machine of several, set {doc.setting('num_machines')} to their number; else "
                   f"set {doc.setting('machine_rank')} to 0", value=rank, **at(doc, "machine_rank"))
    elif is_int(machines) and is_int(rank) and not 0 <= rank < machines and not ctx.plan.accelerate.head_runner:
        yield fail(f"{doc.where('machine_rank')}: machine_rank is {rank}, expected 0 to {machines - 1} "
                   f"(num_machines is {machines})", f"set {doc.setting('machine_rank')} between 0 and {machines - 1}",
                   value=rank, **at(doc, "machine_rank"))


@check("CFG020", "process-counts", "config", tags=["accelerate", "multinode", "gpu"])
def process_counts(ctx) -> Iterator[Finding]:
    """num_processes is the total over all machines, divides evenly by num_machines, and every machine has
    a GPU in gpu_ids for each of its processes.

    accelerate starts num_processes // num_machines processes per machine: a total that does not divide
    leaves processes out, and the common per-node reading (num_processes = GPUs per node) silently halves
    the job. Fewer gpu_ids than processes per machine puts two processes on one GPU or fails with an
    invalid device ordinal; a gpu_ids that YAML read as a number crashes accelerate. With distributed_type
    'NO', accelerate starts one process whatever num_processes says, and machines that never meet; MULTI_CPU
    and --cpu start one process a machine (mpirun its share of num_processes) and need no GPU.

    Set num_processes to num_machines x GPUs per machine, and list at least that many GPUs per machine
    in gpu_ids as a quoted string ('0,1,2,3'), or 'all'.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    data = doc.data
    procs, machines = text_number(data.get("num_processes")), text_number(data.get("num_machines", 1))
    if is_int(machines) and machines < 1:
        machines = 1  # accelerate's one-machine launch (CFG011 says so)
    dtype = data.get("distributed_type")
    # The simple launcher starts one process whatever num_processes says, and never meets other machines.
    simple = ctx.plan.accelerate.simple_launch
    if simple:
        shown = yaml_word(dtype)
        if is_int(machines) and machines > 1:
            yield fail(f"{doc.where('num_machines')}: num_machines is {machines} but distributed_type is {shown}: "
                       "accelerate launches the script as one process on each machine, with no distributed setup, "
                       f"so the {machines} machines each train alone and never meet",
                       "set distributed_type: MULTI_GPU (or DEEPSPEED, FSDP) for a job over several machines",
                       num_machines=machines, distributed_type=dtype, **at(doc, "num_machines"))
        elif is_int(procs) and procs > 1:
            yield warn(f"{doc.where('num_processes')}: num_processes is {procs} but distributed_type is {shown}: "
                       f"accelerate launches one process, not {procs}",
                       f"set distributed_type: MULTI_GPU (or DEEPSPEED, FSDP) to start {procs} processes, or "
                       "num_processes: 1", num_processes=procs, distributed_type=dtype, **at(doc, "num_processes"))
    # accelerate gives num_processes a default for 'NO' only (config_args.py process_config); else -1 stops launch.
    # A SageMaker config has no such key: SageMaker sizes the job by its instances.
    # Without a config file accelerate counts the GPUs instead.
    # ('NO' gets num_processes 1 only when the key is missing: an explicit -1 stops it too)
    if "distributed_type" in data and (dtype != "NO" or procs == -1) and \
            (procs is None or (is_int(procs) and procs < 1)) and \
            not ctx.plan.accelerate.is_sagemaker and not ctx.plan.accelerate.from_command:
        # A file meant to be completed by the launch command's --num_processes (SLURM scripts do) works: a
        # failure only when that command is known and does not pass it either.
        make = fail if ctx.plan.command else warn
        yield make(f"{doc.where('num_processes')}: num_processes is {'not set' if procs is None else procs}; "
                   "accelerate launch stops with 'You need to manually pass in `--num_processes`'"
                   + ("" if ctx.plan.command else " unless the launch command passes --num_processes"),
                   "set num_processes to the total number of processes over all machines (or pass --num_processes "
                   "to accelerate launch)", **at(doc, "num_processes"))
    if not (is_int(procs) and is_int(machines) and procs > 0 and machines > 0):
        return
    # MULTI_CPU and --cpu run the simple launcher: one process a machine, or mpirun's share of num_processes with
    # an mpirun hostfile; GPUs are not theirs to need (accelerate/utils/launch.py prepare_simple_launcher_cmd_env).
    on_cpu = not simple and (ctx.plan.accelerate.cpu or accelerate_launcher(dtype) == "simple")
    mpirun = isinstance(data.get("mpirun_config"), Mapping) and data["mpirun_config"].get("mpirun_hostfile")
    if procs % machines and not simple and (mpirun or not on_cpu) and ctx.plan.accelerate.runner is not None:
        per = procs // machines  # accelerate's --num_gpus to DeepSpeed's runner, which keeps every slot for 0
        yield warn(f"{doc.where('num_processes')}: num_processes {procs} does not divide by num_machines {machines}; "
                   f"accelerate passes --num_gpus {per} to DeepSpeed's runner, which starts "
                   + (f"{per} processes on each host" if per else "one on every slot of the hostfile"),
                   f"set {doc.setting('num_processes')} to a multiple of {machines}, such as {max(per, 1) * machines}",
                   num_processes=procs, num_machines=machines, **at(doc, "num_processes"))
        return
    if procs % machines and not simple and (mpirun or not on_cpu):
        per = procs // machines
        yield fail(f"{doc.where('num_processes')}: num_processes {procs} does not divide by num_machines {machines}; "
                   f"accelerate would start {per} per machine ({per * machines} in all)",
                   f"set {doc.setting('num_processes')} to a multiple of {machines}, such as {max(per, 1) * machines}",
                   num_processes=procs, num_machines=machines, **at(doc, "num_processes"))
        return
    per_machine = procs // machines
    ids_value = data.get("gpu_ids")
    if isinstance(ids_value, str) and ids_value != "all" and len(ids_value.split(",")) < 2 and dtype in MULTI_TYPES \
            and machines <= 1 and not ctx.plan.accelerate.from_command:
        # accelerate's own test, with a config file, whatever --cpu says (commands/launch.py _validate_launch_command)
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids is {shorten(ids_value)} under {dtype} on one machine; accelerate "
                   "launch stops with 'Less than two GPU ids were configured and tried to run on multiple GPUs'",
                   f"set {doc.setting('gpu_ids')} to two GPUs or more (such as '0,1'), or 'all'", **at(doc, "gpu_ids"))
        return
    if is_int(ids_value):
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids is the number {ids_value}, expected a string; accelerate crashes "
                   "with \"'int' object has no attribute 'split'\"", f"quote it: gpu_ids: '{ids_value}'",
                   **at(doc, "gpu_ids"))
        return
    if ctx.plan.accelerate.hostfile_unread is None and not (simple or on_cpu):
        # DeepSpeed's runner: gpu_ids reach only the runner's own environment; on every node DeepSpeed's launch sets
        # the visible GPUs from the hostfile's slots (utils/launch.py, deepspeed/launcher/launch.py)
        if ids_value is not None and ids_value != "all":
            yield warn(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} is not read: under DeepSpeed's runner each "
                       "node uses the GPUs of its hostfile slots", "delete gpu_ids; limit the GPUs with the "
                       "hostfile's slots or deepspeed_inclusion_filter", **at(doc, "gpu_ids"))
        return
    if isinstance(ids_value, str) and ids_value != "all" and ids_value.strip().lower() in ("all", "") and not on_cpu:
        # accelerate compares it with 'all' exactly (commands/launch.py) and otherwise exports it as
        # CUDA_VISIBLE_DEVICES, where it names no GPU (utils/launch.py)
        yield (warn if simple else fail)(
            f"{doc.where('gpu_ids')}: gpu_ids is {ids_value!r}, not 'all': accelerate compares it with 'all' exactly "
            f"and exports CUDA_VISIBLE_DEVICES={ids_value!r}, which hides every GPU"
            + (": the process runs on the CPU" if simple else " (with MULTI_GPU on one machine it stops: 'Less than "
               "two GPU ids')"), f"set {doc.setting('gpu_ids')} to 'all'", **at(doc, "gpu_ids"))
        return
    ids = gpu_id_list(ids_value)
    if ids is None:
        return
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} holds {', '.join(map(repr, bad))}, "
                   "expected GPU indices separated by commas", "write gpu_ids like '0,1,2,3', or 'all'",
                   **at(doc, "gpu_ids"))
        return
    if len(set(ids)) != len(ids):
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} lists a GPU twice",
                   "list each GPU index once", **at(doc, "gpu_ids"))
    if simple or on_cpu:  # one process, or processes on CPUs: any GPU listed will do
        return
    if machines > 1 and procs == len(ids):
        yield warn(f"{doc.where('num_processes')}: num_processes is {procs}, the number of gpu_ids of one machine, "
                   f"but it is the total over all {machines} machines: each machine runs only {per_machine}",
                   f"to use every listed GPU on every machine, set num_processes: {procs * machines}",
                   num_processes=procs, num_machines=machines, gpu_ids=len(ids), **at(doc, "num_processes"))
    elif len(ids) < per_machine:
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids lists {len(ids)} GPUs but each machine runs {per_machine} "
                   f"processes (num_processes {procs} / num_machines {machines})",
                   f"every machine runs num_processes / num_machines = {per_machine} processes and needs that many "
                   f"GPUs: on each machine set gpu_ids to {per_machine} of its GPUs (or 'all'), or lower num_processes "
                   f"to {len(ids) * machines} if every machine has only {len(ids)}",
                   gpu_ids=len(ids), processes_per_machine=per_machine, **at(doc, "gpu_ids"))


@check("CFG021", "hostfile", "config", tags=["hostfile", "multinode", "deepspeed"])
def hostfile(ctx) -> Iterator[Finding]:
    """The hostfile lists each host once, as many hosts as num_machines, each with the slots (GPUs) that
    its processes need; a host filter (--include/--exclude) names only hosts and slots it lists.

    DeepSpeed's launcher refuses a hostfile with a host twice; a hostfile that disagrees with the
    accelerate config starts a different number of processes than the config and the batch arithmetic
    assume. accelerate reads its deepspeed_hostfile only over several machines with a launcher other than
    'standard'; elsewhere the key is a warning, as the job runs without it.

    Make the hostfile list num_machines distinct hosts, each with slots equal to num_processes /
    num_machines (or change the config to match the hostfile).
    """
    hf = ctx.plan.hostfile
    if hf is None:
        named = ctx.plan.hostfile_named
        if named and ctx.plan.accelerate is not None:
            doc = accel_doc(ctx)
            unread = ctx.plan.accelerate.hostfile_unread
            if unread:
                yield warn(f"{doc.where('deepspeed_config', 'deepspeed_hostfile')}: deepspeed_hostfile {named!r} is "
                           f"never read: {unread}", "delete deepspeed_hostfile, or set num_machines and "
                           "deepspeed_multinode_launcher for the hosts it lists", **at(doc, "deepspeed_config",
                                                                                         "deepspeed_hostfile"))
                return
            machines = ctx.plan.accelerate.integer("num_machines", 1)
            yield fail(f"{doc.where('deepspeed_config', 'deepspeed_hostfile')}: deepspeed_hostfile {named!r} does not "
                       "exist (looked in the working directory and beside the config); DeepSpeed's runner warns "
                       f"'Unable to find hostfile' and trains on the head alone, not over {machines} machines",
                       "correct the path; the hostfile must exist on the head node",
                       **at(doc, "deepspeed_config", "deepspeed_hostfile"))
            return
        accel = ctx.plan.accelerate
        section = accel.deepspeed_section if accel is not None else None
        if accel is not None and accel.runner is not None and section is not None and not named:
            doc = accel_doc(ctx)
            written = section.data.get("deepspeed_hostfile")
            machines = accel.integer("num_machines", 1)
            yield fail(f"{doc.where('deepspeed_config')}: deepspeed_hostfile is "
                       f"{'not set' if written is None else shorten(written)}: accelerate passes `--hostfile "
                       f"{str(written) or repr('')}` to DeepSpeed's runner, which warns 'Unable to find hostfile' "
                       f"and trains on the head alone, not over {machines} machines", f"set {doc.setting('deepspeed_config')}"
                       ".deepspeed_hostfile to a hostfile listing the machines (`host slots=GPUS` a line)",
                       **at(doc, "deepspeed_config"))
            return
        yield skip("no hostfile given (--hostfile, or deepspeed_hostfile in the accelerate config)")
        return
    seen = {}
    for entry in hf.entries:
        if entry.host in seen:
            yield fail(f"{hf.path}:{entry.line}: host {entry.host!r} is listed again (first on line {seen[entry.host]}); "
                       "DeepSpeed refuses 'multiple entries' for a host", f"delete line {entry.line}",
                       host=entry.host, file=hf.path, line=entry.line)
        seen.setdefault(entry.host, entry.line)
    # The host filter DeepSpeed's runner applies to the hostfile: its own flags, or accelerate's keys under its runner
    command = ctx.plan.launch
    accel = ctx.plan.accelerate
    if command is not None and command.launcher == "deepspeed":
        include, exclude, given = command.get("include"), command.get("exclude"), "flags --include/--exclude"
    elif accel is not None and accel.runner is not None and accel.deepspeed_section is not None:
        section = accel.deepspeed_section.data
        include, exclude = section.get("deepspeed_inclusion_filter"), section.get("deepspeed_exclusion_filter")
        given = "deepspeed_inclusion_filter/deepspeed_exclusion_filter"
        include, exclude = (None, exclude) if exclude is not None else (include, None)  # one, exclude first
    else:
        include = exclude = None
    include, exclude = (v if isinstance(v, str) else "" for v in (include, exclude))
    problem = None if from_shell(include + exclude) else runner_resources({e.host: e.slots for e in hf.entries}, include, exclude)[1]
    if problem:
        yield fail(f"{hf.path}: the host filter ({given}: {shorten(include or exclude)}) does not match the hostfile; "
                   f"DeepSpeed's runner stops with '{problem}'", "name hosts and slot numbers (0 to slots-1) that "
                   "the hostfile lists", file=hf.path, line=None, filter=include or exclude)
    doc = accel_doc(ctx)
    if doc is None:
        return
    machines = doc.data.get("num_machines", 1)
    if is_int(machines) and machines != len(seen):
        yield fail(f"{hf.path}: lists {len(seen)} hosts, but num_machines is {machines} ({doc.where('num_machines')})",
                   f"list {machines} hosts, or set num_machines: {len(seen)}", hosts=len(seen),
                   num_machines=machines, file=hf.path, line=None)
    per_machine = processes_per_machine(doc.data)
    if per_machine is None:
        return
    for entry in hf.entries:
        if entry.slots != per_machine:
            yield fail(f"{hf.path}:{entry.line}: {entry.host} has slots={entry.slots}, but the accelerate config runs "
                       f"{per_machine} processes per machine ({doc.where('num_processes')})",
                       f"set slots={per_machine}, or change num_processes", host=entry.host, slots=entry.slots,
                       expected=per_machine, file=hf.path, line=entry.line)


# --- DeepSpeed config ---------------------------------------------------------------------------

@check("CFG030", "batch-size", "config", tags=["deepspeed", "batch"])
def batch_size(ctx) -> Iterator[Finding]:
    """train_batch_size equals train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size.

    DeepSpeed asserts this equality when the engine starts, after the model is loaded on every node; when
    one of the three is missing it derives it with integer division, which can give 0 or a product that
    no longer matches. With sequence_parallel_size the world is divided by it first; a file with no batch
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
    if world is not None and is_int(sp) and sp > 1:
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
        if usage == "unknown":
            yield warn(f"{ds.path}: neither train_batch_size nor train_micro_batch_size_per_gpu is set: {why}, unless "
                       "the training framework fills them in (PyTorch Lightning sets the micro batch from its "
                       "dataloader; the transformers Trainer and accelerate fill in only keys set to \"auto\")",
                       'under the transformers Trainer or accelerate, add "train_micro_batch_size_per_gpu": "auto" '
                       '(and "train_batch_size": "auto"); with DeepSpeed alone, set the micro batch size',
                       **at(ds), **evidence)
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


def zero_settings(ctx) -> Optional[Tuple[Document, Tuple[str, ...], Any, Mapping[str, Any]]]:
    """Where the ZeRO settings come from: (doc, path of the stage key, stage, offload devices).

    The DeepSpeed JSON when there is one; else accelerate's own keys, which accelerate turns into one.
    """
    ds = ds_doc(ctx)
    if ds is not None:
        zero = ds.data.get("zero_optimization")
        if isinstance(zero, bool):  # the old boolean form: true is stage 1
            return ds, ("zero_optimization",), int(zero), {}
        if not isinstance(zero, Mapping):
            return ds, ("zero_optimization",), 0, {}
        return ds, ("zero_optimization", "stage"), text_number(zero.get("stage", 0)), zero
    doc = accel_doc(ctx)
    section = live_ds_section(ctx)
    if section is None or "zero_stage" not in section.data:
        return None

    def lower(value: Any) -> Any:  # accelerate lower-cases the devices (str(...).lower(), utils/launch.py)
        return value.lower() if isinstance(value, str) else value

    devices = {
        "offload_param": {"device": lower(section.data.get("offload_param_device")),
                          "nvme_path": section.data.get("offload_param_nvme_path")},
        "offload_optimizer": {"device": lower(section.data.get("offload_optimizer_device")),
                              "nvme_path": section.data.get("offload_optimizer_nvme_path")},
    }
    stage = section.data["zero_stage"]  # null: DeepSpeedPlugin's default, 2 (utils/dataclasses.py)
    return doc, ("deepspeed_config", "zero_stage"), 2 if stage is None else text_number(stage), devices


@check("CFG040", "zero-stage", "config", tags=["deepspeed", "zero"])
def zero_stage(ctx) -> Iterator[Finding]:
    """The ZeRO stage is 0, 1, 2 or 3.

    DeepSpeed refuses any other stage when the engine starts. A stage of "auto" in the DeepSpeed JSON is
    filled in only by accelerate (with `accelerate launch --zero_stage`, 2 when not given); DeepSpeed on
    its own silently drops it, training at stage 0 with no sharding at all.

    Set zero_optimization.stage (or accelerate's zero_stage) to 0, 1, 2 or 3.
    """
    found = zero_settings(ctx)
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
    elif stage == AUTO:
        yield warn(f"{doc.where(*keys)}: {dotted(keys)} is \"auto\": accelerate and the transformers Trainer fill it "
                   "in (accelerate's zero_stage, 2 unless given), but DeepSpeed on its own drops it and trains at "
                   "stage 0", f"set {dotted(keys)} to 0, 1, 2 or 3 to say which stage the job runs",
                   **at(doc, *keys))
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
    found = zero_settings(ctx)
    if found is None:
        yield skip("no ZeRO settings (no DeepSpeed config, no zero_stage in the accelerate config)")
        return
    doc, stage_keys, stage, blocks = found
    if stage == AUTO:  # filled in at launch (CFG040 says by whom): the offload is judged then
        yield skip("the ZeRO stage is \"auto\": the offload settings are judged against the stage the job gets")
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
    if wanted and ds_uses and ds_uses != wanted:
        yield fail(f"{where}: mixed_precision is {mp!r} but the DeepSpeed config {ds.path} enables {ds_uses}; "
                   f"accelerate raises '`--mixed_precision` arg cannot be set to `{mp}` when `{ds_uses}` is set'",
                   f"make them agree: mixed_precision: {ds_uses}, or enable {wanted} in the DeepSpeed config",
                   mixed_precision=mp, deepspeed=ds_uses, **at(doc, "mixed_precision"))
    elif wanted and (fp16 if wanted == "fp16" else bf16) is False and (wanted in ds.data or
                                                                        (wanted == "bf16" and "bfloat16" in ds.data)):
        yield fail(f"{where}: mixed_precision is {mp!r} but the DeepSpeed config {ds.path} sets {wanted}.enabled "
                   "to false: DeepSpeed trains in full precision", f'set "{wanted}": {{"enabled": "auto"}} in the DeepSpeed config',
                   mixed_precision=mp, **at(doc, "mixed_precision"))
    elif mp == "no" and ds_uses:
        yield fail(f"{where}: mixed_precision is 'no' but the DeepSpeed config {ds.path} enables {ds_uses}; "
                   f"the job trains in {ds_uses}, not in full precision as the accelerate config says",
                   f"set mixed_precision: {ds_uses}, or {ds_uses}.enabled to \"auto\"", mixed_precision=mp,
                   deepspeed=ds_uses, **at(doc, "mixed_precision"))


@check("CFG060", "deepspeed-keys", "config", tags=["deepspeed"])
def deepspeed_keys(ctx) -> Iterator[Finding]:
    """The DeepSpeed config has only keys that DeepSpeed knows.

    DeepSpeed rejects unknown keys inside zero_optimization, its offload blocks, fp16 and bf16 (and, since
    0.19.8, several removed features such as amp and elasticity); elsewhere it ignores them, so a
    misspelt setting silently keeps its default.

    Correct the spelling to the one suggested, or delete the key.
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    for key in ds.data:
        if key in DS_REMOVED_KEYS:
            yield warn(f"{ds.where(key)}: {key!r} was removed from DeepSpeed; 0.19.8 and newer refuse the file",
                       f"delete {key!r} (or pin an older DeepSpeed on every node)", key=key, **at(ds, key))
    first, rest = unknown((k for k in ds.data if k not in DS_REMOVED_KEYS), DS_TOP_KEYS)
    for key in first:
        # A block is no misspelt number: VideoX-Fun's "sequence_parallel": {"enabled": true} is its own setting.
        like = sorted(k for k in DS_TOP_KEYS if isinstance(ds.data[key], dict) == (k in DS_TOP_BLOCKS))
        typo = any(key.lower() == k.lower() or difflib.SequenceMatcher(None, key, k).ratio() >= 0.8 for k in like)
        # A warning even for a misspelling: the job runs, without the setting (--strict makes it refuse).
        yield warn(f"{ds.where(key)}: unknown key {key!r}"
                   + (f"{did_you_mean(key, like)}; DeepSpeed ignores it, so the setting has no effect" if typo else
                      "; DeepSpeed ignores it"),
                   "correct the spelling" if typo else f"delete {key!r} if it is not for another tool",
                   key=key, **at(ds, key))
    if rest:
        yield more_unknown(ds, (), rest, warn, "DeepSpeed ignores them")
    for block, known in STRICT_BLOCKS.items():
        section = ds.section(*block)
        if section is None:
            continue
        first, rest = unknown(section.data, known)
        for key in first:
            yield fail(f"{ds.where(*block, key)}: unknown key {dotted(block + (key,))!r}"
                       f"{did_you_mean(key, sorted(known - DS_DEPRECATED_ZERO_KEYS))}; DeepSpeed refuses it "
                       "('Extra inputs are not permitted')",
                       f"correct or delete {dotted(block + (key,))}", key=dotted(block + (key,)),
                       **at(ds, *block, key))
        if rest:
            yield more_unknown(ds, block, rest, fail, "DeepSpeed refuses them ('Extra inputs are not permitted')")
    zero = ds.section("zero_optimization")
    if zero is not None:
        for key in zero.data:
            if key in DS_REMOVED_ZERO_KEYS:
                yield warn(f"{ds.where('zero_optimization', key)}: 'zero_optimization.{key}' was removed from DeepSpeed; "
                           "0.19.8 and newer refuse the file", f"delete zero_optimization.{key} (or pin an older "
                           "DeepSpeed on every node)", key=f"zero_optimization.{key}", **at(ds, "zero_optimization", key))
        for field, alias in ZERO_ALIASES.items():
            if field in zero.data and alias in zero.data:
                yield fail(f"{ds.where('zero_optimization', field)}: zero_optimization sets both {field} and its "
                           f"alias {alias}; DeepSpeed refuses the pair", f"keep one of {field} and {alias}",
                           **at(ds, "zero_optimization", field))


# --- the libraries' own validators (--deep, and inside `check`) --------------------------------

@check("CFG090", "accelerate-validator", "config", tags=["accelerate", "deep"])
def accelerate_validator(ctx) -> Iterator[Finding]:
    """accelerate's own config classes accept the accelerate config, as `accelerate launch` will load it.

    The installed accelerate is the final word on which keys and values it takes: it may be older or
    newer than the rules preflight knows.

    Fix what accelerate reports, or align the accelerate version with the config (`accelerate config`
    writes a file that the installed version accepts).
    """
    doc = accel_doc(ctx)
    if not ctx.plan.deep:
        yield skip("the libraries' validators run with --deep, and inside `preflight check`")
        return
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    if ctx.plan.accelerate.from_command:
        yield skip("no accelerate config file: the launch command's flags alone, which accelerate's argument parser "
                   "reads")
        return
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
            from accelerate.utils import PrecisionType
            from accelerate import __version__ as version
    except ImportError as exc:
        yield skip(f"accelerate is not importable here ({exc}); install it, or the 'train' extra")
        return
    cls = SageMakerConfig if ctx.plan.accelerate.is_sagemaker else ClusterConfig
    try:
        data = cls.process_config(copy.deepcopy(dict(doc.data)))
        extra = sorted(set(data) - set(cls.__dataclass_fields__))
        if extra:
            raise ValueError(f"unknown keys {extra}")
        cls(**data)
        mp = data.get("mixed_precision")
        if mp is not None:
            PrecisionType(str(mp).lower())  # what `accelerate launch` does with it
    except Exception as exc:
        yield fail(f"{doc.path}: accelerate {version} rejects the config: {type(exc).__name__}: {_one_line(exc)}",
                   "fix the key or value accelerate names", accelerate=version, **at(doc))
        return
    yield passed(f"accelerate {version} accepts {doc.path}", accelerate=version)


@check("CFG091", "deepspeed-validator", "config", tags=["deepspeed", "deep"])
def deepspeed_validator(ctx) -> Iterator[Finding]:
    """DeepSpeed's own DeepSpeedConfig accepts the DeepSpeed config for the planned world size.

    The installed DeepSpeed validates every block with its own models; a key or value it refuses stops
    the engine on every node after the model has been loaded.

    Fix what DeepSpeed reports ("auto" values are filled in first, as accelerate and the transformers
    Trainer do, so they are not reported here).
    """
    ds = ds_doc(ctx)
    if not ctx.plan.deep:
        yield skip("the libraries' validators run with --deep, and inside `preflight check`")
        return
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    world, _ = ctx.plan.world_size
    world = world or 1
    try:
        # DeepSpeed's logger writes to stdout, which belongs to the report (--json): bind it to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            import deepspeed.comm as dist
            from deepspeed.runtime.config import DeepSpeedConfig
        for handler in logging.getLogger("DeepSpeed").handlers:  # imported earlier, it may hold the real stdout
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stdout__:
                handler.setStream(sys.stderr)
    except ImportError as exc:
        yield skip(f"deepspeed is not importable here ({exc}); install it, or the 'train' extra")
        return
    config = _without_auto(copy.deepcopy(dict(ds.data)), world)
    stand_in = ""
    if ds_usage(ctx) == "unknown" and not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(config):
        # A framework may set the micro batch itself (Lightning does; CFG030 warns): validate the rest.
        config["train_micro_batch_size_per_gpu"] = 1
        stand_in = " (a stand-in micro batch of 1 for the one the training framework sets, see CFG030)"
    saved = dist.get_rank, dist.get_world_size
    # Without an initialised process group DeepSpeedConfig assumes a world of 1: give it the plan's.
    dist.get_rank, dist.get_world_size = (lambda *a, **k: 0), (lambda *a, **k: world)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            parsed = DeepSpeedConfig(config)
    except Exception as exc:
        yield fail(f"{ds.path}: DeepSpeed {deepspeed.__version__} rejects the config at world size {world}: "
                   f"{type(exc).__name__}: {_one_line(exc)}", "fix the key or value DeepSpeed names",
                   deepspeed=deepspeed.__version__, world_size=world, **at(ds))
        return
    finally:
        dist.get_rank, dist.get_world_size = saved
    # The engine builds the optimizer block later, once the model is loaded: one of its own by name (in any case),
    # else getattr(torch.optim, name) (deepspeed/runtime/engine.py, _configure_basic_optimizer).
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    import torch

    name = parsed.optimizer_name
    found = getattr(torch.optim, name, None) if isinstance(name, str) else None
    optimizer_class = isinstance(found, type) and issubclass(found, torch.optim.Optimizer) and \
        found is not torch.optim.Optimizer
    if isinstance(name, str) and name not in DEEPSPEED_OPTIMIZERS and not optimizer_class:
        yield fail(f"{ds.where('optimizer', 'type')}: optimizer {shorten(name)} is neither one of DeepSpeed "
                   f"{deepspeed.__version__}'s own nor a torch.optim optimizer: the engine stops on it on every node "
                   "once the model has loaded", "use one DeepSpeed builds ("
                   + ", ".join(sorted(DEEPSPEED_OPTIMIZERS)) + ") or a torch.optim class by its name, or create the "
                   "optimizer in the script", optimizer=name, deepspeed=deepspeed.__version__,
                   **at(ds, "optimizer", "type"))
        return
    yield passed(f"DeepSpeed {deepspeed.__version__} accepts {ds.path} at world size {world}{stand_in}",
                 deepspeed=deepspeed.__version__, world_size=world)


def _without_auto(config: dict, world: int) -> dict:
    """Stand-ins for "auto", as accelerate would fill them: consistent batch sizes, and no other "auto"."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if any(config.get(k) == AUTO for k in keys):
        micro = config.get(keys[1]) if is_int(config.get(keys[1])) else 1
        steps = config.get(keys[2]) if is_int(config.get(keys[2])) else 1
        sp = config.get("sequence_parallel_size")
        data_parallel = world // sp if is_int(sp) and sp > 0 and world % sp == 0 else world  # as accelerate fills it
        config.update({keys[0]: micro * steps * data_parallel, keys[1]: micro, keys[2]: steps})

    def drop(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: drop(v) for k, v in node.items() if v != AUTO}
        if isinstance(node, list):
            return [drop(v) for v in node if v != AUTO]
        return node

    return drop(config)


def _one_line(exc: BaseException) -> str:
    if callable(getattr(exc, "errors", None)):  # pydantic: one "field: problem" per error
        try:
            text = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."
