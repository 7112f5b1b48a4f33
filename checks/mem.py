"""MEM: will the model fit the GPUs, the host memory and the NVMe of every node, as the job shards it (ZeRO
stage, FSDP strategy or DDP), offloads and trains in its precision (preflight.job.memory has the arithmetic; the
nodes' figures are facts already gathered: NVML's GPU memory, MemAvailable, the free space of each nvme_path)."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator, List, Optional, Tuple

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.inputs import models
from preflight.inputs.configs import runner_resources, tuning_space
from preflight.inputs.numbers import is_int
from preflight.inputs.settings import processes_per_machine, zero_settings
from preflight.job import memory
from preflight.job.gpus import job_gpus
from preflight.job.memory import Need, Setup, gib

MAX_GPUS_PER_NODE, MAX_NODES = 1 << 16, 1 << 20  # past them a count is a typo, and the products overflow a float
NO_MODEL = ("no --model given (nor model in the profile's [memory]): the memory estimate needs the model's size "
            "(--model 7B, a config.json or a cached model id)")


def model_of(ctx) -> Optional[models.Model]:
    inputs = ctx.plan.memory
    return inputs.model if inputs is not None else None


# accelerate's str_to_bool (utils/environment.py), which reads FSDP_OFFLOAD_PARAMS and, for FSDP2,
# FSDP_RESHARD_AFTER_FORWARD: anything else stops the job.
TRUE_WORDS, FALSE_WORDS = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def _truth(value) -> Optional[bool]:
    text = str(value).lower()
    return True if text in TRUE_WORDS else False if text in FALSE_WORDS else None


def fsdp_settings(plan) -> Tuple[Optional[dict], str]:
    """FSDP's settings as accelerate launch hands them to FullyShardedDataParallelPlugin.__post_init__
    (accelerate/utils/dataclasses.py): a launch flag wins over fsdp_config (whose keys take an fsdp_ prefix when
    they lack one, commands/launch.py), then each key's launch default. (None, why) for a value it refuses."""
    section = plan.accelerate.data.get("fsdp_config") if plan.accelerate is not None else None
    section = {(k if k.startswith("fsdp") else "fsdp_" + k): v for k, v in (section or {}).items()
               if isinstance(k, str)} if isinstance(section, dict) else {}
    command = plan.launch
    flags = command.options if command is not None and command.launcher == "accelerate" else {}

    def value(key: str, default):
        return flags[key] if key in flags else section.get(key, default)

    version = str(value("fsdp_version", 1))
    if version not in ("1", "2"):
        return None, f"fsdp_version is {version!r}, not 1 or 2"
    offload, efficient = _truth(value("fsdp_offload_params", False)), _truth(
        value("fsdp_cpu_ram_efficient_loading", False))
    if offload is None or efficient is None:
        return None, "fsdp_offload_params or fsdp_cpu_ram_efficient_loading is no true/false"
    if version == "2":  # FSDP2 reads only reshard_after_forward: true shards like FULL_SHARD, false like SHARD_GRAD_OP
        reshard = _truth(value("fsdp_reshard_after_forward", True))
        if reshard is None:
            return None, "fsdp_reshard_after_forward is no true/false (FSDP2 takes a bool)"
        strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
    else:  # FSDP1: the sharding strategy, a name of FSDP_SHARDING_STRATEGY (its 1-based index) or its number
        # (accelerate always sets FSDP_SHARDING_STRATEGY, so fsdp_reshard_after_forward is not read here)
        text = str(value("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        named = {"HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2", **{n: n for n in memory.FSDP_STRATEGIES}}
        if text.isdigit() and 1 <= int(text) <= len(memory.FSDP_STRATEGIES):
            strategy = memory.FSDP_STRATEGIES[int(text) - 1]
        elif text in named:
            strategy = named[text]
        else:
            return None, f"fsdp_sharding_strategy {text[:40]!r} is not one of FSDP's (FULL_SHARD, SHARD_GRAD_OP, ...)"
    return {"sharding": strategy, "fsdp_version": int(version), "offload_param": "cpu" if offload else "none",
            "one_copy_per_node": efficient}, ""


def runner_slots(plan, gpus_here: Optional[int] = None) -> Optional[dict]:
    """{host: processes} that DeepSpeed's runner starts when it is the launcher (a `deepspeed` command, or
    accelerate's pdsh/openmpi/mvapich launch with a host filter): the hostfile, or this machine's GPUs without
    one, after --include/--exclude/--num_nodes/--num_gpus (deepspeed/launcher/runner.py main,
    parse_resource_filter); None when the runner does not start the job or stops on its flags."""
    command, accel = plan.launch, plan.accelerate
    if command is not None and command.launcher == "deepspeed":
        given = {k: command.get(k) for k in ("include", "exclude") if isinstance(command.get(k), str)}
        counts = {k: command.integer(k) for k in ("num_nodes", "num_gpus") if command.get(k) is not None}
        if None in counts.values():
            return None
    elif accel is not None and accel.uses_deepspeed and accel.runner == "head" and accel.deepspeed_section is not None:
        section = accel.deepspeed_section.data  # accelerate passes --exclude, else --include (utils/launch.py)
        flags = command.options if command is not None and command.launcher == "accelerate" else {}
        exclude, include = (flags.get(k, section.get(k)) for k in ("deepspeed_exclusion_filter",
                                                                   "deepspeed_inclusion_filter"))
        given = {"exclude": str(exclude)} if exclude is not None else {"include": str(include)} if include is not None \
            else {}
        counts = {}
        if not given:
            return None  # then --num_gpus num_processes // num_machines: num_processes already says it
    else:
        return None
    if plan.hostfile is not None and plan.hostfile.entries:
        pool = {e.host: e.slots for e in plan.hostfile.entries}
    elif gpus_here or counts.get("num_gpus", 0) > 0:  # no hostfile: this machine's GPUs
        pool = {"localhost": gpus_here or counts["num_gpus"]}
    else:
        return None
    found, _ = runner_resources(pool, given.get("include", ""), given.get("exclude", ""),
                                counts.get("num_nodes", -1), counts.get("num_gpus", -1))
    return found or None


def job_setup(ctx, gpus_here: Optional[int] = None) -> Tuple[Optional[Setup], str, Tuple[str, ...]]:
    """How the job trains, from the plan's configs: (setup, notes, the counts nothing gives: "gpus_per_node",
    "nodes", taken as 1); (None, why, ()) when the ZeRO stage or the counts are no numbers, or an FSDP setting
    is one accelerate refuses.
    gpus_here: the job's GPUs on this node, when nothing else says how many processes a node runs."""
    plan, notes = ctx.plan, []
    stage, blocks = 0, {}
    accel = plan.accelerate
    launcher = plan.launch.launcher if plan.launch is not None else None
    kind = accel.data.get("distributed_type") if accel is not None and launcher != "deepspeed" else None
    sharding = {}
    if kind == "FSDP":
        sharding, why = fsdp_settings(plan)
        if sharding is None:
            return None, why, ()
    elif plan.deepspeed is None and ((kind is not None and kind != "DEEPSPEED") or launcher in ("torchrun", "python")):
        sharding = {"sharding": "ddp"}  # neither DeepSpeed nor FSDP: every rank holds it all
    found = None if sharding else zero_settings(ctx.plan)
    if found is not None:
        _, _, stage, blocks = found
        if stage == "auto" and plan.accelerate is not None and plan.accelerate.uses_deepspeed:
            stage = 2  # accelerate fills it in: 2 unless `accelerate launch --zero_stage` says otherwise
            notes.append("stage \"auto\" taken as accelerate's 2")
        if tuning_space(stage):
            return None, "the ZeRO stage is the autotuner's choice (see CFG040)", ()
        if not is_int(stage) or not 0 <= stage <= 3:
            return None, f"the ZeRO stage is {stage!r}, not 0-3 (see CFG040)", ()
    elif not sharding:
        notes.append("no ZeRO settings: stage 0")

    def device(block: str) -> str:
        value = (blocks.get(block) or {}).get("device") if isinstance(blocks, dict) else None
        value = value.lower() if isinstance(value, str) else value
        return value if value in ("cpu", "nvme") else "none"

    per = processes_per_machine(accel.data) if accel is not None else None
    if not per and plan.hostfile is not None and plan.hostfile.entries:
        per = max(e.slots for e in plan.hostfile.entries)
    per = per or gpus_here
    machines = accel.data.get("num_machines", 1) if accel is not None else None  # accelerate's default: 1
    if not is_int(machines) or machines < 1:
        machines = len(set(plan.hostfile.hosts)) if plan.hostfile is not None else len(plan.nodes)
    started = runner_slots(plan, gpus_here)
    if started:  # DeepSpeed's runner starts these slots, whatever the hostfile holds besides
        per, machines = max(started.values()), len(started)
    # Stages 1-3 divide by the GPU count: with none known, 1 GPU per node (and 1 node) is only a guess.
    unknown = tuple(name for name, known in (("gpus_per_node", per), ("nodes", machines)) if not known)
    per, machines = per or 1, machines or 1
    if per > MAX_GPUS_PER_NODE or machines > MAX_NODES:
        return None, f"{per} processes per node x {machines} nodes is no job's size (see CFG checks)", ()
    section = accel.deepspeed_section if accel is not None and accel.uses_deepspeed else None
    init_flag = section.data.get("zero3_init_flag") if section is not None else None
    mp = accel.mixed_precision if accel is not None else None
    ds = plan.deepspeed
    halves = [ds.enabled(b) for b in ("fp16", "bf16")] if ds is not None else []
    if True in halves or ("auto" in halves and mp in ("fp16", "bf16", "fp8")):
        weight_bytes = 2
    elif mp in ("fp16", "bf16", "fp8") and ds is None:
        weight_bytes = 2
    elif ds is not None or mp == "no":
        weight_bytes = 4
    else:
        weight_bytes = 2
        notes.append("precision not given: 16-bit assumed")
    micro = ds.get("train_micro_batch_size_per_gpu") if ds is not None else None
    inputs = plan.memory
    setup = Setup(stage=stage, offload_optimizer=device("offload_optimizer"),
                  offload_param=device("offload_param") if stage >= 3 else "none",
                  gpus_per_node=per, nodes=machines,
                  zero_init=init_flag not in (False, "false", "False"),  # at stage 3, and for a move there
                  weight_bytes=weight_bytes,
                  micro_batch=micro if is_int(micro) and 0 < micro <= models.MAX_MICRO_BATCH else None,
                  seq_len=inputs.seq_len if inputs is not None else None)
    if sharding:
        setup = replace(setup, **{"stage": 0, "offload_optimizer": "none", "offload_param": "none", "zero_init": False,
                                  **sharding})
    return setup, "; ".join(notes), unknown


def figures(model: models.Model, setup: Setup, need: Need) -> str:
    count = memory.count_text(model.params) + (" (estimated)" if model.estimated else "")
    deepspeeds = f" ({gib(need.host)} by DeepSpeed's estimate)" if need.host > need.certain else ""
    return (f"{count} parameters, {setup.describe()}: {gib(need.gpu)} per GPU for the model states, "
            f"{gib(need.certain)} host RAM per node{deepspeeds}")


def evidence(model: models.Model, setup: Setup, need: Need, **more) -> dict:
    return dict(params=model.params, largest_layer_params=model.largest_layer, params_estimated=model.estimated,
                sharding=setup.sharding, stage=setup.stage, offload_optimizer=setup.offload_optimizer,
                offload_param=setup.offload_param,
                gpus_per_node=setup.gpus_per_node, nodes=setup.nodes, gpu_bytes=need.gpu, host_bytes=need.host,
                states_host_bytes=need.states_host, load_bytes=need.load, offloaded_host_bytes=need.offloaded,
                certain_host_bytes=need.certain,
                nvme_bytes=need.nvme_optimizer + need.nvme_param, activation_bytes=need.activations, **more)


def short_at_any_count(model: models.Model, setup: Setup, unknown: Tuple[str, ...], gpu_room: Optional[int],
                       host_room: Optional[int]) -> bool:
    """Does the job miss `gpu_room` or `host_room` whatever the counts nothing gives? The GPUs judged at the
    most GPUs (the states spread thinnest), the host at 1 GPU per node (one copy to load) over the most nodes."""
    most = {"gpus_per_node": MAX_GPUS_PER_NODE, "nodes": MAX_NODES}
    spread = replace(setup, **{k: most[k] for k in unknown})
    fewest = replace(spread, gpus_per_node=1) if "gpus_per_node" in unknown else spread
    return ((gpu_room is not None and memory.estimate(model, spread).gpu > gpu_room) or
            (host_room is not None and memory.estimate(model, fewest).certain > host_room))


def upper_bound(setup: Setup, need: Need) -> str:
    """Why DeepSpeed's host figure is above what the job surely needs."""
    if need.offloaded and setup.stage < 3:
        return "P·max(4N, 16)·1.5 at stage 1-2 with offload, an upper bound that grows with the node count"
    if need.offloaded:
        return "with its 1.5 buffer factor"
    return "an fp32 copy per rank and its 1.5 buffer factor"


def remedy(model: models.Model, setup: Setup, gpu_room: Optional[int], host_room: Optional[int]) -> str:
    """The cheapest change that fits, with its figures; else what is left to try."""
    found = memory.cheapest(model, setup, gpu_room, host_room)
    if found is None:
        return ("nothing in reach fits: more nodes than 8x, GPUs with more memory, a smaller model, or a "
                "parameter-efficient method (LoRA)")
    what, need = found
    return f"{what} fits: {gib(need.gpu)} per GPU, {gib(need.certain)} host RAM per node"


def activation_margin(setup: Setup, need: Need, room: int, where: str) -> Optional[Finding]:
    """A warning when the model states fit but the activations (a stated margin) may not."""
    if need.activations is None:
        return None
    if need.gpu + need.checkpointed > room:
        extra, how = need.checkpointed, "even with activation checkpointing"
        fix = "lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep the batch)"
    elif need.gpu + need.activations > room:
        extra, how = need.activations, "without activation checkpointing"
        fix = "turn on activation (gradient) checkpointing, or lower train_micro_batch_size_per_gpu"
    else:
        return None
    return warn(f"the model states fit ({gib(need.gpu)}), but micro-batch {setup.micro_batch} x {setup.seq_len} "
                f"tokens adds about {gib(extra)} of activations per GPU {how}: {gib(need.gpu + extra)} against "
                f"{gib(room)} {where}", fix, activation_bytes=need.activations, checkpointed_bytes=need.checkpointed)


@check("MEM001", "memory-estimate", "config", tags=["memory", "deepspeed", "zero"])
def memory_estimate(ctx) -> Iterator[Finding]:
    """With --model, the memory the job needs (model states per GPU, host RAM and NVMe per node) as it shards
    the model: DeepSpeed's estimators for its ZeRO stage and offload, FSDP's sharding strategy and parameter
    offload, or DDP (nothing sharded), over the GPUs the launch really starts (a DeepSpeed host filter
    included), against --gpu-memory and --host-memory (or the profile's [memory]) when given.

    An out-of-memory at the first step fails one rank while the others hang in their next collective until
    the NCCL timeout; host RAM runs out when every rank on a node loads a full copy of the model.

    Take the change the finding names, cheapest first: the next ZeRO stage, optimizer offload to the CPU,
    parameter offload (stage 3), more nodes; for FSDP a strategy that shards more, fsdp_offload_params, more
    nodes; for DDP, FSDP. `preflight explain MEM001` and the README's "Will it fit"
    section show the arithmetic. Host RAM fails on what the job surely needs (as MEM003 judges) and warns on
    DeepSpeed's larger figure; with no GPU count (num_processes, hostfile slots) 1 is taken, said, and only a
    job that fits at no count fails.
    """
    model = model_of(ctx)
    if model is None:
        yield skip(NO_MODEL)
        return
    setup, note, unknown = job_setup(ctx)
    if setup is None:
        yield skip(note)
        return
    need = memory.estimate(model, setup)
    inputs = ctx.plan.memory
    assumed = ""
    if unknown:
        assumed = " x ".join(f"1 {'GPU per node' if k == 'gpus_per_node' else 'node'}" for k in unknown)
        note = "; ".join(filter(None, [note, f"{assumed} assumed: no num_processes, hostfile slots or GPUs say "
                                             "how many"]))
    text = figures(model, setup, need) + (f" ({note})" if note else "")
    facts = evidence(model, setup, need, how=model.how, assumed_counts=list(unknown) or None)
    gpu_short = inputs.gpu_bytes is not None and need.gpu > inputs.gpu_bytes
    host_short = inputs.host_bytes is not None and need.certain > inputs.host_bytes  # what MEM003 fails on
    if gpu_short or host_short:
        against = ", ".join(f"{gib(v)} {w}" for v, w in ((inputs.gpu_bytes, "per GPU (--gpu-memory)"),
                                                         (inputs.host_bytes, "per node (--host-memory)")) if v)
        fix = remedy(model, setup, inputs.gpu_bytes, inputs.host_bytes)
        if unknown and not short_at_any_count(model, setup, unknown, inputs.gpu_bytes, inputs.host_bytes):
            # a guess at the GPU count refuses no job: say it, and how to give the count
            yield warn(f"may not fit: {text}, against {against}",
                       f"give the job's GPU count (--config with num_processes, or a --hostfile with slots); at "
                       f"{assumed}: {fix}", **facts)
        else:
            anyway = ", whatever the GPU count" if unknown else ""
            yield fail(f"does not fit{anyway}: {text}, against {against}", fix, **facts)
        return
    if inputs.host_bytes is not None and need.host > inputs.host_bytes:
        yield warn(f"tight: {text}: the {gib(need.certain)} surely needed fits {gib(inputs.host_bytes)} per node "
                   f"(--host-memory), DeepSpeed's estimate ({upper_bound(setup, need)}) does not",
                   "keep host memory free on the nodes, and watch it at the first step", **facts)
        return
    if inputs.gpu_bytes is not None:
        margin = activation_margin(setup, need, inputs.gpu_bytes, "per GPU (--gpu-memory)")
        if margin is not None:
            yield margin
            return
    compared = " (fits --gpu-memory/--host-memory)" if inputs.gpu_bytes or inputs.host_bytes else ""
    yield passed(f"{text}{compared}", **facts)


def _node_setup(ctx) -> Tuple[Optional[models.Model], Optional[Setup], Optional[List[dict]], Optional[Finding]]:
    """(model, setup, the job's GPUs here or None, why there are none); setup None: the last says why
    nothing can be checked."""
    model = model_of(ctx)
    if model is None:
        return None, None, None, skip(NO_MODEL)
    gpus, why = job_gpus(ctx)
    setup, note, _ = job_setup(ctx, len(gpus) if gpus else None)
    if setup is None:
        return model, None, None, skip(note)
    return model, setup, gpus, why


def _gpu_free(gpu: dict) -> Optional[int]:
    total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    return total - used if total is not None and used is not None else None


def _host_room(ctx) -> Optional[int]:
    return (ctx.fact.get("memory") or {}).get("available_bytes")


@check("MEM002", "gpu-memory-fit", "node", tags=["memory", "gpu", "nvml"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES", "memory.available_bytes"])
def gpu_memory_fit(ctx) -> Iterator[Finding]:
    """With --model, the model states per GPU fit the total and the free memory (NVML) of each GPU the job
    uses on the node; memory another process holds counts against it.

    The rank whose GPU is smaller, or half taken by a leftover process, runs out of memory at the first
    step and the other ranks wait for it in their next collective until the NCCL timeout.

    Stop the process that holds the GPU (its PID is in the finding), or take the change the finding
    names: the next ZeRO stage (or FSDP strategy), optimizer or parameter offload, more nodes.
    """
    model, setup, gpus, why = _node_setup(ctx)
    if setup is None or not gpus:
        yield why
        return
    need = memory.estimate(model, setup)
    known = [g for g in gpus if g.get("memory_total_bytes") is not None]
    if not known:
        yield skip("NVML did not give the memory of the job's GPUs here")
        return
    smallest = min(known, key=lambda g: g["memory_total_bytes"])
    tightest = min(known, key=lambda g: _gpu_free(g) if _gpu_free(g) is not None else g["memory_total_bytes"])
    free = _gpu_free(tightest)
    facts = evidence(model, setup, need, gpu_total_bytes=smallest["memory_total_bytes"], gpu_free_bytes=free)
    text = figures(model, setup, need)
    if need.gpu > smallest["memory_total_bytes"]:
        yield fail(f"does not fit: {text}; GPU {smallest['index']} has {gib(smallest['memory_total_bytes'])} in all",
                   remedy(model, setup, free, _host_room(ctx)), **facts)
    elif free is not None and need.gpu > free:
        holders = ", ".join(f"PID {p['pid']} ({gib(p.get('used_memory_bytes'))})" for p in tightest.get("processes") or [])
        held = f": {holders} hold{'s' if len(tightest.get('processes') or []) == 1 else ''} memory there" if holders else ""
        yield fail(f"does not fit now: {text}; GPU {tightest['index']} has {gib(free)} free of "
                   f"{gib(tightest['memory_total_bytes'])}{held}",
                   f"stop what holds GPU {tightest['index']}, or: {remedy(model, setup, free, _host_room(ctx))}",
                   **facts)
    else:
        room = free if free is not None else smallest["memory_total_bytes"]
        margin = activation_margin(setup, need, room, f"free on GPU {tightest['index']}")
        if margin is not None:
            yield margin
        else:
            yield passed(f"{text}; the tightest GPU ({tightest['index']}) has {gib(room)} free", **facts)


@check("MEM003", "host-memory-fit", "node", tags=["memory", "offload"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES", "memory.available_bytes"])
def host_memory_fit(ctx) -> Iterator[Finding]:
    """With --model, the node's available memory (MemAvailable) holds what the job needs there: loading the
    model (every rank on the node loads a full copy unless ZeRO-3 builds it partitioned) and the states it
    offloads to the CPU fail when they do not fit; DeepSpeed's per-node figure, which adds its 1.5 buffer
    factor (and, without offload, an fp32 copy per rank), only warns.

    A node short of host memory is killed by the OOM killer while it loads the model or when the offloaded
    optimizer states are pinned, with little said, and the other nodes hang. Each rank keeps 1/N of the
    offloaded states, so a node holds 16 bytes a parameter over the nodes (18 with ZeRO-3 parameter offload);
    DeepSpeed's figure at stage 2 (P·max(4N, 16)·1.5) is an upper bound that grows with the node count.

    Free memory on the node, load the model once (stage 3 with zero3_init_flag), offload less, or spread
    the job over more nodes; the finding names the cheapest change that fits.
    """
    model, setup, gpus, why = _node_setup(ctx)
    if setup is None:
        yield why
        return
    room = _host_room(ctx)
    if room is None:
        yield skip("the node's available memory is unknown")
        return
    need = memory.estimate(model, setup)
    facts = evidence(model, setup, need, available_bytes=room)
    # What the job surely holds (need.certain, as MEM001 judges): the loaded copies, or this node's share of
    # the states offloaded to the CPU, whichever is larger. DeepSpeed's figure is an upper bound: it warns.
    parts = f"offloaded states {gib(need.offloaded)}, loading {gib(need.load)}"
    free = min((_gpu_free(g) for g in gpus or [] if _gpu_free(g) is not None), default=None)
    if need.certain > room:
        yield fail(f"does not fit: {figures(model, setup, need)} ({parts}); {gib(room)} available here",
                   remedy(model, setup, free, room), **facts)
    elif need.host > room:
        yield warn(f"tight: the {gib(need.certain)} surely needed ({parts}) fits in the {gib(room)} available, "
                   f"DeepSpeed's estimate of {gib(need.host)} ({upper_bound(setup, need)}) does not", "the job should start; keep memory free on the node and watch it at the first step",
                   **facts)
    else:
        deepspeeds = f", {gib(need.host)} by DeepSpeed's estimate" if setup.sharding == "zero" else ""
        yield passed(f"{gib(need.certain)} host RAM per node surely needed ({parts}){deepspeeds}; {gib(room)} "
                     "available", **facts)


@check("MEM004", "nvme-fit", "node", tags=["memory", "offload", "filesystem"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES", "memory.available_bytes", "storage"])
def nvme_fit(ctx) -> Iterator[Finding]:
    """With --model and NVMe offload, the free space at each nvme_path holds this node's share of the
    offloaded optimizer states (16 bytes a parameter) and parameters (2 bytes), split over the nodes.

    DeepSpeed's swap files grow to their full size when the engine starts: a drive too small fails on
    that node after the model has loaded.

    Free space at nvme_path, point it at a larger local NVMe drive, or spread the job over more nodes.
    """
    model, setup, _, why = _node_setup(ctx)
    if setup is None:
        yield why
        return
    need = memory.estimate(model, setup)
    wanted = [(k, n) for k, n in (("offload_optimizer.nvme_path", need.nvme_optimizer),
                                  ("offload_param.nvme_path", need.nvme_param)) if n]
    if not wanted:
        yield skip("the job offloads nothing to NVMe (stage 3 with device nvme)")
        return
    storage = ctx.fact.get("storage") or {}
    by_path = {}
    for key, n in wanted:
        entry = storage.get(key)
        if not entry or not entry.get("exists"):
            yield skip(f"{key} is not there to measure (see FS003)")
            return
        by_path.setdefault(entry["path"], [entry, 0])[1] += n  # two blocks on one folder share its space
    for path, (entry, n) in by_path.items():
        facts = evidence(model, setup, need, path=path, free_bytes=entry["free_bytes"], nvme_path_bytes=n)
        if n > entry["free_bytes"]:
            yield fail(f"{path} has {gib(entry['free_bytes'])} free, NVMe offload needs {gib(n)} here "
                       f"({figures(model, setup, need)})",
                       f"free space at {path}, use a larger NVMe drive, or run on {2 * setup.nodes} nodes "
                       f"({gib(n // 2)} each)", **facts)
        else:
            yield passed(f"{path}: {gib(n)} of NVMe offload, {gib(entry['free_bytes'])} free", **facts)
