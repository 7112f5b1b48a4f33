"""A SLURM batch script as sbatch and the shell will run it: its #SBATCH directives (and the SBATCH_* input
environment variables, which override them), the allocation they ask for, and its launch lines (`srun`, the
launchers, and what each task runs).

What sbatch does (Slurm's src/sbatch/sbatch.c and opt.c, `_opt_batch_script`): it refuses a script whose first line
is not `#!`, or that holds DOS line breaks; it takes the words of every line that starts with `#SBATCH` up to the
first line whose first non-blank character is not `#`, as literal text (quotes group, `#` starts a comment, no shell
expands them); the SBATCH_* environment variables override them. The script then runs once, in the batch step on
the first node, where SLURM_PROCID and SLURM_NODEID are 0: a variable in a launch line expands there, once, unless it
is single-quoted or escaped into a shell the task runs (`srun bash -c '... $SLURM_PROCID'`), or a script srun starts.

The shell is read by preflight.inputs.shell and shellwalker (tree-sitter-bash's grammar; bash's rules there),
sbatch's and srun's options by preflight.inputs.slurmopts. Here: which commands start the job's processes (srun, the
launchers, the wrappers they run under), what each task's shell sees (what the batch step exports, `srun --export`, VAR=value
before srun), the files the script writes (heredocs, redirections), and what was not read, in `unread`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

from preflight.inputs import launchcmd, shell
from preflight.inputs.allocation import gpu_count
from preflight.inputs.documents import InputError, read_regular
from preflight.inputs.shell import Field, Scope, Unknown, Var
from preflight.inputs.shellwalker import Simple, Walker
from preflight.inputs.slurmopts import (ALIASES, SBATCH_ENV, SBATCH_SHORT, SBATCH_SHORT_FLAGS, SRUN_FLAGS,
                                       SRUN_OPTIONAL, SRUN_SHORT, SRUN_SHORT_FLAGS, directive_words, options)

# Real batch scripts are a few KiB; Slurm's own bound is max_script_size (SchedulerParameters, slurm.conf(5); 4 MB by
# default). Past 1 MiB the file is refused, which keeps the read within seconds.
MAX_BYTES = 1024 * 1024
MAX_NOTES = 50  # lines of `unread` kept
MAX_STEPS = 64  # launch and helper lines read; past them, one note says how many more were not
MAX_STEP_SCRIPTS = 8  # scripts srun runs (`srun step.sh`) read, when they are here
MAX_IGNORED = 16  # #SBATCH lines after the first command (or literal ones) said one by one

# What SLURM sets differently in every task (srun(1), OUTPUT ENVIRONMENT VARIABLES), with its value in the batch
# step, which is task 0 on node 0 (sbatch(1)).
PER_TASK = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": None,
            "SLURM_STEP_ID": None, "SLURM_TOPOLOGY_ADDR": None, "SLURM_TASK_PID": None}
LAUNCHERS = ("accelerate", "torchrun", "deepspeed", "python")
SHELLS = ("bash", "sh", "zsh", "dash", "ksh")
STARTERS = ("mpirun", "mpiexec", "mpiexec.hydra", "orterun")  # they start tasks on the allocation's nodes, as srun
# Programs that run the rest of their words, with their options that take a value: they are skipped to the
# program they run (a container's image is one more word).
WRAPPERS = {"env": "-u --unset -C --chdir -S --split-string", "time": "-f --format -o --output", "nohup": "",
            "exec": "-a", "command": "", "builtin": "", "nice": "-n --adjustment", "stdbuf": "-i -o -e",
            "numactl": "-C --physcpubind -N --cpunodebind -m --membind -p --preferred -i --interleave",
            "taskset": "", "chrt": "", "ionice": "-c -n", "uv": "--with --python -p --project --directory --group "
            "--extra --env-file", "conda": "-n --name -p --prefix", "micromamba": "-n --name -p --prefix",
            "mamba": "-n --name -p --prefix", "pixi": "-e --environment --manifest-path", "poetry": "", "pipenv": "",
            "nsys": "-o --output -t --trace -s --sample --capture-range -c --delay -d --duration",
            "singularity": "-B --bind --env --env-file --home -H --pwd -W --workdir --overlay -o --scratch -S",
            "apptainer": "-B --bind --env --env-file --home -H --pwd -W --workdir --overlay -o --scratch -S",
            "enroot": "-e --env -m --mount -r --root -w --rw", "xargs": ""}
SUBCOMMANDS = {"uv": ("run",), "conda": ("run",), "micromamba": ("run",), "mamba": ("run",), "pixi": ("run",),
               "poetry": ("run",), "pipenv": ("run",), "nsys": ("profile",), "singularity": ("exec", "run"),
               "apptainer": ("exec", "run"), "enroot": ("start", "exec")}
IMAGE_FIRST = ("singularity", "apptainer", "enroot")  # the image (or container) comes before the program


# ---- words -----------------------------------------------------------------------------------------------------

@dataclass
class Rendered:
    """A word after the shell expanded what it could: its text, and where its unknown parts come from."""

    text: str
    unknown: List[str] = field(default_factory=list)  # what is computed at run time (as written, and why)
    batch_task_vars: List[str] = field(default_factory=list)  # per-task variables expanded in the batch step
    task_vars: List[str] = field(default_factory=list)  # per-task variables expanded in each task
    host_commands: List[str] = field(default_factory=list)  # $(hostname) and the like, and where (batch or task)
    unset: List[str] = field(default_factory=list)  # variables the script sets nowhere (from the environment?)
    unset_unless_sourced: List[str] = field(default_factory=list)  # set nowhere, unless in a file it sources
    spread: bool = False  # an unquoted run-time expansion: may be several words (options among them), or none


def rendered(f: Field) -> Rendered:
    unknown = [u.why or u.written for u in f.unknowns() if u.shown is None and
               not {s.split(":")[0] for s in u.sources} <= {"task", "batch_task"} or not u.sources and u.shown is None]
    return Rendered(f.text, list(dict.fromkeys(unknown)), f.sources("batch_task"), f.sources("task"),
                    f.sources("host"), f.sources("unset"), f.sources("sourced"), f.spread)


# ---- the script ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Directive:
    option: str  # the long option, without dashes: nodes, ntasks-per-node, gpus-per-node, gres, ...
    value: Optional[str]  # None for a flag
    line: int  # 0 for an environment variable
    text: str  # the line (or NAME=value) as written
    source: str = "#SBATCH"  # or the environment variable's name


def exported(scope: shell.Scope) -> Dict[str, str]:
    """The exported variables of SCOPE whose value is known here (no part left to run time)."""
    return {name: "".join(var.value) for name, var in scope.vars.items()
            if var.exported and var.array is None and all(isinstance(p, str) for p in var.value)}


def exported_at_run_time(scope: shell.Scope) -> Dict[str, str]:
    """The exported variables of SCOPE set to a value with a part known only at run time: name -> the value with
    those parts as written ($LOGDIR/nccl.log)."""
    return {name: shell.Field(var.value).text for name, var in scope.vars.items()
            if var.exported and (var.array is not None or not all(isinstance(p, str) for p in var.value))}


@dataclass(frozen=True)
class Step:
    """A line that starts the job's processes: srun with what each task runs, or a launcher run in the batch step."""

    line: int
    text: str  # the command as written, whole (a report shortens it)
    srun: Optional[Mapping[str, str]]  # srun's options (long names; "" for a flag); None without srun
    command: launchcmd.LaunchCommand  # what runs (the launcher), words expanded where the script tells their value
    words: Tuple[Rendered, ...]  # the launcher's words with where their unknown parts come from
    in_task_shell: bool = False  # run by a shell in each task (srun bash -c '...', srun step.sh)
    loop: bool = False  # inside a for/while loop
    conditional: bool = False  # inside an if/case
    background: bool = False
    chosen_by: Optional[str] = None  # the per-task value a `case` in each task picks this launch by ($SLURM_PROCID)
    alternatives: Tuple["Step", ...] = ()  # with chosen_by: the launches of the case's other branches
    hidden: Tuple[str, ...] = ()  # run-time words that may hold the launcher's options (`torchrun $ARGS train.py`)
    srun_hidden: Tuple[str, ...] = ()  # likewise for srun's own options (`srun $SRUN_ARGS torchrun ...`)
    starter: Optional[str] = None  # srun, or mpirun and the like; None: the batch step runs it
    container: Optional[str] = None  # the image its tasks run in (pyxis --container-image, apptainer exec IMAGE)
    workdir: Optional[str] = "."  # the folder it runs in, as the script leaves it ("." the one it starts in)
    # the variables the script exports with a value known here, as they reach it (srun's default --export=ALL);
    # PKG008 reads them for a known defect's variable or workaround
    env: Mapping[str, str] = field(default_factory=dict)
    # those it exports with a value known only at run time, as written (JOB012 names them as not judged)
    env_at_run_time: Mapping[str, str] = field(default_factory=dict)

    def value_of(self, *options: str) -> Optional[Rendered]:
        """The rendered word given as the value of one of the launcher's options (the last one given)."""
        found = None
        argv = self.command.argv
        for k, word in enumerate(argv):
            if word == "--" or (k > 0 and self.command.script is not None and k >= len(argv) - len(
                    self.command.script_args)):
                break
            name, eq, value = word.partition("=")
            if name.startswith("--") and launchcmd.canonical(name) in options:
                if eq:
                    found = replace(self.words[k], text=value)
                elif k + 1 < len(argv):
                    found = self.words[k + 1]
        return found


@dataclass(frozen=True)
class Allocation:
    """What the directives ask SLURM for (None where they do not say, or say it in a way not read here)."""

    nodes: Optional[int]
    nodes_text: Optional[str]
    ntasks: Optional[int]
    tasks_per_node: Optional[int]
    gpus_per_node: Optional[int]
    gpus_per_task: Optional[int]
    gpus: Optional[int]


@dataclass(frozen=True)
class Heredoc:
    """A file the script writes from a heredoc (`cat > FILE <<EOF`), as it will hold it."""

    name: str  # the file as the script names it, expanded (its run-time parts as written)
    line: int  # the line of the command that writes it
    body_line: int  # the script's line of the body's first line
    text: str  # the body as the file will hold it (an unquoted heredoc expanded as the batch shell expands it)
    runtime: Tuple[str, ...] = ()  # what in the body is computed at run time, as written; empty: the text is literal
    unset: Tuple[str, ...] = ()  # variables in the body the script sets nowhere

    def document_text(self) -> str:
        """The body with as many newlines before it as there are script lines above it: read as the config, every
        key keeps the script's line number."""
        return "\n" * (self.body_line - 1) + self.text


@dataclass(frozen=True)
class BatchScript:
    path: str
    directives: Mapping[str, Directive]  # the option sbatch takes, the environment's over the script's
    literal: Tuple[Directive, ...]  # directives with a $ or ` in them: sbatch takes the text as it is
    ignored: Tuple[Directive, ...]  # #SBATCH lines after the first command: sbatch never reads them
    first_command_line: Optional[int]
    overridden: Tuple[Tuple[Directive, Directive], ...]  # (the script's directive, the environment's)
    variables: Mapping[str, Var]
    steps: Tuple[Step, ...]
    helpers: Tuple[Tuple[int, str], ...]  # sruns that run something else (hostname, nvidia-smi, ...)
    unread: Tuple[Tuple[int, str], ...]  # what was not read, and why
    written_files: Mapping[str, int]  # files the script writes (heredocs, > FILE, tee FILE), by line
    sourced: Tuple[str, ...] = ()  # files it sources (their variables are not read)
    heredocs: Mapping[str, Heredoc] = field(default_factory=dict)  # what those files hold, by name
    refused: Tuple[Tuple[int, str], ...] = ()  # why sbatch refuses the file, by line (it still reads as far as it can)
    interpreter: str = "bash"  # the #! line's program
    stopped: Optional[int] = None  # the line past which the script was not read (too large or too deep to follow)

    def named_configs(self) -> List[Tuple[str, str, Heredoc]]:
        """The config files the launch names that this script writes from a heredoc: (what reads it, "accelerate"
        or "deepspeed"; the option that names it; the heredoc)."""
        if self.main is None:
            return []
        command, found = self.main.command, []
        named = [("accelerate", "--config_file", command.get("config_file") if command.launcher == "accelerate"
                  else None), ("deepspeed", "--deepspeed_config_file", command.get("deepspeed_config_file"))]
        named += [("deepspeed", option, value) for option, value in deepspeed_files_named(command)]
        for reader, option, value in named:
            heredoc = self.written(value)
            if heredoc is not None and all(heredoc is not h for _, _, h in found):
                found.append((reader, option, heredoc))
        return found

    def written(self, named: Optional[str]) -> Optional[Heredoc]:
        """The heredoc that writes the file a launch names (as it names it: `./ds.json` and `ds.json` alike)."""
        if not isinstance(named, str):
            return None
        key = os.path.normpath(named)
        return next((h for name, h in self.heredocs.items() if os.path.normpath(name) == key), None)

    def writes(self, named: str) -> bool:
        """Whether the script writes (or may write) the file a launch names before it runs."""
        key = os.path.normpath(named)
        return any(os.path.normpath(name) == key or os.path.basename(name) == os.path.basename(key)
                   for name in self.written_files)

    def resolve(self, step: "Step", named: str) -> Optional[str]:
        """A path a launch names, as this machine would find it where the step runs (its folder: `#SBATCH --chdir`,
        `cd`, or the one sbatch is run from); None where that is not known here (the folder, or the text, is known
        only at run time, or the step runs in a container image)."""
        if not named or "$" in named or "`" in named or step.container is not None:
            return None
        if os.path.isabs(named):
            return named
        return None if step.workdir is None else os.path.normpath(os.path.join(step.workdir, named))

    def missing(self, step: "Step", named: str) -> Optional[bool]:
        """Whether a file the launch names is proven missing where it runs: not here, not written by the script, and
        the launch's own script is here (so this is the machine and folder the job runs from); None: not known."""
        path = self.resolve(step, named)
        if path is None or self.writes(named):
            return None
        if os.path.exists(path):
            return False
        script = step.command.script
        here = self.resolve(step, script) if script and step.command.launcher != "other" else None
        return True if here is not None and os.path.isfile(here) and not step.command.flag("module") else None

    @property
    def allocation(self) -> Allocation:
        return allocation(self.directives)

    @property
    def main(self) -> Optional[Step]:
        """The step that starts the training: the first that runs a launcher (srun's before the batch step's), else
        the first that runs a Python script (srun's first: a `python prep.py` in the batch step is a helper where an
        srun starts the job). None where the script was not read whole: the launch may be in what was not read."""
        if self.stopped is not None:
            return None
        for launchers in (LAUNCHERS[:-1], LAUNCHERS[-1:]):
            for in_srun in (True, False):
                found = next((s for s in self.steps if s.command.launcher in launchers and
                              (s.starter is not None) == in_srun), None)
                if found is not None:
                    return found
        return None

    def where(self, line: int) -> str:
        return f"{self.path}:{line}" if line else self.path


def deepspeed_files_named(command: launchcmd.LaunchCommand) -> List[Tuple[str, str]]:
    """The DeepSpeed JSON the launch gives the training script: (option, file) of --deepspeed FILE (the HF
    Trainer's, transformers TrainingArguments.deepspeed) and --deepspeed_config FILE (DeepSpeed's own,
    deepspeed.add_config_arguments)."""
    args, found = list(command.script_args), []
    for k, word in enumerate(args):
        name, eq, value = word.partition("=")
        if name in ("--deepspeed", "--deepspeed_config"):
            path = value if eq else (args[k + 1] if k + 1 < len(args) else "")
            if path and not path.startswith("-"):
                found.append((name, path))
    return found


def _count(value: Optional[str]) -> Optional[int]:
    return int(value) if isinstance(value, str) and re.fullmatch(r"\d{1,6}", value.strip()) else None


def allocation(directives: Mapping[str, Directive]) -> Allocation:
    def get(name):
        d = directives.get(name)
        return d.value if d is not None else None

    nodes_text = get("nodes")
    nodes = _count(nodes_text)
    if nodes_text is not None and "-" in nodes_text:  # min-max: SLURM picks
        low, _, high = nodes_text.partition("-")
        nodes = _count(low) if low == high else None
    ntasks = _count(get("ntasks"))
    per_node = _count(get("ntasks-per-node"))
    if nodes_text is None and directives.get("nodes") is None and "nodelist" not in directives:
        nodes = 1 if ntasks is None or per_node is None else max(1, ntasks // max(per_node, 1))
    if per_node is None and ntasks is not None and nodes:
        per_node = ntasks // nodes if ntasks % nodes == 0 else None
    elif per_node is None and ntasks is None:
        per_node = 1  # one task per node, sbatch's default
    gpus = _count(get("gpus").split(":")[-1]) if get("gpus") else None
    per_gpu_node = gpu_count(get("gpus-per-node")) if get("gpus-per-node") else gpu_count(get("gres"))
    if per_gpu_node is None and gpus is not None and nodes:
        per_gpu_node = gpus // nodes if gpus % nodes == 0 else None
    per_task = gpu_count(get("gpus-per-task")) if get("gpus-per-task") else None
    if per_gpu_node is None and per_task is not None and per_node is not None:
        per_gpu_node = per_task * per_node
    return Allocation(nodes, nodes_text, ntasks, per_node, per_gpu_node, per_task, gpus)


def load(path: str, environ: Optional[Mapping[str, str]] = None) -> BatchScript:
    """Read a batch script as sbatch and the shell will. Bad input (missing, not a regular file, too large,
    binary, not a batch script at all) raises InputError naming the file."""
    if not path:
        raise InputError("--sbatch", "the batch script path is empty")
    text = read_regular(path, "batch script", MAX_BYTES)
    if not text.startswith("#!") and not re.search(r"^#(SBATCH|SLURM)", text, re.M):
        raise InputError(path, "does not look like a batch script: the first line must start with #! followed by "
                               "the interpreter, as sbatch requires", 1)
    return parse(path, text, os.environ if environ is None else environ)


def parse(path: str, text: str, environ: Mapping[str, str]) -> BatchScript:
    refused = []
    if not text.startswith("#!"):
        refused.append((1, "the first line does not start with #! and an interpreter: sbatch refuses the script "
                           "('This does not look like a batch script')"))
    if "\r\n" in text:
        line = text[:text.index("\r\n")].count("\n") + 1
        refused.append((line, "DOS line breaks (\\r\\n): sbatch refuses the script ('Batch script contains DOS line "
                              "breaks')"))
        text = text.replace("\r\n", "\n")
    if "\r" in text and text.count("\r") > text.count("\n"):  # old Mac line breaks: one line to the kernel
        refused.append((1, "line breaks of \\r alone: the whole file is one line to sbatch and to the kernel, so no "
                           "#SBATCH line is read and the #! line names no program that exists"))
        text = text.replace("\r", "\n")
    directives: Dict[str, Directive] = {}
    literal, ignored, after = [], [], {}  # after: #SBATCH lines after the first command, by line
    first_command = None
    for number, raw in enumerate(text.split("\n"), 1):
        tag = "#SBATCH" if raw.startswith("#SBATCH") else "#SLURM" if raw.startswith("#SLURM") else None
        if tag is None:
            if first_command is None and raw.strip() and not raw.lstrip().startswith("#"):
                first_command = number
            continue
        if first_command is not None and len(after) >= MAX_IGNORED:
            continue  # as many as a report needs to say it
        found, _ = options(directive_words(raw[len(tag):]), SBATCH_SHORT, SBATCH_SHORT_FLAGS, stop_at_word=False)
        for option, value in found.items():
            d = Directive(option, value, number, raw.strip())
            if first_command is not None:
                after.setdefault(number, []).append(d)
                continue
            if value is not None and ("$" in value or "`" in value) and len(literal) < MAX_IGNORED:
                literal.append(d)
            directives[option] = d
    overridden = []
    for name, option in SBATCH_ENV.items():
        if name in environ:
            d = Directive(option, environ[name], 0, f"{name}={environ[name]}", name)
            if option in directives and directives[option].value != d.value:
                overridden.append((directives[option], d))
            directives[option] = d
    interpreter = _interpreter(text.split("\n", 1)[0]) if text.startswith("#!") else "bash"
    reader = _Reader(path, directives, environ)

    def sort_out(tree, end: int) -> bool:  # a heredoc's #SBATCH lines are its text (a child job's), not ignored
        for number in [n for n in after if n < end]:
            found = after.pop(number)
            if shell.is_comment(tree, number):
                ignored.extend(found)
        return bool(after)

    if interpreter in SHELLS:
        reader.read(text, reader.batch, visit=sort_out)
        reader.finish()
    else:
        reader.note(1, f"the script runs under {interpreter}, not a shell: its commands are not read")
        ignored += [d for found in after.values() for d in found]
    return BatchScript(path, directives, tuple(literal), tuple(ignored), first_command, tuple(overridden),
                       reader.batch.vars, tuple(reader.steps), tuple(reader.helpers),
                       tuple(reader.notes[:MAX_NOTES]), dict(reader.written), tuple(reader.sourced),
                       reader.heredocs, tuple(refused), interpreter, reader.stopped)


def _interpreter(first_line: str) -> str:
    """The program a `#!` line runs (its options aside: `#!/bin/bash -l`); through env, the first word env does not
    take itself (`#!/usr/bin/env -S bash -e`)."""
    words = first_line[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words, rest = [], words[1:]
        while rest:
            word = rest.pop(0)
            if word in ("-u", "--unset", "-C", "--chdir"):  # an option with a value
                rest = rest[1:]
            elif not word.startswith("-") and "=" not in word:
                words.append(word)
                break
    return os.path.basename(words[0]) if words else "sh"


def slurm_values(directives: Mapping[str, Directive], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Var]:
    """The allocation's variables SLURM sets in the batch step that the directives tell (sbatch(1), OUTPUT
    ENVIRONMENT VARIABLES); inside the allocation (SLURM_JOB_ID set), the environment's own: what the script's
    $SLURM_NNODES will be, whatever the directives ask (sbatch's command line and SBATCH_* override them)."""
    alloc = allocation(directives)
    known = {}
    if alloc.nodes is not None:
        for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            known[name] = str(alloc.nodes)
    if alloc.tasks_per_node is not None and "ntasks-per-node" in directives:
        known["SLURM_NTASKS_PER_NODE"] = str(alloc.tasks_per_node)
    if alloc.nodes is not None and alloc.tasks_per_node is not None:
        for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
            known[name] = str(alloc.ntasks or alloc.nodes * alloc.tasks_per_node)
    if alloc.gpus_per_node is not None:
        known["SLURM_GPUS_ON_NODE"] = str(alloc.gpus_per_node)
    if "gpus-per-node" in directives and alloc.gpus_per_node is not None:
        known["SLURM_GPUS_PER_NODE"] = str(alloc.gpus_per_node)
    found = {k: Var((v,), 0, True, f"from the directives ({k})") for k, v in known.items()}
    if environ and environ.get("SLURM_JOB_ID"):
        for name in SLURM_COUNTS:
            found.pop(name, None)
            if name in environ:
                found[name] = Var((environ[name],), 0, True, f"${name} of this allocation")
    return found


# The batch step's variables that slurm_values tells.
SLURM_COUNTS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS",
                "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")


class _Reader(Walker):
    """The script's commands in order: sruns and launchers, the files it writes, what it sources."""

    def __init__(self, path: str, directives: Mapping[str, Directive], environ: Mapping[str, str]):
        super().__init__()
        self.path = path
        self.batch = Scope("batch", environ, slurm_values(directives, environ))
        self.batch.per_task = PER_TASK
        chdir = directives.get("chdir")
        self.batch.cwd = chdir.value if chdir is not None and chdir.value and "$" not in chdir.value else \
            "." if chdir is None else None
        self.steps: List[Step] = []
        self.helpers: List[Tuple[int, str]] = []
        self.heredocs: Dict[str, Heredoc] = {}
        self.written: Dict[str, int] = {}
        self.sourced: List[str] = []
        self.skipped = 0
        self.task: Optional[Tuple[Simple, Dict[str, str], Optional[str], Optional[str]]] = None  # (srun, ...)
        self.task_case: Optional[str] = None
        self.step_scripts = 0

    def finish(self) -> None:
        for name, body in self.functions.items():
            if name not in self.ever_called and re.search(r"\b(srun|accelerate|torchrun|deepspeed)\b",
                                                          shell.text_of(body)):
                self.note(shell.line_of(body), f"function {name} is defined but never called: the launch in it "
                                               "does not run")
        if self.skipped:
            self.note(0, f"{self.skipped} more launch lines after the first {MAX_STEPS}: not read")

    def case(self, node, scope: Scope) -> None:
        value = node.child_by_field_name("value")
        word = self.one(value, scope) if value is not None else Field(())
        if scope.level == "task" and (word.sources("task") or word.sources("host")):
            self.task_case = shell.text_of(value)  # each task takes its own branch
        super().case(node, scope)

    def command(self, cmd: Simple) -> None:
        if cmd.head() in ("srun", "exec", "time", "nohup") and self.task is None and \
                len(self.steps) + len(self.helpers) >= MAX_STEPS and "srun" in shell.text_of(cmd.node):
            self.skipped += 1  # an srun past the lines read: not even expanded
            return
        words = cmd.fields
        while words and words[0].text in ("exec", "time", "nohup", "command", "builtin", "then", "do", "!"):
            words = words[1:]
        if not words:
            return
        program = os.path.basename(words[0].text)
        for target in self.targets(cmd):  # `scontrol show hostnames ... > hostfile`: there when the launch runs
            self.written.setdefault(target.text, cmd.line)
        if program == "tee":
            for f in words[1:]:
                if not f.text.startswith("-"):
                    self.written.setdefault(f.text, cmd.line)
        heredoc = self.heredoc(cmd)
        if heredoc is not None and program in ("cat", "tee"):
            return self.heredoc_file(cmd, heredoc, words)
        if cmd.in_substitution:
            if program == "srun":
                task = self.srun_words(words[1:])[2]
                self.helper(cmd.line, task)
            return
        if heredoc is not None and program in SHELLS + ("srun", "python", "python3"):
            self.note(cmd.line, f"{program} runs a heredoc script here: its commands are not read")
            return
        if program in ("source", ".") and len(words) > 1:
            self.note(cmd.line, f"sources {words[1].text}: the variables it sets are not read")
            self.sourced.append(words[1].text)
            return
        if program == "eval":
            self.note(cmd.line, "eval: the command it builds at run time is not read")
            return
        if program == "srun" and self.task is None:  # (past MAX_STEPS it was skipped above, unexpanded)
            return self.srun(cmd, words[1:])
        starter = program if program in STARTERS and self.task is None else None
        if starter is not None:  # mpirun's options are many (-mca takes two words): the program is the first we know
            k = next((k for k, f in enumerate(words[1:], 1) if _a_program(f.text)), None)
            words = words[k:] if k is not None else []
        self.run(cmd, words, starter)

    def run(self, cmd: Simple, words: List[Field], starter: Optional[str]) -> None:
        """What a task (or the batch step) runs: a launcher becomes a step; a shell string or script is read."""
        words, image = self.unwrap(words)
        if not words:
            return
        program = os.path.basename(words[0].text)
        if program in SHELLS:
            k = next((k for k, f in enumerate(words[1:], 1) if not f.text.startswith("-") or "c" in f.text[1:]),
                     None)
            if k is not None and words[k].text.startswith("-") and "c" in words[k].text and k + 1 < len(words):
                return self.task_shell(cmd, self.handed_on(words[k + 1].parts), starter, image)
            if k is not None:
                return self.step_script(cmd, words[k], starter, image)
            return
        if program.endswith(".sh") and words[0].known:
            return self.step_script(cmd, words[0], starter, image)
        launcher, at = launchcmd.launcher_of([f.text for f in words])
        if launcher == "python" and any(f.text.startswith("-c") for f in words[1:at + 1]):
            launcher = "other"  # `python -c CODE`: a helper (the training runs a script or a module)
        if launcher in LAUNCHERS:
            self.add_step(cmd, words, starter, image)
        elif starter is not None or self.task is not None:
            self.helper(cmd.line, words)

    def srun_words(self, words: List[Field]):
        """(srun's options, the run-time words among them, what each task runs). srun's getopt stops at the first
        word that is not an option: the task's program."""
        texts, hidden, i = [], [], 0
        while i < len(words):
            f, text = words[i], words[i].text
            if _opens_unknown(f):  # `srun $SRUN_ARGS torchrun`: options srun reads at run time
                hidden.append(shell.short(text))
                i += 1
                continue
            if text == "--" or not text.startswith("-") or text == "-":
                break
            name = ALIASES.get(text[2:].partition("=")[0], text[2:].partition("=")[0]) if text.startswith("--") \
                else None
            takes = (name not in SRUN_FLAGS and name not in SRUN_OPTIONAL and "=" not in text) if name is not None \
                else (text[:2] in SRUN_SHORT and len(text) == 2)
            texts += [w.text for w in words[i:i + 1 + takes]]
            i += 1 + takes
        found, _ = options(texts, SRUN_SHORT, SRUN_SHORT_FLAGS, SRUN_FLAGS, SRUN_OPTIONAL)
        task = words[i + 1:] if i < len(words) and words[i].text == "--" else words[i:]
        return {n: (v if v is not None else "") for n, v in found.items()}, tuple(hidden), task

    def srun(self, cmd: Simple, words: List[Field]) -> None:
        opts, hidden, task = self.srun_words(words)
        if not task:
            self.note(cmd.line, "srun with no command read")
            return
        scope = self.task_scope(cmd, opts)
        image = opts.get("container-image") or opts.get("container-name")
        self.task, self.task_case = (cmd, opts, image, hidden), None
        before = len(self.steps)
        try:
            task_cmd = replace(cmd, scope=scope)
            self.run(task_cmd, task, "srun")
        finally:
            self.task = None
        found = self.steps[before:]
        if len(found) > 1 and self.task_case is not None:  # `case $SLURM_NODEID in 0) ...;; *) ...;; esac`
            self.steps[before:] = [replace(found[0], chosen_by=self.task_case, alternatives=tuple(found[1:]))]

    def task_scope(self, cmd: Simple, opts: Mapping[str, str]) -> Scope:
        """What each task's shell knows: what the batch step exports (srun --export=ALL, the default), what
        --export and VAR=value before srun add, and SLURM's per-task variables (srun(1), --export)."""
        export = opts.get("export", "ALL")
        listed = [e for e in export.split(",") if e not in ("ALL", "NONE", "NIL", "")]
        keep_all = export.split(",")[0] == "ALL" if export else True
        known = {n: v for n, v in self.batch.vars.items() if v.exported and keep_all and not n.isdigit()}
        self.work += len(self.batch.vars) // 64
        for item in listed:
            name, eq, value = item.partition("=")
            if eq:
                known[name] = Var((value,), cmd.line, True, item)
            elif name in self.batch.vars and self.batch.vars[name].exported:
                known[name] = self.batch.vars[name]
        known.update(cmd.env)
        scope = Scope("task", self.batch.environ, known)
        scope.unexported = frozenset(n for n, v in self.batch.vars.items() if n not in known)
        scope.per_task, scope.sourced, scope.cwd = PER_TASK, self.batch.sourced, cmd.scope.cwd
        return scope

    def task_shell(self, cmd: Simple, text: str, starter: Optional[str], image: Optional[str]) -> None:
        """`bash -c STRING` in each task: the string (what the batch step left of it) read by the task's shell."""
        scope = cmd.scope if cmd.scope.level == "task" else self.task_scope(cmd, {})
        outer = self.task
        self.task = outer or (cmd, {}, image, ())
        before = len(self.steps)
        try:
            self._read_in_task(text, cmd, scope)
        finally:
            self.task = outer
        for k in range(before, len(self.steps)):
            self.steps[k] = replace(self.steps[k], in_task_shell=True, line=cmd.line)
        if len(self.steps) == before and outer is not None:
            self.note(cmd.line, "the task's shell string runs no launcher read here")

    def step_script(self, cmd: Simple, word: Field, starter: Optional[str], image: Optional[str]) -> None:
        """`srun step.sh` (or `srun bash step.sh`): the script each task runs, read when it is here."""
        path = word.text
        base = cmd.scope.cwd
        if word.known and base is not None and not os.path.isabs(path):
            path = os.path.join(base, path)  # sbatch runs the script where it is submitted (or --chdir)
        here = word.known and image is None and os.path.isfile(path)
        if not here or self.step_scripts >= MAX_STEP_SCRIPTS:
            why = "inside its container" if image else "not a file here" if not here else f"past {MAX_STEP_SCRIPTS} read"
            self.note(cmd.line, f"each task runs {shell.short(word.text)}: what it launches is not read ({why})")
            if self.task is not None or starter is not None:
                self.add_step(cmd, [word], starter, image, in_task_shell=True)
            return
        self.step_scripts += 1
        try:
            text = read_regular(path, "step script", MAX_BYTES)
        except InputError as exc:
            self.note(cmd.line, str(exc))
            return
        scope = cmd.scope if cmd.scope.level == "task" else self.task_scope(cmd, {})
        before = len(self.steps)
        self._read_in_task(text, cmd, scope)
        for k in range(before, len(self.steps)):
            self.steps[k] = replace(self.steps[k], in_task_shell=True, line=cmd.line)

    def _read_in_task(self, text: str, cmd: Simple, scope: Scope) -> None:
        loops, conditionals = self.loops, self.conditionals
        self.loops, self.conditionals = int(cmd.loop), int(cmd.conditional)
        try:
            self.read(text, scope, cmd.background)
        finally:
            self.loops, self.conditionals = loops, conditionals

    def unwrap(self, words: List[Field]) -> Tuple[List[Field], Optional[str]]:
        """The program the words run, past wrappers (env, numactl, uv run, apptainer exec IMAGE, ...): (its words,
        the container image they run in, if any)."""
        image = None
        for _ in range(8):
            if not words:
                break
            program = os.path.basename(words[0].text)
            if program not in WRAPPERS:
                break
            takes_value = WRAPPERS[program].split()
            k = 1
            if program in SUBCOMMANDS:
                if len(words) < 2 or words[1].text not in SUBCOMMANDS[program]:
                    break
                k = 2
            while k < len(words) and (words[k].text.startswith("-") or program == "env" and "=" in words[k].text
                                      or program == "taskset" and k == 1 or program == "chrt" and k == 1):
                k += 1 + (words[k].text in takes_value and "=" not in words[k].text)
            if program in IMAGE_FIRST and k < len(words):
                image, k = words[k].text, k + 1
            words = words[k:]
        return words, image

    def helper(self, line: int, words: List[Field]) -> None:
        """An srun (or a task) that runs something else than the training: hostname, nvidia-smi, a prep script."""
        if len(self.steps) + len(self.helpers) >= MAX_STEPS:
            self.skipped += 1
            return
        self.helpers.append((line, shell.short(" ".join(f.text for f in words[:32]), 120)))

    def add_step(self, cmd: Simple, words: List[Field], starter: Optional[str], image: Optional[str],
                 in_task_shell: bool = False) -> None:
        if len(self.steps) + len(self.helpers) >= MAX_STEPS:
            self.skipped += 1
            return
        srun_opts, srun_hidden = {}, ()
        if self.task is not None:
            _, srun_opts, outer_image, srun_hidden = self.task
            starter, image = starter or "srun", image or outer_image
        kept, hidden = _without_hidden(words)
        if cmd.damaged:  # a line tree-sitter-bash cannot read as bash does: what it holds may be cut
            hidden += ("(its line, not read whole)",)
            self.note(cmd.line, "the launch line is not read whole (its shell syntax is beyond the grammar used "
                                "here): an option not seen may still be there")
        command = launchcmd.parse([f.text for f in kept])
        text = shell.text_of(cmd.node) if cmd.node is not None else ""
        scope = self.task_scope(cmd, srun_opts) if starter == "srun" and cmd.scope.level != "task" else cmd.scope
        self.steps.append(Step(cmd.line, " ".join(text.split()), srun_opts if starter == "srun" else None, command,
                               tuple(rendered(f) for f in kept), in_task_shell or cmd.scope.level == "task",
                               cmd.loop, cmd.conditional, cmd.background, hidden=hidden, srun_hidden=srun_hidden,
                               starter=starter, container=image, workdir=cmd.scope.cwd,
                               env=exported(scope), env_at_run_time=exported_at_run_time(scope)))

    def heredoc_file(self, cmd: Simple, heredoc, words: List[Field]) -> None:
        """`cat > FILE <<EOF` (or `tee FILE <<EOF`): the file as it will hold it."""
        body, body_line, quoted = heredoc
        names = [t.text for t in self.targets(cmd)] + [f.text for f in words[1:] if words[0].text == "tee"
                                                       and not f.text.startswith("-")]
        runtime = tuple(dict.fromkeys(u.why or u.written for u in body.unknowns() if u.shown is None))
        for name in names:
            self.heredocs[name] = Heredoc(name, cmd.line, body_line, body.text, () if quoted else runtime,
                                          tuple(body.sources("unset")))


def _without_hidden(words: List[Field]) -> Tuple[List[Field], Tuple[str, ...]]:
    """The launcher's words without the run-time ones that stand among its options before a known word
    (`torchrun $ARGS train.py`): they may be options, or nothing, and argparse would take them for the script. An
    option's value stays, and so does a run-time word last (it may be the script itself)."""
    launcher, i = launchcmd.launcher_of([f.text for f in words])
    if launcher not in launchcmd.MULTI_LAUNCHERS:  # python's first word is the script
        return words, ()
    flags, kept, hidden = launchcmd.FLAGS[launcher], list(words[:i]), []
    while i < len(words):
        f = words[i]
        if _opens_unknown(f):
            after = next((g for g in words[i + 1:] if not _opens_unknown(g)), None)
            if after is None or not (launchcmd.known_option(launcher, after.text) or after.text.endswith(".py")):
                break  # the script itself, or the script's arguments after it
            hidden.append(shell.short(f.text))
            i += 1
            continue
        if f.text == "--" or not f.text.startswith("-"):
            break
        width = 1 if "=" in f.text or launchcmd.canonical(f.text) in flags else 2
        kept += words[i:i + width]
        i += width
    return kept + list(words[i:]), tuple(hidden)


def _a_program(word: str) -> bool:
    name = os.path.basename(word)
    return launchcmd.launcher_of([word])[0] != "other" or name in SHELLS or name.endswith(".sh") or \
        name in WRAPPERS or name in ("accelerate", "python", "python3")


def _opens_unknown(f: Field) -> bool:
    """A word that may be several words, or none, and starts with what only the run tells (`$ARGS`, not
    `--rdzv_id=$RANDOM`, which is that option whatever its value)."""
    return f.spread and bool(f.parts) and isinstance(f.parts[0], Unknown) and f.parts[0].shown is None
