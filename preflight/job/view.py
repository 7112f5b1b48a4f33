"""The job as each node will launch it: that node's own accelerate config and DeepSpeed JSON, with the
launch command's flags over them (as `accelerate launch`, torchrun and DeepSpeed's runner merge them).

The collector reads, on every node, the files that node's launch would read (preflight.node.launchfiles.facts);
here, on this machine, they are parsed and merged into one effective launch per node, a plain dict that
the JOB checks compare and the reports show as the launch plan. No I/O here: facts in, dicts out.
"""
from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from preflight.inputs import allocation, launchcmd
from preflight.inputs.launchcmd import DEFAULT_PORT
from preflight.inputs.documents import (Document, InputError, parse_deepspeed, parse_json, parse_yaml, shorten,
                                       syntax_by_name)
from preflight.inputs.configs import (DEEPSPEED_HOSTFILE_LINE, accelerate_launcher, deepspeed_runner,
                                      text_number_stops_launch)
from preflight.inputs.numbers import flag_int, is_int, is_numeric_string, text_number
from preflight.inputs.settings import job_variables
from preflight.job.nccl import socket_interface
from preflight.node.launchfiles import expand
from preflight.node.ncclconf import FILE_VARIABLES

DEEPSPEED_HOSTFILE = "/job/hostfile"  # DeepSpeed's runner reads this one when none is named
CONFIG_TEXT_LIMIT = 256 * 1024  # a config's text past this is not parsed (PyYAML takes seconds a megabyte)
JOB_READ_S = 5.0  # a node's digests of the command's files stop here: the rest is said to be unread
UNEXPANDED = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*")
# Keys of an accelerate config that differ per node by design (each node's rank, its own GPUs), and keys
# that `accelerate launch` never takes from the file (their flags' defaults are not None: launch.py).
PER_NODE_KEYS = frozenset({"machine_rank", "gpu_ids", "main_training_function"})
NOT_READ_KEYS = frozenset({"rdzv_backend", "same_network"})
# Fields of the effective launch that must be the same on every node, with their names in the plan.
MUST_MATCH = ("main_ip", "main_port", "num_machines", "world_size", "distributed_type", "mixed_precision",
              "zero_stage", "gradient_accumulation_steps", "rdzv_backend")
# Left out of a config's settings digest too: the head's name, compared by where it reaches on each node (main_ip).
NOT_DIGESTED_KEYS = PER_NODE_KEYS | NOT_READ_KEYS | {"main_process_ip"}
# Script arguments that name a DeepSpeed config: transformers' TrainingArguments.deepspeed, and deepspeed's own
# --deepspeed_config (deepspeed/__init__.py, add_config_arguments).
DEEPSPEED_ARGUMENTS = ("--deepspeed", "--deepspeed_config")
# The program each of DeepSpeed's multinode launchers needs on the head, by name on its PATH: the runner stops
# with "launcher '...' not installed" without it (deepspeed/launcher/multinode_runner.py, each backend_exists).
RUNNER_BACKENDS = {"pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun", "mvapich": "mpiname",
                   "slurm": "sinfo"}


def step_allocation(plan, environ: Optional[Mapping[str, str]] = None) -> Optional[allocation.Allocation]:
    """The SLURM allocation the job's steps run in, when the nodes are reached from inside it and their
    sessions expand the command: theirs are SSH sessions or one-node helper steps, not the training step,
    so a SLURM step variable in the command is the step's (allocation.step_variables), filled in here."""
    if not (plan.remote and plan.expand_vars and plan.command):
        return None
    try:
        return allocation.read(os.environ if environ is None else environ)
    except InputError:  # a node list not read: the sessions' own values stand
        return None


def request(plan, environ: Optional[Mapping[str, str]] = None) -> dict:
    """What the collector reads on each node for the job (preflight.node.launchfiles.facts' argument).
    `environ`: this process's environment (default os.environ), where a SLURM allocation is read."""
    cmd = launchcmd.parse(plan.command) if plan.command else None
    accelerate = cmd is None or cmd.launcher == "accelerate"
    # `accelerate launch` reads its --config_file, else each node's default: --config is for no command only.
    config = plan.config_path if cmd is None else None
    if cmd is not None and cmd.launcher == "accelerate" and isinstance(cmd.get("config_file"), str):
        config = cmd.get("config_file")
    files = list(cmd.files) if cmd is not None else []
    text = [v for k, v in (cmd.options.items() if cmd else ()) if k in launchcmd.FILE_OPTIONS and isinstance(v, str)]
    text += [name for name in settings_files(cmd) if name not in text]
    if plan.deepspeed_path:
        files.append(plan.deepspeed_path)
        text.append(plan.deepspeed_path)
    if cmd is not None and cmd.launcher == "deepspeed" and not cmd.get("hostfile"):
        files.append(DEEPSPEED_HOSTFILE)
        text.append(DEEPSPEED_HOSTFILE)
    programs = ["python3"]
    if cmd is not None and cmd.from_program:
        programs.insert(0, cmd.from_program[0])
    if cmd is not None and cmd.launcher in ("accelerate", "deepspeed"):  # what they may run by name (launch())
        programs += ["deepspeed", *dict.fromkeys(RUNNER_BACKENDS.values())]
    return {"cwd": plan.workdir or os.getcwd(), "argv": list(plan.command), "config": config,
            "default_config": accelerate and not (cmd is not None and cmd.flag("cpu")),
            "files": list(dict.fromkeys(f for f in files if f)), "text": text, "programs": programs,
            "expand": plan.expand_vars, "env": dict(cmd.env) if cmd is not None else {}, "nccl": nccl_request(plan),
            "deadline_s": JOB_READ_S, "resolve": head_names(cmd),
            "keep": list(allocation.STEP_VARIABLES) if step_allocation(plan, environ) else [],
            # the checkpoint the job resumes from, as each node sees it (CKPT005)
            "resume": {"path": plan.resume_from, "universal": plan.load_universal,
                       "digest": (plan.resume or {}).get("digest")} if plan.resume_from else None}


def nccl_request(plan) -> dict:
    """The variables that decide which of NCCL's configuration files the job reads (NCCL_CONF_FILE, HOME) as its
    batch script or manifest sets them, for the node to read those files (preflight.node.ncclconf.section): "env"
    the values known here, "later" those set when the job runs (as written: not read, said so)."""
    known, later = job_variables(plan)
    return {"env": {k: known[k] for k in FILE_VARIABLES if k in known},
            "later": {k: later[k][:200] for k in FILE_VARIABLES if k in later}}


def head_names(cmd: Optional[launchcmd.LaunchCommand]) -> List[str]:
    """The names of the head the command gives (each node resolves them as its launcher would; the one in a
    node's own config, the node finds itself: preflight.node.launchfiles.facts)."""
    if cmd is None:
        return []
    names = [cmd.get("main_process_ip"), cmd.get("master_addr"), _endpoint(cmd.get("rdzv_endpoint"))[0]]
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n]


def _endpoint(endpoint: Any) -> Tuple[Optional[str], str]:
    """torchrun's --rdzv_endpoint as (host, port text); torch's get_rdzv_endpoint: "host", "host:port", "[::1]:port"."""
    if not isinstance(endpoint, str) or not endpoint:
        return None, ""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:  # no port ("host", "[::1]")
        host, port = endpoint, ""
    return host.strip("[]") or endpoint, port


def settings_files(cmd: Optional[launchcmd.LaunchCommand], deepspeed_path: Optional[str] = None) -> Dict[str, str]:
    """The files of the command line that the launch reads as settings, by kind ("accelerate", "deepspeed"):
    two nodes' copies are the same when their settings are, whatever their formatting or key order."""
    kinds: Dict[str, str] = {}
    if cmd is not None and cmd.launcher == "accelerate":
        for option, kind in (("config_file", "accelerate"), ("deepspeed_config_file", "deepspeed")):
            if isinstance(cmd.get(option), str) and cmd.get(option):
                kinds[cmd.get(option)] = kind
    args = list(cmd.script_args) if cmd is not None else []
    for i, word in enumerate(args):
        option, sep, value = word.partition("=")
        value = value if sep else (args[i + 1] if i + 1 < len(args) else "")
        # deepspeed's --deepspeed is a switch: the next word is a path only when it names a file
        if option in DEEPSPEED_ARGUMENTS and value in cmd.files:
            kinds.setdefault(value, "deepspeed")
    if deepspeed_path:
        kinds.setdefault(deepspeed_path, "deepspeed")
    return kinds


@functools.lru_cache(maxsize=256)
def _parse(path: str, text: str, kind: str) -> Document:
    """A file's text as a Document (thousands of nodes usually send the same few texts: parsed once)."""
    # Each as its reader reads it, as lint does (documents.syntax_by_name, parse_deepspeed). No type validation:
    # accelerate builds its ClusterConfig from the mapping as it is; where a type matters, the effective launch
    # says so (launch()).
    if kind != "accelerate":
        return parse_deepspeed(path, text)
    what = "accelerate config"
    return parse_json(path, text, what) if syntax_by_name(path) == "json" else parse_yaml(path, text, what)


def parsed(entry: Optional[dict], kind: str) -> Tuple[Optional[Document], Optional[str]]:
    """(the Document, None) or (None, why not) for a file the collector read (or one parsed already here)."""
    if isinstance(entry, dict) and isinstance(entry.get("doc"), Document):
        return entry["doc"], None
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return None, "not read"
    if entry.get("error"):
        return None, str(entry["error"])
    if not isinstance(entry.get("text"), str):
        return None, "its text did not come back"
    if len(entry["text"]) > CONFIG_TEXT_LIMIT:
        return None, f"larger than {CONFIG_TEXT_LIMIT // 1024} KiB: not a configuration file"
    try:
        return _parse(entry["path"], entry["text"], kind), None
    except InputError as exc:
        return None, f"line {exc.line}: {exc.problem}" if exc.line else exc.problem
    except (RecursionError, ValueError) as exc:  # ValueError: an integer past Python's digit limit
        return None, "nested too deeply" if isinstance(exc, RecursionError) else f"cannot be read ({exc})"


def named_files(job: Mapping[str, Any]) -> List[str]:
    """The files a node's own accelerate config names (its DeepSpeed JSON, its hostfile), for a second
    request to that node once its config is known; those the command line names were read already."""
    if not isinstance(job.get("files"), dict):
        return []
    doc, _ = parsed(job.get("config"), "accelerate")
    if doc is None:
        return []
    section = doc.data.get("deepspeed_config")
    names = [section.get(k) for k in ("deepspeed_config_file", "deepspeed_hostfile")] if isinstance(section, dict) else []
    return [n for n in names if isinstance(n, str) and n.strip() and n not in (job.get("files") or {})]


def _file(job: Mapping[str, Any], name: str) -> Optional[dict]:
    """A file the node read for its job: named on the command line, or by its own config."""
    for group in (job.get("files"), job.get("named")):
        if isinstance(group, dict) and isinstance(group.get(name), dict):
            return group[name]
    return None


def settings_digest(data: Mapping[str, Any], leave_out=frozenset()) -> str:
    """A digest of a config's settings, leaving out the keys that differ per node by design: configs that
    differ only in machine_rank have the same one (the file's bytes would not)."""
    kept = {k: v for k, v in data.items() if k not in leave_out}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]


def as_launched(data: Mapping[str, Any]) -> Dict[str, Any]:
    """An accelerate config's settings as its launcher uses them, the form two nodes are compared by.
    accelerate/commands/config/config_args.py process_config turns the old keys into the new ones (fp16: true
    is mixed_precision fp16, a missing one is "no"; dynamo_backend moves into dynamo_config); launch.py
    _validate_launch_command then copies each value into the launch's arguments as it is, and launched() says
    what each becomes. A key whose value means "not set" (false, empty) is left out, as a missing key is."""
    data = dict(data)
    if "mixed_precision" not in data:
        data["mixed_precision"] = "fp16" if data.get("fp16") else "no"
    data.pop("fp16", None)
    if "dynamo_backend" in data:
        data["dynamo_config"] = {"dynamo_backend": data.pop("dynamo_backend")}
    values = {k: launched(k, v) for k, v in data.items()}
    return {k: v for k, v in values.items() if v is not None}


def launched(key: Any, value: Any) -> Any:
    """One value of an accelerate config as the launcher uses it (None: as good as not set)."""
    if isinstance(value, dict):
        inner = {k: launched(k, v) for k, v in value.items()}
        return {k: v for k, v in inner.items() if v is not None} or None
    if value is False or value is None or (isinstance(value, (str, list)) and not value):
        return None
    if not isinstance(value, str):
        return value
    if key == "mixed_precision":  # utils/launch.py, every prepare_*_env: PrecisionType(args.mixed_precision.lower())
        return value.lower()
    if key == "dynamo_backend":  # utils/launch.py: DynamoBackend(args.dynamo_backend.upper()); NO is no dynamo
        return None if value.upper() == "NO" else value.upper()
    if value.lower() == "true":  # truthy in `if args.x`, "true" in str(args.x).lower() (utils/launch.py): as true
        return True
    # Other values reach the launcher as text (its argv, str(args.x) in its environment): "4" and 4 alike.
    # (distributed_type is not folded: DistributedType(value) takes only its upper-case names.)
    return text_number(value)


def _short(digest: Any) -> Optional[str]:
    return digest[:8] if isinstance(digest, str) else None


class _Fields:
    """The effective values of one node's launch, each with where it came from."""

    def __init__(self, node: str):
        self.node, self.values, self.sources = node, {}, {}

    def set(self, key: str, value: Any, source: str) -> None:
        self.values[key], self.sources[key] = value, source

    def first(self, key: str, *candidates: Tuple[Any, Optional[str]], default: Any = None) -> None:
        """The first candidate that is given (flag, then file), else the launcher's default."""
        for value, source in candidates:
            if value is not None and source is not None:
                self.set(key, value, source)
                return
        self.set(key, default, "default")


def launch(node: str, job: Mapping[str, Any], command: Optional[launchcmd.LaunchCommand], gpus: int = 0,
           kinds: Optional[Mapping[str, str]] = None, unknown: Optional[Mapping[str, str]] = None) -> dict:
    """One node's effective launch: {"launcher", "started_by", field: value..., "sources": {field: where},
    "problems": [...], "files": {...}}. `command` is this node's launch command (its $VARs expanded);
    `gpus`, the GPUs the node has (accelerate picks its launcher by them when nothing else says); `kinds`,
    the command line's config files by the names the node read them under (default: settings_files(command));
    `unknown`, the variables of the command whose value is not known here, with why (step_variables)."""
    out = _Fields(node)
    problems: List[str] = []
    warnings = [f"the command cannot be read as {command.launcher} reads it: {command.problem}"] \
        if command is not None and command.problem else []
    if command is not None:
        found = _variables(command.argv)
        unset = sorted(found - set(unknown or {}))
        if unset:
            problems.append(f"{', '.join('$' + v for v in unset)} in the command {'is' if len(unset) == 1 else 'are'} "
                            "not set in this node's SSH session: the launcher would get the text itself")
        warnings += [f"${name} in the command is not known: {(unknown or {})[name]}"
                     for name in sorted(found & set(unknown or {}))]
    launcher = command.launcher if command is not None else "accelerate"
    config_entry = job.get("config")
    doc, why = parsed(config_entry, "accelerate") if config_entry else (None, "none")
    config_path = config_entry.get("path") if isinstance(config_entry, dict) else None
    if launcher == "accelerate" and doc is None and config_entry is not None:
        if not (config_entry.get("default") and why == "missing"):
            problems.append(f"accelerate config {config_path}: {why}")
    if launcher != "accelerate":
        doc = None  # torchrun and DeepSpeed's runner never read accelerate's config
    data = doc.data if doc is not None else {}
    section = data.get("deepspeed_config") if isinstance(data.get("deepspeed_config"), dict) else {}

    def flag(name: str) -> Tuple[Any, Optional[str]]:
        if command is None or name not in command.options:
            return None, None
        value = command.options[name]  # argparse gives --gpu_ids no type: '0' stays text
        return (value if name == "gpu_ids" else flag_int(value)), f"flag --{name}"

    def in_file(key: str, *inner: str) -> Tuple[Any, Optional[str]]:
        """The file's value of key, or of key's section's inner[0] (deepspeed_config, fsdp_config)."""
        holder = (data.get(key) if isinstance(data.get(key), dict) else {}) if inner else data
        name = inner[0] if inner else key
        if doc is None or name not in holder:
            return None, None
        line = doc.line(*((key, name) if inner else (key,)))
        return holder[name], f"{config_path}:{line}" if line else config_path

    def number_in_file(key: str, *inner: str) -> Tuple[Any, Optional[str]]:
        value, source = in_file(key, *inner)
        return flag_int(value), source

    ds_doc = None
    by_name: List[str] = []  # the programs the launch runs by name on this node, beside its own launcher
    if launcher == "accelerate":
        # accelerate takes int() of it: "1" in the file works
        out.first("machine_rank", flag("machine_rank"), number_in_file("machine_rank"), default=0)
        out.first("num_machines", flag("num_machines"), in_file("num_machines"), default=1)
        out.first("num_processes", flag("num_processes"), in_file("num_processes"))
        out.first("main_ip", flag("main_process_ip"), in_file("main_process_ip"))
        out.first("main_port", flag("main_process_port"), in_file("main_process_port"), default=DEFAULT_PORT)
        precision, where = in_file("mixed_precision")
        if "mixed_precision" not in data and data.get("fp16"):  # process_config's old key: fp16: true
            precision, where = "fp16", in_file("fp16")[1]
        # The file's value as every launcher reads it (utils/launch.py: .lower()); the flag's has argparse's choices.
        out.first("mixed_precision", flag("mixed_precision"),
                  (precision.lower() if isinstance(precision, str) else precision, where), default="no")
        # Not from the file: the flag's default ("static") is not None, so accelerate never copies the file's.
        out.first("rdzv_backend", flag("rdzv_backend"), default="static")
        out.first("gpu_ids", flag("gpu_ids"), in_file("gpu_ids"), default="all")
        chosen = next(((f, t) for f, t in (("use_deepspeed", "DEEPSPEED"), ("multi_gpu", "MULTI_GPU"),
                                          ("use_fsdp", "FSDP"), ("use_megatron_lm", "MEGATRON_LM"), ("tpu", "XLA"))
                       if command is not None and command.flag(f)), (None, None))
        # Without a config or a flag, accelerate turns on multi_gpu when the node has more than one GPU.
        out.first("distributed_type", (chosen[1], f"flag --{chosen[0]}" if chosen[0] else None),
                  in_file("distributed_type"), ("MULTI_GPU", f"{gpus} GPUs" if doc is None and gpus > 1 else None),
                  default="NO")
        # Which of accelerate's launchers runs (accelerate/commands/launch.py, launch_command): --cpu (the
        # flag, not use_cpu in the file) makes it the simple one, which starts one process and no rendezvous.
        cpu = command is not None and command.flag("cpu")
        dtype = out.values["distributed_type"]
        path = accelerate_launcher(dtype) if not cpu else "simple"
        out.set("accelerate_launcher", path, "flag --cpu" if cpu else out.sources["distributed_type"])
        for key, keys in (("num_machines", ("num_machines",)), ("num_processes", ("num_processes",)),
                          ("main_port", ("main_process_port",)), ("machine_rank", ("machine_rank",))):
            value = out.values[key]
            if not isinstance(value, str) or _variables([value]) & set(unknown or {}):
                continue  # a value not known here (a warning says so) is not judged as text
            launch_values = {"distributed_type": dtype, "cpu": cpu, "use_cpu": data.get("use_cpu"),
                             "num_cpu_threads_per_process": data.get("num_cpu_threads_per_process"),
                             "num_machines": out.values["num_machines"], "machine_rank": out.values["machine_rank"],
                             "deepspeed_config": {k: flag(k)[0] if flag(k)[1] else section.get(k) for k in
                                                  ("deepspeed_multinode_launcher", "deepspeed_exclusion_filter",
                                                   "deepspeed_inclusion_filter")}}
            stop = text_number_stops_launch(keys, value, launch_values) if is_numeric_string(value) else \
                "neither accelerate nor its launchers read it as a number"
            if stop:
                problems.append(f"{keys[0]} is the text {shorten(value)} ({out.sources[key]}): {stop}; write it as a "
                                "number")
            else:  # passed on as text to a launcher that reads it as its number
                out.set(key, flag_int(value), out.sources[key])
        deepspeed = path == "deepspeed"
        out.first("deepspeed_config_file", flag("deepspeed_config_file"),
                  in_file("deepspeed_config", "deepspeed_config_file") if deepspeed else (None, None))
        ds_name = out.values["deepspeed_config_file"]
        if isinstance(ds_name, str) and ds_name:
            ds_doc, ds_why = parsed(_file(job, ds_name), "deepspeed")
            if ds_doc is None:
                problems.append(f"DeepSpeed config {ds_name}: {ds_why}")
        if ds_doc is not None:
            stage = (ds_doc.data.get("zero_optimization") or {}).get("stage") \
                if isinstance(ds_doc.data.get("zero_optimization"), dict) else None
            where = f"{(_file(job, ds_name) or {}).get('path')}:{ds_doc.line('zero_optimization', 'stage') or 1}"
            out.set("zero_stage", stage, where if stage is not None else "default")
            accumulation = ds_doc.data.get("gradient_accumulation_steps")
            out.set("gradient_accumulation_steps", accumulation,
                    f"{(_file(job, ds_name) or {}).get('path')}:{ds_doc.line('gradient_accumulation_steps')}"
                    if accumulation is not None else "default")
        elif deepspeed:
            # As text, both reach the script in the environment and are read back with int() there.
            out.first("zero_stage", flag("zero_stage"), number_in_file("deepspeed_config", "zero_stage"))
            out.first("gradient_accumulation_steps", flag("gradient_accumulation_steps"),
                      number_in_file("deepspeed_config", "gradient_accumulation_steps"), default=1)
        else:
            out.set("zero_stage", None, "default")
            out.first("gradient_accumulation_steps", flag("gradient_accumulation_steps"), default=1)
        out.first("multinode_launcher", flag("deepspeed_multinode_launcher"),
                  in_file("deepspeed_config", "deepspeed_multinode_launcher"), default="pdsh")
        for key in ("fsdp_auto_wrap_policy", "fsdp_min_num_params"):  # a flag wins over fsdp_config's key
            out.first(key, flag(key), in_file("fsdp_config", key))
        procs, machines = out.values["num_processes"], out.values["num_machines"]
        if path in ("torchrun", "deepspeed"):  # num_processes is the total: each node starts its share
            # accelerate divides only for several machines (utils/launch.py): below that, one machine runs all
            per_node = (procs // machines if machines > 1 else procs) if is_int(procs) and is_int(machines) \
                else None
            out.set("processes", per_node, out.sources["num_processes"])
            out.set("world_size", procs, out.sources["num_processes"])
        else:  # one process per node, and no rendezvous of the launcher's own: machine_rank is not read
            out.set("processes", 1, f"accelerate's {path} launcher")
            out.set("world_size", None, f"accelerate's {path} launcher")
            out.set("rdzv_backend", "none", f"accelerate's {path} launcher")
        # nossh: every node runs DeepSpeed's runner itself with --node_rank (utils/launch.py).
        runner = deepspeed_runner(path, machines, out.values["multinode_launcher"])
        head_starts = runner == "head"
        started_by = "head" if head_starts else "self"
        if runner is not None:  # prepare_deepspeed_cmd_env: cmd = ["deepspeed", ...], found on this node's PATH
            by_name.append("deepspeed")
        if head_starts:  # accelerate passes --hostfile str(deepspeed_hostfile): "None" when it is not set
            out.first("hostfile", flag("deepspeed_hostfile"), in_file("deepspeed_config", "deepspeed_hostfile"),
                      default="None")
            out.first("host_filter", flag("deepspeed_inclusion_filter"), flag("deepspeed_exclusion_filter"),
                      in_file("deepspeed_config", "deepspeed_inclusion_filter"),
                      in_file("deepspeed_config", "deepspeed_exclusion_filter"))
    elif launcher == "torchrun":
        standalone = command.flag("standalone")
        nnodes = command.get("nnodes")
        out.first("num_machines", (1, "flag --standalone") if standalone else (None, None),
                  (_nnodes(nnodes), "flag --nnodes" if nnodes is not None else None), default=1)
        out.first("machine_rank", flag("node_rank"), default=0)
        out.first("processes", flag("nproc_per_node"), default=1)
        out.first("rdzv_backend", ("c10d", "flag --standalone") if standalone else (None, None), flag("rdzv_backend"),
                  default="static")
        if isinstance(nnodes, str) and ":" in nnodes:
            low, high = (flag_int(x) for x in nnodes.split(":", 1))
            out.set("nnodes_range", [low, high], "flag --nnodes")
        host, port = _endpoint(command.get("rdzv_endpoint"))
        if host is not None:  # torch's get_rdzv_endpoint: the endpoint wins when given
            default = DEFAULT_PORT if out.values["rdzv_backend"] == "static" else 29400  # c10d's own default
            out.set("main_ip", host, "flag --rdzv_endpoint")
            out.set("main_port", flag_int(port) if port else default, "flag --rdzv_endpoint")
        else:
            out.first("main_ip", flag("master_addr"), default="127.0.0.1")
            out.first("main_port", flag("master_port"), default=DEFAULT_PORT)
        machines, procs = out.values["num_machines"], out.values["processes"]
        world = machines * procs if is_int(machines) and is_int(procs) else None
        out.set("world_size", world, "--nnodes x --nproc-per-node")
        started_by = "self"
    elif launcher == "deepspeed":
        out.first("main_ip", flag("master_addr"))
        out.first("main_port", flag("master_port"), default=DEFAULT_PORT)
        if command.flag("no_ssh"):  # every node runs the runner itself, with its --node_rank
            started_by = "self"
            out.first("machine_rank", flag("node_rank"), default=0)
            out.first("num_machines", flag("num_nodes"))
            out.set("rdzv_backend", "static", "DeepSpeed's runner")
        else:
            started_by = "head"  # the runner on the first node starts every node (pdsh by default)
            out.first("multinode_launcher", flag("launcher"), default="pdsh")
        out.first("hostfile", flag("hostfile"), default=DEEPSPEED_HOSTFILE)
        out.first("host_filter", flag("include"), flag("exclude"), flag("num_nodes"))
    else:
        started_by = "self"
    if started_by == "head" and isinstance(out.values.get("multinode_launcher"), str):
        backend = RUNNER_BACKENDS.get(out.values["multinode_launcher"].lower())  # runner.py: args.launcher.lower()
        by_name += [backend] if backend else []
    programs = job.get("programs") if isinstance(job.get("programs"), dict) else {}
    facts = {
        # Without a command or a config, nothing says how this node launches: not compared.
        "known": command is not None or doc is not None or bool(problems),
        "launcher": launcher, "started_by": started_by, **out.values, "sources": out.sources, "problems": problems,
        "warnings": warnings,
        "config": config_path if doc is not None or (config_entry and not config_entry.get("error")) else None,
        "config_sha": settings_digest(as_launched(data), NOT_DIGESTED_KEYS) if doc is not None else None,
        "main_resolved": _resolution(job, out.values.get("main_ip")),
        "deepspeed_settings": dict(_leaves(ds_doc)) if ds_doc is not None else None,
        "deepspeed_path": (_file(job, out.values.get("deepspeed_config_file") or "") or {}).get("path") if ds_doc else None,
        "deepspeed_sha": _short((_file(job, out.values.get("deepspeed_config_file") or "") or {}).get("sha256"))
        if ds_doc is not None else None,
        "accelerate_settings": {k: (v, doc.line(k)) for k, v in as_launched(data).items()} if doc is not None else None,
        "script": command.script if command is not None else None,
        "runs": {name: _clean_program(programs.get(name)) for name in by_name},
        "hosts": _hosts(job, out.values.get("hostfile")),
        "files": {name: _clean_file(entry) for name, entry in
                  ((job.get("files") if isinstance(job.get("files"), dict) else {}).items()) if isinstance(entry, dict)},
    }
    kinds = settings_files(command) if kinds is None else kinds
    for name, kind in kinds.items():
        if name in facts["files"]:
            facts["files"][name].update(_settings_of(job, name, kind, config_path, facts["config_sha"]))
    return facts


def _settings_of(job: Mapping[str, Any], name: str, kind: str, config_path: Optional[str],
                 config_sha: Optional[str]) -> dict:
    """{"settings_sha", "settings_of"} of a config file on the command line, read as its launcher reads it
    (accelerate's less the per-node keys, as config_sha; DeepSpeed's parsed): {} when it cannot be read so."""
    entry = _file(job, name) or {}
    if kind == "accelerate":
        digest = config_sha if config_sha and entry.get("path") == config_path else None
        return {"settings_sha": digest, "settings_of": "accelerate reads it, without its per-node keys"} \
            if digest else {}
    doc, _ = parsed(entry, "deepspeed")
    return {"settings_sha": settings_digest(doc.data), "settings_of": "DeepSpeed reads it"} if doc is not None else {}


def _resolution(job: Mapping[str, Any], name: Any) -> Any:
    """What the node resolved the head's name to ([address, ...], or {"error"}); an address is itself; None when
    the node was not asked (then the name is compared as written)."""
    if not isinstance(name, str) or not name:
        return None
    try:
        return [str(ipaddress.ip_address(name.strip("[]")))]
    except ValueError:
        pass
    found = (job.get("resolved") if isinstance(job.get("resolved"), dict) else {}).get(name)
    if isinstance(found, list) and found and all(isinstance(a, str) for a in found):
        return found[:16]
    if isinstance(found, dict) and isinstance(found.get("error"), str):
        return {"error": found["error"][:200]}
    return None


def _clean_file(entry: Mapping[str, Any]) -> dict:
    """A file entry a node sent, with only the fields and types the checks read."""
    kept = {k: entry.get(k) for k in ("path", "sha256", "error") if isinstance(entry.get(k), str)}
    if isinstance(entry.get("size"), int) and not isinstance(entry.get("size"), bool):
        kept["size"] = entry["size"]
    return kept


def _leaves(doc: Document, keys: Tuple[str, ...] = ()) -> List[Tuple[str, Tuple[Any, Optional[int]]]]:
    """Every setting of a DeepSpeed config as (dotted key, (value, line)): what two nodes' files are compared by."""
    value = doc.data
    for key in keys:
        value = value[key]
    if isinstance(value, dict) and value:
        return [leaf for key in value for leaf in _leaves(doc, keys + (key,))]
    return [(".".join(map(str, keys)), (value, doc.line(*keys)))]


def _nnodes(text: Any) -> Any:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job (its maximum is what may join)."""
    if isinstance(text, str) and ":" in text:
        return flag_int(text.split(":", 1)[1])
    return flag_int(text)


def _hosts(job: Mapping[str, Any], name: Any) -> Optional[dict]:
    """The hostfile DeepSpeed's runner reads on this node: {"path", "hosts": [[host, slots]]} or {"path", "error"}."""
    if not isinstance(name, str):
        return None
    if name == "None":
        return {"path": None, "error": "no deepspeed_hostfile is set: accelerate passes `--hostfile None`, and "
                                       "DeepSpeed's runner then trains on the head alone"}
    entry = _file(job, name)
    if entry is None:
        return None
    if entry.get("error") or not isinstance(entry.get("text"), str):
        return {"path": entry.get("path"), "error": entry.get("error") or "its text did not come back"}
    hosts, problem = hostfile_hosts(entry["text"])
    if problem:
        return {"path": entry.get("path"), "error": problem}
    return {"path": entry.get("path"), "hosts": [list(h) for h in hosts]}


def hostfile_hosts(text: str) -> Tuple[List[Tuple[str, int]], Optional[str]]:
    """DeepSpeed's hostfile text as its runner reads it: ([(host, slots)], None), or ([], why it stops)."""
    found: List[Tuple[str, int]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = DEEPSPEED_HOSTFILE_LINE.search(line)
        if match is None:
            return [], f"a bad entry {line[:60]!r}: the runner stops ('Hostfile contains a bad entry')"
        if any(h == match.group(1) for h, _ in found):
            return [], f"{match.group(1)} is listed twice: the runner stops"
        found.append((match.group(1), int(match.group(2))))
    if not found:
        return [], "it is empty: the runner stops"
    return found, None


def launches(plan, facts: Mapping[str, Any], head_address: Optional[str],
             environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Every reached node's effective launch, in node order: probes["job"] for the JOB checks.
    With `preflight launch` over SSH, each node's command is the one preflight will run there (its
    rank flags inserted by preflight.gate.launcher). When the head's launcher starts every node (DeepSpeed's
    runner), the other nodes' own configs are never read: their views keep only what they run. Inside a SLURM
    allocation, each node's SLURM step variables are those of its task in the job's step (step_allocation)."""
    nodes = [n for n in plan.nodes if (facts.get(n) or {}).get("facts")]
    slurm = step_allocation(plan, environ)
    result: Dict[str, Any] = {"command": list(plan.command), "nodes": {}}
    sets_ranks = plan.sets_ranks and plan.command and launchcmd.is_accelerate_launch(plan.command)
    raw = launchcmd.parse(plan.command) if plan.command else None
    names = {"program": raw.from_program[0] if raw is not None and raw.from_program else None,
             "script": raw.script if raw is not None else None}  # the collector's keys: the words as typed
    kinds = settings_files(raw, plan.deepspeed_path)  # by the collector's keys too
    for index, node in enumerate(plan.nodes):
        if (facts.get(node) or {}).get("error") is not None:
            continue  # not reached, or stopped answering half-way: SSH001 says so, its facts are not the job's
        node_facts = (facts.get(node) or {}).get("facts")
        job = node_facts.get("job") if isinstance(node_facts, dict) else None
        if not isinstance(job, dict):
            continue
        try:
            argv = [str(a) for a in job["argv"]] if isinstance(job.get("argv"), list) else list(plan.command)
            unknown: Dict[str, str] = {}
            if slurm is not None:  # the node left the step variables to be filled in here (request's "keep")
                argv, unknown = _step_command(argv, slurm, node)
            if sets_ranks:
                argv = launchcmd.rank_command(argv, index, head_address or plan.head, plan.port, len(plan.nodes))
            result["nodes"][node] = _node_view(node, node_facts, job, argv, names, kinds, head_address, unknown)
        except Exception as exc:  # what a node sent is not to be trusted: its launch is unknown, said so
            result["nodes"][node] = {"known": True, "launcher": "other", "started_by": "self", "sources": {},
                                     "problems": [f"its job facts cannot be read ({type(exc).__name__}: {exc})"]}
    if plan.runs_here and not _rank_per_node(raw):
        for node, view in result["nodes"].items():
            if node != plan.head and "machine_rank" in view:
                view.update(machine_rank=None, own_rank=True)
                view["sources"]["machine_rank"] = "its own launch: the gate starts the head's alone"
    head = result["nodes"].get(plan.head) or {}
    if head.get("started_by") == "head":
        for node, view in result["nodes"].items():
            if node != plan.head:
                result["nodes"][node] = {k: view.get(k) for k in ("known", "launcher", "files", "script", "program",
                                                                  "python", "interface", "session_stdout")}
                result["nodes"][node].update(started_by="head", sources={}, problems=[])
    result["reached"] = nodes
    return result


def head_port(plan, facts: Mapping[str, Any]) -> Optional[int]:
    """The main port of the head's own launch (its own config, as its facts read it), or None."""
    port = (launches(plan, facts, None)["nodes"].get(plan.head) or {}).get("main_port")
    return port if isinstance(port, int) and 1 <= port <= 65535 else None


def _variables(words) -> set:
    """The names of the $VARs left in these words."""
    return {m.group(0).lstrip("${") for word in words for m in UNEXPANDED.finditer(word)}


def _step_command(argv: List[str], alloc: allocation.Allocation, node: str) -> Tuple[List[str], Dict[str, str]]:
    """The command with the SLURM step variables of the node's task in it, and those not known, with why."""
    values = allocation.step_variables(alloc, node)
    if not values:
        why = f"{node} is not a node of the allocation's srun step ({alloc.nodelist})"
    else:
        why = ("it depends on which of the node's tasks runs the command, and an srun step in this allocation starts "
               "more than one task per node (SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE)")
    known = {k: v for k, v in values.items() if v is not None}
    return [expand(word, known) for word in argv], {k: why for k in allocation.STEP_VARIABLES if k not in known}


def _rank_per_node(command: Optional[launchcmd.LaunchCommand]) -> bool:
    """Whether the command's rank (torchrun's and DeepSpeed's --node_rank) is each node's own, a `$VAR` each node
    sets: a rank written out (or the launcher's default) is the launch of the node that runs this command."""
    rank = command.get("node_rank") if command is not None else None
    return isinstance(rank, str) and UNEXPANDED.search(rank) is not None


def _node_view(node: str, node_facts: dict, job: dict, argv: List[str], names: Mapping[str, Optional[str]],
               kinds: Mapping[str, str], head_address: Optional[str], unknown: Mapping[str, str]) -> dict:
    command = launchcmd.parse(argv) if argv else None
    devices = (node_facts.get("gpus") or {}).get("devices") if isinstance(node_facts.get("gpus"), dict) else None
    view = launch(node, job, command, len(devices) if isinstance(devices, list) else 0, kinds, unknown)
    host = node_facts.get("host") if isinstance(node_facts.get("host"), dict) else {}
    if view.get("main_resolved") is None and head_address and view.get("main_ip") == head_address:
        # the head address every node was asked about (preflight launch puts it on the command)
        view["main_resolved"] = _resolution({"resolved": {head_address: host.get("head_resolves_to")}}, head_address)
    view["script"] = names["script"] if names["script"] in view["files"] else view.get("script")
    view["interface"] = socket_interface(node_facts)
    programs = job.get("programs") if isinstance(job.get("programs"), dict) else {}
    view["program"] = _clean_program(programs.get(names["program"])) if names["program"] else None
    view["python"] = _clean_program(programs.get("python3"))
    session = node_facts.get("session")
    view["session_stdout"] = session.get("stdout") if isinstance(session, dict) else None
    return view


def _clean_program(entry: Any) -> Optional[dict]:
    """A program a node resolved, with string fields only."""
    if not isinstance(entry, dict):
        return None
    return {k: entry.get(k) if isinstance(entry.get(k), str) else None for k in ("name", "path", "real", "interpreter")}


def plan_rows(job: Mapping[str, Any]) -> List[dict]:
    """The launch plan table: one row per node, the columns a user compares by hand."""
    rows = []
    for node, v in (job.get("nodes") or {}).items():
        program = v.get("program") or {}
        main = f"{v.get('main_ip') or '?'}:{v.get('main_port') or '?'}" if v.get("main_ip") or v.get("main_port") else None
        rows.append({
            "node": node, "machine_rank": "by head" if v.get("started_by") != "self" else
            "its own" if v.get("own_rank") else v.get("machine_rank"),
            "main": main, "num_machines": v.get("num_machines"), "processes": v.get("processes"),
            "world_size": v.get("world_size"), "distributed_type": v.get("distributed_type"),
            "precision": v.get("mixed_precision"), "zero_stage": v.get("zero_stage"), "config": v.get("config"),
            "config_sha": v.get("config_sha"), "deepspeed_sha": v.get("deepspeed_sha"),
            "script_sha": _short(((v.get("files") or {}).get(v.get("script") or "") or {}).get("sha256")),
            "python": program.get("interpreter") or (v.get("python") or {}).get("path"),
            "launcher": program.get("path") if program else None,
            "interface": v.get("interface").split()[0] if isinstance(v.get("interface"), str) else None,
        })
    return rows
