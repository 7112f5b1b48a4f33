"""GPU: the GPUs each node has, as NVML reports them (the `gpus` fact), against what the job asks for."""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

from preflight.api import Finding, Status, check, fail, fold, grouped, holders, odd_ones_out, passed, skip, warn
from preflight.inputs.settings import job_environment, processes_per_machine
from preflight.job.gpus import gpus_of, job_gpus, needs_gpus, no_gpus_reason, selection
from preflight.job.nccl import fabric_of, mnnvl_off, nccl_env, nccl_param, nccl_version
from preflight.node.gpus import ZERO_UUID

# Precision -> (lowest compute capability, status below it, why).
PRECISION_NEEDS = {
    "fp8": ((8, 9), Status.FAIL, "fp8 needs Ada or Hopper GPUs (compute capability 8.9 or more)"),
    "bf16": ((8, 0), Status.FAIL, "bf16 needs Ampere or newer GPUs (compute capability 8.0 or more)"),
    "fp16": ((7, 0), Status.WARN, "before Volta (7.0) there are no fp16 tensor cores: fp16 trains no faster"),
}
HW_SLOWDOWNS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
NO_NVML_FIX = ("install nvidia-ml-py in the training environment (--python) and make sure the NVIDIA driver is "
               "loaded on this node (nvidia-smi works)")


# --- helpers -----------------------------------------------------------------------------------

def gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def processes_per_node(ctx) -> Tuple[Optional[int], Optional[str]]:
    """How many processes the job starts on this node, and where that number comes from."""
    if not needs_gpus(ctx.plan):
        return None, None
    accel, hostfile = ctx.plan.accelerate, ctx.plan.hostfile
    per = processes_per_machine(accel.data) if accel is not None else None
    if per:
        return per, (f"num_processes {accel.data['num_processes']} / num_machines {accel.data.get('num_machines', 1)} "
                     f"in {accel.doc.path}")
    slots = [e.slots for e in hostfile.entries if e.host == ctx.node] if hostfile is not None else []
    if slots:
        return slots[0], f"slots={slots[0]} in {hostfile.path}"
    return None, None


def indices(devices: List[dict]) -> str:
    """'GPU 3' or 'GPUs 0-3,6'."""
    runs: List[List[int]] = []
    for i in sorted(d["index"] for d in devices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"GPU {text}" if len(devices) == 1 else f"GPUs {text}"


def label(gpu: dict) -> str:
    return f"GPU {gpu['index']} ({gpu['pci_bus_id']})" if gpu.get("pci_bus_id") else f"GPU {gpu['index']}"


def lost(gpu: dict) -> bool:
    """NVML could not even read the GPU's name: it fell off the bus, or its driver state is broken."""
    return gpu.get("name") is None and bool(gpu.get("errors"))


# --- checks ------------------------------------------------------------------------------------

@check("GPU001", "gpu-count", "node", tags=["gpu", "nvml"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES"])
def gpu_count(ctx) -> Iterator[Finding]:
    """Every node has a GPU for each process the job starts there (num_processes / num_machines), the
    GPUs that gpu_ids and CUDA_VISIBLE_DEVICES name exist, and NVML answers where the job needs GPUs.

    A missing GPU fails only when the job starts: with 'invalid device ordinal' on one rank while the
    others wait for it until the NCCL timeout. CUDA silently ignores a CUDA_VISIBLE_DEVICES entry it
    cannot use, and every entry after it; accelerate replaces CUDA_VISIBLE_DEVICES with gpu_ids.

    Lower num_processes to num_machines x the GPUs of the smallest node, correct gpu_ids (or 'all') and
    CUDA_VISIBLE_DEVICES, or leave out the node whose GPUs are missing (`nvidia-smi -L` lists them).
    Without NVML: install nvidia-ml-py in the training environment and load the NVIDIA driver.
    """
    gpus = gpus_of(ctx.fact)
    why = needs_gpus(ctx.plan)
    if gpus is None:
        if why:
            yield fail(f"no GPU facts: {no_gpus_reason(ctx.fact)}; expected GPUs, the job needs them ({why})",
                       NO_NVML_FIX, reason=no_gpus_reason(ctx.fact))
        else:
            yield skip(f"no GPU facts: {no_gpus_reason(ctx.fact)}")
        return
    chosen, usable, how, problems = selection(ctx, gpus)
    yield from problems
    broken = [d for d in chosen if lost(d)]
    if broken:
        usable -= len(broken)
        how += f"; {indices(broken)} not answering NVML (see GPU004)"
    need, source = processes_per_node(ctx)
    evidence = {"count": gpus.get("count"), "usable": usable, "processes_per_node": need}
    if need is not None and usable < need:
        yield fail(f"{usable} GPU(s) usable here ({how}; the node has {gpus.get('count')}), expected at least {need}: "
                   f"the job runs {need} process(es) per node ({source})",
                   "lower num_processes to num_machines x the GPUs each node has, or run on nodes with enough GPUs",
                   **evidence)
    elif not problems:
        names = ", ".join(sorted({d["name"] for d in chosen if d.get("name")})) or "none"
        wanted = f" for {need} process(es) per node" if need is not None else ""
        yield passed(f"{usable} GPU(s) usable ({how}: {names}){wanted}", **evidence)


@check("GPU002", "same-gpus", "cluster", tags=["gpu", "nvml"])
def same_gpus(ctx) -> Iterator[Finding]:
    """Every node has the same GPU model, memory size and count, and the same NVIDIA driver version.

    Data parallelism runs at the pace of the slowest GPU, and ZeRO partitions assume the same memory on
    every rank: the smaller GPU runs out of memory first. Different drivers give different CUDA and NCCL
    behaviour, and a driver older than the CUDA build of torch fails on that node only.

    Run the job on identical nodes (a SLURM constraint or partition), and install one driver version
    everywhere; the message names the odd node and what the others have.
    """
    nodes = [n for n in ctx.reachable if gpus_of(ctx.facts[n]["facts"])]
    if len(nodes) < 2:
        yield skip("fewer than two nodes with GPU facts: nothing to compare")
        return
    described, said = {}, {}  # said: id(gpus facts) -> their description (the gathering shares identical ones)
    for node in nodes:
        gpus = gpus_of(ctx.facts[node]["facts"])
        if id(gpus) not in said:
            counts = Counter((d.get("name"), d.get("memory_total_bytes")) for d in gpus.get("devices") or [])
            said[id(gpus)] = {
                "GPUs": ", ".join(f"{n} x {name} ({gib(mem)})" if name is not None else f"{n} x unreadable (lost)"
                                  for (name, mem), n in sorted(counts.items(), key=str)),
                "driver": f"{gpus.get('driver_version')} (CUDA {gpus.get('cuda_driver_version')})",
            }
        described[node] = said[id(gpus)]
    agreeing = set(nodes)
    for what, fix in (("GPUs", "run the job on nodes with the same GPUs (a SLURM constraint or partition)"),
                      ("driver", "install the same NVIDIA driver on {node}")):
        values = {n: described[n][what] for n in nodes}
        majority, odd = odd_ones_out(values, ctx.plan.head)
        majority_holders = holders(values, majority) if odd else ""
        for node, value in odd.items():
            agreeing.discard(node)
            yield Finding(Status.FAIL, f"{what} differ: {node} has {value}; {majority_holders} {majority}",
                          fix.format(node=node),
                          nodes=(node,), evidence={"what": what, "value": value, "expected": majority})
    if agreeing:
        reference = described[sorted(agreeing)[0]]
        yield Finding(Status.PASS, f"the same GPUs ({reference['GPUs']}) and driver {reference['driver']}",
                      nodes=tuple(n for n in nodes if n in agreeing), evidence=reference)


def requested_precisions(plan) -> dict:
    """precision -> where the job asks for it."""
    wanted = {}
    accel, ds = plan.accelerate, plan.deepspeed
    mp = accel.mixed_precision if accel is not None else None
    if mp in PRECISION_NEEDS:
        wanted[mp] = f"mixed_precision {mp} in {accel.doc.path}"
    for block in ("bf16", "fp16"):
        if ds is not None and ds.enabled(block) is True:
            wanted.setdefault(block, f"{block}.enabled in {ds.doc.path}")
    return wanted


@check("GPU003", "gpu-precision", "node", tags=["gpu", "precision"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES"])
def gpu_precision(ctx) -> Iterator[Finding]:
    """The GPUs support the precision the job asks for: bf16 (accelerate's mixed_precision bf16, or the
    DeepSpeed bf16 block) needs compute capability 8.0, fp8 needs 8.9; fp16 below 7.0 is a warning.

    On a V100 (7.0) bf16 is emulated or refused (accelerate and DeepSpeed stop at start-up, or the run
    is several times slower); fp8 kernels exist only from Ada and Hopper on; before Volta, fp16 brings
    no speed-up.

    Train in fp16 on V100-class GPUs (mixed_precision: fp16, and the DeepSpeed fp16 block instead of
    bf16), or run the job on A100/H100-class nodes.
    """
    chosen, skipped = job_gpus(ctx)
    if skipped:
        yield skipped
        return
    wanted = requested_precisions(ctx.plan)
    if not wanted:
        yield skip("the job asks for neither fp16, bf16 nor fp8")
        return
    known = [d for d in chosen if d.get("compute_capability")]
    for precision, source in wanted.items():
        need, status, why = PRECISION_NEEDS[precision]
        below = [d for d in known if tuple(d["compute_capability"]) < need]
        if below:
            cc = ", ".join(sorted({".".join(map(str, d["compute_capability"])) for d in below}))
            names = ", ".join(sorted({str(d.get("name")) for d in below}))
            fix = ("train in fp32 (mixed_precision: no), or use Volta or newer GPUs" if precision == "fp16" else
                   "use fp16 on these GPUs (mixed_precision: fp16 and the DeepSpeed fp16 block), or newer GPUs")
            yield Finding(status, f"{precision} requested ({source}), but {indices(below)} ({names}) have compute "
                          f"capability {cc}, expected at least {need[0]}.{need[1]}: {why}", fix,
                          evidence={"precision": precision, "compute_capability": cc,
                                    "required": f"{need[0]}.{need[1]}"})
        else:
            lowest = min((tuple(d["compute_capability"]) for d in known), default=None)
            shown = f"{lowest[0]}.{lowest[1]}" if lowest else "unknown"
            yield passed(f"{precision} requested ({source}); lowest compute capability {shown}", precision=precision)


@check("GPU004", "gpu-health", "node", tags=["gpu", "nvml", "health"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES"])
def gpu_health(ctx) -> Iterator[Finding]:
    """The job's GPUs are healthy and free: no uncorrectable ECC errors, no pending row remapping or page
    retirement, no other process holding their memory, PCIe links at their full width (and generation
    when busy), every NVLink link up, clocks not held down by the hardware.

    A GPU with uncorrectable errors or a pending remap crashes the job hours in (Xid 48/63/94); memory
    another process holds makes one rank run out of memory; a degraded PCIe link or a down NVLink link
    slows every collective to the pace of that one GPU.

    Reset the GPU (`nvidia-smi -r -i N`, or reboot) for pending remaps and retirements, kill leftover
    processes, reseat a GPU whose link is narrow, drain the node for ECC errors or NVLink faults and
    ask for a repair.
    """
    chosen, skipped = job_gpus(ctx)
    if skipped:
        yield skipped
        return
    devices = gpus_of(ctx.fact).get("devices") or []
    # NVLink: compare with the best GPU of the node; a GPU with none active while others have none is PCIe-only.
    best_links = max((sum(d["nvlink_active"]) for d in devices if d.get("nvlink_active")), default=0)
    found = 0
    for gpu in chosen:
        n = gpu["index"]

        def problem(status, message, fix, **values):  # its label and evidence only for a GPU with a problem
            nonlocal found
            found += 1
            return Finding(status, f"{label(gpu)}: {message}", fix,
                           evidence=dict({"gpu": gpu["index"], "pci_bus_id": gpu.get("pci_bus_id")}, **values))

        if gpu.get("errors"):
            fields = sorted(gpu["errors"])
            shown = ", ".join(fields[:3]) + (f" and {len(fields) - 3} more" if len(fields) > 3 else "")
            yield problem(Status.FAIL, f"NVML could not read {shown}: {gpu['errors'][fields[0]]}",
                          f"look for Xid errors in dmesg; reset GPU {n} or reboot the node", errors=gpu["errors"])
        volatile, aggregate = gpu.get("ecc_uncorrected_volatile"), gpu.get("ecc_uncorrected_aggregate")
        if volatile:
            yield problem(Status.FAIL, f"{volatile} uncorrectable ECC error(s) since the driver loaded, expected 0",
                          f"drain the node and reset GPU {n} (nvidia-smi -r -i {n}); replace it if they return",
                          ecc_uncorrected_volatile=volatile)
        elif aggregate:
            yield problem(Status.WARN, f"{aggregate} uncorrectable ECC error(s) in its lifetime (none since the "
                          "driver loaded), expected 0", "watch this GPU; ask for a replacement if the count grows",
                          ecc_uncorrected_aggregate=aggregate)
        if gpu.get("remapped_rows_failure"):
            yield problem(Status.FAIL, "row remapping failed: no spare memory rows left", "drain the node; the GPU "
                          "needs replacing", remapped_rows_failure=True)
        elif gpu.get("remapped_rows_pending"):
            yield problem(Status.FAIL, "a row remapping is pending, expected none: rows with uncorrectable errors "
                          "stay in use until the GPU is reset", f"reset GPU {n} (nvidia-smi -r -i {n}) or reboot",
                          remapped_rows_pending=True)
        if gpu.get("retired_pages_pending"):
            yield problem(Status.FAIL, "a page retirement is pending, expected none: the bad pages stay in use until "
                          "the GPU is reset", f"reset GPU {n} (nvidia-smi -r -i {n}) or reboot",
                          retired_pages_pending=True)
        processes = gpu.get("processes") or []
        if processes:
            used = sum(p.get("used_memory_bytes") or 0 for p in processes)
            shown = ", ".join(f"pid {p['pid']} ({gib(p.get('used_memory_bytes'))})" for p in processes[:4])
            yield problem(Status.FAIL, f"{len(processes)} process(es) already hold {gib(used)} of its memory "
                          f"({shown}), expected none", "stop them (a previous job's leftovers?) or use other GPUs",
                          processes=processes)
        width, max_width = gpu.get("pcie_width"), gpu.get("pcie_max_width")
        if width and max_width and width < max_width:
            yield problem(Status.FAIL, f"PCIe link is x{width}, expected x{max_width} (its maximum)",
                          "reseat the GPU (or its riser / cable) and check the slot's settings in the BIOS",
                          pcie_width=width, pcie_max_width=max_width)
        generation, max_generation = gpu.get("pcie_generation"), gpu.get("pcie_max_generation")
        reasons = gpu.get("clock_event_reasons")
        # An idle GPU lowers its link generation to save power: only a busy one is slow.
        if generation and max_generation and generation < max_generation and reasons is not None \
                and "gpu_idle" not in reasons:
            yield problem(Status.WARN, f"PCIe link runs at gen {generation} while the GPU is not idle, expected gen "
                          f"{max_generation}", "reseat the GPU; check the slot's PCIe generation in the BIOS",
                          pcie_generation=generation, pcie_max_generation=max_generation)
        links = gpu.get("nvlink_active")
        if links is not None and sum(links) < best_links:
            down = [i for i, up in enumerate(links) if not up]
            yield problem(Status.FAIL, f"{sum(links)} of {len(links)} NVLink links active, expected {best_links} as on "
                          f"the node's other GPUs (down: {', '.join(map(str, down))})",
                          "drain the node and have the NVLink / NVSwitch fabric checked (nvidia-smi nvlink -s)",
                          nvlink_active=sum(links), expected=best_links)
        slow = [r for r in reasons or [] if r in HW_SLOWDOWNS]
        if slow:
            yield problem(Status.WARN, f"clocks held down by {', '.join(slow)}, expected none",
                          "check the node's cooling and power supply", clock_event_reasons=reasons)
    if not found:
        yield passed(f"{indices(chosen)} healthy: no uncorrectable ECC errors, no pending remaps or retirements, "
                     "no other processes, PCIe and NVLink at full width", gpus=len(chosen))


@check("GPU005", "compute-mode", "node", tags=["gpu", "nvml"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES"])
def compute_mode(ctx) -> Iterator[Finding]:
    """The job's GPUs are in a compute mode that lets its processes run: not prohibited, and not
    exclusive-process when the job puts more than one process on a GPU.

    In prohibited mode no process can create a CUDA context; in exclusive-process mode only one can, so
    the second process on a GPU fails with 'all CUDA-capable devices are busy or unavailable'.

    Set the default mode: `sudo nvidia-smi -i N -c DEFAULT` (or ask the administrators, who may set the
    mode in a SLURM prolog); or run one process per GPU.
    """
    chosen, skipped = job_gpus(ctx)
    if skipped:
        yield skipped
        return
    need, source = processes_per_node(ctx)
    per_gpu = -(-need // len(chosen)) if need else 1
    modes = {}
    for gpu in chosen:
        modes.setdefault(gpu.get("compute_mode"), []).append(gpu)
    for mode, gpus in sorted(modes.items(), key=lambda item: repr(item[0])):  # not the GPUs' repr: 20 us a node
        which = ",".join(str(g["index"]) for g in gpus)
        if mode == "prohibited":
            yield fail(f"{indices(gpus)}: compute mode is prohibited, expected default: no process can use them",
                       f"sudo nvidia-smi -i {which} -c DEFAULT", compute_mode=mode)
        elif mode in ("exclusive_process", "exclusive_thread") and per_gpu > 1:
            yield fail(f"{indices(gpus)}: compute mode is {mode}, expected default: the job puts {per_gpu} processes "
                       f"on each GPU ({need} processes from {source}, {len(chosen)} GPUs)",
                       f"sudo nvidia-smi -i {which} -c DEFAULT, or run one process per GPU", compute_mode=mode)
        else:
            yield passed(f"{indices(gpus)}: compute mode {mode or 'unknown'}", compute_mode=mode)


@check("GPU006", "mig-mode", "node", tags=["gpu", "nvml", "mig"],
       reads=["gpus", "env.CUDA_VISIBLE_DEVICES"])
def mig_mode(ctx) -> Iterator[Finding]:
    """MIG (multi-instance GPU) mode is off on the job's GPUs, unless CUDA_VISIBLE_DEVICES selects MIG
    instances; no MIG mode change waits for a GPU reset.

    With MIG on, CUDA shows the job a slice of the GPU instead of the GPU: a fraction of its memory and
    compute, and NCCL cannot run collectives between MIG instances, so a distributed job fails or
    crawls. A pending change takes effect at the next GPU reset, in the middle of somebody's job.

    Turn MIG off: `sudo nvidia-smi -i N -mig 0`, then reset the GPU (`nvidia-smi -r -i N`) or reboot.
    """
    chosen, skipped = job_gpus(ctx)
    if skipped:
        yield skipped
        return
    visible = (ctx.fact.get("env") or {}).get("CUDA_VISIBLE_DEVICES") or ""
    expects = "MIG-" in visible
    on = [g for g in chosen if g.get("mig_enabled")]
    pending = [g for g in chosen if g.get("mig_pending") is not None and g.get("mig_pending") != g.get("mig_enabled")]
    if on and not expects:
        which = ",".join(str(g["index"]) for g in on)
        yield fail(f"{indices(on)}: MIG mode is on, expected off: the job would see MIG slices, not the GPUs",
                   f"sudo nvidia-smi -i {which} -mig 0, then reset the GPUs (nvidia-smi -r) or reboot",
                   mig_enabled=[g["index"] for g in on])
    if pending:
        yield warn(f"{indices(pending)}: a MIG mode change is pending, expected none: it takes effect at the next GPU "
                   "reset", "reset the GPUs before the job, or undo the change (nvidia-smi -mig)",
                   mig_pending=[g["index"] for g in pending])
    if not (on and not expects) and not pending:
        state = "on, as CUDA_VISIBLE_DEVICES expects" if expects else "off"
        if all(g.get("mig_enabled") is None for g in chosen):
            state = "not supported by these GPUs"
        yield passed(f"{indices(chosen)}: MIG {state}")


@check("GPU007", "host-expectations", "node", tags=["gpu", "nvml", "profile"])
def host_expectations(ctx) -> Iterator[Finding]:
    """The node has the GPUs its [[hosts]] entry of the profile expects (gpus = 8, gpu_model = "H100"):
    the first entry whose hosts pattern (such as gpu[001-064]) names the node decides.

    A node that lost a GPU, or was given the wrong hardware, runs the job slower or not at all, and the
    job's own settings (num_processes) may not reveal it when they were written for that node.

    Repair or replace the node (`nvidia-smi -L` lists its GPUs), leave it out of the job, or correct the
    [[hosts]] entry of the profile.
    """
    profile = ctx.plan.profile
    expected = profile.expectation(ctx.node) if profile is not None else None
    if expected is None:
        yield skip("no [[hosts]] entry of the profile names this node" if profile is not None and profile.hosts
                   else "no [[hosts]] expectations in the profile")
        return
    if expected.gpus is None and expected.gpu_model is None:
        yield passed(f"nothing about GPUs expected by hosts = {expected.pattern!r}")
        return
    where = f"hosts = {expected.pattern!r} in {profile.path}"
    gpus = gpus_of(ctx.fact)
    if gpus is None:
        if expected.gpus == 0:
            yield passed(f"no GPU, as expected ({where})", count=0)
        else:
            yield fail(f"no GPU facts: {no_gpus_reason(ctx.fact)}; expected "
                       f"{expected.gpus if expected.gpus is not None else 'some'} {expected.gpu_model or ''} GPU(s) "
                       f"({where})".replace("  ", " "), NO_NVML_FIX, reason=no_gpus_reason(ctx.fact))
        return
    devices = gpus.get("devices") or []
    evidence = {"count": len(devices), "expected_count": expected.gpus, "expected_model": expected.gpu_model}
    problems = False
    if expected.gpus is not None and len(devices) != expected.gpus:
        problems = True
        yield fail(f"{len(devices)} GPU(s) here, expected {expected.gpus} ({where})",
                   "repair the node or leave it out of the job (`nvidia-smi -L` lists its GPUs)", **evidence)
    if expected.gpu_model is not None:
        odd = [d for d in devices if expected.gpu_model.lower() not in (d.get("name") or "").lower()]
        if odd:
            problems = True
            names = ", ".join(sorted({d.get("name") or "unknown" for d in odd}))
            yield fail(f"{indices(odd)} {'is' if len(odd) == 1 else 'are'} {names}, expected {expected.gpu_model} "
                       f"({where})", "run on nodes with the expected GPUs, or correct gpu_model in the profile",
                       models=names, **evidence)
    if not problems:
        names = ", ".join(sorted({d.get("name") or "unknown" for d in devices})) or "none"
        yield passed(f"{len(devices)} GPU(s) ({names}), as expected ({where})", **evidence)


# --- Xid events ----------------------------------------------------------------------------------

# NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors): the events that mean the GPU itself is faulty
# or needs a reset, and those that only say a program misbehaved.
XID_FAULTS = {48: "double-bit ECC error", 61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
              64: "ECC page retirement or row remapping failure", 74: "NVLink error", 79: "GPU has fallen off the bus",
              95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error",
              154: "GPU recovery action changed (reset or reboot required)"}
XID_WATCH = {63: "ECC page retirement or row remapping event", 92: "high single-bit ECC error rate",
             94: "contained ECC error"}
XID_PROGRAM = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
               45: "preemptive cleanup"}


def _pci_key(text) -> Optional[tuple]:
    """'00000003:3B:00.0' (NVML) and '0003:3b:00' (the kernel's Xid line) -> (3, 0x3b, 0): domain, bus, device
    (machines with one PCI domain per GPU have the same bus on every GPU)."""
    parts = str(text or "").split(".")[0].split(":")
    try:
        return tuple(int(p, 16) for p in parts[-3:]) if len(parts) >= 3 else None
    except ValueError:
        return None


@check("GPU008", "xid-errors", "node", tags=["gpu", "health", "xid"],
       reads=["fabric", "gpus", "env.CUDA_VISIBLE_DEVICES"])
def xid_errors(ctx) -> Iterator[Finding]:
    """The job's GPUs logged no Xid error that means a faulty GPU (fallen off the bus, double-bit or
    uncontained ECC, NVLink, GSP errors) since the NVIDIA driver loaded; ECC events to watch are warnings, program errors
    (13, 31, 43, 45) are only listed.

    A GPU with such an Xid fails again under load: the rank on it dies or hangs in its next collective,
    and the whole job with it. The kernel log is the only record (NVML forgets after a reset).

    Drain the node and reboot it (the kernel log keeps the event until the NVIDIA driver is reloaded or the
    node reboots); a GPU that logs them again goes back to the vendor. Reading the log needs root or
    kernel.dmesg_restrict=0.
    """
    gpus, why = job_gpus(ctx)
    if why:
        yield why
        return
    xid = (fabric_of(ctx.fact)[0] or {}).get("xid")
    if not isinstance(xid, dict):
        yield skip("these facts do not include the kernel log (no NVIDIA driver under /proc, or an older node)")
        return
    if not xid.get("readable"):
        yield skip(f"the kernel log is not readable here ({xid.get('reason')}): run as root, or set "
                   "kernel.dmesg_restrict=0, to check Xid errors")
        return
    ours = {_pci_key(g.get("pci_bus_id")): g for g in gpus if _pci_key(g.get("pci_bus_id"))}
    faults, watch, program = [], [], []
    for event in xid.get("events") or []:
        gpu = ours.get(_pci_key(event.get("pci")))
        if gpu is None:
            continue
        code = event.get("xid")
        said = f"GPU {gpu.get('index')} ({event.get('pci')}): Xid {code}"
        if code in XID_FAULTS:
            faults.append(f"{said} {XID_FAULTS[code]}")
        elif code in XID_PROGRAM:
            program.append(f"{said} {XID_PROGRAM[code]}")
        else:
            watch.append(f"{said} {XID_WATCH.get(code, 'see NVIDIA Xid catalogue')}")
    evidence = {"faults": faults, "watch": watch, "program": program, "events_since_driver_load": xid.get("count"),
                "log_cut": xid.get("cut")}
    if faults:
        yield fail(f"{len(faults)} Xid fault(s) since the driver loaded: {'; '.join(dict.fromkeys(faults))}",
                   f"drain {ctx.node} and reboot it; replace the GPU if the Xid comes back", **evidence)
    elif watch:
        yield warn(f"Xid event(s) to watch since the driver loaded: {'; '.join(dict.fromkeys(watch))}",
                   f"watch {ctx.node}'s ECC counters (GPU004); reset the GPU at the next maintenance", **evidence)
    else:
        extra = f" (program errors only: {'; '.join(dict.fromkeys(program))})" if program else ""
        cut = " (the log was read only in part: it floods)" if xid.get("cut") else ""
        yield passed(f"no GPU fault Xid on the job's GPUs since the driver loaded{extra}{cut}", **evidence)


FABRIC_HEALTH_SAID = {"degraded_bandwidth": "its bandwidth is degraded", "route_recovery": "a route is in recovery",
                      "route_unhealthy": "a route is unhealthy",
                      "access_timeout_recovery": "it recovers from an access timeout"}


@check("GPU009", "nvswitch-fabric", "node", tags=["gpu", "nvml", "nvswitch", "fabric"],
       reads=["gpus", "fabric", "host.container", "env.CUDA_VISIBLE_DEVICES"])
def nvswitch_fabric(ctx) -> Iterator[Finding]:
    """On a node with NVSwitches, every GPU is registered with the NVSwitch fabric, and Fabric Manager runs at
    the driver's own version.

    On NVSwitch systems (HGX and DGX A100, H100, H200, B200) CUDA starts no work until Fabric Manager has set up
    the NVSwitches and registered the GPUs: before that, and for good when nvidia-fabricmanager is stopped or of
    another version than the driver (it refuses to start: 'fabric manager NVIDIA GPU driver interface version
    ... don't match with driver version'), every CUDA call fails with 'system not yet initialized'
    (cudaErrorSystemNotReady, 802), and NCCL with it. A fabric NVML flags (degraded bandwidth, an unhealthy
    route) slows or stops the job's NVLink traffic.

    Install nvidia-fabricmanager of exactly the driver's version (the package nvidia-fabricmanager-BRANCH at
    VERSION) and start it: `systemctl enable --now nvidia-fabricmanager`; after a driver update, update it too
    and reboot. Drain a node whose fabric NVML flags.
    """
    gpus = gpus_of(ctx.fact)
    if gpus is None:
        yield skip(f"no GPU facts on this node: {no_gpus_reason(ctx.fact)}")
        return
    devices = [g for g in gpus.get("devices") or [] if not lost(g)]
    fabric = ctx.fact.get("fabric") if isinstance(ctx.fact.get("fabric"), dict) else {}
    switches = [n for n, d in ((fabric.get("pci") or {}).get("devices") or {}).items() if d.get("kind") == "nvswitch"]
    states = [g for g in devices if isinstance(g.get("fabric"), dict) and g["fabric"]["state"] != "not_supported"]
    if not switches and not states:
        yield skip("no NVSwitch on this node (none on its PCIe tree, and NVML reports no GPU fabric)")
        return
    driver, manager = gpus.get("driver_version"), fabric.get("fabric_manager") or {}
    in_container = bool((ctx.fact.get("host") or {}).get("container"))
    running = None if in_container else manager.get("running")  # a container sees only its own processes
    version = manager.get("version")
    about = []
    if running is False:
        about.append("nv-fabricmanager is not running")
    if version and driver and version != driver:
        about.append(f"Fabric Manager {version} ({manager.get('package')}) is not the driver's {driver}, which "
                     "makes it refuse to start")
    at = driver or "of the driver's version"

    def fix() -> str:  # the node's name only in a finding that says it: a pass holds for every node alike
        return f"install nvidia-fabricmanager {at} and start it (systemctl enable --now nvidia-fabricmanager) on {ctx.node}"

    evidence = {"nvswitches": len(switches), "driver": driver, "fabric_manager": manager or None,
                "states": {g["index"]: g["fabric"] for g in states}}
    pending = [g for g in states if g["fabric"]["state"] in ("not_started", "in_progress")]
    failed = [g for g in states if g["fabric"]["state"] == "completed" and g["fabric"]["status"] != 0]
    if pending or failed:
        parts = [f"{indices(pending)} not registered with the NVSwitch fabric (NVML: {pending[0]['fabric']['state']})"
                 ] if pending else []
        if failed:
            parts.append(f"{indices(failed)}: registration failed (NVML status {failed[0]['fabric']['status']})")
        said = "; ".join(parts)
        yield fail(f"{said}: CUDA stops with 'system not yet initialized' (802) until Fabric Manager registers them"
                   + (f" ({'; '.join(about)})" if about else ""), fix(), **evidence)
        return
    if not states and (running is False or about):  # a fabric NVML cannot tell (before Hopper): Fabric Manager's word
        yield fail(f"{len(switches)} NVSwitches and {'; '.join(about)}: CUDA stops with 'system not yet initialized' "
                   "(802) on this node", fix(), **evidence)
        return
    if about:  # registered, so Fabric Manager ran: it is what the next start of it or of the node meets
        yield warn(f"the GPU fabric is registered, but {'; '.join(about)}: at its next start (a reboot, a restart of "
                   "the service) CUDA stops with 'system not yet initialized' (802)", fix(), **evidence)
        return
    flagged = {g["index"]: g["fabric"]["health"] for g in states if g["fabric"].get("health")}
    if flagged:
        worst = [g for g in states if g["index"] in flagged]
        said = ", ".join(FABRIC_HEALTH_SAID.get(h, h) for h in flagged[worst[0]["index"]])
        yield warn(f"{indices(worst)}: NVML flags the fabric's health: {said}", f"drain {ctx.node} and check its "
                   "NVSwitches and NVLinks (nvidia-smi -q | grep -A8 Fabric, Fabric Manager's log)", **evidence)
        return
    tail = f", Fabric Manager {version}" if version else ""
    tail += " running" if running else ""
    if running is None and not states:  # nothing NVML says either: said as not known, not as fine
        tail += ("; whether nv-fabricmanager runs is not known here (" + ("a container sees only its own processes"
                 if in_container else "this user does not see other users' processes") + ")")
    shown = f"{indices(states)} registered with the NVSwitch fabric (NVML: completed)" if states else \
        f"{len(switches)} NVSwitches"
    yield passed(f"{shown}{tail}" + (", as the driver" if version and version == driver else ""), **evidence)


# NCCL's own words when the FABRIC handles of multi-node NVLink fail (src/mnnvl.cc, ncclMnnvlCheck; N is the clique's
# ranks): the allocation (no IMEX channel), and the export or import through the IMEX daemon. NCCL 2.25 and 2.26
# gave up silently on the allocation, and said NCCL_NO_IMEX_2_25 on the export.
NCCL_NO_CHANNEL = ("MNNVL (cliqueSize N) is available but not working on this system. Check the IMEX channel "
                   "configuration (/dev/nvidia-caps-imex-channels). Set NCCL_MNNVL_ENABLE=0 to ignore this issue.")
NCCL_NO_IMEX = ("MNNVL (cliqueSize N) is available but not working on this system. Check the IMEX configuration "
                "(nvidia-imex-ctl -N). Set NCCL_MNNVL_ENABLE=0 to ignore this issue.")
NCCL_NO_IMEX_2_25 = ("MNNVL (cliqueSize N) is available but not supported on this system. Check the IMEX "
                     "configuration.")
MNNVL_CHECK_SINCE, MNNVL_STOPS_SINCE = (2, 25), (2, 27)  # ncclMnnvlCheck's FABRIC test; its stop on the allocation
MNNVL_OFF_FIX = "or set NCCL_MNNVL_ENABLE=0 in the job's environment to run without multi-node NVLink"
IMEX_MAJOR = "$(awk '$2==\"nvidia-caps-imex-channels\" {print $1}' /proc/devices)"


def _mnnvl_domains(gpus: List[dict]) -> Tuple[Dict[str, List[dict]], List[str], List[str]]:
    """The multi-node NVLink domains of a node's job GPUs as NCCL reads NVML (cluster UUID -> GPUs), why each other
    GPU is in none (NCCL then uses multi-node NVLink nowhere in the job), and the GPUs whose fabric is not known."""
    domains: Dict[str, List[dict]] = {}
    outside: Dict[str, List[dict]] = {}
    unknown: Dict[str, List[dict]] = {}
    for gpu in gpus:
        fabric = gpu.get("fabric")
        if lost(gpu) or "fabric" in (gpu.get("errors") or {}):
            unknown.setdefault("not answering NVML", []).append(gpu)
        elif fabric is None:  # NVML has no fabric for it: NCCL keeps NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
            outside.setdefault("have no NVSwitch fabric (NVML)", []).append(gpu)
        elif fabric["state"] != "completed":
            outside.setdefault(f"are not registered with the fabric (NVML: {fabric['state']})", []).append(gpu)
        elif fabric.get("cluster_uuid") is None:
            unknown.setdefault("have no cluster UUID in these facts (an older preflight)", []).append(gpu)
        elif fabric["cluster_uuid"] == ZERO_UUID:
            outside.setdefault("are in no multi-node NVLink domain (cluster UUID zero)", []).append(gpu)
        else:
            domains.setdefault(fabric["cluster_uuid"], []).append(gpu)

    def said(groups: Dict[str, List[dict]]) -> List[str]:
        return [f"{indices(members)} {why}" for why, members in groups.items()]

    return domains, said(outside), said(unknown)


def _imex_problems(imex: dict) -> Tuple[List[str], List[str]]:
    """(the channels this user may open, what is wrong where there is none)."""
    major = imex.get("major")
    channels = imex.get("channels") or []
    usable = [c["name"] for c in channels if c["char"] and c["usable"] and (major is None or c.get("major") == major)]
    if usable and imex.get("registered") is not False:  # (a driver that registers none has none that works)
        return usable, []
    wrong = []
    if imex.get("registered") is False:
        wrong.append("/proc/devices lists no nvidia-caps-imex-channels device (a driver without IMEX channels)")
    if not imex.get("directory"):
        wrong.append("/dev/nvidia-caps-imex-channels does not exist (channels are not made by default, nor kept "
                     "across a reboot)")
    elif not channels:
        wrong.append("/dev/nvidia-caps-imex-channels holds no channel")
    for channel in channels[:3]:
        name = channel["name"]
        if not channel["char"]:
            wrong.append(f"{name} is not a character device")
        elif major is not None and channel.get("major") != major:
            wrong.append(f"{name} is device {channel.get('major')}:{channel.get('minor')}, not of the driver's "
                         f"nvidia-caps-imex-channels major {major}")
        elif not channel["usable"]:
            wrong.append(f"this user may not open {name} for reading and writing")
    return [], wrong


def _imex_on(ctx, node: str, domain: str, job_env: Dict[str, str]) -> Iterator[Finding]:
    """The IMEX channels and daemon of one node of a multi-node NVLink domain of two or more of the job's nodes
    (`domain` says which), as NCCL needs them there."""
    facts = ctx.facts[node]["facts"]
    env = nccl_env(facts, job_env).values  # the job's own settings over the node's, then NCCL's files
    nccl = nccl_version(facts)
    release = ".".join(map(str, nccl)) if nccl else None
    off = mnnvl_off(env, nccl)
    if off:
        yield passed(f"{domain}; {off}: no IMEX channel needed", nccl_mnnvl_enable=env.get("NCCL_MNNVL_ENABLE"))
        return
    if nccl is not None and tuple(nccl[:2]) < MNNVL_CHECK_SINCE:
        yield skip(f"{domain}; not judged for NCCL {release}: its MNNVL rules are older than the FABRIC handle test "
                   "of NCCL 2.25 (src/mnnvl.cc) that preflight follows", nccl=release)
        return
    fabric = fabric_of(facts)[0] or {}
    imex = fabric.get("imex")
    if not isinstance(imex, dict):
        yield skip(f"{domain}; these facts do not include its IMEX channels (a node running an older preflight)")
        return
    in_container = bool((facts.get("host") or {}).get("container"))
    running = None if in_container else imex.get("running")  # a container sees only its own processes
    usable, wrong = _imex_problems(imex)
    evidence = {"imex": imex, "nccl": release}
    if wrong:
        major = imex.get("major") if isinstance(imex.get("major"), int) else IMEX_MAJOR
        fix = (f"on {node}, as root and again after every reboot (NVIDIA's IMEX guide): mkdir -p "
               f"/dev/nvidia-caps-imex-channels && mknod -m 666 /dev/nvidia-caps-imex-channels/channel0 c {major} 0; "
               "in a container, have the runtime give it the channel (NVIDIA_IMEX_CHANNELS=0 with the NVIDIA "
               f"Container Toolkit, a ComputeDomain's channel on Kubernetes); {MNNVL_OFF_FIX}")
        said = f"{domain}, but no IMEX channel this user may open: {'; '.join(wrong)}"
        if nccl is not None and tuple(nccl[:2]) < MNNVL_STOPS_SINCE:
            yield warn(f"{said}: NCCL {release} then runs without multi-node NVLink, over the network (its "
                       "ncclMnnvlCheck gives up when the FABRIC allocation fails; NCCL 2.27 and newer stop instead)",
                       fix, **evidence)
        else:
            yield fail(f"{said}: NCCL stops every rank with '{NCCL_NO_CHANNEL}'", fix, **evidence)
    if running is False:
        words = NCCL_NO_IMEX_2_25 if nccl is not None and tuple(nccl[:2]) < MNNVL_STOPS_SINCE else NCCL_NO_IMEX
        yield fail(f"{domain}, but nvidia-imex is not running: FABRIC handles are exported and imported through it, "
                   f"and NCCL stops every rank with '{words}'",
                   f"start nvidia-imex on {node} and on every node of its NVLink domain (systemctl enable --now "
                   "nvidia-imex, the domain's nodes listed in /etc/nvidia-imex/nodes_config.cfg); `nvidia-imex-ctl -N` "
                   f"shows each node's state; {MNNVL_OFF_FIX}", **evidence)
    if not wrong and running is not False:
        seen = "nvidia-imex running" if running else "whether nvidia-imex runs is not known here (" + (
            "a container sees only its own processes" if in_container else
            "this user does not see other users' processes") + ")"
        yield passed(f"{domain}: IMEX {', '.join(usable)} open to this user, {seen}", **evidence)


@check("GPU010", "imex-channels", "cluster", tags=["gpu", "nvml", "fabric", "mnnvl", "imex"])
def imex_channels(ctx) -> Iterator[Finding]:
    """Where two or more of the job's nodes share a multi-node NVLink domain (GB200/GB300 NVL72: their GPUs
    registered with the fabric under the same non-zero cluster UUID, NVML), each of them has an IMEX channel the
    job may open (/dev/nvidia-caps-imex-channels/channelN) and runs the nvidia-imex daemon, unless the job's
    environment turns multi-node NVLink off (NCCL_MNNVL_ENABLE=0, NCCL_CUMEM_ENABLE=0, NCCL_P2P_DISABLE=1).

    NCCL then shares GPU memory across the nodes through CUDA FABRIC handles, and tests them at initialization
    (src/mnnvl.cc, ncclMnnvlCheck): without a channel (they are not made by default, nor kept across a reboot)
    every rank stops with 'MNNVL (cliqueSize N) is available but not working on this system. Check the IMEX
    channel configuration (/dev/nvidia-caps-imex-channels)', and without the daemon with '... Check the IMEX
    configuration (nvidia-imex-ctl -N)' (NCCL 2.27 and newer). NCCL uses multi-node NVLink only where every
    rank's GPU is in a domain: a node outside turns it off for the whole job (an NVSwitch node, HGX, is in none:
    its cluster UUID is zero).

    Create channel0 as NVIDIA's IMEX guide says (as root, after every reboot: mknod -m 666
    /dev/nvidia-caps-imex-channels/channel0 c MAJOR 0, MAJOR from /proc/devices), or give the container its
    channel (NVIDIA_IMEX_CHANNELS=0, a ComputeDomain on Kubernetes); start nvidia-imex on every node of the
    domain (systemctl enable --now nvidia-imex; nvidia-imex-ctl -N); or set NCCL_MNNVL_ENABLE=0 to run without
    multi-node NVLink.
    """
    if not ctx.plan.remote or len(ctx.facts) < 2:
        where = "the job runs on one node" if ctx.plan.remote else "this machine alone"
        yield skip(f"{where}: NCCL tries multi-node NVLink only across nodes")
        return
    domains: Dict[str, List[str]] = {}  # cluster UUID -> the job's nodes with a GPU in it
    outside, unknown = {}, {}  # node -> why its GPUs are in no domain, or not known
    for node, on_node in ctx.on_node.items():
        gpus, why = job_gpus(on_node) if on_node is not None else (None, None)
        if gpus is None:
            unknown[node] = why.message if why else (ctx.facts[node].get("error") or {}).get("message") or "no facts"
            continue
        found, out, not_known = _mnnvl_domains(gpus)
        for uuid in found:
            domains.setdefault(uuid, []).append(node)
        if not_known:
            unknown[node] = "; ".join(not_known)
        elif out:
            outside[node] = "; ".join(out)
    shared = {uuid: nodes for uuid, nodes in domains.items() if len(nodes) > 1}
    if not domains and not outside:  # (said as GPU001 says it: the reports count the skips by their words)
        said = "; ".join(f"{fold(sorted(nodes))}: {why}" for why, nodes in _by_reason(unknown).items())
        yield skip(f"no GPU facts: no node's GPUs are known, so no multi-node NVLink domain is ({said})")
        return
    if not shared:
        said = "; ".join(f"{fold(sorted(nodes))}: {why}" for why, nodes in
                         _by_reason({**outside, **unknown}).items()) or "each node's GPUs are a domain of their own"
        yield skip(f"no two of the job's nodes share a multi-node NVLink domain ({said}): NCCL needs no IMEX channel")
        return
    in_shared = sorted({n for nodes in shared.values() for n in nodes})
    if unknown:
        said = "; ".join(f"{fold(sorted(nodes))}: {why}" for why, nodes in _by_reason(unknown).items())
        yield Finding(Status.SKIP, f"not judged: NCCL uses multi-node NVLink only where every rank's GPU is in a "
                      f"domain (src/mnnvl.cc), and that is not known for {said}", nodes=tuple(in_shared))
        return
    job_env = job_environment(ctx.plan)
    overriding = sorted(n for n in ctx.reachable if nccl_param(
        nccl_env(ctx.facts[n]["facts"], job_env).values, "NCCL_MNNVL_UUID", -1) != -1)
    if overriding:
        yield Finding(Status.SKIP, f"not judged: NCCL_MNNVL_UUID on {fold(overriding)} replaces NVML's cluster UUID "
                      "of every GPU (src/init.cc), so the domains are not NVML's", nodes=tuple(in_shared))
        return
    if outside:
        said = "; ".join(f"{fold(sorted(nodes))}: {why}" for why, nodes in _by_reason(outside).items())
        yield Finding(Status.PASS, f"NCCL runs without multi-node NVLink, over the network: it uses it only where "
                      f"every rank's GPU is in a domain (src/mnnvl.cc), and on {said}; no IMEX channel needed",
                      nodes=tuple(in_shared), evidence={"outside": outside})
        return
    for uuid, nodes in sorted(domains.items(), key=lambda item: item[1]):
        others = sorted(set(ctx.facts) - set(nodes))
        if len(nodes) == 1:  # NCCL tests FABRIC handles here too where two ranks share it: no proof of two nodes
            yield Finding(Status.PASS, f"NVLink domain {uuid} of no other node of the job: NCCL reaches the others "
                          "over the network; its IMEX channels are not judged (preflight judges a domain of two or "
                          "more nodes)", nodes=tuple(nodes), evidence={"cluster_uuid": uuid})
            continue
        domain = f"NVLink domain {uuid} of {fold(sorted(nodes))}"
        if others:
            domain += f" (NCCL uses it among them, and the network to {fold(others)})"
        yield from grouped(lambda node: _imex_on(ctx, node, domain, job_env), sorted(nodes))


def _by_reason(reasons: Dict[str, str]) -> Dict[str, List[str]]:
    """node -> why, as why -> its nodes."""
    nodes: Dict[str, List[str]] = {}
    for node, why in reasons.items():
        nodes.setdefault(why, []).append(node)
    return nodes
