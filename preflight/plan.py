"""The plan: what the job asks for, built once from the inputs and never changed."""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple

from preflight.inputs.documents import InputError, syntax_by_name
from preflight.inputs.inventory import head_first
from preflight.inputs.launchcmd import DEFAULT_PORT, RANK_FLAGS, is_accelerate_launch
from preflight.inputs.configs import (
    AccelerateConfig,
    DISTRIBUTED_TYPES,
    SAGEMAKER_DISTRIBUTED_TYPES,
    DeepSpeedConfig,
    FlagDocument,
    Hostfile,
    load_accelerate_config,
    load_deepspeed_config,
    load_hostfile,
    resolve_beside,
    runner_resources,
    with_values,
)

if TYPE_CHECKING:
    from preflight.inputs.launchcmd import LaunchCommand
    from preflight.inputs.profile import Profile


@dataclass(frozen=True)
class Limits:
    """Thresholds the checks compare against (expectations live here, not in the checks)."""

    clock_warn_s: float = 0.1
    clock_fail_s: float = 1.0
    shm_fail_bytes: int = 512 * 2**20
    shm_warn_bytes: int = 2**30
    nofile_warn: int = 4096
    disk_warn_bytes: int = 10 * 2**30
    min_busbw_gbps: Optional[float] = None  # --min-busbw: the all-reduce's bus bandwidth below this fails COL002


@dataclass(frozen=True)
class Plan:
    accelerate: Optional[AccelerateConfig] = None
    deepspeed: Optional[DeepSpeedConfig] = None
    hostfile: Optional[Hostfile] = None
    world_size_override: Optional[int] = None
    # deepspeed_config_file as the accelerate config names it, resolved; None when it names none
    deepspeed_file_named: Optional[str] = None
    # deepspeed_hostfile as the accelerate config names it, resolved; read as the hostfile when --hostfile is not given
    hostfile_named: Optional[str] = None
    deep: bool = False  # also run accelerate's and DeepSpeed's own validators
    nodes: Tuple[str, ...] = ()  # the first is the head; empty for lint
    remote: bool = False  # nodes are reached over SSH (else: this machine, in-process)
    port: int = DEFAULT_PORT
    port_named: bool = True  # by --port, the launch command or the config here (else: each node's own config)
    limits: Limits = Limits()
    checkpoint_dir: Optional[str] = None
    resume_from: Optional[str] = None  # --resume-from: the checkpoint the job loads (CKPT)
    resume_named_by: Optional[str] = None  # the launch command's flag that named it, without --resume-from
    profile: Optional["Profile"] = None  # pins and per-host expectations (its thresholds are in limits)
    command: Tuple[str, ...] = ()  # the launch command (after `--`): its flags override the files
    config_path: Optional[str] = None  # --config as given: each node resolves it in the job's directory
    deepspeed_path: Optional[str] = None  # --deepspeed as given
    workdir: Optional[str] = None  # the job's working directory on every node (this one's)
    expand_vars: bool = True  # $VAR in the command is each node's; `launch` over SSH quotes every word
    sets_ranks: bool = False  # `launch` over SSH gives each node its rank flags (preflight.gate.launcher)
    runs_here: bool = False  # `launch` execs the command on the head alone: the other nodes start their own
    python: Optional[str] = None  # --python: the interpreter whose versions the facts hold
    memory: Optional[Any] = None  # preflight.inputs.models.Inputs: --model, --gpu-memory, --host-memory, --seq-len
    batch: Optional[Any] = None  # preflight.inputs.batchscript.BatchScript: --sbatch; its launch line is `command`
    manifest: Optional[Any] = None  # preflight.inputs.manifests.Manifest: --k8s; its main container's launch is `command`

    @property
    def head(self) -> Optional[str]:
        return self.nodes[0] if self.nodes else None

    @property
    def main_address(self) -> Optional[str]:
        """main_process_ip of the accelerate config: the address the workers will connect to."""
        ip = self.accelerate.data.get("main_process_ip") if self.accelerate is not None else None
        return ip if isinstance(ip, str) and ip else None

    @functools.cached_property  # once per plan (a frozen dataclass keeps it in its __dict__), not once per node
    def paths(self) -> dict:
        """Folders whose existence and free space every node reports, as the job sees them (job_path)."""
        paths = {}
        if self.checkpoint_dir:
            paths["checkpoint_dir"] = self.job_path(self.checkpoint_dir)
        if self.deepspeed is not None:
            for block in ("offload_param", "offload_optimizer"):
                nvme = self.deepspeed.get("zero_optimization", block, "nvme_path")
                if isinstance(nvme, str) and nvme:
                    paths[f"{block}.nvme_path"] = self.job_path(nvme)
        return paths

    @property
    def load_universal(self) -> bool:
        """The job loads a universal checkpoint (load_checkpoint reads `latest_universal`): its DeepSpeed config sets
        checkpoint.load_universal, or Megatron-DeepSpeed's --universal-checkpoint does (megatron/training.py:
        _create_ds_config_dict)."""
        from preflight.inputs.settings import megatron_switch

        return self.deepspeed is not None and self.deepspeed.get("checkpoint", "load_universal") is True or \
            megatron_switch(self, "--universal-checkpoint")

    @functools.cached_property
    def resume(self) -> Optional[dict]:
        """What this machine reads of the checkpoint given with --resume-from (preflight.node.checkpoint), once."""
        if not self.resume_from:
            return None
        from preflight.node import checkpoint

        named_by = self.resume_named_by or "--resume-from"
        if "$" in self.resume_from:  # a variable of the batch script's or the node's, set when the job runs
            return {"path": self.resume_from, "named_by": named_by, "at_run_time": True}
        facts = checkpoint.read(self.job_path(self.resume_from), universal=self.load_universal)
        facts["named_by"] = named_by
        return facts

    @functools.cached_property
    def conditions(self) -> tuple:
        """The job's answers to the known-defects table's conditions, and why the others are not known
        (preflight.inputs.settings.job_conditions): once per plan, not once per node."""
        from preflight.inputs.settings import job_conditions

        return job_conditions(self)

    @functools.cached_property
    def degrees(self) -> tuple:
        """The job's tensor- and pipeline-parallel degrees where its launch or DeepSpeed config names them, and why
        the others are not known (preflight.inputs.settings.parallel_degrees)."""
        from preflight.inputs.settings import parallel_degrees

        return parallel_degrees(self)

    @functools.cached_property
    def module_only(self) -> tuple:
        """(where the launch asks DeepSpeed for a module-only load, or None; a note on a flag that does not) (preflight.
        inputs.settings.module_only_load)."""
        from preflight.inputs.settings import module_only_load

        return module_only_load(self)

    @functools.cached_property
    def sequence_parallel(self) -> Optional[tuple]:
        """The job's sequence-parallel degree and the data-parallel size ZeRO partitions over where the config fixes it
        (preflight.inputs.settings.sequence_parallel)."""
        from preflight.inputs.settings import sequence_parallel

        return sequence_parallel(self)

    def job_path(self, path: str) -> str:
        """A relative path as the job reads it: from the job's working directory (where `launch` starts it on
        every node), not from wherever a node's session starts (its home)."""
        return os.path.join(self.workdir, path) if self.workdir and not os.path.isabs(path) else path

    @property
    def launch(self) -> Optional["LaunchCommand"]:
        """The launch command after `--` as its launcher reads it (preflight.inputs.launchcmd), or None without one."""
        from preflight.inputs import launchcmd

        return launchcmd.parse(self.command) if self.command else None

    @property
    def world_size(self) -> Tuple[Optional[int], str]:
        """The number of processes of the whole job, and where that number comes from."""
        if self.world_size_override:
            return self.world_size_override, "--world-size"
        if self.accelerate is not None:
            procs = self.accelerate.integer("num_processes")
            if procs is not None and procs > 0:
                return procs, f"num_processes in {self.accelerate.doc.path}"
        if self.hostfile is not None:
            return self.runner_world(self.hostfile)
        return None, "unknown (give --world-size, an accelerate config or a hostfile)"


    def runner_world(self, hostfile: Hostfile) -> Tuple[int, str]:
        """The processes DeepSpeed's runner starts over the hostfile: every slot, or those a deepspeed command's
        --include/--exclude/--num_nodes/--num_gpus leave (where the runner stops on them, CFG007/CFG021 say so)."""
        every = sum(e.slots for e in hostfile.entries), f"the slots of {hostfile.path}"
        command = self.launch
        if command is None or command.launcher != "deepspeed":
            return every
        given = {k: command.get(k) for k in ("include", "exclude", "num_nodes", "num_gpus")
                 if isinstance(command.get(k), str)}
        counts = {k: command.integer(k) for k in ("num_nodes", "num_gpus") if k in given}
        if not given or None in counts.values():
            return every
        resources, _ = runner_resources({e.host: e.slots for e in hostfile.entries}, given.get("include", ""),
                                        given.get("exclude", ""), counts.get("num_nodes", -1),
                                        counts.get("num_gpus", -1))
        if resources is None:
            return every
        flags = " ".join(f"--{k} {v}" for k, v in given.items())
        return sum(resources.values()), f"what DeepSpeed's runner starts over {hostfile.path} with {flags}"


def default_accelerate_config() -> Optional[str]:
    """accelerate's default config file, as `accelerate launch` finds it, when it exists."""
    from preflight.node.launchfiles import accelerate_default_config

    path = accelerate_default_config()
    return path if os.path.isfile(path) else None


def build_plan(
    config: Optional[str] = None,
    deepspeed: Optional[str] = None,
    hostfile: Optional[str] = None,
    world_size: Optional[int] = None,
    deep: bool = False,
    nodes: Optional[Tuple[str, ...]] = None,
    port: Optional[int] = None,
    limits: Limits = Limits(),
    checkpoint_dir: Optional[str] = None,
    resume_from: Optional[str] = None,
    resume_named_by: Optional[str] = None,
    profile: Optional["Profile"] = None,
    command: Tuple[str, ...] = (),
    config_path: Optional[str] = None,
    launching: bool = False,
    python: Optional[str] = None,
    memory: Optional[Any] = None,
    batch: Optional[Any] = None,
    manifest: Optional[Any] = None,
) -> Plan:
    """Load every input; unreadable input raises InputError (exit 2).

    nodes None: a lint, no node at all; () : this machine alone; names: those nodes over SSH."""
    # A config the launch names that the batch script writes itself, with a text known before it runs: read from the
    # script (its keys on the script's lines), as the launcher will read the file.
    written = {reader: h for reader, _, h in batch.named_configs() if not h.runtime and not h.unset} if batch else {}
    accel = load_accelerate_config(config) if config else None
    if accel is None and "accelerate" in written:
        h = written["accelerate"]
        accel = _written(lambda: load_accelerate_config(batch.path, h.document_text(), syntax_by_name(h.name)))
    # `launch` over SSH sets each node's rank, head and machine count itself (preflight.gate.launcher).
    ignored = RANK_FLAGS if launching and nodes else ()
    if accel is not None and command:  # -- COMMAND: its flags over the file, as accelerate merges them
        accel = with_launch_flags(accel, command, ignored)
    elif accel is None and command and not nodes:  # remote nodes may hold a default config this machine lacks
        accel = launch_flags_alone(command, ignored)
    named = hostfile_named = None
    if accel is not None and accel.uses_deepspeed:  # other types never read the section
        section = accel.deepspeed_section
        name = section.data.get("deepspeed_config_file") if section is not None else None
        if isinstance(name, str) and name.strip():
            named = resolve_beside(name, accel.doc.path)
        name = section.data.get("deepspeed_hostfile") if section is not None else None
        if isinstance(name, str) and name.strip() and name != "None":
            hostfile_named = resolve_beside(name, accel.doc.path)
    if hostfile is None and hostfile_named and accel.hostfile_unread is None and os.path.isfile(hostfile_named):
        hostfile = hostfile_named
    ds_path = deepspeed or (named if named and os.path.isfile(named) else None)
    config_port = accel.integer("main_process_port") if accel is not None else None
    config_port = config_port if config_port and 1 <= config_port <= 65535 else None  # else CFG010 says so
    remote = bool(nodes)
    if nodes is not None:
        main_ip = accel.data.get("main_process_ip") if accel is not None else None
        nodes = tuple(head_first(list(nodes), main_ip)) if nodes else (socket.gethostname(),)
    return Plan(
        accelerate=accel,
        deepspeed=load_deepspeed_config(ds_path) if ds_path else _written(lambda: load_deepspeed_config(
            batch.path, written["deepspeed"].document_text())) if "deepspeed" in written else None,
        hostfile=load_hostfile(hostfile) if hostfile else None,
        world_size_override=world_size,
        deepspeed_file_named=named,
        hostfile_named=hostfile_named,
        deep=deep,
        nodes=nodes or (),
        remote=remote,
        port=port or config_port or DEFAULT_PORT,
        port_named=bool(port or config_port),
        limits=limits,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume_from,
        resume_named_by=resume_named_by,
        profile=profile,
        command=tuple(command),
        config_path=config_path,
        deepspeed_path=deepspeed,
        workdir=os.getcwd(),
        expand_vars=not (launching and remote and is_accelerate_launch(command)),
        sets_ranks=launching and remote,
        runs_here=launching and remote and not is_accelerate_launch(command),
        python=python,
        memory=memory,
        batch=batch,
        manifest=manifest,
    )


def _written(load):
    """A config the batch script writes, as its launcher will read it; None where it does not read (CFG076 says why:
    a finding of the script, not bad input to preflight)."""
    try:
        return load()
    except InputError:
        return None


# The effective launch's fields (preflight.job.view.launch) that come from accelerate's config, by key path.
LAUNCH_FIELDS = {
    "num_processes": ("num_processes",), "num_machines": ("num_machines",), "machine_rank": ("machine_rank",),
    "main_ip": ("main_process_ip",), "main_port": ("main_process_port",), "mixed_precision": ("mixed_precision",),
    "gpu_ids": ("gpu_ids",), "distributed_type": ("distributed_type",),
    "zero_stage": ("deepspeed_config", "zero_stage"),
    "gradient_accumulation_steps": ("deepspeed_config", "gradient_accumulation_steps"),
    "deepspeed_config_file": ("deepspeed_config", "deepspeed_config_file"),
    "multinode_launcher": ("deepspeed_config", "deepspeed_multinode_launcher"),
    "hostfile": ("deepspeed_config", "deepspeed_hostfile"),
    "fsdp_auto_wrap_policy": ("fsdp_config", "fsdp_auto_wrap_policy"),
    "fsdp_min_num_params": ("fsdp_config", "fsdp_min_num_params"),
}


def launch_flags_alone(command: Tuple[str, ...], ignored: Tuple[str, ...] = ()) -> Optional[AccelerateConfig]:
    """`accelerate launch FLAGS` with no config file (none named, no default one here): its flags alone, which
    accelerate launches over its own defaults; None for another launcher, or a command naming a config file
    that only the nodes have."""
    from preflight.inputs import launchcmd

    cmd = launchcmd.parse(command)
    if cmd.launcher != "accelerate" or cmd.get("config_file") is not None:
        return None
    bare = AccelerateConfig(FlagDocument("the launch command", {}, "flags"), from_command=True)
    return dataclasses.replace(with_launch_flags(bare, command, ignored), from_command=True)


def with_launch_flags(accel: AccelerateConfig, command: Tuple[str, ...], ignored: Tuple[str, ...] = ()) -> AccelerateConfig:
    """The accelerate config as `accelerate launch` COMMAND sees it: a flag wins where it is given.

    The merge rules are preflight.job.view.launch's (one place for accelerate's _validate_launch_command);
    here only the values that came from a flag are written over the file's, each named by its flag."""
    from preflight.inputs import launchcmd
    from preflight.job import view

    cmd = launchcmd.parse(command)
    if ignored:
        cmd = dataclasses.replace(cmd, options={k: v for k, v in cmd.options.items() if k not in ignored})
    if cmd.launcher != "accelerate" or not cmd.options:
        return accel
    path = accel.doc.path
    effective = view.launch("lint", {"config": {"path": path, "doc": accel.doc}}, cmd)  # read once (a pipe too)
    flags = {}
    for field, keys in LAUNCH_FIELDS.items():
        source = effective["sources"].get(field, "")
        if isinstance(source, str) and source.startswith("flag --"):
            flags[keys] = (effective.get(field), source)
    written = accel.data.get("distributed_type")
    if isinstance(written, str) and written not in DISTRIBUTED_TYPES + SAGEMAKER_DISTRIBUTED_TYPES:
        flags.pop(("distributed_type",), None)  # accelerate still loads the file, and stops on it (CFG002 says so)
    cpu = cmd.flag("cpu")
    if not flags and not cpu:
        return accel
    return AccelerateConfig(with_values(accel.doc, flags) if flags else accel.doc, cpu=cpu)
