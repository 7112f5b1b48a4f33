"""The job's configuration: accelerate's config file, the DeepSpeed config, DeepSpeed's hostfile.

What accelerate and DeepSpeed accept is written down here, once, for the loaders (which turn a
wrong type into a one-line input error) and for the CFG checks (which find the defects).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from preflight.inputs.documents import Document, InputError, load, parse_deepspeed, read_text, shorten
from preflight.inputs.numbers import is_int, is_numeric_string, reads_as, text_number

NoneType = type(None)
AUTO = "auto"  # in a type tuple: the string "auto" is accepted (filled in by accelerate / transformers)
MAP = (dict, NoneType)
ANY = (object,)  # in a schema: every value is taken (the checks judge it)

# accelerate's ClusterConfig and BaseConfig fields (accelerate/commands/config/config_args.py).
ACCELERATE_KEYS: Dict[str, tuple] = {
    # bool too: YAML 1.1 reads an unquoted NO / no as false, a trap the CFG checks explain.
    "compute_environment": (str,),
    # Any value: accelerate converts only strings (config_args.py), and launches any other as 'NO' (CFG002, CFG003).
    "distributed_type": ANY,
    "mixed_precision": (str, bool, NoneType),
    "use_cpu": (bool,),
    "debug": ANY,  # tested for truth only (commands/launch.py)
    "num_processes": (int, NoneType),  # null: not set (launch's flags, else its own default, fill it in)
    # null is read only over several machines, where int(None) stops accelerate (CFG011)
    "machine_rank": (int, NoneType),
    "num_machines": (int, NoneType),
    "gpu_ids": (str, int, NoneType),
    "main_process_ip": (str, NoneType),
    "main_process_port": (int, str, NoneType),  # text: read only where a launch takes the port (CFG003, CFG010)
    "rdzv_backend": (str, NoneType),
    # Never copied into accelerate launch's arguments, whose flags default to False, not None (commands/launch.py),
    # or read by the TPU launchers alone: any value runs.
    "same_network": ANY,
    "main_training_function": ANY,
    "enable_cpu_affinity": ANY,
    "fp8_config": MAP,
    "deepspeed_config": MAP,
    "fsdp_config": MAP,
    "parallelism_config": MAP,
    "megatron_lm_config": MAP,
    "mpirun_config": MAP,
    "dynamo_config": MAP,
    "downcast_bf16": ANY,
    "tpu_name": ANY,
    "tpu_zone": ANY,
    "tpu_use_cluster": ANY,
    "tpu_use_sudo": ANY,
    "command_file": ANY,
    "commands": ANY,
    "tpu_vm": ANY,
    "tpu_env": ANY,
    # Old spellings that accelerate still converts on load (fp16 is tested for truth only).
    "fp16": ANY,
    "dynamo_backend": (str, bool, NoneType),  # null: accelerate then sets 'no' (commands/launch.py)
}
# SageMakerConfig replaces the cluster fields with these.
SAGEMAKER_KEYS: Dict[str, tuple] = {
    **{k: ACCELERATE_KEYS[k] for k in ("compute_environment", "distributed_type", "mixed_precision", "use_cpu",
                                       "debug", "num_machines", "gpu_ids", "dynamo_config", "enable_cpu_affinity",
                                       "fp16", "dynamo_backend")},
    "ec2_instance_type": (str,),
    "iam_role_name": (str,),
    "image_uri": (str, NoneType),
    "profile": (str, NoneType),
    "region": (str,),
    "base_job_name": (str,),
    "pytorch_version": (str,),
    "transformers_version": (str,),
    "py_version": (str,),
    "sagemaker_inputs_file": (str, NoneType),
    "sagemaker_metrics_file": (str, NoneType),
    "additional_args": MAP,
}
# Keys accelerate rejects today although older versions wrote them.
ACCELERATE_REMOVED_KEYS = {
    "ipex_config": "removed in accelerate 1.x (IPEX is enabled by itself on Intel CPUs)",
    "use_ipex": "removed in accelerate 1.x (IPEX is enabled by itself on Intel CPUs)",
    "use_mps_device": "removed in accelerate 0.2x (MPS is used by itself on Apple silicon)",
}
COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
DISTRIBUTED_TYPES = (
    "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
    "MULTI_HPU", "MULTI_NEURON", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM",
)
SAGEMAKER_DISTRIBUTED_TYPES = ("NO", "DATA_PARALLEL", "MODEL_PARALLEL")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")

# The keys of accelerate's `deepspeed_config` section (accelerate launch's DeepSpeed arguments).
ACCELERATE_DS_KEYS: Dict[str, tuple] = {
    # null: accelerate exports nothing for it, and DeepSpeedPlugin takes its default (stage 2, no file)
    "deepspeed_config_file": (str, NoneType),
    "zero_stage": (int, NoneType),
    "offload_optimizer_device": (str, NoneType),
    "offload_param_device": (str, NoneType),
    "offload_optimizer_nvme_path": (str, NoneType),
    "offload_param_nvme_path": (str, NoneType),
    "gradient_accumulation_steps": (int, AUTO, NoneType),
    "gradient_clipping": (float, NoneType, AUTO),
    "zero3_init_flag": (bool, NoneType),
    "zero3_save_16bit_model": (bool, NoneType),
    "deepspeed_hostfile": (str, NoneType),
    "deepspeed_exclusion_filter": (str, NoneType),
    "deepspeed_inclusion_filter": (str, NoneType),
    "deepspeed_multinode_launcher": (str, NoneType),
    "deepspeed_moe_layer_cls_names": (str, NoneType),
}
# Set beside deepspeed_config_file, these make accelerate raise a ValueError when the script starts
# (DeepSpeedPlugin._deepspeed_config_checks); so does any mixed_precision value in the config file.
ACCELERATE_DS_KEYS_CONFLICTING_WITH_FILE = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model",
)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# Numbers in accelerate's own config (top level and its sections).
ACCELERATE_NUMERIC = (
    ("num_processes",), ("machine_rank",), ("num_machines",), ("main_process_port",),
    ("deepspeed_config", "zero_stage"), ("deepspeed_config", "gradient_accumulation_steps"),
    ("deepspeed_config", "gradient_clipping"), ("fsdp_config", "fsdp_min_num_params"),
)
# fsdp_config as accelerate 1.15 hands it to the script: launch exports each value as text (utils/launch.py
# prepare_multi_gpu_env), and FullyShardedDataParallelPlugin reads it back when the script starts
# (utils/dataclasses.py): enumerations by name in any case or by their torch enum's number, booleans by str_to_bool.
FSDP_ENUMS = {  # key: (names, highest number taken)
    "fsdp_sharding_strategy": (("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"), 5),
    "fsdp_backward_prefetch": (("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"), 2),
    "fsdp_state_dict_type": (("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"), 3),
    "fsdp_auto_wrap_policy": (("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"), 0),
}
TRUTH_WORDS = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")  # utils/environment.py
# Parser defaults of the keys the rules below read (commands/launch.py): a missing key is its default.
FSDP_DEFAULTS = {"fsdp_version": "1", "fsdp_sync_module_states": "true", "fsdp_cpu_ram_efficient_loading": "true",
                 "fsdp_activation_checkpointing": "false", "fsdp_activation_checkpointing_offload": "false"}


def fsdp_problems(section: Mapping[str, Any]) -> Iterator[Tuple[str, str, str]]:
    """(key, why the launch or the script stops, the fix) for each fsdp_config value accelerate cannot read."""
    plugin = "accelerate's FSDP plugin stops on it when the script starts"

    def get(key: str) -> Any:
        return section.get(key, FSDP_DEFAULTS.get(key))

    def truth(key: str) -> Optional[bool]:
        word = str(get(key)).lower()
        return word in TRUTH_WORDS[:6] if word in TRUTH_WORDS else None

    version = str(get("fsdp_version"))
    if not (version.isascii() and version.isdigit() and int(version) in (1, 2)):
        yield "fsdp_version", "expected 1 or 2 (the only ones --fsdp_version takes): accelerate's FSDP plugin reads " \
            "any other as neither FSDP1 nor FSDP2, and stops on its default reshard_after_forward", "set it to 1 or 2"
        return
    version = int(version)
    for key, (names, top) in FSDP_ENUMS.items():
        if key == "fsdp_sharding_strategy" and (version != 1 or key not in section):
            continue  # read by FSDP1 alone; exported even when null (str(None))
        if section.get(key) is None and key != "fsdp_sharding_strategy":
            continue  # not exported: the plugin's default
        text = str(section[key])
        if not (text.upper() in names or text.isascii() and text.isdigit() and 1 <= int(text) <= top):
            yield key, f"expected one of {', '.join(names)} (in any case){f' or 1-{top}' if top else ''}; {plugin}", \
                f"set it to one of: {', '.join(names)}"
    if version == 2 and str(get("fsdp_state_dict_type")).upper() in ("LOCAL_STATE_DICT", "2"):
        yield "fsdp_state_dict_type", f"which FSDP2 does not support; {plugin}", \
            "set it to SHARDED_STATE_DICT or FULL_STATE_DICT"
    booleans = ["fsdp_offload_params", "fsdp_use_orig_params", "fsdp_sync_module_states",
                "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload"]
    booleans.append("fsdp_forward_prefetch" if version == 1 else "fsdp_reshard_after_forward")
    for key in booleans:
        if key in section and truth(key) is None:
            yield key, f"expected true or false; {plugin} (str_to_bool: invalid truth value " \
                f"{str(section[key]).lower()!r})", "set it to true or false"
    # launch tests the raw values for truth (commands/launch.py prepare_multi_gpu_env)
    if get("fsdp_cpu_ram_efficient_loading") and not get("fsdp_sync_module_states"):
        yield "fsdp_sync_module_states", "with fsdp_cpu_ram_efficient_loading on (on by default); accelerate launch " \
            "stops: 'When using `--fsdp_cpu_ram_efficient_loading` set `--fsdp_sync_module_states` to `True`'", \
            "set it to true, or fsdp_cpu_ram_efficient_loading to false"
    if truth("fsdp_activation_checkpointing_offload"):
        if not truth("fsdp_activation_checkpointing"):
            yield "fsdp_activation_checkpointing_offload", f"without fsdp_activation_checkpointing; {plugin}", \
                "set fsdp_activation_checkpointing to true, or this to false"
        elif version != 2:
            yield "fsdp_activation_checkpointing_offload", f"with fsdp_version 1; {plugin}", \
                "set fsdp_version to 2, or this to false"


# accelerate.utils.DynamoBackend (1.15): the launchers read DynamoBackend(dynamo_backend.upper()).
DYNAMO_BACKENDS = ("NO", "EAGER", "AOT_EAGER", "INDUCTOR", "AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "CUDAGRAPHS", "OFI",
                   "FX2TRT", "ONNXRT", "TENSORRT", "AOT_TORCHXLA_TRACE_ONCE", "TORCHXLA_TRACE_ONCE", "TVM",
                   "HPU_BACKEND", "NEURON")
MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "impi", "nossh", "slurm")
# accelerate compares these two with its own spelling (utils/launch.py prepare_deepspeed_cmd_env); any other value
# goes to DeepSpeed's runner as `--launcher VALUE`, which lower-cases it (deepspeed/launcher/runner.py).
ACCELERATE_LAUNCHERS = ("standard", "nossh")
RUNNER_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm")


def multinode_launcher_problem(value: str) -> Optional[str]:
    """Why a DEEPSPEED job over several machines cannot start with deepspeed_multinode_launcher VALUE, or None.

    accelerate reads the key only when num_machines > 1: 'standard' starts torchrun, 'nossh' DeepSpeed's runner
    without ssh, and anything else DeepSpeed's runner with `--launcher VALUE`, which lower-cases it ('PDSH' works;
    'STANDARD' reaches the runner as 'standard', a launcher it does not know)."""
    if value in ACCELERATE_LAUNCHERS or value.lower() in RUNNER_LAUNCHERS:
        return None
    if value.lower() in ACCELERATE_LAUNCHERS:
        return (f"accelerate recognises only {value.lower()!r}, so it starts DeepSpeed's runner with --launcher "
                f"{value}, which stops on the unknown launcher {value.lower()!r} (NotImplementedError)")
    return f"DeepSpeed's runner stops on the unknown launcher {value.lower()!r} (NotImplementedError)"


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    line: int


@dataclass(frozen=True)
class Hostfile:
    path: str
    entries: Tuple[HostEntry, ...]

    @property
    def hosts(self) -> Tuple[str, ...]:
        return tuple(e.host for e in self.entries)


MAX_SLOTS = 65536  # processes on one node: more is a typo, and huge numbers would flow into the world size
# DeepSpeed's runner reads `host slots=N` at the start of a line (deepspeed/launcher/runner.py, _parse_hostfile) and
# ignores the rest: other launchers' settings after it (OpenMPI's max_slots=8) and comments are taken; any other rest
# is refused here, as the sign of a broken line (DeepSpeed would read its start and drop the rest).
DEEPSPEED_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)(\s+[A-Za-z_]\w*=\S*)*\s*(#.*)?$")


def runner_resources(slots: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> Tuple[Optional[Dict[str, int]], Optional[str]]:
    """The processes DeepSpeed's runner starts on each host of a hostfile ({host: slots}), as its main() reads
    --include/--exclude (`host[:slot,slot][@host...]`, parse_resource_filter) and then --num_nodes and --num_gpus
    (apply_num_nodes_and_gpus) before it starts anything: ({host: processes}, None), or (None, why it stops)."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        return None, "Cannot specify num_nodes/gpus with include/exclude"
    if include and exclude:
        return None, "include_str and exclude_str are mutually exclusive."
    counts = dict(slots)  # counted, never listed: a hostfile may give 65,536 slots to each of many hosts
    if include or exclude:
        specs: Dict[str, List[int]] = {}  # by host, the slots of all its specs together (parse_node_config_list)
        for spec in (include or exclude).split("@"):
            host, colon, listed = spec.partition(":")
            try:
                numbers = [int(slot) for slot in listed.split(",")] if colon else []
            except ValueError:
                return None, f"invalid literal for int() with base 10 in {shorten(spec)}"
            specs.setdefault(host, []).extend(numbers)
        picked = {} if include else dict(counts)
        for host, numbers in specs.items():
            if host not in counts:
                return None, f"Hostname {shorten(host)} not found in hostfile"
            wanted = set(numbers)
            missing = sorted(n for n in wanted if not 0 <= n < counts[host])
            if missing:
                return None, f"No slot {shorten(str(missing[0]))} specified on host {shorten(host)}"
            if include:
                picked[host] = len(wanted) or counts[host]
            else:
                picked[host] = counts[host] - len(wanted) if wanted else 0
        counts = {host: picked[host] for host in slots if picked.get(host)}
        if not counts:  # the runner then indexes the first of no hosts
            return None, f"the filter {shorten(include or exclude)} leaves no slot (IndexError)"
    if num_nodes > 0:
        counts = dict(list(counts.items())[:num_nodes])
    if num_gpus > 0:
        counts = {host: num_gpus for host in counts}
    return counts, None


def load_hostfile(path: str) -> Hostfile:
    """DeepSpeed's format: `host slots=N` a line; blank lines and `#` comments are ignored."""
    entries = []
    # Lines as DeepSpeed reads them (universal newlines); str.splitlines() would also split at \f, \x85, ...
    lines = read_text(path, "hostfile").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if not match:
            raise InputError(path, f"expected 'HOSTNAME slots=N', found {line[:60]!r}", number)
        slots = int(match.group(2)) if len(match.group(2)) <= 9 else MAX_SLOTS + 1  # int() refuses 4300+ digits
        if slots > MAX_SLOTS:
            written = match.group(2) if len(match.group(2)) <= 12 else match.group(2)[:12] + "..."
            raise InputError(path, f"host {match.group(1)!r} has slots={written}; no node runs more than "
                                   f"{MAX_SLOTS} processes", number)
        if slots < 1:
            raise InputError(path, f"host {match.group(1)!r} has slots={slots}; it must be at least 1", number)
        entries.append(HostEntry(match.group(1), slots, number))
    if not entries:
        raise InputError(path, "hostfile lists no hosts")
    return Hostfile(path, tuple(entries))


def gpu_id_items(value: str) -> List[str]:
    """gpu_ids as torch reads it: accelerate exports it unchanged as CUDA_VISIBLE_DEVICES (utils/launch.py), which
    torch splits at commas, strips, and reads up to the first item that is no index (torch/cuda/__init__.py,
    _parse_visible_devices). So empty items at the end name nothing: `0,` is GPU 0 alone (and its comma is what gets
    a one-GPU MULTI_GPU launch past accelerate's own `len(gpu_ids.split(",")) < 2`). Any other item that is no
    index, an empty one in the middle included, is left in: torch stops there and never sees the GPUs after it."""
    items = [item.strip() for item in value.split(",")]
    while items and not items[-1]:
        items.pop()
    return items


# The types that make accelerate launch a multi-GPU job from the config file (commands/launch.py).
MULTI_TYPES = ("MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
               "MULTI_NEURON")
# distributed_type values that accelerate starts with torchrun (its multi_gpu_launcher).
TORCHRUN_TYPES = frozenset("""MULTI_GPU FSDP MEGATRON_LM MULTI_NPU MULTI_MLU MULTI_SDAA MULTI_MUSA MULTI_XPU MULTI_HPU
MULTI_NEURON""".split())


def accelerate_launcher(distributed_type: Any) -> str:
    """Which of accelerate's launchers runs a distributed_type (commands/launch.py, launch_command): "deepspeed",
    "torchrun", "xla", or "simple" (one process, or MULTI_CPU's mpirun; 'NO', null and any other value)."""
    if not isinstance(distributed_type, str):
        return "simple"  # null, a YAML boolean, a number: no launcher flag matches
    if distributed_type == "DEEPSPEED":
        return "deepspeed"
    if distributed_type in TORCHRUN_TYPES:
        return "torchrun"
    return "xla" if distributed_type == "XLA" else "simple"


def deepspeed_runner(launcher: str, machines: Any, multinode_launcher: Any) -> Optional[str]:
    """How DeepSpeed's runner starts an accelerate launch (utils/launch.py, prepare_deepspeed_cmd_env): "head" when
    the runner on the head starts every node (pdsh, the default, openmpi, ...), "each" when every node runs it
    itself ('nossh'), None when it does not run (another launcher, one machine, or 'standard': torchrun on each
    machine). Where it runs, it reads the hostfile, and each node uses the GPUs of its hostfile slots: DeepSpeed's
    launch sets the visible GPUs, so gpu_ids is never read. LAUNCHER is accelerate_launcher's answer ("simple"
    under --cpu)."""
    if launcher != "deepspeed" or not is_int(machines) or machines <= 1 or multinode_launcher == "standard":
        return None
    return "each" if multinode_launcher == "nossh" else "head"


TORCHRUN_PORT = re.compile(r"^[0-9]{1,5}$")  # torchrun's rendezvous endpoint (elastic/rendezvous/utils.py)


def text_number_stops_launch(keys: Tuple[str, ...], text: str, launch: Mapping[str, Any]) -> Optional[str]:
    """Why `accelerate launch` (1.15), its launcher or accelerate in the script stops on the number at `keys`
    written as text, or None where the text is read as its number or not read at all. `launch`: the launch's
    distributed_type, use_cpu, num_machines, machine_rank, deepspeed_config and fsdp_config as accelerate
    merged them, and "cpu", whether the command passes --cpu.

    accelerate copies the file's values into its arguments untyped (commands/launch.py): a value it compares or
    does arithmetic on stops it with a TypeError; one it passes on as text (to torchrun, DeepSpeed's runner, or
    the script's environment) is read back there, with int() or a stricter pattern."""
    dtype = launch.get("distributed_type")
    launcher = "simple" if launch.get("cpu") else accelerate_launcher(dtype)
    machines, rank = text_number(launch.get("num_machines", 1)), text_number(launch.get("machine_rank", 0))
    several = is_int(machines) and machines > 1
    section = launch.get("deepspeed_config") if isinstance(launch.get("deepspeed_config"), Mapping) else {}
    shown = shorten(text)
    if keys[0] == "deepspeed_config" and launcher != "deepspeed" or keys[0] == "fsdp_config" and (
            dtype != "FSDP" or launch.get("cpu")):
        return None  # a section the launch never reads (CFG004 says so of a DeepSpeed one)
    fsdp = launch.get("fsdp_config") if isinstance(launch.get("fsdp_config"), Mapping) else {}
    if keys[-1] == "fsdp_min_num_params" and str(fsdp.get("fsdp_auto_wrap_policy")).upper() != "SIZE_BASED_WRAP":
        return None  # read only by the size-based wrap policy (FullyShardedDataParallelPlugin)
    # With use_cpu, accelerate shares the CPU threads out first: num_processes >= 1, num_processes / num_machines.
    shares_threads = launch.get("use_cpu") is True and launch.get("num_cpu_threads_per_process") is None
    if keys == ("num_processes",) and shares_threads:
        return "accelerate compares it with 1 (use_cpu) and stops with a TypeError"
    if keys == ("num_machines",) and shares_threads:
        return "accelerate divides num_processes by it (use_cpu) and stops with a TypeError"
    if launcher == "xla":
        return None  # the TPU launchers read none of these from the file (tpu_launcher, prepare_tpu)
    if keys == ("num_machines",):
        return "accelerate compares it with 1 (`num_machines > 1`) and stops with a TypeError"
    if keys == ("num_processes",) and launcher == "simple":
        return "accelerate compares it with 1 and stops with a TypeError"
    if keys == ("num_processes",) and several:
        if launcher == "deepspeed" and section.get("deepspeed_multinode_launcher") != "standard" and \
                (section.get("deepspeed_exclusion_filter") is not None or
                 section.get("deepspeed_inclusion_filter") is not None):
            return None  # DeepSpeed's runner takes the GPUs from the filter: accelerate never divides it
        return "accelerate divides it by num_machines and stops with a TypeError"
    if keys in (("main_process_port",), ("machine_rank",)) and launcher == "simple":
        # Passed on as MASTER_PORT, which torch reads with int() where the processes meet (MULTI_CPU); 'NO'
        # starts one process that meets no other.
        if keys == ("main_process_port",) and dtype == "MULTI_CPU" and not reads_as(int, text):
            return (f"accelerate exports it as MASTER_PORT, and torch's rendezvous reads that with int(), which "
                    f"refuses {shown}")
        return None
    if keys == ("machine_rank",) and not several:
        return None  # read (int()) only for a launch over several machines
    if keys == ("main_process_port",) and (not several or rank == 0):  # only the head tests its port
        return "accelerate tests whether the port is free (socket.connect_ex) and stops with a TypeError"
    runner = launcher == "deepspeed" and several and section.get("deepspeed_multinode_launcher") != "standard"
    if keys == ("main_process_port",) and not runner and not TORCHRUN_PORT.match(text):
        return f"torchrun's rendezvous reads only 1 to 5 digits 0-9 as a port and refuses {shown}"
    if keys[-1] == "gradient_clipping":
        return None  # float() in DeepSpeedPlugin reads any number
    if keys[-1] == "gradient_accumulation_steps" and not text.isdigit():
        return (f"accelerate passes it to the script as text, where the Accelerator reads it with int(), which "
                f"refuses {shown} (DeepSpeedPlugin keeps text that is not all digits)")
    if not reads_as(int, text):  # torchrun's --nproc_per_node, int(machine_rank), DeepSpeed's runner, the plugins
        return f"accelerate passes it on as text, and it is read back with int(), which refuses {shown}"
    return None


def type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
             list: "a list", NoneType: "null", AUTO: '"auto"'}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _matches(value: Any, types: tuple) -> bool:
    if value == AUTO and AUTO in types:
        return True
    types = tuple(t for t in types if t != AUTO)
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, tuple(types))


def validate_types(doc: Document, schema: Mapping[str, tuple], keys: Tuple = ()) -> None:
    """A known key with a value of the wrong type is bad input. Numbers written as strings are
    left to the CFG checks, which explain the YAML and JSON traps behind them."""
    section = doc.section(*keys) if keys else doc
    if section is None:
        return
    for key, types in schema.items():
        if key not in section.data:
            continue
        value = section.data[key]
        if types == ANY:
            continue
        if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity, 1e999: read, but no setting
            raise InputError(doc.path, f"{'.'.join(map(str, keys + (key,)))} must be a finite number, found {value}",
                             section.line(key))
        if _matches(value, types):
            continue
        numeric = int in types or float in types
        if numeric and is_numeric_string(value):
            continue
        shown = ".".join(map(str, keys + (key,)))
        raise InputError(doc.path, f"{shown} must be {type_name(types)}, found {shorten(value)}", section.line(key))


@dataclass(frozen=True)
class AccelerateConfig:
    doc: Document
    cpu: bool = False  # the launch command passes --cpu: accelerate's simple launcher, whatever the type
    # No config file at all: `accelerate launch` runs on its flags over its own defaults (the GPU count for
    # num_processes, and MULTI_GPU on a node with several GPUs), so no key is missing from a file.
    from_command: bool = False

    @property
    def launch(self) -> Mapping[str, Any]:
        """The launch as text_number_stops_launch reads it."""
        return {**self.data, "cpu": self.cpu}

    @property
    def data(self) -> Mapping[str, Any]:
        return self.doc.data

    @property
    def is_sagemaker(self) -> bool:
        return self.data.get("compute_environment") == "AMAZON_SAGEMAKER"

    @property
    def deepspeed_section(self) -> Optional[Document]:
        return self.doc.section("deepspeed_config")

    @property
    def uses_deepspeed(self) -> bool:
        """accelerate launch reads the deepspeed_config section only for distributed_type DEEPSPEED
        (accelerate/commands/launch.py: use_deepspeed = distributed_type == DEEPSPEED); under any other type
        its keys are copied into launch's arguments that no launcher reads."""
        return self.data.get("distributed_type") == "DEEPSPEED"

    @property
    def runner(self) -> Optional[str]:
        """deepspeed_runner's answer for this file and the launch flags over it."""
        section = self.deepspeed_section
        launcher = section.data.get("deepspeed_multinode_launcher") if section is not None else None
        return deepspeed_runner("simple" if self.cpu else accelerate_launcher(self.data.get("distributed_type")),
                                self.integer("num_machines", 1), launcher)

    @property
    def hostfile_unread(self) -> Optional[str]:
        """Why accelerate launch never reads deepspeed_hostfile (DeepSpeed's runner does not run), or None."""
        if self.runner is not None:
            return None
        if not self.uses_deepspeed:
            return "distributed_type is not DEEPSPEED"
        if self.cpu:
            return "--cpu starts the simple launcher"
        machines = self.integer("num_machines", 1)
        if machines is None:
            return "num_machines is not a number"
        if machines <= 1:
            return f"num_machines is {machines}: torchrun starts every process on this machine"
        return "the launcher is 'standard': torchrun starts on each machine"

    @property
    def head_runner(self) -> bool:
        """Whether DeepSpeed's runner on the head starts every node: it finds the head's address with `hostname -I`
        when none is given, and never reads machine_rank (deepspeed/launcher/runner.py)."""
        return self.runner == "head"

    @property
    def simple_launch(self) -> bool:
        """Whether the file's distributed_type runs accelerate's simple launcher: one process, no rendezvous. 'NO',
        or a value that is no string (null, a YAML boolean, a number), which no launcher flag matches
        (commands/launch.py)."""
        if "distributed_type" not in self.data:
            return False
        value = self.data["distributed_type"]
        return value == "NO" or not isinstance(value, str)

    @property
    def mixed_precision(self) -> Any:
        """mixed_precision as accelerate uses it: lower-cased before use by every launcher
        (accelerate/utils/launch.py: PrecisionType(args.mixed_precision.lower())), so 'FP16' is fp16."""
        value = self.data.get("mixed_precision")
        return value.lower() if isinstance(value, str) else value

    def integer(self, key: str, default: Optional[int] = None) -> Optional[int]:
        """An integer setting, written as a number or as text ('2'); whether accelerate reads such text is
        CFG003's to say (text_number_stops_launch)."""
        value = text_number(self.data.get(key, default))
        return value if is_int(value) else None


def load_accelerate_config(path: str, text: Optional[str] = None, kind: Optional[str] = None) -> AccelerateConfig:
    """The accelerate config at path; `text` (and its syntax, `kind`): the text a batch script writes there."""
    doc = load(path, "accelerate config", kind, text=text)
    _not_the_other_kind(doc, "accelerate config", ACCELERATE_ONLY_KEYS, DEEPSPEED_ONLY_KEYS, "--deepspeed")
    schema = SAGEMAKER_KEYS if doc.data.get("compute_environment") == "AMAZON_SAGEMAKER" else ACCELERATE_KEYS
    config = AccelerateConfig(doc)
    if not config.uses_deepspeed:  # a section accelerate never reads is not bad input (CFG004 says it is ignored)
        schema = {k: v for k, v in schema.items() if k != "deepspeed_config"}
    validate_types(doc, schema)
    if config.uses_deepspeed:
        validate_types(doc, ACCELERATE_DS_KEYS, ("deepspeed_config",))
    if doc.data.get("distributed_type") == "NO" and "num_processes" not in doc.data and isinstance(doc.data, dict):
        doc.data["num_processes"] = 1  # as accelerate loads such a file (config_args.py process_config)
    return config


# DeepSpeed settings whose values must be numbers ("auto" is filled in by accelerate / transformers).
DS_NUMERIC: Dict[Tuple[str, ...], tuple] = {
    # null: not set (DeepSpeed reads them with get_scalar_param, whose default is None; CFG030 judges the rest)
    ("train_batch_size",): (int, NoneType, AUTO),
    ("train_micro_batch_size_per_gpu",): (int, NoneType, AUTO),
    ("gradient_accumulation_steps",): (int, NoneType, AUTO),
    ("gradient_clipping",): (float, AUTO),
    ("steps_per_print",): (int, float, AUTO),  # accelerate and the HF Trainer replace it (inf)
    ("zero_optimization", "stage"): (int, AUTO),
    ("zero_optimization", "reduce_bucket_size"): (int, float, AUTO),
    ("zero_optimization", "allgather_bucket_size"): (int, float, AUTO),
    ("zero_optimization", "stage3_prefetch_bucket_size"): (int, float, AUTO),
    ("zero_optimization", "stage3_param_persistence_threshold"): (int, float, AUTO),
    ("zero_optimization", "stage3_max_live_parameters"): (int, float, AUTO),
    ("zero_optimization", "stage3_max_reuse_distance"): (int, float, AUTO),
    ("zero_optimization", "sub_group_size"): (int, float, AUTO),
    ("fp16", "loss_scale"): (int, float),
    ("fp16", "initial_scale_power"): (int,),
    ("fp16", "loss_scale_window"): (int,),
    ("fp16", "hysteresis"): (int,),
    ("fp16", "min_loss_scale"): (int, float),
    ("optimizer", "params", "lr"): (float, AUTO),
    ("optimizer", "params", "eps"): (float, AUTO),
    ("optimizer", "params", "weight_decay"): (float, AUTO),
    ("scheduler", "params", "warmup_min_lr"): (float, AUTO),
    ("scheduler", "params", "warmup_max_lr"): (float, AUTO),
    ("scheduler", "params", "warmup_num_steps"): (int, AUTO),
    ("scheduler", "params", "total_num_steps"): (int, AUTO),
}
DS_SECTIONS = ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler")
# DeepSpeed's pydantic models (DeepSpeedZeroConfig, DeepSpeedFP16Config) read text that parses as the field's
# number: for an integer '3', ' +3 ' and '3.0' (a zero fraction), never '3e0'; fp16.loss_scale is a float, and
# two validators ask for an int and refuse '3.0' too.
INT_TEXT = re.compile(r"^\s*[+-]?[0-9]+(_[0-9]+)*\s*$")
ZERO_FRACTION_INT_TEXT = re.compile(r"^\s*[+-]?[0-9]+(_[0-9]+)*(\.0+)?\s*$")
PYDANTIC_MAX_DIGITS = 4300  # longer integer text is refused (int_parsing_size), as int() refuses it
DS_FLOAT_FIELDS = frozenset({("fp16", "loss_scale")})
DS_STRICT_INT_FIELDS = frozenset({("fp16", "loss_scale_window"), ("fp16", "min_loss_scale")})
DS_BATCH_KEYS = (("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",))


def ds_text_number_stops(keys: Tuple[str, ...], text: str, usage: str) -> Optional[Tuple[bool, str]]:
    """For a number of the DeepSpeed JSON written as text: None where everything that reads it reads it as its
    number, else (whether the job stops, why). usage: who reads the JSON, "accelerate", "deepspeed" (its runner
    alone) or "unknown" (the HF Trainer, which reads it through accelerate's DeepSpeedPlugin too; Lightning; a
    script)."""
    shown = shorten(text)
    if keys[0] in ("zero_optimization", "fp16"):
        pattern = INT_TEXT if keys in DS_STRICT_INT_FIELDS else ZERO_FRACTION_INT_TEXT
        if keys not in DS_FLOAT_FIELDS and not (pattern.match(text) and len(text) <= PYDANTIC_MAX_DIGITS):
            return True, f"DeepSpeed's config model reads only an integer there and refuses the text {shown}"
        if keys != ("zero_optimization", "stage") or usage == "deepspeed":
            return None
        # HfDeepSpeedConfig keeps the text, and accelerate's plugin takes it as zero_stage.
        if usage == "accelerate":
            return True, ("DeepSpeed reads it as a number, but accelerate's DeepSpeedPlugin keeps the text as its "
                          "zero_stage and compares it with 2 on every accumulation step (`zero_stage < 2` in "
                          "Accelerator.no_sync): TypeError")
        return False, ("DeepSpeed reads it as a number, but accelerate's and transformers' HfDeepSpeedConfig keep "
                       "the text: under accelerate the job stops comparing it with 2 (Accelerator.no_sync)"
                       + (", and ZeRO-3's zero.Init is skipped when the model loads" if text_number(text) == 3 else ""))
    if keys in DS_BATCH_KEYS:
        return True, "DeepSpeed compares it with numbers when its config loads and stops with a TypeError"
    if keys == ("steps_per_print",):
        why = "DeepSpeed keeps it as text, and its engine stops computing `step % steps_per_print` with it"
        if usage == "deepspeed":
            return True, why
        # accelerate's DeepSpeedPlugin (under accelerate and the HF Trainer) replaces it: inf, nothing printed.
        return None if usage == "accelerate" else (False, why + " when DeepSpeed runs it without accelerate "
                                                   "(the HF Trainer and accelerate replace it)")
    if keys == ("gradient_clipping",):
        return True, "DeepSpeed keeps it as text, and its engine stops comparing it with 0.0 when it clips"
    return True, (f"DeepSpeed keeps it as text and passes it to the {keys[0]} as it is, which stops computing "
                  "with it")


@dataclass(frozen=True)
class DeepSpeedConfig:
    doc: Document

    @property
    def data(self) -> Mapping[str, Any]:
        return self.doc.data

    def get(self, *keys: str) -> Any:
        value: Any = self.data
        for key in keys:
            if not isinstance(value, Mapping):
                return None
            value = value.get(key)
        return value

    def enabled(self, block: str) -> Any:
        """fp16 / bf16 `enabled`: True, False or "auto". DeepSpeed also reads "bfloat16" for bf16."""
        section = self.get(block)
        if section is None and block == "bf16":
            section = self.get("bfloat16")
        if not isinstance(section, Mapping):
            return False
        return section.get("enabled", False)


def autotuned(data: Any) -> bool:
    """DeepSpeed's autotuner runs the job (`autotuning.enabled`, with `deepspeed --autotuning`): its search space
    gives the ZeRO stage as a list or "all", the micro batch and the ZeRO settings as lists, and each experiment
    gets one value of each (autotuning/autotuner.py, deepspeed/autotuning/README.md "Configuring ZeRO Stage")."""
    tuning = data.get("autotuning") if isinstance(data, dict) else None
    return isinstance(tuning, dict) and tuning.get("enabled") is True


def tuning_space(value: Any) -> bool:
    """A value that is the autotuner's search space rather than one setting (see autotuned)."""
    return isinstance(value, list) or value == "all"


TUNED = ("zero_optimization", "train_micro_batch_size_per_gpu")  # what the autotuner explores (replace_dict)


def load_deepspeed_config(path: str, text: Optional[str] = None) -> DeepSpeedConfig:
    # Read as JSON whatever its name, past what hjson alone takes: CFG008 judges that, by who reads the file
    doc = parse_deepspeed(path, read_text(path, "DeepSpeed config", bom=True) if text is None else text)
    _not_the_other_kind(doc, "DeepSpeed config", DEEPSPEED_ONLY_KEYS, ACCELERATE_ONLY_KEYS, "--config")
    tuned = autotuned(doc.data)
    for keys, types in DS_NUMERIC.items():
        section = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if keys == ("steps_per_print",) and str(doc.data.get("steps_per_print")).strip().lower() in ("inf", "infinity"):
            continue  # accelerate's DeepSpeedPlugin sets it to inf itself (nothing printed): the text says the same
        if section is None:
            continue
        value = section.data.get(keys[-1])
        if tuned and keys[0] in TUNED and (isinstance(value, list) or keys[-1] == "stage" and value == "all"):
            numeric = int in types or float in types
            for item in value if isinstance(value, list) else ():  # each is a setting an experiment gets
                if not (_matches(item, types) or numeric and is_numeric_string(item)) or item == AUTO:
                    raise InputError(path, f"{'.'.join(keys)} lists {shorten(item)}: each value the autotuner tries "
                                           f"must be {type_name(tuple(t for t in types if t != AUTO))}",
                                     section.line(keys[-1]))
            continue
        validate_types(doc, {keys[-1]: types}, keys[:-1])
    for block in DS_SECTIONS:
        value = doc.data.get(block)
        if block == "zero_optimization" and (isinstance(value, bool) or tuned and value == "all"):
            continue  # the old form `"zero_optimization": true` (stage 1) DeepSpeed still reads; "all" the autotuner's
        if value is not None and not isinstance(value, dict):
            raise InputError(path, f"{block} must be a mapping, found {shorten(value)}", doc.line(block))
    return DeepSpeedConfig(doc)


# Keys only one of the two files has at its top level: a file with the other's and none of its own was given to the
# wrong option (`--config ds.json`), and is said to be in one line rather than judged key by key.
ACCELERATE_ONLY_KEYS = frozenset(("distributed_type", "compute_environment", "num_processes", "num_machines",
                                  "machine_rank", "main_training_function", "deepspeed_config", "fsdp_config"))
DEEPSPEED_ONLY_KEYS = frozenset(("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                                 "optimizer", "scheduler", "bf16", "zero_allow_untested_optimizer"))


def _not_the_other_kind(doc: Document, what: str, own: frozenset, other: frozenset, option: str) -> None:
    keys = set(doc.data) if isinstance(doc.data, dict) else set()
    theirs = sorted(keys & other)
    if theirs and not keys & own:
        other_kind = "a DeepSpeed config" if option == "--deepspeed" else "an accelerate config"
        raise InputError(doc.path, f"{other_kind} ({', '.join(theirs[:3])}), given as the {what}: give it with "
                                   f"{option}")


def resolve_beside(path: str, reference: str) -> str:
    """A path named inside a config file: as written (accelerate opens it from the working
    directory), else next to the file that names it."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    beside = os.path.join(os.path.dirname(reference), path)
    return beside if os.path.exists(beside) else path


@dataclass(frozen=True)
class FlagDocument(Document):
    """A config with some values replaced by the launch command's flags: where() names the flag."""

    flags: Mapping[Tuple[Any, ...], str] = None  # key path -> "flag --name"

    def where(self, *keys: Any) -> str:
        source = (self.flags or {}).get(self.prefix + keys)
        if self.kind == "flags":  # no file under the flags
            return source or self.path
        return f"{source} (over {super().where(*keys)})" if source else super().where(*keys)

    def line(self, *keys: Any) -> Optional[int]:
        return None if self.prefix + keys in (self.flags or {}) else super().line(*keys)

    def setting(self, *keys: Any) -> str:
        """The flag, where one gives the value: the command's flag wins, so editing the file would change nothing."""
        source = (self.flags or {}).get(self.prefix + keys)
        if source:
            return source[len("flag "):]
        return f"--{keys[-1]}" if self.kind == "flags" else super().setting(*keys)

    def given_by_flag(self, *keys: Any) -> bool:
        return self.prefix + keys in (self.flags or {})

    def in_file(self, *keys: Any) -> bool:
        return self.prefix + keys in self.lines if self.given_by_flag(*keys) else super().in_file(*keys)


def with_values(doc: Document, values: Mapping[Tuple[str, ...], Tuple[Any, str]]) -> Document:
    """doc with the values at some key paths replaced: {path: (value, "flag --name")}."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.data.items()}
    for keys, (value, _) in values.items():
        holder = data
        for key in keys[:-1]:
            if not isinstance(holder.get(key), dict):
                holder[key] = {}
            holder = holder[key]
        holder[keys[-1]] = value
    fields = {f.name: getattr(doc, f.name) for f in dataclasses.fields(Document)}  # all the file told, but the data
    return FlagDocument(**{**fields, "data": data}, flags={k: s for k, (_, s) in values.items()})
