"""CFG world: the machines and processes the job starts. machine_rank within num_machines, num_processes over
the machines and their GPUs (gpu_ids), and the hostfile against both."""
from __future__ import annotations

from typing import Iterator, Mapping

from preflight.api import Finding, check, fail, skip, warn
from preflight.checks.config.common import accel_doc, at, files_unknown, from_shell, yaml_word
from preflight.inputs.configs import MULTI_TYPES, accelerate_launcher, gpu_id_items, runner_resources
from preflight.inputs.documents import Document, shorten
from preflight.inputs.numbers import is_int, text_number
from preflight.inputs.settings import processes_per_machine


@check("CFG011", "machine-rank", "config", tags=["accelerate", "multinode"])
def machine_rank(ctx) -> Iterator[Finding]:
    """num_machines is at least 1 and machine_rank lies in [0, num_machines).

    A rank outside the range makes that node wait for a rendezvous that can never complete; the other
    nodes hang until the timeout. A num_machines below 1 launches on one machine, and on one machine the
    rank is not read (warnings).

    Give each machine its own rank from 0 to num_machines - 1 (0 on the head); `preflight launch`
    sets it per node for you.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    machines, rank = text_number(doc.data.get("num_machines", 1)), text_number(doc.data.get("machine_rank", 0))
    if is_int(machines) and machines < 1:
        if machines == 0 and doc.data.get("use_cpu") is True:  # commands/launch.py, unless OMP_NUM_THREADS is set
            yield fail(f"{doc.where('num_machines')}: num_machines is 0 with use_cpu: accelerate launch divides "
                       "num_processes by it to share the CPU threads and stops (ZeroDivisionError)",
                       f"set {doc.setting('num_machines')} to the number of nodes (1 for one)", value=machines,
                       **at(doc, "num_machines"))
            return
        # Every launcher tests `num_machines > 1` (utils/launch.py): below 1 is the one-machine launch.
        yield warn(f"{doc.where('num_machines')}: num_machines is {machines}; accelerate launches the job on this "
                   "machine alone, as with num_machines: 1", f"set {doc.setting('num_machines')} to the number of "
                   "nodes (1 for one)",
                   value=machines, **at(doc, "num_machines"))
        return
    unranked = "machine_rank" in doc.data and doc.data["machine_rank"] is None or \
        ctx.plan.accelerate.from_command and "machine_rank" not in doc.data  # the flag's default is None
    launcher = "simple" if ctx.plan.accelerate.cpu else accelerate_launcher(doc.data.get("distributed_type"))
    if is_int(machines) and machines > 1 and unranked and launcher != "simple":
        given = "not given" if ctx.plan.accelerate.from_command else "null"
        yield fail(f"{doc.where('machine_rank')}: machine_rank is {given} over {machines} machines; accelerate launch "
                   "stops on int(None) (TypeError)",
                   f"set {doc.setting('machine_rank')} to this machine's rank, 0 to {machines - 1}",
                   **at(doc, "machine_rank"))
    elif is_int(machines) and is_int(rank) and not 0 <= rank < machines and machines == 1:
        # Read only over several machines (utils/launch.py): a per-node copy that left num_machines at 1
        yield warn(f"{doc.where('machine_rank')}: machine_rank is {rank} with num_machines 1: accelerate reads it "
                   "only over several machines, so this machine runs the job alone",
                   f"if this is one machine of several, set {doc.setting('num_machines')} to their number; else "
                   f"set {doc.setting('machine_rank')} to 0", value=rank, **at(doc, "machine_rank"))
    elif is_int(machines) and is_int(rank) and not 0 <= rank < machines and not ctx.plan.accelerate.head_runner:
        yield fail(f"{doc.where('machine_rank')}: machine_rank is {rank}, expected 0 to {machines - 1} "
                   f"(num_machines is {machines})", f"set {doc.setting('machine_rank')} between 0 and {machines - 1}",
                   value=rank, **at(doc, "machine_rank"))


@check("CFG020", "process-counts", "config", tags=["accelerate", "multinode", "gpu"])
def process_counts(ctx) -> Iterator[Finding]:
    """num_processes is the total over all machines, divides evenly by num_machines, and every machine has
    a GPU in gpu_ids for each of its processes.

    accelerate starts num_processes // num_machines processes per machine: a total that does not divide
    leaves processes out, and the common per-node reading (num_processes = GPUs per node) silently halves
    the job. Fewer gpu_ids than processes per machine puts two processes on one GPU or fails with an
    invalid device ordinal; a gpu_ids that YAML read as a number crashes accelerate. With distributed_type
    'NO', accelerate starts one process whatever num_processes says, and machines that never meet; MULTI_CPU
    and --cpu start one process a machine (mpirun its share of num_processes) and need no GPU.

    Set num_processes to num_machines x GPUs per machine, and list at least that many GPUs per machine
    in gpu_ids as a quoted string ('0,1,2,3'), or 'all'.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    data = doc.data
    procs, machines = text_number(data.get("num_processes")), text_number(data.get("num_machines", 1))
    if is_int(machines) and machines < 1:
        machines = 1  # accelerate's one-machine launch (CFG011 says so)
    dtype = data.get("distributed_type")
    # The simple launcher starts one process whatever num_processes says, and never meets other machines.
    simple = ctx.plan.accelerate.simple_launch
    if simple:
        shown = yaml_word(dtype)
        if is_int(machines) and machines > 1:
            yield fail(f"{doc.where('num_machines')}: num_machines is {machines} but distributed_type is {shown}: "
                       "accelerate launches the script as one process on each machine, with no distributed setup, "
                       f"so the {machines} machines each train alone and never meet",
                       "set distributed_type: MULTI_GPU (or DEEPSPEED, FSDP) for a job over several machines",
                       num_machines=machines, distributed_type=dtype, **at(doc, "num_machines"))
        elif is_int(procs) and procs > 1:
            yield warn(f"{doc.where('num_processes')}: num_processes is {procs} but distributed_type is {shown}: "
                       f"accelerate launches one process, not {procs}",
                       f"set distributed_type: MULTI_GPU (or DEEPSPEED, FSDP) to start {procs} processes, or "
                       "num_processes: 1", num_processes=procs, distributed_type=dtype, **at(doc, "num_processes"))
    # accelerate gives num_processes a default for 'NO' only (config_args.py process_config); else -1 stops launch.
    # A SageMaker config has no such key: SageMaker sizes the job by its instances.
    # Without a config file accelerate counts the GPUs instead.
    # ('NO' gets num_processes 1 only when the key is missing: an explicit -1 stops it too)
    if "distributed_type" in data and (dtype != "NO" or procs == -1) and \
            (procs is None or (is_int(procs) and procs < 1)) and \
            not ctx.plan.accelerate.is_sagemaker and not ctx.plan.accelerate.from_command:
        # A file meant to be completed by the launch command's --num_processes (SLURM scripts do) works: a
        # failure only when that command is known and does not pass it either.
        said = (f"{doc.where('num_processes')}: num_processes is {'not set' if procs is None else procs}; "
                "accelerate launch stops with 'You need to manually pass in `--num_processes`'")
        if ctx.plan.command:
            yield fail(said, "set num_processes to the total number of processes over all machines (or pass "
                       "--num_processes to accelerate launch)", **at(doc, "num_processes"))
        else:  # without the launch command: not judged
            yield skip(said + " unless the launch command passes --num_processes (not judged without it)",
                       **at(doc, "num_processes"))
    if not (is_int(procs) and is_int(machines) and procs > 0 and machines > 0):
        return
    # MULTI_CPU and --cpu run the simple launcher: one process a machine, or mpirun's share of num_processes with
    # an mpirun hostfile; GPUs are not theirs to need (accelerate/utils/launch.py prepare_simple_launcher_cmd_env).
    on_cpu = not simple and (ctx.plan.accelerate.cpu or accelerate_launcher(dtype) == "simple")
    mpirun = isinstance(data.get("mpirun_config"), Mapping) and data["mpirun_config"].get("mpirun_hostfile")
    if procs % machines and not simple and (mpirun or not on_cpu) and ctx.plan.accelerate.runner is not None:
        per = procs // machines  # accelerate's --num_gpus to DeepSpeed's runner, which keeps every slot for 0
        yield warn(f"{doc.where('num_processes')}: num_processes {procs} does not divide by num_machines {machines}; "
                   f"accelerate passes --num_gpus {per} to DeepSpeed's runner, which starts "
                   + (f"{per} processes on each host" if per else "one on every slot of the hostfile"),
                   f"set {doc.setting('num_processes')} to a multiple of {machines}, such as {max(per, 1) * machines}",
                   num_processes=procs, num_machines=machines, **at(doc, "num_processes"))
        return
    if procs % machines and not simple and (mpirun or not on_cpu):
        per = procs // machines
        yield fail(f"{doc.where('num_processes')}: num_processes {procs} does not divide by num_machines {machines}; "
                   f"accelerate would start {per} per machine ({per * machines} in all)",
                   f"set {doc.setting('num_processes')} to a multiple of {machines}, such as {max(per, 1) * machines}",
                   num_processes=procs, num_machines=machines, **at(doc, "num_processes"))
        return
    per_machine = procs // machines
    ids_value = data.get("gpu_ids")
    if isinstance(ids_value, str) and ids_value != "all" and len(ids_value.split(",")) < 2 and dtype in MULTI_TYPES \
            and machines <= 1 and not ctx.plan.accelerate.from_command:
        # accelerate's own test, with a config file, whatever --cpu says (commands/launch.py _validate_launch_command)
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids is {shorten(ids_value)} under {dtype} on one machine; accelerate "
                   "launch stops with 'Less than two GPU ids were configured and tried to run on multiple GPUs'",
                   f"set {doc.setting('gpu_ids')} to two GPUs or more (such as '0,1'), or 'all'", **at(doc, "gpu_ids"))
        return
    if is_int(ids_value):
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids is the number {ids_value}, expected a string; accelerate crashes "
                   "with \"'int' object has no attribute 'split'\"", f"quote it: gpu_ids: '{ids_value}'",
                   **at(doc, "gpu_ids"))
        return
    listed = gpu_id_items(ids_value) if isinstance(ids_value, str) and ids_value.strip().lower() != "all" else None
    if ctx.plan.accelerate.hostfile_unread is None and not (simple or on_cpu):
        # DeepSpeed's runner: gpu_ids reach only the runner's own environment; on every node DeepSpeed's launch sets
        # the visible GPUs from the hostfile's slots (utils/launch.py, deepspeed/launcher/launch.py). Without a host
        # filter accelerate passes it --num_gpus num_processes // num_machines (prepare_deepspeed_cmd_env).
        section = ctx.plan.accelerate.deepspeed_section
        filtered = section is not None and any(section.data.get(k) is not None for k in (
            "deepspeed_inclusion_filter", "deepspeed_exclusion_filter"))
        if listed is not None and not filtered:
            yield from _per_node_reading(doc, procs, machines, len(listed),
                                         f"accelerate passes --num_gpus {per_machine} to DeepSpeed's runner, so each "
                                         f"node runs {per_machine} processes and leaves the other "
                                         f"{procs - per_machine} of its {procs} GPUs idle")
        # --num_gpus N gives every host the slots 0 to N-1 (deepspeed/launcher/runner.py apply_num_nodes_and_gpus):
        # gpu_ids that list just those say what runs
        same = not filtered and listed == [str(i) for i in range(per_machine)]
        if ids_value is not None and ids_value != "all" and not same:
            yield warn(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} is not read: under DeepSpeed's runner each "
                       "node uses the GPUs of its hostfile slots", "delete gpu_ids; limit the GPUs with the "
                       "hostfile's slots or deepspeed_inclusion_filter", **at(doc, "gpu_ids"))
        return
    if isinstance(ids_value, str) and ids_value != "all" and not listed and not on_cpu:
        # accelerate compares it with 'all' exactly (commands/launch.py) and otherwise exports it as
        # CUDA_VISIBLE_DEVICES, where it names no GPU (utils/launch.py; torch reads no index there)
        yield (warn if simple else fail)(
            f"{doc.where('gpu_ids')}: gpu_ids is {ids_value!r}, not 'all': accelerate compares it with 'all' exactly "
            f"and exports CUDA_VISIBLE_DEVICES={ids_value!r}, which hides every GPU"
            + (": the process runs on the CPU" if simple else " (with MULTI_GPU on one machine it stops: 'Less than "
               "two GPU ids')"), f"set {doc.setting('gpu_ids')} to 'all'", **at(doc, "gpu_ids"))
        return
    ids = listed
    if not ids:  # 'all' (in any case) or unset; a value that names no GPU is failed above
        return
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        stops = "" if bad == [ids[-1]] else f": torch stops reading CUDA_VISIBLE_DEVICES at {bad[0]!r}, and " \
            "never sees the GPUs after it"
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} holds {', '.join(map(repr, bad))}, "
                   f"expected GPU indices separated by commas{stops}", "write gpu_ids like '0,1,2,3', or 'all'",
                   **at(doc, "gpu_ids"))
        return
    if len(set(ids)) != len(ids):  # torch: "Repeated ordinal results in empty set"
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids {ids_value!r} lists a GPU twice; torch then sees no GPU at all",
                   "list each GPU index once", **at(doc, "gpu_ids"))
        return
    if simple or on_cpu:  # one process, or processes on CPUs: any GPU listed will do
        return
    if machines > 1 and procs == len(ids):
        yield from _per_node_reading(doc, procs, machines, len(ids), f"each machine runs only {per_machine}")
    elif len(ids) < per_machine:
        yield fail(f"{doc.where('gpu_ids')}: gpu_ids lists {len(ids)} GPUs but each machine runs {per_machine} "
                   f"processes (num_processes {procs} / num_machines {machines})",
                   f"every machine runs num_processes / num_machines = {per_machine} processes and needs that many "
                   f"GPUs: on each machine set gpu_ids to {per_machine} of its GPUs (or 'all'), or lower num_processes "
                   f"to {len(ids) * machines} if every machine has only {len(ids)}",
                   gpu_ids=len(ids), processes_per_machine=per_machine, **at(doc, "gpu_ids"))


def _per_node_reading(doc: Document, procs: int, machines: int, listed: int, runs: str) -> Iterator[Finding]:
    """num_processes read as the processes of one machine, where it is the total over all: it equals the gpu_ids
    of one machine (accelerate divides it by num_machines, utils/launch.py)."""
    if machines > 1 and procs == listed:
        yield warn(f"{doc.where('num_processes')}: num_processes is {procs}, the number of gpu_ids of one machine, "
                   f"but it is the total over all {machines} machines: {runs}",
                   f"to use every listed GPU on every machine, set {doc.setting('num_processes')}: {procs * machines}",
                   num_processes=procs, num_machines=machines, gpu_ids=listed, **at(doc, "num_processes"))


@check("CFG021", "hostfile", "config", tags=["hostfile", "multinode", "deepspeed"])
def hostfile(ctx) -> Iterator[Finding]:
    """The hostfile lists each host once, as many hosts as num_machines, each with the slots (GPUs) that
    its processes need; a host filter (--include/--exclude) names only hosts and slots it lists.

    DeepSpeed's launcher refuses a hostfile with a host twice; a hostfile that disagrees with the
    accelerate config starts a different number of processes than the config and the batch arithmetic
    assume. accelerate reads its deepspeed_hostfile only over several machines with a launcher other than
    'standard'; elsewhere the key is a warning, as the job runs without it.

    Make the hostfile list num_machines distinct hosts, each with slots equal to num_processes /
    num_machines (or change the config to match the hostfile).
    """
    hf = ctx.plan.hostfile
    if hf is None:
        named = ctx.plan.hostfile_named
        if named and ctx.plan.accelerate is not None:
            doc = accel_doc(ctx)
            unread = ctx.plan.accelerate.hostfile_unread
            if unread:
                yield warn(f"{doc.where('deepspeed_config', 'deepspeed_hostfile')}: deepspeed_hostfile {named!r} is "
                           f"never read: {unread}", "delete deepspeed_hostfile, or set num_machines and "
                           "deepspeed_multinode_launcher for the hosts it lists", **at(doc, "deepspeed_config",
                                                                                         "deepspeed_hostfile"))
                return
            machines = ctx.plan.accelerate.integer("num_machines", 1)
            if files_unknown(ctx):
                yield skip(f"{doc.where('deepspeed_config', 'deepspeed_hostfile')}: deepspeed_hostfile {named!r} is "
                           "not here (the working directory, beside the config): DeepSpeed's runner opens it on the "
                           "head (`preflight check` asks it); not judged", **at(doc, "deepspeed_config",
                                                                                 "deepspeed_hostfile"))
                return
            yield fail(f"{doc.where('deepspeed_config', 'deepspeed_hostfile')}: deepspeed_hostfile {named!r} does not "
                       "exist (looked in the working directory and beside the config); DeepSpeed's runner warns "
                       f"'Unable to find hostfile' and trains on the head alone, not over {machines} machines",
                       "correct the path; the hostfile must exist on the head node",
                       **at(doc, "deepspeed_config", "deepspeed_hostfile"))
            return
        accel = ctx.plan.accelerate
        section = accel.deepspeed_section if accel is not None else None
        if accel is not None and accel.runner is not None and section is not None and not named:
            doc = accel_doc(ctx)
            written = section.data.get("deepspeed_hostfile")
            machines = accel.integer("num_machines", 1)
            yield fail(f"{doc.where('deepspeed_config')}: deepspeed_hostfile is "
                       f"{'not set' if written is None else shorten(written)}: accelerate passes `--hostfile "
                       f"{str(written) or repr('')}` to DeepSpeed's runner, which warns 'Unable to find hostfile' "
                       f"and trains on the head alone, not over {machines} machines", f"set {doc.setting('deepspeed_config')}"
                       ".deepspeed_hostfile to a hostfile listing the machines (`host slots=GPUS` a line)",
                       **at(doc, "deepspeed_config"))
            return
        yield skip("no hostfile given (--hostfile, or deepspeed_hostfile in the accelerate config)")
        return
    seen = {}
    for entry in hf.entries:
        if entry.host in seen:
            yield fail(f"{hf.path}:{entry.line}: host {entry.host!r} is listed again (first on line {seen[entry.host]}); "
                       "DeepSpeed refuses 'multiple entries' for a host", f"delete line {entry.line}",
                       host=entry.host, file=hf.path, line=entry.line)
        seen.setdefault(entry.host, entry.line)
    # The host filter DeepSpeed's runner applies to the hostfile: its own flags, or accelerate's keys under its runner
    command = ctx.plan.launch
    accel = ctx.plan.accelerate
    if command is not None and command.launcher == "deepspeed":
        include, exclude, given = command.get("include"), command.get("exclude"), "flags --include/--exclude"
    elif accel is not None and accel.runner is not None and accel.deepspeed_section is not None:
        section = accel.deepspeed_section.data
        include, exclude = section.get("deepspeed_inclusion_filter"), section.get("deepspeed_exclusion_filter")
        given = "deepspeed_inclusion_filter/deepspeed_exclusion_filter"
        include, exclude = (None, exclude) if exclude is not None else (include, None)  # one, exclude first
    else:
        include = exclude = None
    include, exclude = (v if isinstance(v, str) else "" for v in (include, exclude))
    problem = None if from_shell(include + exclude) else runner_resources({e.host: e.slots for e in hf.entries}, include, exclude)[1]
    if problem:
        yield fail(f"{hf.path}: the host filter ({given}: {shorten(include or exclude)}) does not match the hostfile; "
                   f"DeepSpeed's runner stops with '{problem}'", "name hosts and slot numbers (0 to slots-1) that "
                   "the hostfile lists", file=hf.path, line=None, filter=include or exclude)
    doc = accel_doc(ctx)
    if doc is None:
        return
    machines = doc.data.get("num_machines", 1)
    if is_int(machines) and machines != len(seen):
        yield fail(f"{hf.path}: lists {len(seen)} hosts, but num_machines is {machines} ({doc.where('num_machines')})",
                   f"list {machines} hosts, or set num_machines: {len(seen)}", hosts=len(seen),
                   num_machines=machines, file=hf.path, line=None)
    per_machine = processes_per_machine(doc.data)
    if per_machine is None:
        return
    procs = text_number(doc.data.get("num_processes"))
    for entry in hf.entries:
        if entry.slots != per_machine:
            fix = f"set slots={per_machine}, or change num_processes"
            if entry.slots == procs and len(seen) > 1:  # num_processes read as one host's processes: the total mends it
                fix = f"set {doc.setting('num_processes')} to {sum(e.slots for e in hf.entries)}, the total over all " \
                    f"hosts (or slots={per_machine})"
            yield fail(f"{hf.path}:{entry.line}: {entry.host} has slots={entry.slots}, but the accelerate config runs "
                       f"{per_machine} processes per machine ({doc.where('num_processes')})", fix, host=entry.host,
                       slots=entry.slots, expected=per_machine, file=hf.path, line=entry.line)
