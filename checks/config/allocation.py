"""CFG allocation: the job's launch (the batch script's launch line with --sbatch, else the command after `--`)
against the SLURM allocation it runs in, as SLURM reports it there (`check --slurm` inside the allocation; the
engine reads SLURM_* and `scontrol show job` into the `allocation` probe, preflight.inputs.allocation)."""
from __future__ import annotations

import re
from typing import Iterator, Optional, Tuple

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.inputs.allocation import command_script, fold_counts, srun_options, step_layout, written_value
from preflight.inputs.documents import counted, shorten
from preflight.inputs.launchcmd import LAUNCHER_NAMES as NAMES, LOCAL_ADDRESSES as LOCAL, MULTI_LAUNCHERS

NODE_COUNT_VARS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
HEAD_FIX = ("name the allocation's first node: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
            "head -n 1)")


def _launch(ctx):
    """(step, where it was read): the batch script's launch line, else the command after `--` read as a line of
    one (its srun options, if it starts with srun)."""
    batch = getattr(ctx.plan, "batch", None)
    if batch is not None:
        return batch.main, batch.where(batch.main.line) if batch.main else batch.path
    if not ctx.plan.command:
        return None, ""
    return command_script(ctx.plan.command).main, "the command after --"


def _setting(ctx, command, name: str) -> Tuple[Optional[int], Optional[str]]:
    """(value, as written) of a launcher option: the command's flag over the accelerate config's key."""
    if command.get(name) is not None:
        return command.integer(name), str(command.get(name))
    config = ctx.plan.accelerate if command.launcher == "accelerate" else None
    if config is not None and config.data.get(name) is not None:
        return config.integer(name), str(config.data.get(name))
    return None, None


def _processes_per_node(ctx, step) -> Tuple[Optional[int], str]:
    """The processes one launcher starts on its node, and from what (accelerate: num_processes over num_machines,
    the job's; torchrun: --nproc_per_node; DeepSpeed's runner: --num_gpus); None where not read."""
    cmd = step.command
    if cmd.launcher == "accelerate":
        procs, written = _setting(ctx, cmd, "num_processes")
        machines, _ = _setting(ctx, cmd, "num_machines")
        if written is None:
            return None, "num_processes not given: accelerate starts one per GPU it sees"
        if procs is None or (written_value(step, "num_processes") or "").count("SLURM_"):
            return None, f"num_processes {shorten(written)} is computed at run time"
        machines = machines or 1  # accelerate/utils/launch.py, prepare_multi_gpu_env: num_processes // num_machines
        return procs // machines, f"num_processes {procs} / num_machines {machines}"
    if cmd.launcher == "torchrun":
        value = cmd.get("nproc_per_node")
        if value is None:  # torch/distributed/run.py, get_args_parser: --nproc-per-node default "1"
            return 1, "torchrun's default --nproc_per_node 1"
        number = cmd.integer("nproc_per_node")
        return (number, f"--nproc_per_node {number}") if number is not None else \
            (None, f"--nproc_per_node {shorten(value)}: one per GPU it sees, or computed at run time")
    if cmd.launcher == "deepspeed":
        number = cmd.integer("num_gpus")
        if number is None:
            return None, "DeepSpeed's runner: every GPU it sees"
        return number, f"--num_gpus {number}"
    return None, ""


def _node_of(ctx, alloc, address: str) -> Optional[str]:
    """The allocation's node that an address names: by its short name, else by an address a node's facts list."""
    short = address.split(".")[0].lower()
    for node in alloc.nodes:
        if node.lower() == short or node.lower() == address.lower():
            return node
    for node, state in ctx.facts.items():
        interfaces = (((state or {}).get("facts") or {}).get("host") or {}).get("interfaces") or {}
        if isinstance(interfaces, dict) and any(address in (addrs or []) for addrs in interfaces.values()):
            return node if node in alloc.nodes else None
    return None


def _head_address(ctx, step) -> Tuple[Optional[str], str]:
    """(the head's address the launch names, the option): main_process_ip (flag or config), --master_addr, or the
    host of --rdzv_endpoint."""
    cmd = step.command
    options = {"accelerate": ("main_process_ip",), "torchrun": ("rdzv_endpoint", "master_addr"),
               "deepspeed": ("master_addr",)}.get(cmd.launcher, ())
    for option in options:
        word = step.value_of(option)
        if word is not None:
            host = word.text.rsplit(":", 1)[0] if option == "rdzv_endpoint" else word.text
            return host, f"--{option}"
    if cmd.launcher == "accelerate" and ctx.plan.accelerate is not None:
        ip = ctx.plan.accelerate.data.get("main_process_ip")
        if isinstance(ip, str) and ip:
            return ip, "main_process_ip"
    return None, ""


@check("CFG075", "slurm-allocation", "config", tags=["slurm", "multinode"])
def allocation(ctx) -> Iterator[Finding]:
    """Inside the allocation, the launch matches what SLURM gave the job: one launcher per node, as many
    processes per node as the node's GPUs, as many machines as nodes, and rank 0 on the node the head's
    address names.

    What the batch script's directives ask for is not always what the job got: `sbatch -N3 --ntasks-per-node=8`
    on the command line overrides them, a partition's defaults fill in the rest. SLURM says what it gave in the
    job's own variables (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE such as `2(x3),1`, SLURM_GPUS_PER_NODE) and in
    `scontrol show job`: `srun accelerate launch` under 8 tasks per node starts 8 launchers on every node, on
    the same GPUs and port; a launch of 8 processes on nodes of 4 GPUs puts two ranks on a GPU; num_machines 4
    on 2 nodes waits for machines that never come. Task 0 and the batch step run on the first node of
    SLURM_JOB_NODELIST, in SLURM's order (not the order --nodelist gave): a MASTER_ADDR naming another node
    waits at an address where rank 0 never listens.

    Run `preflight check --slurm --sbatch "$0"` (or `-- srun ... LAUNCHER ...`) in the batch script before the
    training step. Give the launch one task per node with a task count to match, `srun --ntasks=$SLURM_NNODES
    --ntasks-per-node=1` (under a job with SLURM_NTASKS, srun ignores a --ntasks-per-node that does not match
    it); derive counts from SLURM's variables (--num_machines $SLURM_NNODES), and the head from the allocation:
    `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1`.
    """
    alloc = ctx.probes.get("allocation")
    if alloc is None:
        yield skip("no SLURM allocation read: inside one, give --slurm or --sbatch SCRIPT with the launch (in the "
                   "batch script, or under salloc)")
        return
    step, where = _launch(ctx)
    ev = dict(job=alloc.job_id, nodelist=alloc.nodelist, nodes=list(alloc.nodes), tasks_per_node=list(alloc.tasks),
              gpus_per_node=list(alloc.gpus), gpus_from=alloc.gpus_from, notes=list(alloc.notes))
    if step is None:
        yield skip(f"{alloc.summary()}: no launch to judge against it (give --sbatch SCRIPT or -- COMMAND)", **ev)
        return
    if step.loop:
        yield passed(f"{where}: {alloc.summary()}; the launch runs in a loop (one srun per iteration): how many it "
                     "starts where is not read without running it", **ev)
        return
    launcher, name = step.command.launcher, NAMES.get(step.command.launcher, step.command.program)
    if step.srun is None and getattr(ctx.plan, "batch", None) is None:  # `-- COMMAND`: what each node runs
        layout_nodes, layout_tasks, source = alloc.nodes, (1,) * len(alloc.nodes), "the command on every node"
    else:
        options = srun_options(step, alloc)
        layout = step_layout(alloc, options) if options is not None else None
        if layout is None:
            yield passed(f"{where}: {alloc.summary()}; srun's options ({shorten(step.text, 80)}) place its tasks "
                         "in a way not read here (a node list, a distribution, a range of nodes)", **ev)
            return
        layout_nodes, layout_tasks, source = layout.nodes, layout.tasks, layout.source
    ev.update(step_nodes=list(layout_nodes), step_tasks=list(layout_tasks), layout_from=source)
    gpus = dict(zip(alloc.nodes, alloc.gpus))
    found = False
    notes = [f"not read: {n}" for n in alloc.notes]

    crowded = [(n, t) for n, t in zip(layout_nodes, layout_tasks) if t > 1]
    if launcher in MULTI_LAUNCHERS and crowded:
        found = True
        most = max(t for _, t in crowded)
        yield fail(f"{where}: srun starts {fold_counts([t for _, t in crowded])} tasks on {_names(crowded)} in this "
                   f"allocation ({source}), each running {name}: up to {most} launchers on a node, each starting its "
                   "own processes on the same GPUs and port", "give the launch srun one task per node, with "
                   "a task count that matches it (srun takes the job's SLURM_NTASKS otherwise): srun "
                   f"--ntasks=$SLURM_NNODES --ntasks-per-node=1 {' '.join(step.command.from_program[:2])} ...", **ev)
    if launcher == "python" and gpus:
        over = [(n, t) for n, t in zip(layout_nodes, layout_tasks) if gpus.get(n) is not None and t > gpus[n]]
        if over:
            found = True
            yield warn(f"{where}: srun starts {fold_counts([t for _, t in over])} tasks on {_names(over)} with "
                       f"{fold_counts([gpus[n] for n, _ in over])} GPUs there: with srun as the launcher each task is "
                       "one rank, and two share a GPU", "give srun --ntasks-per-node equal to the GPUs per node", **ev)

    per_launcher, per_source = _processes_per_node(ctx, step)
    if launcher in MULTI_LAUNCHERS and per_launcher is not None and gpus:
        ranked = [(n, per_launcher * t, gpus.get(n)) for n, t in zip(layout_nodes, layout_tasks)]
        over = [(n, p, g) for n, p, g in ranked if g is not None and p > g]
        idle = [(n, p, g) for n, p, g in ranked if g is not None and p < g]
        if over:
            found = True
            yield fail(f"{where}: {name} starts {over[0][1]} processes on {_names(over)} ({per_source}), which have "
                       f"{counted(over[0][2], 'GPU')} in this allocation ({alloc.gpus_from}): ranks share a GPU or "
                       "stop on 'invalid device ordinal'", f"start {counted(over[0][2], 'process', 'processes')} per node, "
                       "or ask SLURM for more GPUs per node (--gpus-per-node)", **ev)
        elif idle:
            found = True
            yield warn(f"{where}: {name} starts {idle[0][1]} processes on {_names(idle)} ({per_source}), which have "
                       f"{counted(idle[0][2], 'GPU')} in this allocation ({alloc.gpus_from}): the others stay idle",
                       f"start {counted(idle[0][2], 'process', 'processes')} per node (accelerate: --num_processes "
                       "is the whole job's, nodes x GPUs per node)", **ev)
    elif launcher in MULTI_LAUNCHERS and not gpus:
        notes.append(f"GPUs per node not judged: {alloc.gpus_from}")

    machines_option = {"accelerate": "num_machines", "torchrun": "nnodes"}.get(launcher)
    if machines_option and not ctx.plan.sets_ranks:  # `launch` gives each node --num_machines itself
        written = written_value(step, machines_option)
        number, given = _setting(ctx, step.command, machines_option)
        if given is not None and re.fullmatch(r"\d{1,6}:\d{1,6}", given):  # torchrun's elastic MIN:MAX
            low, high = map(int, given.split(":"))
            number = len(layout_nodes) if low <= len(layout_nodes) <= high else low
        if written is not None and any(v in written for v in NODE_COUNT_VARS):
            notes.append(f"--{machines_option} {written}: the allocation's node count")
        elif number is not None and number != len(layout_nodes):
            found = True
            yield fail(f"{where}: --{machines_option} {given} on {len(layout_nodes)} nodes "
                       f"({fold_nodes(layout_nodes)}) of this allocation: the rendezvous waits for machines that "
                       "never come (or leaves nodes out)",
                       f"give --{machines_option} $SLURM_NNODES ({len(layout_nodes)})", **ev)

    if step.srun is not None and launcher in MULTI_LAUNCHERS and len(layout_nodes) > 1:
        problem = _rank_zero(ctx, alloc, step, layout_nodes, where)
        if isinstance(problem, Finding):
            found = True
            yield problem
        elif problem:
            notes.append(problem)
    if not found:
        said = "; " + "; ".join(notes) if notes else ""
        yield passed(f"{where}: {alloc.summary()}: {name} on {len(layout_nodes)} node(s), "
                     f"{fold_counts(layout_tasks)} task(s) per node{said}", **ev)


def _rank_zero(ctx, alloc, step, nodes, where: str):
    """A Finding when the head's address names a node other than the one rank 0 runs on; else a note (or '')."""
    address, option = _head_address(ctx, step)
    if address is None:
        return ""
    if "$" in address:
        return f"{option} {shorten(address)} is computed at run time"
    if address in LOCAL or address.startswith("-") or not address:
        return ""  # every node names itself, or no value: CFG073
    rank_option = "machine_rank" if step.command.launcher == "accelerate" else "node_rank"
    rank = step.value_of(rank_option)
    static = not isinstance(step.command.get("rdzv_backend"), str) or step.command.get("rdzv_backend") == "static"
    node = _node_of(ctx, alloc, address)
    ev = dict(address=address, option=option, first_node=nodes[0], nodelist=alloc.nodelist)
    if node is None:
        return warn(f"{where}: {option} {address} is not one of this allocation's nodes ({alloc.nodelist}, as SLURM "
                    f"names them): the head must run in the job, and rank 0 starts on {nodes[0]}", HEAD_FIX, **ev)
    from_task = rank is not None and bool(re.search(r"SLURM_(NODEID|PROCID)", " ".join(rank.task_vars)))
    if not static or not from_task or node == nodes[0]:
        return ""
    return fail(f"{where}: {option} {address} names {node}, but rank 0 starts on {nodes[0]}: --{rank_option} is "
                f"${rank.task_vars[0]}, 0 on the first node of SLURM_JOB_NODELIST={alloc.nodelist} (SLURM orders the "
                "allocation's nodes itself, not as --nodelist gave them); the others wait where rank 0 never listens",
                HEAD_FIX, **ev)


def _names(pairs) -> str:
    return fold_nodes([p[0] for p in pairs])


def fold_nodes(names) -> str:
    from preflight.inputs.inventory import fold

    return fold(list(names))
