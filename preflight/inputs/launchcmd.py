"""The launch command: which launcher it starts, and the flags that override the config files.

One parser for the launchers a multi-node job is started with: `accelerate launch`, `torchrun` (and
`python -m torch.distributed.run` / `.launch`), DeepSpeed's runner (`deepspeed`), and a plain `python
train.py`. Each launcher's options are parsed as its own argparse parser reads them (accelerate and
torchrun accept `--num-processes` for `--num_processes`, neither takes abbreviations): every option takes a
value except the flags listed here; the first word that is neither is the script, and what follows is
the script's. Used by `lint`, `check` and `launch` alike (preflight.job.view turns it into each node's
effective launch).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from preflight.inputs.documents import shorten

# Options that take no value (argparse store_true / store_const), by launcher, canonical names.
FLAGS = {
    # accelerate 1.x, accelerate/commands/launch.py
    "accelerate": frozenset("""
help quiet cpu debug multi_gpu tpu use_deepspeed use_fsdp use_megatron_lm use_parallelism_config module no_python
same_network downcast_bf16 dynamo_use_dynamic dynamo_use_fullgraph dynamo_use_regional_compilation
enable_cpu_affinity fp8_use_autocast_during_eval tpu_cluster no_tpu_cluster tpu_use_sudo
""".split()),
    # torch/distributed/run.py
    "torchrun": frozenset("standalone module no_python run_path virtual_local_rank use_env help".split()),
    # deepspeed/launcher/runner.py
    "deepspeed": frozenset("""
module no_python no_local_rank no_ssh no_ssh_check force_multi save_pid bind_cores_to_rank quiet help
""".split()),
    "python": frozenset(),
}
SHORT = {  # short options, by launcher: canonical name
    "accelerate": {"-h": "help", "-q": "quiet", "-m": "module", "-t": "tee"},
    "torchrun": {"-m": "module", "-r": "redirects", "-t": "tee", "-h": "help"},
    "deepspeed": {"-H": "hostfile", "-i": "include", "-e": "exclude", "-q": "quiet", "-h": "help"},
    "python": {},
}
# Every long option of the launchers whose parsers take abbreviations (argparse's allow_abbrev, on by default
# in torch/distributed/run.py and deepspeed/launcher/runner.py): `--node_r 1` is --node_rank there.
OPTIONS = {
    "torchrun": frozenset("""
nnodes nproc_per_node rdzv_backend rdzv_endpoint rdzv_id rdzv_conf standalone max_restarts
monitor_interval start_method event_log_handler role module no_python run_path log_dir redirects tee
local_ranks_filter duplicate_stdout_filters duplicate_stderr_filters node_rank master_addr master_port local_addr
logs_specs numa_binding signals_to_handle shutdown_timeout virtual_local_rank use_env help
""".split()),
    "deepspeed": frozenset("""
hostfile include exclude num_nodes num_gpus num_accelerators master_port master_addr node_rank launcher
launcher_args module no_python no_local_rank no_ssh no_ssh_check force_multi save_pid enable_each_rank_log
autotuning bind_cores_to_rank bind_core_list ssh_port venv_script log_level quiet help
""".split()),
}
# accelerate launch's long options (1.15, commands/launch.py): its parser takes no abbreviation, and stops on any
# other option before the script.
ACCELERATE_OPTIONS = frozenset("""
aws_access_key_id aws_secret_access_key config_file cpu debug deepspeed_config_file deepspeed_exclusion_filter
deepspeed_hostfile deepspeed_inclusion_filter deepspeed_moe_layer_cls_names deepspeed_multinode_launcher downcast_bf16
dynamo_backend dynamo_mode dynamo_use_dynamic dynamo_use_fullgraph dynamo_use_regional_compilation enable_cpu_affinity
env fp8_amax_compute_algo fp8_amax_history_len fp8_backend fp8_enable_fsdp_float8_all_gather fp8_format fp8_interval
fp8_margin fp8_opt_level fp8_override_linear_precision fp8_pad_inner_dim fp8_use_autocast_during_eval
fsdp_activation_checkpointing fsdp_activation_checkpointing_offload fsdp_auto_wrap_policy fsdp_backward_prefetch
fsdp_cpu_ram_efficient_loading fsdp_forward_prefetch fsdp_min_num_params fsdp_offload_params
fsdp_reshard_after_forward fsdp_sharding_strategy fsdp_state_dict_type fsdp_sync_module_states
fsdp_transformer_layer_cls_to_wrap fsdp_use_orig_params fsdp_version gpu_ids gradient_accumulation_steps
gradient_clipping help log_dir machine_rank main_process_ip main_process_port main_training_function max_restarts
megatron_lm_attention_backend megatron_lm_attention_dropout megatron_lm_attention_softmax_in_fp32
megatron_lm_calculate_per_token_loss megatron_lm_context_parallel_size megatron_lm_decoder_last_pipeline_num_layers
megatron_lm_eod_mask_loss megatron_lm_expert_model_parallel_size megatron_lm_expert_tensor_parallel_size
megatron_lm_gradient_clipping megatron_lm_hidden_dropout megatron_lm_no_load_optim megatron_lm_no_save_optim
megatron_lm_num_micro_batches megatron_lm_optimizer_cpu_offload megatron_lm_overlap_cpu_optimizer_d2h_h2d
megatron_lm_pp_degree megatron_lm_recompute_activations megatron_lm_recompute_granularity megatron_lm_recompute_method
megatron_lm_recompute_num_layers megatron_lm_sequence_parallelism megatron_lm_tp_degree megatron_lm_use_custom_fsdp
megatron_lm_use_distributed_optimizer megatron_lm_use_precision_aware_optimizer
megatron_lm_use_rotary_position_embeddings mixed_precision module monitor_interval mpirun_hostfile multi_gpu no_python
no_tpu_cluster num_cpu_threads_per_process num_machines num_processes offload_optimizer_device
offload_optimizer_nvme_path offload_param_device offload_param_nvme_path parallelism_config_cp_backend
parallelism_config_cp_comm_strategy parallelism_config_cp_size parallelism_config_dp_replicate_size
parallelism_config_dp_shard_size parallelism_config_sp_attn_implementation parallelism_config_sp_backend
parallelism_config_sp_seq_length parallelism_config_sp_seq_length_is_variable parallelism_config_sp_size
parallelism_config_tp_size quiet rdzv_backend rdzv_conf role same_network tee tpu tpu_cluster tpu_use_sudo
use_deepspeed use_fsdp use_megatron_lm use_parallelism_config vm zero3_init_flag zero3_save_16bit_model zero_stage
""".split())
# Options each launcher's argument parser reads with int(), and options it takes only from a fixed set of choices
# (in their case, unlike accelerate's config file): any other value stops the launch with a usage error.
# accelerate 1.15 (commands/launch.py), torch/distributed/run.py, deepspeed/launcher/runner.py.
INT_OPTIONS = {
    "accelerate": frozenset("""
num_processes num_machines machine_rank main_process_port num_cpu_threads_per_process max_restarts zero_stage
gradient_accumulation_steps fsdp_min_num_params fp8_amax_history_len fp8_interval fp8_margin megatron_lm_tp_degree
megatron_lm_pp_degree megatron_lm_num_micro_batches megatron_lm_recompute_num_layers
megatron_lm_context_parallel_size megatron_lm_expert_model_parallel_size megatron_lm_expert_tensor_parallel_size
megatron_lm_decoder_last_pipeline_num_layers parallelism_config_dp_replicate_size parallelism_config_dp_shard_size
parallelism_config_tp_size parallelism_config_cp_size parallelism_config_sp_size
""".split()),
    "torchrun": frozenset("node_rank master_port max_restarts shutdown_timeout".split()),
    "deepspeed": frozenset("num_nodes num_gpus master_port node_rank ssh_port".split()),
}
FLOAT_OPTIONS = {  # read with float()
    "accelerate": frozenset("gradient_clipping megatron_lm_attention_dropout megatron_lm_gradient_clipping "
                            "megatron_lm_hidden_dropout monitor_interval".split()),
    "torchrun": frozenset({"monitor_interval"}),
    "deepspeed": frozenset(),
}
# read with accelerate's str_to_bool: y, yes, t, true, on, 1, n, no, f, false, off, 0 in any case
TRUTH_OPTIONS = {"accelerate": frozenset({"fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim"}),
                 "torchrun": frozenset(), "deepspeed": frozenset()}
CHOICES = {
    "accelerate": {
        "mixed_precision": ("no", "fp16", "bf16", "fp8"),
        "dynamo_backend": ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs",
                           "ofi", "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torhchxla_trace_once",
                           "tvm"),  # sic: accelerate 1.15's own spelling
        "dynamo_mode": ("default", "reduce-overhead", "max-autotune"),
        "fsdp_version": ("1", "2"),
        "fp8_backend": ("ao", "te", "msamp"),
        "fp8_format": ("HYBRID", "E4M3", "E5M2"),
        "fp8_amax_compute_algo": ("max", "most_recent"),
        "fp8_opt_level": ("O1", "O2"),
    },
    "torchrun": {"start_method": ("spawn", "fork", "forkserver")},
    "deepspeed": {},
}
# accelerate launch's type switches: it takes one of them at most (commands/launch.py).
TYPE_FLAGS = ("cpu", "multi_gpu", "tpu", "use_deepspeed", "use_fsdp")
# `python -m MODULE` that is a launcher.
LAUNCHER_MODULES = {
    "accelerate.commands.launch": "accelerate",
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "deepspeed.launcher.runner": "deepspeed",
}
# Options whose value is a file the launcher (or accelerate) reads on the node.
FILE_OPTIONS = frozenset("config_file deepspeed_config_file deepspeed_hostfile hostfile mpirun_hostfile".split())
# A word of the script's arguments that names a file (digested on every node when it exists there).
# The training scripts' flags that name the checkpoint to resume from: the HF Trainer's (TrainingArguments,
# HfArgumentParser gives each field its dashed alias too), Megatron-DeepSpeed's and the common one.
RESUME_FLAGS = ("--resume_from_checkpoint", "--resume-from-checkpoint", "--load", "--resume")
FILE_LIKE = re.compile(r"(/|\.(py|json|ya?ml|toml|cfg|ini|txt|sh|jsonl)$)", re.I)
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

Value = Union[str, bool]
# A word argparse takes for an option, not for the value before it: a dash and more, no space, no negative number.
LOOKS_LIKE_AN_OPTION = re.compile(r"^-(?!\d+$|\d*\.\d+$)[^ ]+$")


@dataclass(frozen=True)
class LaunchCommand:
    argv: Tuple[str, ...]
    launcher: str  # "accelerate", "torchrun", "deepspeed", "python", or "other" (not a launcher we know)
    program: str  # the word that starts it: accelerate, torchrun, deepspeed, python3, ...
    options: Mapping[str, Value] = field(default_factory=dict)  # canonical name -> last value given
    script: Optional[str] = None  # the training script (a module name with -m)
    script_args: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # `env A=B` / `A=B` before the program
    problem: Optional[str] = None  # why the flags could not be read to the end
    given: Tuple[Tuple[str, Value], ...] = ()  # every option in order: argparse reads each, the last one wins

    def get(self, name: str) -> Optional[Value]:
        return self.options.get(name)

    def integer(self, name: str) -> Optional[int]:
        value = self.options.get(name)
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d{1,9}", value.strip()):
            return int(value)
        return None

    def flag(self, name: str) -> bool:
        return self.options.get(name) is True

    @property
    def from_program(self) -> Tuple[str, ...]:
        """The command from its program on (after `env` and VAR=value words)."""
        i = 1 if self.argv and os.path.basename(self.argv[0]) == "env" else 0
        while i < len(self.argv) and ENV_ASSIGNMENT.match(self.argv[i]):
            i += 1
        return self.argv[i:]

    @property
    def resume_flag(self) -> Optional[Tuple[str, str]]:
        """(flag, value) of the training script's own flag that names the checkpoint it resumes from
        (RESUME_FLAGS; the last one given, as argparse keeps it), or None. A value that is a word of its own
        (true, a flag) is no path."""
        found = None
        for i, word in enumerate(self.script_args):
            flag, eq, value = word.partition("=")
            if flag not in RESUME_FLAGS:
                continue
            if not eq:
                value = self.script_args[i + 1] if i + 1 < len(self.script_args) else ""
            if value and not value.startswith("-") and value.lower() not in ("true", "false", "none", "1", "0"):
                found = (flag, value)
        return found

    @property
    def files(self) -> List[str]:
        """The paths on the command line that the job may read: the script, file options, file-like arguments."""
        found = [v for k, v in self.options.items() if k in FILE_OPTIONS and isinstance(v, str) and v]
        if self.script and not self.flag("module") and not self.flag("no_python"):
            found.append(self.script)
        found += [a for a in self.script_args if FILE_LIKE.search(a) and not a.startswith("-") and "=" not in a]
        found += [a.split("=", 1)[1] for a in self.script_args
                  if a.startswith("--") and "=" in a and FILE_LIKE.search(a.split("=", 1)[1])]
        return list(dict.fromkeys(found))[:32]


def canonical(option: str) -> str:
    """`--num-processes` -> `num_processes` (the launchers accept both spellings)."""
    return option.lstrip("-").replace("-", "_")


def launcher_of(argv: Sequence[str]) -> Tuple[str, int]:
    """(launcher, index of its first option) after `env` and VAR=value words."""
    i = 0
    if i < len(argv) and os.path.basename(argv[i]) == "env":
        i += 1
    while i < len(argv) and ENV_ASSIGNMENT.match(argv[i]):
        i += 1
    if i >= len(argv):
        return "other", i
    program = os.path.basename(argv[i])
    if program == "accelerate" and tuple(argv[i + 1:i + 2]) == ("launch",):
        return "accelerate", i + 2
    if program in ("accelerate-launch", "torchrun", "deepspeed"):
        return {"accelerate-launch": "accelerate"}.get(program, program), i + 1
    if re.fullmatch(r"python[0-9.]*", program):
        j = i + 1
        while j < len(argv) and argv[j].startswith("-") and argv[j] != "-m" and not argv[j].startswith("-m"):
            j += 1  # the interpreter's own flags: -u, -O, -X dev, ...
            if argv[j - 1] in ("-X", "-W") and j < len(argv):
                j += 1
        if j < len(argv) and argv[j].startswith("-m"):
            module = argv[j][2:] or (argv[j + 1] if j + 1 < len(argv) else "")
            start = j + (1 if argv[j][2:] else 2)
            return LAUNCHER_MODULES.get(module, "other"), start
        return "python", j
    return "other", i


# Launchers whose parsers give each option of several words both spellings (`--nproc-per-node` and
# `--nproc_per_node`); DeepSpeed's runner has the underscored ones only. Options under another dest.
BOTH_SPELLINGS = frozenset(("accelerate", "torchrun"))
DEST = {"deepspeed": {"num_accelerators": "num_gpus"}}
LEGACY_LAUNCH_OPTIONS = frozenset(("use_env",))  # python -m torch.distributed.launch's, not torchrun's


@functools.lru_cache(maxsize=4096)  # the same few options on every node's launcher: 16,384 of them for doctor
def _full_name(launcher: str, option: str, legacy_launch: bool = False) -> Optional[str]:
    """The name (dest) of the option the launcher's argparse reads OPTION as (without its dashes): the option itself,
    or the one option string it abbreviates, or None (unknown, or ambiguous: argparse counts both spellings of a
    name, so `--nproc` could be --nproc-per-node or --nproc_per_node and stops the launch)."""
    known = OPTIONS.get(launcher)
    if known is None:
        return canonical(option)
    if launcher == "torchrun" and not legacy_launch:
        known = known - LEGACY_LAUNCH_OPTIONS
    spellings = {name: name for name in known}
    if launcher in BOTH_SPELLINGS:
        spellings.update({name.replace("_", "-"): name for name in known})
    dest = DEST.get(launcher, {})
    if option in spellings:
        return dest.get(spellings[option], spellings[option])
    matches = [name for text, name in spellings.items() if text.startswith(option)]
    return dest.get(matches[0], matches[0]) if len(matches) == 1 else None


def known_option(launcher: str, word: str) -> bool:
    """Whether the launcher's parser reads WORD (`--nnodes`, `--nnodes=2`) as one of its own options."""
    if not word.startswith("--"):
        return word[:2] in SHORT.get(launcher, {})
    name = word[2:].partition("=")[0]
    if launcher == "accelerate":
        return canonical(name) in ACCELERATE_OPTIONS
    return launcher in OPTIONS and _full_name(launcher, name) is not None


def parse(argv: Sequence[str]) -> LaunchCommand:
    """The launch command as its launcher reads it. Never raises: what cannot be read is `problem`."""
    argv = tuple(str(a) for a in argv)
    launcher, i = launcher_of(argv)
    env: Dict[str, str] = {}
    for word in argv[:i]:
        if ENV_ASSIGNMENT.match(word):
            name, value = word.split("=", 1)
            env[name] = value
    start = next((k for k, w in enumerate(argv) if w not in ("env",) and not ENV_ASSIGNMENT.match(w)), 0)
    program = os.path.basename(argv[start]) if start < len(argv) else ""
    if launcher == "other":
        return LaunchCommand(argv, launcher, program, env=env)
    if launcher == "python":
        script = argv[i] if i < len(argv) else None
        return LaunchCommand(argv, launcher, program, {}, script, argv[i + 1:], env)
    flags, short = FLAGS[launcher], SHORT[launcher]
    legacy_launch = any(w.endswith("torch.distributed.launch") for w in argv[:i])  # python -m torch.distributed.launch
    options: Dict[str, Value] = {}
    given: List[Tuple[str, Value]] = []
    problem = None
    while i < len(argv):
        word, full = argv[i], None
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        if word.startswith("--"):
            name, has_value, value = word.partition("=")
            full = _full_name(launcher, name[2:], legacy_launch)
            key = full or canonical(name)
        elif word[:2] in short:
            key, has_value, value = short[word[:2]], bool(word[2:]), word[2:]
        else:
            problem = f"unknown option {word!r}"
            key, has_value, value = canonical(word), "", ""
        known = ACCELERATE_OPTIONS if launcher == "accelerate" else OPTIONS.get(launcher)
        if word.startswith("--") and known is not None and (full is None or key not in known or
                                                             word.startswith("---")) and problem is None:
            kind = "unknown option" if launcher == "accelerate" else "unknown or ambiguous option"  # abbreviations
            problem = f"{kind} {word.split('=', 1)[0]!r}"
        if key in flags:
            if has_value and problem is None:
                problem = f"{word}: {word.split('=', 1)[0]} takes no value"
            options[key] = True
            i += 1
        elif has_value:
            options[key] = value
            i += 1
        elif i + 1 < len(argv):
            options[key] = argv[i + 1]
            if LOOKS_LIKE_AN_OPTION.match(argv[i + 1]) and problem is None:  # argparse will not take it as the value
                problem = f"{word} expected one argument (argparse reads {shorten(argv[i + 1])} as an option)"
            i += 2
        else:
            problem = f"{word} needs a value"
            i += 1
            continue
        given.append((key, options[key]))
    script = argv[i] if i < len(argv) else None
    return LaunchCommand(argv, launcher, program, options, script, argv[i + 1:], env, problem, tuple(given))


# The main process port of torchrun, accelerate and DeepSpeed's runner when nothing names one (torch.distributed's
# MASTER_PORT default), and so preflight's.
DEFAULT_PORT = 29500
MULTI_LAUNCHERS = ("accelerate", "torchrun", "deepspeed")  # each starts its node's processes itself
LAUNCHER_NAMES = {"accelerate": "accelerate launch", "torchrun": "torchrun", "deepspeed": "DeepSpeed's runner",
                  "python": "python"}
LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1", "0.0.0.0")  # each node's own: no way to reach the head

# The flags that tell a node of a multi-node accelerate launch who it is: `preflight launch` sets them on each
# node (rank_command), and the plan leaves the user's own values of them out of what it judges.
RANK_FLAGS = ("machine_rank", "main_process_ip", "main_process_port", "num_machines")


def is_accelerate_launch(command: Sequence[str]) -> bool:
    """`accelerate launch ...` (any path to accelerate): the launcher preflight starts on every node."""
    return len(command) >= 2 and os.path.basename(command[0]) == "accelerate" and command[1] == "launch"


def rank_command(command: Sequence[str], rank: int, address: str, port: int, machines: int) -> List[str]:
    """The command for the node of this rank: the four flags after `accelerate launch`, the user's own
    values of them dropped (only among the launcher's options: the script's arguments are left alone)."""
    head, rest = list(command[:2]), list(command[2:])
    kept: List[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word == "--" or not word.startswith("-") or word == "-":
            break  # the script (or `--` before it): from here on, nothing is ours to change
        name = canonical(word.split("=", 1)[0])
        width = 1 if "=" in word or SHORT["accelerate"].get(word, name) in FLAGS["accelerate"] else 2
        if name not in RANK_FLAGS:
            kept.extend(rest[i:i + width])
        i += width
    flags = ["--machine_rank", str(rank), "--main_process_ip", address, "--main_process_port", str(port),
             "--num_machines", str(machines)]
    return head + flags + kept + rest[i:]
