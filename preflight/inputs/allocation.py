"""The SLURM allocation a job runs in, as SLURM reports it inside it, and the tasks an srun step starts there.

What SLURM sets in the batch step (sbatch(1) and salloc(1) of Slurm 22.05, OUTPUT ENVIRONMENT VARIABLES):
SLURM_JOB_NODELIST (a hostlist, in SLURM's own order: the batch step and task 0 run on its first node),
SLURM_JOB_NUM_NODES (SLURM_NNODES), SLURM_TASKS_PER_NODE ("tasks on each node, in the order of
SLURM_JOB_NODELIST; a count repeated on consecutive nodes is followed by (x#)": `2(x3),1`), SLURM_NTASKS,
SLURM_NTASKS_PER_NODE (only with --ntasks-per-node), SLURM_GPUS_PER_NODE (only with --gpus-per-node,
`[type:]N`), SLURM_GPUS_ON_NODE (the GPUs of the batch step, on the first node) and SLURM_JOB_GPUS (their
IDs). `scontrol show job --details` adds what varies by node: each node's GRES (`GRES=gpu:2(IDX:0-1)`) and
the BatchHost.

An srun step inside the allocation (srun(1)) takes its options from its command line, else from those same
variables (SLURM_NNODES is -N, SLURM_NTASKS is -n, SLURM_NTASKS_PER_NODE is --ntasks-per-node; "command line
options always override environment variable settings"); with -n, --ntasks-per-node is a maximum.
Nothing here runs anything: preflight.gate.slurm runs scontrol, the engine gives its text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.inputs.documents import InputError
from preflight.inputs.inventory import expand, fold

COUNTS = re.compile(r"(\d{1,6})(?:\(x(\d{1,6})\))?")


@dataclass(frozen=True)
class Allocation:
    """The allocation as SLURM reports it; () or None where it does not say (and `notes` says what was not read)."""

    job_id: str
    nodelist: str  # SLURM_JOB_NODELIST as SLURM wrote it
    nodes: Tuple[str, ...]  # expanded, in SLURM's order
    tasks: Tuple[int, ...]  # SLURM_TASKS_PER_NODE, per node of `nodes`
    ntasks: Optional[int]  # SLURM_NTASKS
    ntasks_per_node: Optional[int]  # SLURM_NTASKS_PER_NODE
    gpus: Tuple[int, ...]  # GPUs per node of `nodes`; () when the allocation names none
    gpus_from: str  # where the GPU counts come from
    batch_host: Optional[str]  # where the batch step runs (scontrol's BatchHost), else the first node
    notes: Tuple[str, ...] = ()

    @property
    def first(self) -> str:
        return self.nodes[0]

    def summary(self) -> str:
        tasks = f", SLURM_TASKS_PER_NODE={fold_counts(self.tasks)}" if self.tasks else ""
        gpus = f", {fold_counts(self.gpus)} GPUs per node ({self.gpus_from})" if self.gpus else ", no GPUs"
        return f"job {self.job_id}: {len(self.nodes)} nodes {self.nodelist}{tasks}{gpus}"


def counts(text: str) -> Optional[List[int]]:
    """SLURM's per-node counts (`2(x3),1` -> [2, 2, 2, 1]), or None when the text is not in that form."""
    found: List[int] = []
    for part in text.strip().split(","):
        m = COUNTS.fullmatch(part.strip())
        if not m:
            return None
        found += [int(m.group(1))] * int(m.group(2) or 1)
        if len(found) > 100_000:
            return None
    return found


def fold_counts(values: Sequence[int]) -> str:
    """[2, 2, 2, 1] -> `2(x3),1`, as SLURM writes them."""
    out: List[str] = []
    k = 0
    while k < len(values):
        run = 1
        while k + run < len(values) and values[k + run] == values[k]:
            run += 1
        out.append(f"{values[k]}(x{run})" if run > 1 else str(values[k]))
        k += run
    return ",".join(out)


def _number(text: Optional[str]) -> Optional[int]:
    return int(text) if text is not None and re.fullmatch(r"\d{1,6}", text.strip()) else None


def gpu_count(value: Optional[str]) -> Optional[int]:
    """The GPUs of `N`, `type:N`, `gpu:N`, `gpu:type:N` (SLURM_GPUS_PER_NODE, a GRES), before any `(IDX:..)`."""
    if not value:
        return None
    for item in value.split(","):
        parts = item.split("(")[0].strip().split(":")
        if parts[0] in ("gpu", "gres/gpu") or (len(parts) <= 2 and _number(parts[-1]) is not None):  # not nvme
            if parts == ["gpu"]:
                return 1
            return _number(parts[-1])
    return None


def _scontrol_nodes(text: str) -> Dict[str, int]:
    """GPUs by node from the `Nodes=node[01-02] CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)` parts of `scontrol show job
    --details`."""
    found: Dict[str, int] = {}
    for m in re.finditer(r"(?<![A-Za-z])Nodes=(\S+)((?:(?!\bNodes=)[^\n])*)", text):
        gres = re.search(r"\bGRES=(\S*)", m.group(2))
        if gres is None:
            continue
        gpus = gpu_count(gres.group(1)) if "gpu" in gres.group(1) else 0
        try:
            names = expand(m.group(1), "scontrol show job")
        except InputError:  # a node list not read: nor its GRES
            continue
        for name in names:
            found[name] = gpus or 0
    return found


def read(environ: Mapping[str, str], scontrol_text: Optional[str] = None,
         scontrol_problem: Optional[str] = None) -> Optional[Allocation]:
    """The allocation of this environment (None outside one: no SLURM_JOB_ID and SLURM_JOB_NODELIST)."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    notes: List[str] = []
    nodes = tuple(expand(nodelist, "SLURM_JOB_NODELIST"))
    number = _number(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES"))
    if number is not None and number != len(nodes):
        notes.append(f"SLURM_JOB_NUM_NODES={number} but SLURM_JOB_NODELIST={nodelist} names {len(nodes)}")
    tasks: Tuple[int, ...] = ()
    text = environ.get("SLURM_TASKS_PER_NODE")
    if text:
        per_node = counts(text)
        if per_node is None or len(per_node) != len(nodes):
            notes.append(f"SLURM_TASKS_PER_NODE={text[:60]} is not one count per node of {nodelist}: not read")
        else:
            tasks = tuple(per_node)
    gpus, source = _gpus(environ, scontrol_text, nodes)
    if scontrol_problem:
        notes.append(f"scontrol show job: {scontrol_problem}")
    batch_host = None
    if scontrol_text:
        m = re.search(r"\bBatchHost=(\S+)", scontrol_text)
        batch_host = m.group(1) if m and m.group(1) != "(null)" else None
    return Allocation(job_id, nodelist, nodes, tasks, _number(environ.get("SLURM_NTASKS")),
                      _number(environ.get("SLURM_NTASKS_PER_NODE")), gpus, source, batch_host, tuple(notes))


def _gpus(environ: Mapping[str, str], scontrol_text: Optional[str], nodes: Sequence[str]):
    """(GPUs per node, where that comes from): scontrol's GRES of each node, else SLURM_GPUS_PER_NODE, else
    scontrol's TresPerNode, else the batch step's own (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS) on a single node."""
    by_node = _scontrol_nodes(scontrol_text or "")
    if by_node and all(n in by_node for n in nodes) and any(by_node.values()):
        return tuple(by_node[n] for n in nodes), "scontrol show job: GRES of each node"
    per_node = gpu_count(environ.get("SLURM_GPUS_PER_NODE"))
    if per_node is not None:
        return (per_node,) * len(nodes), f"SLURM_GPUS_PER_NODE={environ['SLURM_GPUS_PER_NODE']}"
    tres = re.search(r"\bTresPerNode=\S*?gres[:/]gpu(?::[^,\s:]+)?:(\d+)", scontrol_text or "")
    if tres:
        return (int(tres.group(1)),) * len(nodes), f"scontrol show job: TresPerNode gpu:{tres.group(1)}"
    on_node = _number(environ.get("SLURM_GPUS_ON_NODE"))
    ids = environ.get("SLURM_JOB_GPUS")
    if on_node is None and ids:
        on_node = len([i for i in ids.split(",") if i.strip()])
    if on_node and len(nodes) == 1:
        return (on_node,), f"SLURM_GPUS_ON_NODE={on_node}"
    if on_node:
        return (), (f"only the first node's GPUs are in the variables (SLURM_GPUS_ON_NODE={on_node}), and scontrol "
                    "show job gave no GRES by node")
    return (), "no GPUs in the allocation (no SLURM_GPUS_PER_NODE, no gres/gpu in scontrol show job)"


# ---- an srun step in the allocation ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """The tasks an srun step starts on each of its nodes, and from what."""

    nodes: Tuple[str, ...]
    tasks: Tuple[int, ...]
    source: str  # which options and variables decided it


def step_layout(alloc: Allocation, srun: Optional[Mapping[str, str]]) -> Optional[Layout]:
    """The step's tasks per node; the batch step's own command (srun None) is one task, on the first node. None
    where the options say it in a way not read here (a node list, a distribution, a -N range).

    srun takes -n from SLURM_NTASKS when the job has one (sbatch sets it with --ntasks or --ntasks-per-node), and
    then honours --ntasks-per-node only where it matches -n over the nodes: Slurm 22.05 says "can't honor
    --ntasks-per-node set to 1 which doesn't match the requested tasks 4 with the number of requested nodes 2.
    Ignoring --ntasks-per-node" and lays out the 4 tasks as the job's (tests/fixtures/slurm_allocation)."""
    if srun is None:
        return Layout((alloc.batch_host or alloc.first,), (1,), "the batch step (no srun)")
    if any(k in srun for k in ("nodelist", "exclude", "relative", "distribution", "multi-prog", "het-group")):
        return None
    nodes_opt, ntasks_opt, per_opt = (_number(srun.get(k)) for k in ("nodes", "ntasks", "ntasks-per-node"))
    if "nodes" in srun and nodes_opt is None or "ntasks" in srun and ntasks_opt is None or \
            "ntasks-per-node" in srun and per_opt is None:
        return None
    count = min(nodes_opt or len(alloc.nodes), len(alloc.nodes))
    ntasks = ntasks_opt if ntasks_opt is not None else alloc.ntasks
    per_node = per_opt if per_opt is not None else alloc.ntasks_per_node
    said = [f"srun -N {nodes_opt}"] if nodes_opt is not None else []
    said.append(f"srun -n {ntasks}" if ntasks_opt is not None else f"SLURM_NTASKS={ntasks}" if ntasks else "")
    if ntasks is None:  # no task count: --ntasks-per-node on each node, else the job's layout
        if per_node is not None:
            return Layout(alloc.nodes[:count], (per_node,) * count, f"srun --ntasks-per-node={per_node}"
                          if per_opt is not None else f"SLURM_NTASKS_PER_NODE={per_node}")
        if alloc.tasks and count == len(alloc.nodes):
            return Layout(alloc.nodes, alloc.tasks, f"SLURM_TASKS_PER_NODE={fold_counts(alloc.tasks)}")
        return Layout(alloc.nodes[:count], (1,) * count, "one task per node")
    if per_opt is not None and ntasks != per_opt * count:
        said.append(f"srun --ntasks-per-node={per_opt} ignored: it does not match {ntasks} tasks on {count} nodes")
    elif per_node is not None and ntasks == per_node * count:
        said.append(f"srun --ntasks-per-node={per_node}" if per_opt is not None else
                    f"SLURM_NTASKS_PER_NODE={per_node}")
        return Layout(alloc.nodes[:count], (per_node,) * count, ", ".join(filter(None, said)))
    if count == len(alloc.nodes) and ntasks == sum(alloc.tasks):  # the job's own layout
        said.append(f"SLURM_TASKS_PER_NODE={fold_counts(alloc.tasks)}")
        return Layout(alloc.nodes, alloc.tasks, ", ".join(filter(None, said)))
    count = min(count, ntasks)  # fewer tasks than nodes: srun takes as many nodes as tasks
    base, extra = divmod(ntasks, count)  # the block distribution: the first nodes take the remainder
    return Layout(alloc.nodes[:count], tuple(base + (k < extra) for k in range(count)), ", ".join(filter(None, said)))


# What srun sets in each task of a step (srun(1), OUTPUT ENVIRONMENT VARIABLES; Slurm's env_array_for_step, in
# src/common/env.c, with the older SLURM_NNODES, SLURM_NTASKS/SLURM_NPROCS, SLURM_NODELIST and SLURM_TASKS_PER_NODE
# from the step too): by node, then by task. A one-node helper step (preflight.remote.srun) has SLURM_NODEID=0 and
# SLURM_NNODES=1 on every node; the training step, across the allocation, has these.
NODE_VARIABLES = ("SLURM_NODEID", "SLURMD_NODENAME", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_NODELIST",
                  "SLURM_NODELIST")
TASK_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_GTIDS", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                  "SLURM_NPROCS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
STEP_VARIABLES = NODE_VARIABLES + TASK_VARIABLES


def step_variables(alloc: Allocation, node: str) -> Dict[str, Optional[str]]:
    """The step variables of the task on `node` in an srun step without options across the allocation (its
    layout: step_layout), {} when the step does not run there. SLURM_NODEID is the node's index in the step's
    nodes, in SLURM's order; the task variables are known with one task per node (SLURM_PROCID is then the
    node's index, SLURM_LOCALID 0), else None: they depend on which of the node's tasks runs the command."""
    layout = step_layout(alloc, {})
    if layout is None or node not in layout.nodes:
        return {}
    index, count = layout.nodes.index(node), len(layout.nodes)
    nodelist = alloc.nodelist if layout.nodes == alloc.nodes else fold(layout.nodes)
    found: Dict[str, Optional[str]] = dict(zip(NODE_VARIABLES, (str(index), node, str(count), str(count), nodelist,
                                                                nodelist)))
    one_each = all(t == 1 for t in layout.tasks)
    per_node = fold_counts(layout.tasks)
    values = (str(index), "0", str(index), str(count), str(count), str(count), per_node, per_node)
    found.update(zip(TASK_VARIABLES, values if one_each else (None,) * len(TASK_VARIABLES)))
    return found


def command_script(words: Sequence[str]):
    """The command after `--` read as one line of a batch script (preflight.inputs.batchscript), so that an
    `srun ... LAUNCHER` given there is read as the script's srun line is: its options, what each task runs."""
    import shlex

    from preflight.inputs import batchscript

    return batchscript.parse("the command after --", "#!/bin/sh\n" + shlex.join(words) + "\n", {})


def written_value(step, *options: str, short: str = "") -> Optional[str]:
    """An option's value as the line writes it (before the batch step expands it), or None: a value written from
    SLURM's own variables (`--nnodes $SLURM_NNODES`) is the allocation's when the step runs, whatever the
    directives say."""
    names = "|".join(re.escape(o).replace("_", "[-_]") for o in options)
    pattern = rf"(?:--(?:{names})(?:=|\s+)" + (rf"|{re.escape(short)}\s*" if short else "") + r")(\S+)"
    found = None
    for m in re.finditer(rf"(?<!\S){pattern}", step.text):
        found = m.group(1).strip("'\"")
    return found


SRUN_COUNTS = {"nodes": "-N", "ntasks": "-n", "ntasks-per-node": ""}
VARIABLE = re.compile(r"\$\{?(SLURM_[A-Z_]+)\}?")


def srun_options(step, alloc: Allocation) -> Optional[Dict[str, str]]:
    """The step's srun options with the counts it writes from SLURM's variables (`-n $SLURM_NNODES`) taken from
    the allocation, not from the directives the script was read with; None where such a count is computed from
    them in a way not read here (`$((SLURM_NNODES * 2))`)."""
    values = {"SLURM_NNODES": len(alloc.nodes), "SLURM_JOB_NUM_NODES": len(alloc.nodes), "SLURM_NTASKS": alloc.ntasks,
              "SLURM_NPROCS": alloc.ntasks, "SLURM_NTASKS_PER_NODE": alloc.ntasks_per_node}
    options = dict(step.srun)
    for option, short in SRUN_COUNTS.items():
        written = written_value(step, option, short=short) if option in options else None
        if written is None or "SLURM_" not in written:
            continue
        m = VARIABLE.fullmatch(written)
        if m is None or values.get(m.group(1)) is None:
            return None
        options[option] = str(values[m.group(1)])
    return options
