"""CFG values: accelerate's enumerations (compute_environment, distributed_type, mixed_precision, rdzv_backend,
the DeepSpeed launcher and offload devices, dynamo_backend, fsdp_config) hold values accelerate accepts."""
from __future__ import annotations

from typing import Any, Iterator, Tuple

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.checks.config.common import (accel_doc, accelerate_command, at, did_you_mean, dotted,
                                           dynamo_backend_read, live_ds_section, yaml_word)
from preflight.inputs.configs import (AUTO, COMPUTE_ENVIRONMENTS, DISTRIBUTED_TYPES, DYNAMO_BACKENDS, MIXED_PRECISIONS,
                                      MULTINODE_LAUNCHERS, OFFLOAD_DEVICES, RDZV_BACKENDS, SAGEMAKER_DISTRIBUTED_TYPES,
                                      fsdp_problems, multinode_launcher_problem)
from preflight.inputs.documents import Document, shorten


@check("CFG002", "accelerate-values", "config", tags=["accelerate"])
def accelerate_values(ctx) -> Iterator[Finding]:
    """compute_environment, distributed_type, mixed_precision, rdzv_backend and the DeepSpeed launcher and
    offload devices hold values that accelerate accepts.

    accelerate reads these as enumerations: a misspelt value fails at launch (mixed_precision only when
    `accelerate launch` runs, long after the config was written). Case matters except where a library
    normalises it: accelerate lower-cases the offload devices and mixed_precision, and DeepSpeed's runner its
    launchers, but 'STANDARD' and 'NOSSH' miss accelerate's own; the launcher is read only over several machines.
    rdzv_backend in the config is never read (the flag's default, 'static', wins): a value there is a warning.
    A deepspeed_config.gradient_accumulation_steps of "auto" is filled in by the transformers Trainer, and stops a
    script that calls Accelerator() itself: lint does not read the script, so it says so and does not judge it.
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
        # script hands it an accumulation plugin of its own, as the transformers Trainer does (accelerator.py,
        # trainer.py): which the script does is not read here (rhymes-ai/Aria's configs run under trl's SFTTrainer).
        keys = ("deepspeed_config", "gradient_accumulation_steps")
        yield passed(f"{doc.where(*keys)}: deepspeed_config.gradient_accumulation_steps is \"auto\": not judged (the "
                     "script is not read): the transformers Trainer fills it in, a script that calls Accelerator() "
                     "itself stops on int('auto')", **at(doc, *keys))
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
    if value in RDZV_BACKENDS and ctx.plan.accelerate.integer("num_machines", 1) == 1:  # static and c10d alike here
        yield passed(f"{doc.where('rdzv_backend')}: rdzv_backend {shorten(value)} is not read from the config (the "
                     "flag's default, 'static', wins); on one machine either starts the job", value=value,
                     **at(doc, "rdzv_backend"))
        return
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
