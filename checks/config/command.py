"""CFG launch command: the command after `--` reads as its launcher's argument parser reads it."""
from __future__ import annotations

import os
import re
from typing import Iterator

from preflight.api import Finding, check, fail, passed, skip
from preflight.checks.config.common import did_you_mean, from_shell
from preflight.inputs.configs import TRUTH_WORDS
from preflight.inputs.documents import shorten
from preflight.inputs.launchcmd import TYPE_FLAGS
from preflight.inputs.numbers import reads_as

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
        if key in launchcmd.INT_OPTIONS[command.launcher] and not reads_as(int, value):
            found.append(fail(f"flag --{key} is {shorten(value)}, expected a whole number; {name} stops with "
                              "'invalid int value'", f"give --{key} a number", flag=key, value=value))
        elif key in launchcmd.FLOAT_OPTIONS[command.launcher] and not reads_as(float, value):
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
            not (nnodes.count(":") <= 1 and all(reads_as(int, part) for part in nnodes.split(":"))):
        found.append(fail(f"flag --nnodes is {shorten(nnodes)}, expected N or MIN:MAX (whole numbers); torchrun stops "
                          "on it (parse_min_max_nnodes)", "give --nnodes N, or MIN:MAX for an elastic job",
                          flag="nnodes", value=nnodes))
    if command.launcher == "torchrun" and command.flag("standalone"):
        most = nnodes.split(":", 1)[-1] if isinstance(nnodes, str) else None
        if most is not None and reads_as(int, most) and int(most) > 1:
            found.append(fail(f"the launch command passes --standalone with --nnodes {shorten(nnodes)}: torchrun "
                              "then meets on localhost only (torch/distributed/run.py), so each node waits alone "
                              "for the others until the rendezvous times out", "drop --standalone and give "
                              "--rdzv_endpoint HEAD:PORT (or --master_addr and --master_port)", nnodes=nnodes))
    # The files the launcher opens first, as named here (lint has no nodes to ask: they are this machine's).
    named_file = {"accelerate": "config_file", "deepspeed": "hostfile"}.get(command.launcher)
    named = command.get(named_file) if named_file else None
    unjudged = ""
    missing = _missing(ctx, named) if isinstance(named, str) and named and not from_shell(named) and \
        not ctx.plan.remote else False
    if missing is None:
        unjudged = f"; --{named_file} {shorten(named)} is not judged (not a file of this machine: it may be on the " \
                   "nodes or in the image)"
    if missing:
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
        count = len(command.options)
        yield passed(f"{name} reads the command: script {shorten(command.script)}, {count} option"
                     f"{'' if count == 1 else 's'}{unjudged}")


def _missing(ctx, named: str):
    """Whether the file the launcher opens first is missing where the launch runs: True, False, or None where that
    is not known here (a batch script's folder or a container image on the cluster, a manifest's image)."""
    batch = getattr(ctx.plan, "batch", None)
    if batch is not None and batch.main is not None:
        return batch.missing(batch.main, named)
    if getattr(ctx.plan, "manifest", None) is not None:
        return None
    return not os.path.isfile(named)
