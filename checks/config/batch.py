"""CFG batch script: a SLURM batch script (`lint --sbatch SCRIPT`) as sbatch, srun and the launcher will run it:
its directives, the launchers it starts on each node, the rank each node takes, the head's address, and the world
size against the allocation. The script is read by preflight.inputs.batchscript; its launch line is the plan's
launch command, so the other CFG checks judge it (and the config files it names) as they judge `-- COMMAND`."""
from __future__ import annotations

import re
from typing import Iterator, Optional

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.inputs.documents import (InputError, counted, parse_deepspeed, parse_json, parse_yaml, shorten,
                                        syntax_by_name)
from preflight.inputs.launchcmd import LAUNCHER_NAMES as NAMES, LOCAL_ADDRESSES as LOCAL, MULTI_LAUNCHERS



def _script(ctx):
    return getattr(ctx.plan, "batch", None)


def _step_tasks(step, alloc):
    """(nodes, tasks per node) of an srun step: its own -N/-n/--ntasks-per-node over the allocation's."""
    opts = step.srun or {}

    def count(name):
        value = opts.get(name)
        return int(value) if isinstance(value, str) and value.isdigit() else None

    nodes = count("nodes") or alloc.nodes
    per_node = count("ntasks-per-node")
    ntasks = count("ntasks")
    if per_node is None and ntasks is not None and nodes:
        per_node = max(1, ntasks // nodes) if ntasks >= nodes else 1
        nodes = min(nodes, ntasks)
    if per_node is None:
        per_node = alloc.tasks_per_node if "nodes" not in opts else 1
    return nodes, per_node


def _script_word(step):
    """The rendered word the launcher takes as its training script, or None."""
    command = step.command
    if command.script is None:
        return None
    at = len(command.argv) - len(command.script_args) - 1
    return step.words[at] if 0 <= at < len(step.words) else None


def _rendezvous(command) -> str:
    value = command.get("rdzv_backend")
    return value if isinstance(value, str) else "static"  # the default of torchrun and of accelerate launch


def _many(count, noun: str) -> str:
    """"1 node", "4 nodes", "? nodes" (not known)."""
    return f"{count or '?'} {noun}{'' if count == 1 else 's'}"


@check("CFG070", "sbatch-directives", "config", tags=["slurm"])
def directives(ctx) -> Iterator[Finding]:
    """The batch script's #SBATCH directives are ones sbatch reads: before the first command, without shell
    variables; the SBATCH_* variables of the environment it is submitted from override them.

    sbatch reads `#SBATCH` lines as literal text up to the first command and ignores the rest: a `$NODES`
    there is never expanded (sbatch stops on it, or names a file `$HOME/out`), and a directive after the
    first command silently leaves the job with the default (one node, one task). An SBATCH_GPUS_PER_NODE
    left in the shell changes what every script asks for.

    Write the values as numbers in `#SBATCH` lines at the top, before any command; pass computed values on
    the command line (`sbatch --nodes=$N script`), which overrides the directives.
    """
    script = _script(ctx)
    if script is None:
        yield skip("no batch script given (--sbatch)")
        return
    found = False
    for line, why in script.refused:
        found = True
        yield fail(f"{script.where(line)}: {why}", "make the first line `#!/bin/bash` (nothing before it) and save the "
                   "file with UNIX line breaks (dos2unix)", file=script.path, line=line)
    for d in script.literal:
        found = True
        yield fail(f"{script.where(d.line)}: `#SBATCH --{d.option}={d.value}` is literal text: sbatch never expands "
                   f"{shorten(d.value)} (it takes it as written)", f"write the value itself, or pass it on the "
                   f"command line: sbatch --{d.option}=VALUE {script.path}", file=script.path, line=d.line,
                   option=d.option, value=d.value)
    for d in script.ignored:
        found = True
        yield fail(f"{script.where(d.line)}: `#SBATCH --{d.option}` comes after the first command (line "
                   f"{script.first_command_line}): sbatch ignores it", "move every #SBATCH line above the first "
                   "command", file=script.path, line=d.line, option=d.option, first_command=script.first_command_line)
    for written, given in script.overridden:
        found = True
        yield warn(f"{script.where(written.line)}: --{written.option}={written.value} is overridden by "
                   f"{given.source}={given.value} of this environment (sbatch: environment variables override "
                   "the script's directives)", f"unset {given.source}, or drop the directive", file=script.path,
                   line=written.line, option=written.option, environment=given.source)
    templated = []
    for option in ("nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "gpus-per-task"):
        d = script.directives.get(option)
        if d is None or d in script.literal or d.value is None:
            continue
        if re.fullmatch(r"<[^<>]+>|\{\{.*\}\}|@\w+@|__\w+__", d.value.strip()):  # a template's placeholder
            templated.append(f"--{option}={d.value}")
            continue
        if not all(part.strip().split(":")[-1].isdigit() for part in d.value.split("-")):
            found = True
            yield fail(f"{script.where(d.line)}: --{option}={shorten(d.value)} is not a count; sbatch stops on it",
                       f"give --{option} a whole number", file=script.path, line=d.line, option=option, value=d.value)
    if not found:
        alloc = script.allocation
        said = f" ({', '.join(templated)}: a template's placeholders, to fill in before sbatch: not judged)" \
            if templated else ""
        yield passed(f"{script.path}: {_many(len(script.directives), 'directive')}{said}; "
                     f"{_many(alloc.nodes, 'node')}, {_many(alloc.tasks_per_node, 'task')} per node, "
                     f"{_many(alloc.gpus_per_node, 'GPU')} per node",
                     file=script.path, nodes=alloc.nodes, tasks_per_node=alloc.tasks_per_node,
                     gpus_per_node=alloc.gpus_per_node)


@check("CFG071", "sbatch-launchers-per-node", "config", tags=["slurm", "multinode"])
def launchers_per_node(ctx) -> Iterator[Finding]:
    """The batch script starts one launcher per node, on every node: srun's tasks per node times the
    launcher's own processes make one process per GPU.

    torchrun, accelerate launch and DeepSpeed's runner start their node's processes themselves and want one
    srun task per node: with `--ntasks-per-node=8` eight launchers on each node start eight processes each,
    on the same GPUs and port. srun as the launcher (`srun python train.py`, Lightning) wants one task per
    GPU. Without srun the script runs once, on the first node: a multi-node allocation trains there alone
    (or waits for nodes that never start). `srun torchrun` without --nnodes makes each node a job of its own.

    With a launcher: `#SBATCH --ntasks-per-node=1` and `srun LAUNCHER ...`, with --nnodes (torchrun) or
    --num_machines (accelerate) the allocation's node count. With srun as the launcher: --ntasks-per-node
    equal to the GPUs per node.
    """
    script = _script(ctx)
    if script is None:
        yield skip("no batch script given (--sbatch)")
        return
    step, alloc = script.main, script.allocation
    unread = "; ".join(f"line {line}: {why}" for line, why in script.unread[:5])
    if step is None:
        why = f" (not read: {unread})" if unread else ""
        yield skip(f"{script.path}: no launch line read (srun, accelerate launch, torchrun, deepspeed, python){why}",
                   file=script.path, unread=[list(u) for u in script.unread])
        return
    name, launcher = NAMES.get(step.command.launcher, step.command.program), step.command.launcher
    where = script.where(step.line)
    ev = dict(file=script.path, line=step.line, launcher=launcher, nodes=alloc.nodes)
    found = False
    script_word = _script_word(step)
    unset = script_word.unset if script_word is not None else []
    missing = next((n for n in unset if script_word.text in ("$" + n, "${" + n + "}")), None)
    if missing is not None:  # nothing the script reads could set it: only the environment it is submitted from
        found = True
        yield warn(f"{where}: the training script is ${missing}, which the batch script never sets: unless the "
                   "environment it is submitted from sets it, the launcher gets no script",
                   f"set {missing} in the batch script (or correct its name)", unset=[missing], **ev)
    if step.starter is None:
        if alloc.nodes is None or alloc.nodes < 2:
            yield passed(f"{where}: {name} runs in the batch step on the allocation's {alloc.nodes or 1} node", **ev)
            return
        others = _starts_the_other_nodes(ctx, step)
        if others:
            yield passed(f"{where}: {name} runs once, in the batch step, and starts the other nodes itself ({others})",
                         **ev)
        elif others is None:
            yield skip(f"{where}: {name} runs in the batch step on a {alloc.nodes}-node allocation; whether it starts "
                       "the other nodes itself (DeepSpeed's multinode launcher) is in the accelerate config "
                       f"{shorten(step.command.get('config_file'))}, which is not here: not judged", **ev)
        elif not found:
            yield fail(f"{where}: {name} runs without srun on a {alloc.nodes}-node allocation: the batch script runs "
                       f"on the first node only, so the job starts there alone", f"start it with srun, one task per "
                       f"node: srun --ntasks-per-node=1 {' '.join(step.command.from_program[:2])} ...", **ev)
        return
    if step.starter != "srun":
        yield passed(f"{where}: {step.starter} starts {name} on the allocation's nodes", starter=step.starter, **ev)
        return
    nodes, per_node = _step_tasks(step, alloc)
    ev.update(step_nodes=nodes, tasks_per_node=per_node, loop=step.loop)
    hidden = f"; srun's options in {', '.join(step.srun_hidden)} are known only at run time" \
        if step.srun_hidden else ""
    if step.loop and not found:
        yield passed(f"{where}: one srun per iteration of a loop ({name}); how many it starts is not read without "
                     "running it", **ev)
    if step.loop:
        return
    per_task = _launcher_per_task(step, nodes, per_node, alloc)
    if launcher in MULTI_LAUNCHERS and per_node is not None and per_node > 1 and not step.srun_hidden and \
            not per_task:
        found = True
        yield fail(f"{where}: srun starts {per_node} tasks per node, each running {name}: {per_node} launchers on "
                   "every node, each starting its own processes on the same GPUs and port", "give the launch "
                   "srun one task per node: #SBATCH --ntasks-per-node=1 (or srun --ntasks-per-node=1)", **ev)
    if launcher == "torchrun" and (nodes or 0) > 1 and step.command.get("nnodes") is None:
        if step.hidden:
            hidden += f"; --nnodes may be in {', '.join(step.hidden)} (known only at run time)"
        else:
            found = True
            yield fail(f"{where}: srun torchrun on {nodes} nodes without --nnodes: torchrun's default is one node, "
                       "so every node trains as a job of its own", f"add --nnodes {nodes} (or $SLURM_NNODES) and "
                       "--rdzv_backend c10d --rdzv_endpoint HEAD:PORT", **ev)
    if launcher == "python" and alloc.gpus_per_node and per_node is not None and per_node != alloc.gpus_per_node \
            and step.command.script and not step.srun_hidden:
        found = True
        yield warn(f"{where}: srun starts {counted(per_node, 'task')} per node running python "
                   f"{shorten(step.command.script)} "
                   f"on {alloc.gpus_per_node} GPUs per node: with srun as the launcher (plain DDP, Lightning) each "
                   "task is one rank on one GPU", f"set --ntasks-per-node={alloc.gpus_per_node}, or start a "
                   "launcher (torchrun) with one task per node", gpus_per_node=alloc.gpus_per_node, **ev)
    if not found:
        shape = f"{counted(per_node, 'task')} per node" + (", each one node of the rendezvous" if per_task else "")
        yield passed(f"{where}: srun starts {shape} on {nodes or '?'} nodes, running {name}{hidden}"
                     f"{_script_unknown(script, script_word)}", **ev)


def _script_unknown(script, word) -> str:
    """What the pass says of a training script set nowhere the reader saw: a file the script sources (not here,
    not read) or the environment may set it."""
    names = word.unset_unless_sourced if word is not None else []
    name = next((n for n in names if word.text in ("$" + n, "${" + n + "}")), None)
    if name is None:
        return ""
    return (f"; the training script is ${name}, set nowhere in the script: {', '.join(script.sourced)} (sourced, "
            "not here) or the environment it is submitted from may set it (not judged)")


def _launcher_per_task(step, nodes, per_node, alloc) -> bool:
    """A launcher in every task, each one node of the rendezvous (`--nnodes $SLURM_NTASKS --node_rank
    $SLURM_PROCID --nproc_per_node 1` with a GPU bound to each task): what it starts adds up, nothing is shared."""
    if step.command.launcher != "torchrun" or not nodes or not per_node or per_node < 2:
        return False
    nnodes = step.command.integer("nnodes")
    rank = step.value_of("node_rank")
    return nnodes == nodes * per_node and (rank is None or "SLURM_PROCID" in rank.task_vars or
                                           _rendezvous(step.command) != "static")


def _starts_the_other_nodes(ctx, step):
    """Whether a launcher run once in the batch step starts the job on the other nodes itself: a description of how,
    False, or None where the accelerate config that decides it is not here. DeepSpeed's runner does, over its
    hostfile, unless --no_ssh; accelerate does with DeepSpeed on several machines unless its multinode launcher is
    `standard` or `nossh` (accelerate utils/launch.py, prepare_deepspeed_cmd_env; `pdsh` when none is set)."""
    command = step.command
    if command.launcher == "deepspeed":
        return False if command.flag("no_ssh") else "DeepSpeed's runner reaches the hostfile's nodes"
    if command.launcher != "accelerate":
        return False
    config = ctx.plan.accelerate
    here = config is not None and not config.from_command
    if any(command.flag(f) for f in ("multi_gpu", "use_fsdp", "cpu", "tpu", "use_megatron_lm")):
        return False
    deepspeed = command.flag("use_deepspeed") or (here and config.uses_deepspeed)
    if not deepspeed:
        return None if not here and command.get("config_file") is not None else False
    section = config.deepspeed_section if here else None
    chosen = command.get("deepspeed_multinode_launcher") or (
        section.data.get("deepspeed_multinode_launcher") if section is not None else None)
    if chosen is None and not here and command.get("config_file") is not None:
        return None
    chosen = chosen or "pdsh"
    machines = command.integer("num_machines") or (config.integer("num_machines") if here else None)
    if chosen in ("standard", "nossh") or (machines is not None and machines < 2):
        return False
    return f"accelerate hands a {machines or 'multi'}-machine DeepSpeed launch to DeepSpeed's {chosen} launcher"


@check("CFG072", "sbatch-node-rank", "config", tags=["slurm", "multinode"])
def node_rank(ctx) -> Iterator[Finding]:
    """Each node's launcher gets its own node rank (accelerate's --machine_rank, torchrun's --node_rank) from the
    task, not from the batch step.

    A variable in the launch line expands once, in the batch step on the first node, where SLURM_PROCID and
    SLURM_NODEID are 0: `srun accelerate launch --machine_rank $SLURM_PROCID` gives every node rank 0, and
    with the static rendezvous (the default) the nodes wait for ranks that never come. SLURM_PROCID is the
    task's rank, the node's only with one task per node.

    Let the task's own shell expand it: `srun bash -c 'accelerate launch --machine_rank $SLURM_NODEID ...'`,
    or use `--rdzv_backend c10d`, which gives ranks as nodes join.
    """
    script = _script(ctx)
    if script is None:
        yield skip("no batch script given (--sbatch)")
        return
    step = script.main
    if step is None or step.command.launcher not in ("accelerate", "torchrun"):
        yield skip("the launch line runs no accelerate launch or torchrun (they take a node rank)")
        return
    alloc = script.allocation
    nodes, per_node = _step_tasks(step, alloc) if step.srun is not None else (1, 1)
    option = "machine_rank" if step.command.launcher == "accelerate" else "node_rank"
    rdzv = _rendezvous(step.command)
    word = step.value_of(option)
    where = script.where(step.line)
    ev = dict(file=script.path, line=step.line, option=option, rdzv_backend=rdzv, nodes=nodes)
    if step.loop:
        yield passed(f"{where}: the launch runs once per loop iteration; its --{option} is "
                     f"{shorten(word.text) if word else 'not given'} (per iteration, not read)", **ev)
        return
    if not nodes or nodes < 2:
        yield skip(f"{where}: the launch runs on one node: no node rank to give", **ev)
        return
    if rdzv != "static":
        yield passed(f"{where}: --rdzv_backend {rdzv}: ranks are given as the nodes join; --{option} is not read",
                     **ev)
        return
    if step.chosen_by is not None:  # each task runs the branch of a `case` its own $SLURM_NODEID picks
        ranks = [s.value_of(option) for s in (step,) + step.alternatives]
        given = [r.text if r is not None else "none" for r in ranks]
        if len(set(given)) < len(given) and not any(r is not None and (r.task_vars or "$" in r.text) for r in ranks):
            yield fail(f"{where}: the branches of `case {step.chosen_by}` give --{option} {', '.join(given)}: "
                       "nodes in different branches claim one rank", f"give each branch its own --{option} "
                       "(or --rdzv_backend c10d)", branches=given, **ev)
        else:
            yield passed(f"{where}: --{option} is chosen in each task by `case {step.chosen_by}`: "
                         f"{', '.join(given)} in its branches", branches=given, **ev)
        return
    if word is None:
        if step.command.launcher == "accelerate":  # the config's machine_rank, or none: CFG011 judges it
            yield passed(f"{where}: no --machine_rank: accelerate takes the config file's (CFG011)", **ev)
        elif step.command.launcher == "torchrun" and step.hidden:
            yield passed(f"{where}: no --node_rank read; it may be in {', '.join(step.hidden)} (known only at run "
                         "time)", **ev)
        elif step.command.launcher == "torchrun":
            yield fail(f"{where}: torchrun over {nodes} nodes with the static rendezvous and no --node_rank: every "
                       "node is rank 0", "use --rdzv_backend c10d --rdzv_endpoint HEAD:PORT, or --node_rank "
                       "$SLURM_NODEID expanded in the task", **ev)
        return
    if word.batch_task_vars:
        var = word.batch_task_vars[0]
        yield fail(f"{where}: --{option} {shorten(word.text)} comes from ${var}, which the batch step expands once, "
                   f"on the first node, where it is 0: every node's launcher gets rank 0",
                   f"let each task expand it: srun bash -c '... --{option} $SLURM_NODEID ...' (single quotes), "
                   "or use --rdzv_backend c10d", variable=var, **ev)
    elif "SLURM_PROCID" in word.task_vars and per_node and per_node > 1 and \
            not _launcher_per_task(step, nodes, per_node, alloc):
        yield fail(f"{where}: --{option} is $SLURM_PROCID with {per_node} tasks per node: that is the task's rank, "
                   f"0 to {nodes * per_node - 1}, not the node's", "use $SLURM_NODEID", **ev)
    elif word.task_vars:
        yield passed(f"{where}: --{option} is ${word.task_vars[0]}, expanded in each task", **ev)
    elif word.text.isdigit():
        yield fail(f"{where}: --{option} is {word.text} on every one of the {nodes} nodes: they all claim one rank",
                   "use $SLURM_NODEID expanded in the task (srun bash -c '...'), or --rdzv_backend c10d", **ev)
    else:
        yield passed(f"{where}: --{option} is {shorten(word.text)}, computed at run time (not read without running "
                     "it)", **ev)


@check("CFG073", "sbatch-rendezvous", "config", tags=["slurm", "multinode", "network"])
def rendezvous(ctx) -> Iterator[Finding]:
    """The head's address and port (MASTER_ADDR/MASTER_PORT, --main_process_ip, --master_addr, --rdzv_endpoint)
    are the same for every task of a multi-node launch, and are not this machine's own name.

    Computed inside each task (`srun bash -c 'MASTER_ADDR=$(hostname) ...'`) every node names itself as the head
    and waits alone; a variable set in the batch step without `export` is empty in the tasks; localhost on
    several nodes points every node at itself.

    Compute the head once in the batch step and export it: `export MASTER_ADDR=$(scontrol show hostnames
    "$SLURM_JOB_NODELIST" | head -n 1)`, then pass it to the launcher.
    """
    script = _script(ctx)
    if script is None:
        yield skip("no batch script given (--sbatch)")
        return
    step = script.main
    if step is None or step.command.launcher not in MULTI_LAUNCHERS:
        yield skip("the launch line runs no launcher that takes the head's address")
        return
    nodes = _step_tasks(step, script.allocation)[0] if step.srun is not None else 1
    where = script.where(step.line)
    options = {"accelerate": ("main_process_ip", "main_process_port"), "torchrun": ("master_addr", "master_port",
                                                                                     "rdzv_endpoint"),
               "deepspeed": ("master_addr", "master_port")}[step.command.launcher]
    found, said = False, []
    for option in options:
        word = step.value_of(option)
        if word is None:
            continue
        said.append(f"--{option} {shorten(word.text)}")
        ev = dict(file=script.path, line=step.line, option=option, value=word.text, nodes=nodes)
        host = word.text.rsplit(":", 1)[0] if option == "rdzv_endpoint" else word.text
        in_task = [h for h in word.host_commands if h.endswith("(task)")] + \
            [v for v in word.task_vars if v not in ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID")]
        if in_task and (nodes or 0) > 1:
            found = True
            yield fail(f"{where}: --{option} {shorten(word.text)} is computed in each task, so each node names "
                       "its own", "compute it once in the batch step and export it (export MASTER_ADDR=$(scontrol "
                       "show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1))", **ev)
        elif any("not exported" in u for u in word.unknown):
            found = True
            yield fail(f"{where}: --{option} {shorten(word.text)} is set in the batch step without export: the "
                       "task's shell sees it empty", "export it in the batch step", **ev)
        elif host in LOCAL and (nodes or 0) > 1:
            found = True
            yield fail(f"{where}: --{option} {shorten(word.text)} on {nodes} nodes: every node connects to itself",
                       "give the head's address: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
                       "| head -n 1)", **ev)
    if not found:
        runtime = [] if not said else [s for s in said if "$" in s]
        note = f"; computed at run time in the batch step, once ({', '.join(runtime)}): not read without running it" \
            if runtime else ""
        given = ", ".join(said) or "from the environment or the config file"
        yield passed(f"{where}: the head's address is the same for every task ({given}){note}", file=script.path,
                     line=step.line)


@check("CFG074", "sbatch-world-size", "config", tags=["slurm", "multinode"])
def world_size(ctx) -> Iterator[Finding]:
    """The launch's processes match the allocation: nodes x GPUs per node, and each task sees the GPUs its
    launcher uses.

    accelerate's --num_processes is the whole job's (num_processes / num_machines per node); torchrun's
    --nproc_per_node is per node. More processes than GPUs put two ranks on one GPU (or fail with 'invalid
    device ordinal'); fewer leave GPUs idle. `--gpus-per-task=1` with one launcher per node leaves it one GPU
    for all its processes; with one task per GPU it gives each task one GPU, as device 0 only.

    Derive the counts from SLURM: --num_processes $((SLURM_NNODES * GPUS_PER_NODE)), --num_machines
    $SLURM_NNODES, --nproc_per_node the GPUs per node; give a launcher task all its node's GPUs
    (--gpus-per-node or --gres=gpu:N).
    """
    script = _script(ctx)
    if script is None:
        yield skip("no batch script given (--sbatch)")
        return
    step, alloc = script.main, script.allocation
    if step is None:
        yield skip(f"{script.path}: no launch line read")
        return
    # Without srun, CFG071 says the batch step starts it on one node: judged here against the allocation
    nodes, per_node = _step_tasks(step, alloc) if step.srun is not None else (alloc.nodes, 1)
    if step.loop:  # one srun per node in a loop (its iterations are not read): the allocation's nodes
        nodes = alloc.nodes
    gpus = alloc.gpus_per_node
    where = script.where(step.line)
    cmd = step.command
    ev = dict(file=script.path, line=step.line, nodes=nodes, gpus_per_node=gpus, tasks_per_node=per_node)
    found, unread = False, []
    per_launcher: Optional[int] = None
    if cmd.launcher == "accelerate":
        machines, procs = cmd.integer("num_machines"), cmd.integer("num_processes")
        for option, value in (("num_machines", machines), ("num_processes", procs)):
            if value is None and cmd.get(option) is not None:
                unread.append(f"--{option} {shorten(cmd.get(option))}")
        if machines is not None and nodes and machines != nodes:
            found = True
            yield fail(f"{where}: --num_machines {machines} on a {nodes}-node launch", f"give --num_machines "
                       f"$SLURM_NNODES ({nodes})", num_machines=machines, **ev)
        if procs is not None and nodes and gpus and procs != nodes * gpus:
            found = True
            yield fail(f"{where}: --num_processes {procs}, expected {nodes} nodes x {gpus} GPUs = {nodes * gpus}",
                       "give --num_processes $((SLURM_NNODES * GPUS_PER_NODE))", num_processes=procs, **ev)
        if procs is not None and machines:
            per_launcher = procs // machines
    elif cmd.launcher == "torchrun":
        nnodes, nproc = cmd.get("nnodes"), cmd.integer("nproc_per_node")
        launchers = per_node if per_node and _launcher_per_task(step, nodes, per_node, alloc) else 1
        nodes = nodes * launchers if nodes else nodes
        gpus = gpus // launchers if gpus and gpus % launchers == 0 else gpus
        if isinstance(nnodes, str) and nnodes.isdigit() and nodes and int(nnodes) != nodes and not step.loop:
            found = True
            yield fail(f"{where}: --nnodes {nnodes} on a {nodes}-node launch: the rendezvous waits for nodes that "
                       "never come (or leaves some out)", f"give --nnodes $SLURM_NNODES ({nodes})", **ev)
        if nproc is not None and gpus and nproc != gpus:
            found = True
            yield fail(f"{where}: --nproc_per_node {nproc} on nodes of {gpus} GPUs", f"give --nproc_per_node {gpus}",
                       nproc_per_node=nproc, **ev)
        elif nproc is None and cmd.get("nproc_per_node") is not None:
            unread.append(f"--nproc_per_node {shorten(cmd.get('nproc_per_node'))}")
        per_launcher = nproc
    task_gpus = alloc.gpus_per_task
    opts = step.srun or {}
    if isinstance(opts.get("gpus-per-task"), str) and opts["gpus-per-task"].isdigit():
        task_gpus = int(opts["gpus-per-task"])
    if task_gpus is not None and per_launcher is not None and per_launcher > task_gpus:
        found = True
        yield fail(f"{where}: each task has --gpus-per-task={task_gpus} GPU(s) but its launcher starts "
                   f"{per_launcher} processes: they share {task_gpus} GPU(s) (or stop on 'invalid device ordinal')",
                   "give the launcher task its node's GPUs: --gpus-per-node=N (or --gres=gpu:N) instead of "
                   "--gpus-per-task", gpus_per_task=task_gpus, processes_per_launcher=per_launcher, **ev)
    if cmd.launcher == "python" and task_gpus == 1 and per_node and per_node > 1:  # what the script picks: unknown
        unread.append("--gpus-per-task=1: each task sees its GPU as device 0 (a script that picks cuda:LOCAL_RANK "
                      "stops with 'invalid device ordinal')")
    if not found:
        said = f"; not read without running it: {', '.join(unread)}" if unread else ""
        if nodes and gpus:
            shape = f"the launch's processes match {nodes} nodes x {gpus} GPUs"
        else:  # what the directives do not say is not compared
            untold = [what for what, value in (("the node count", nodes), ("the GPUs per node", gpus)) if not value]
            shape = f"{' and '.join(untold)}: not in the directives; the launch's processes are not compared (not " \
                "judged)"
        yield passed(f"{where}: {shape}{said}", **ev)


@check("CFG076", "sbatch-written-config", "config", tags=["slurm"])
def written_config(ctx) -> Iterator[Finding]:
    """A config the launch names that the batch script writes itself (`cat > ds_config.json <<EOF`) is written
    before the launch and reads as the launcher reads it.

    An unquoted heredoc is expanded by the batch shell first: a `$MICRO_BATCH` the script never sets becomes
    nothing, and `"train_micro_batch_size_per_gpu": ,` stops the job when the config loads (DeepSpeed's
    hjson.load, accelerate's HfDeepSpeedConfig json.load); a file written after the launch line is not there
    when the launcher opens it. A quoted delimiter (<<'EOF')
    writes the text as it is, `$` and all. What the shell computes there at run time ($(...), SLURM's
    variables) is said, not guessed.

    Set every variable the heredoc uses before it (or quote the delimiter for literal text), and write the
    file before the srun line that launches the job.
    """
    script = _script(ctx)
    configs = script.named_configs() if script is not None else []
    if not configs:
        yield skip("no config the launch names is written by the batch script (cat > FILE <<EOF)")
        return
    step = script.main
    for reader, option, heredoc in configs:
        where = script.where(heredoc.line)
        ev = dict(file=script.path, line=heredoc.line, config=heredoc.name, option=option, reader=reader)
        what = "accelerate config" if reader == "accelerate" else "DeepSpeed config"
        if heredoc.line > step.line and not step.loop:
            yield fail(f"{where}: {heredoc.name} (the launch's {option}, line {step.line}) is written after the "
                       "launch: the launcher opens it before it exists", "move the heredoc above the launch line",
                       **ev)
            continue
        if heredoc.runtime:
            yield passed(f"{where}: {heredoc.name} ({what}) is computed at run time by the heredoc "
                         f"({', '.join(heredoc.runtime[:3])}): its contents are not read without running it",
                         runtime=list(heredoc.runtime), **ev)
            continue
        problem = written_config_problem(script.path, reader, heredoc)
        if problem is not None:
            unset = f" ({', '.join('$' + n for n in heredoc.unset)}: set nowhere, written as nothing)" \
                if heredoc.unset else ""
            yield fail(f"{problem}{unset}: {heredoc.name}, which the launch's {option} names, does not load as "
                       f"the {what}", "set the variables the heredoc uses before it, or correct its text",
                       unset=list(heredoc.unset), **ev)
        else:
            yield passed(f"{where}: {heredoc.name} ({what}) is written by the script, lines {heredoc.body_line}-"
                         f"{heredoc.body_line + heredoc.text.count(chr(10))}", **ev)


def written_config_problem(path: str, reader: str, heredoc) -> Optional[str]:
    """Why the heredoc's text does not read as its reader reads the file (one line naming the script's line), or
    None: an accelerate config by the file's name (documents.syntax_by_name, accelerate's load_config_from_file), a
    DeepSpeed config as deepspeed/runtime/config.py DeepSpeedConfig (hjson) and accelerate/utils/deepspeed.py
    HfDeepSpeedConfig (json.load) read it (documents.parse_deepspeed)."""
    text = heredoc.document_text()
    try:
        if reader == "deepspeed":
            parse_deepspeed(path, text)
        elif syntax_by_name(heredoc.name) == "json":
            parse_json(path, text, "accelerate config")
        else:
            parse_yaml(path, text, "accelerate config")
    except InputError as exc:
        return str(exc)
    return None
