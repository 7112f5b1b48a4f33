"""RDMA: the fabric NCCL uses between nodes, InfiniBand or RoCE, from each node's sysfs (preflight.node.fabric).

NCCL uses every ACTIVE port of the HCAs that NCCL_IB_HCA selects (all of them when it is unset) and falls
back to TCP sockets, silently and about ten times slower, when it finds none; RoCE needs a GID table entry
of the right type; GPUDirect RDMA needs a kernel module or DMA-BUF.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

from preflight.api import Finding, Status, check, fail, fold, grouped, passed, skip, warn
from preflight.job.nccl import fabric_of, gid_kind, ib_disabled, selected_ports, used_gid

GPUDIRECT_MODULES = ("nvidia_peermem", "nv_peer_mem")
# Counters that a healthy link keeps at zero (port_xmit_discards counts congestion too: evidence only).
ERROR_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors",
                  "local_link_integrity_errors", "excessive_buffer_overrun_errors")


# Past any port's rate (the fastest InfiniBand and Ethernet ports run at 800 to 2,400 Gb/s): a rate no kernel
# wrote, read as "cannot be read" rather than as the usual rate the other nodes are held to.
MAX_RATE_GBPS = 10_000


def rate_of(port: dict) -> Optional[float]:
    """The port's rate in Gb/s, None when it is absent or not a plausible rate (0, negative, inf, nan, huge)."""
    rate = port.get("rate_gbps")
    return rate if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= MAX_RATE_GBPS \
        else None


def active(port: dict) -> bool:
    return port.get("state") == "ACTIVE" and port.get("phys_state") == "LinkUp"


def _rdma_ports(ctx) -> Tuple[Optional[dict], List[Tuple[str, str, dict]], Optional[Finding]]:
    """(fabric, the ports NCCL may use) or a skip: no fabric facts, no RDMA device, or NCCL told not to."""
    fabric, why = fabric_of(ctx.fact)
    if why:
        return None, [], why
    devices = fabric.get("rdma") or {}
    if not devices:
        return fabric, [], skip("no RDMA device on this node (/sys/class/infiniband is empty): NCCL uses TCP sockets")
    env = ctx.fact.get("env") or {}
    if ib_disabled(env):
        return fabric, [], skip(f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}: NCCL does not use the RDMA devices")
    ports = selected_ports(env, devices)
    if not ports:
        return fabric, [], skip("NCCL_IB_HCA selects no port of this node (NET005 says why)")
    return fabric, ports, None


@check("RDMA001", "rdma-ports", "node", tags=["rdma", "infiniband", "roce", "nccl"])
def rdma_ports(ctx) -> Iterator[Finding]:
    """On a node with RDMA devices, the ports NCCL uses (those NCCL_IB_HCA selects, else all) are ACTIVE with
    the physical link up.

    NCCL skips a port that is not ACTIVE. With none left on one node, that node falls back to TCP sockets
    while the others use InfiniBand or RoCE: the job fails to connect, or runs about ten times slower; with
    some left, the node has fewer rails than the others and holds every collective back.

    Bring the port up (`ibstat` / `ibv_devinfo` show it; check the cable, the switch port and the subnet
    manager for InfiniBand, the link and its IP address for RoCE), or leave the node out of the job.
    """
    fabric, ports, why = _rdma_ports(ctx)
    if why:
        yield why
        return
    up = [f"{d}:{p}" for d, p, f in ports if active(f)]
    down = {f"{d}:{p}": f"{f.get('state') or 'unknown'}, {f.get('phys_state') or 'unknown'}"
            for d, p, f in ports if not active(f)}
    evidence = {"active": up, "down": down}
    states = "; ".join(f"{name} is {state}" for name, state in down.items())
    if not up:
        yield fail(f"no RDMA port NCCL may use is active ({states}): NCCL falls back to TCP sockets on this node",
                   f"bring the ports up on {ctx.node} (ibstat; cable, switch port, subnet manager), or take "
                   f"{ctx.node} out of the job", **evidence)
    elif down:
        yield warn(f"{states}: NCCL uses only {', '.join(up)}, {len(down)} rail(s) short of a healthy node",
                   f"bring {', '.join(down)} up on {ctx.node} (ibstat; cable, switch port)", **evidence)
    else:
        yield passed(f"{len(up)} RDMA port(s) active: {', '.join(up)}", **evidence)


@check("RDMA002", "rdma-rate", "cluster", tags=["rdma", "infiniband", "roce", "bandwidth"])
def rdma_rate(ctx) -> Iterator[Finding]:
    """Each active RDMA port runs at the rate the same port (device and port number) has on the other nodes.

    A port that trained at a lower rate (a bad cable or transceiver, a port at 2X width) makes its node the
    slowest member of every collective: the whole job runs at its rate. A node whose HCAs run at different
    rates by design (a 200 Gb/s storage HCA beside 400 Gb/s compute HCAs) is compared port by port.

    Reseat or replace the cable or transceiver of the named port (`ibstat` shows Rate and Width), or take
    the node out of the job.
    """
    ports: Dict[str, Dict[str, Optional[float]]] = {}  # node -> port name -> rate (None: not readable)
    for node in ctx.reachable:
        facts = ctx.facts[node]["facts"]
        fabric, why = fabric_of(facts)
        if why or ib_disabled(facts.get("env") or {}):
            continue
        for device, port, found in selected_ports(facts.get("env") or {}, fabric.get("rdma") or {}):
            if active(found):
                ports.setdefault(node, {})[f"{device}:{port}"] = rate_of(found)
    if not ports:
        yield skip("no node has an active RDMA port")
        return
    seen: Dict[str, Counter] = {}
    for rates in ports.values():
        for name, rate in rates.items():
            if rate:
                seen.setdefault(name, Counter())[rate] += 1
    # The usual rate of a port: the most common; a tie goes to the faster (a link trains down, not up).
    usual = {name: max(counts, key=lambda r: (counts[r], r)) for name, counts in seen.items()}

    def judge(node: str) -> Iterator[Finding]:
        rates = ports[node]
        unread = [name for name, rate in rates.items() if not rate]
        slow = {name: rate for name, rate in rates.items() if rate and rate != usual[name]}
        if slow:
            said = ", ".join(f"{name} at {rate:g} Gb/s (elsewhere {usual[name]:g})" for name, rate in slow.items())
            yield warn(f"{said}: the job's collectives run at the slowest port's rate",
                       f"check the cable and transceiver of {', '.join(slow)} on {node} (ibstat: Rate, Width)",
                       odd=slow, usual={name: usual[name] for name in slow})
        if unread:
            yield warn(f"the rate of {', '.join(unread)} cannot be read (sysfs rate empty or malformed)",
                       f"check {', '.join(unread)} on {node} with ibstat", unread=unread)
        if not slow and not unread:
            yield passed(f"{len(rates)} active port(s) at the usual rate "
                         f"({', '.join(sorted({f'{r:g} Gb/s' for r in rates.values()}))})")

    yield from grouped(judge, sorted(ports))


@check("RDMA003", "roce-gid", "cluster", tags=["rdma", "roce", "nccl"])
def roce_gid(ctx) -> Iterator[Finding]:
    """On the RoCE ports NCCL uses, the GID table entry it uses (NCCL_IB_GID_INDEX, or NCCL's own choice of a
    RoCE v2 IPv4 entry) exists on every node and is of the same kind (RoCE version, address family) there.

    RoCE addresses a peer by a GID table entry, and the table follows each node's addresses and VLANs: the
    same index can be RoCE v2 with an IPv4 address on one node and RoCE v1 or link-local on another. Ranks
    whose entries differ cannot connect their queue pairs: the job stops with 'NET/IB : Got completion with
    error' or hangs at its first collective.

    Set NCCL_IB_GID_INDEX on each node to the index of its RoCE v2 entry with the node's IPv4 address
    (`show_gids`; the index may differ per node), or unset it (or -1) with NCCL 2.21 or newer to let NCCL
    choose.
    """
    used: Dict[str, Dict[str, tuple]] = {}  # node -> port -> (index, entry, how, usable indices)
    for node in ctx.reachable:
        facts = ctx.facts[node]["facts"]
        fabric, why = fabric_of(facts)
        env = facts.get("env") or {}
        if why or ib_disabled(env):
            continue
        for device, port, found in selected_ports(env, fabric.get("rdma") or {}):
            if found.get("link_layer") == "Ethernet" and active(found):
                index, entry, how = used_gid(env, found)
                usable = [g.get("index") for g in found.get("gids") or []
                          if isinstance(g, dict) and gid_kind(g) == ("RoCE v2", "IPv4")]
                used.setdefault(node, {})[f"{device}:{port}"] = (index, entry, how, usable)
    if not used:
        yield skip("no node has an active RoCE port NCCL uses (InfiniBand, no RDMA device, or ports down: RDMA001)")
        return
    # The kind each port (device:port, the rail) has on most nodes; a tie goes to RoCE v2 IPv4.
    kinds: Dict[str, Counter] = {}
    for ports in used.values():
        for name, (_, entry, _, _) in ports.items():
            if entry:
                kinds.setdefault(name, Counter())[gid_kind(entry)] += 1
    usual = {name: max(c, key=lambda k: (c[k], k == ("RoCE v2", "IPv4"))) for name, c in kinds.items()}

    def judge(node: str) -> Iterator[Finding]:
        problems, fine, offers = [], [], set()
        for name, (index, entry, how, usable) in sorted(used[node].items()):
            if entry is None:
                problems.append(f"{name} has no GID at index {index} ({how})" if index is not None else
                                f"{name} has no entry for {how}")
            elif gid_kind(entry) != usual[name]:
                problems.append(f"{name}'s GID {index} ({how}) is {' '.join(gid_kind(entry))}, where the other "
                                f"nodes use {' '.join(usual[name])}")
            else:
                fine.append(f"{name} GID {index} ({' '.join(gid_kind(entry))})")
                continue
            offers.update(usable)
        if problems:
            fix = (f"set NCCL_IB_GID_INDEX={min(offers)} on {node}" if len(offers) == 1 else
                   f"set NCCL_IB_GID_INDEX on {node} to its RoCE v2 IPv4 entry (show_gids)" if offers else
                   f"give the RoCE interface of {node} an IPv4 address (the kernel then adds a RoCE v2 entry)")
            yield fail("; ".join(problems), fix, usual={name: " ".join(kind) for name, kind in usual.items()})
        else:
            yield passed(f"RoCE GIDs: {', '.join(fine)}")

    yield from grouped(judge, sorted(used))


def _kernel_at_least(release: Optional[str], major: int, minor: int) -> bool:
    try:
        parts = (release or "").split("-")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (IndexError, ValueError):
        return False


@check("RDMA004", "gpudirect-rdma", "node", tags=["rdma", "gpu", "nccl", "gpudirect"])
def gpudirect_rdma(ctx) -> Iterator[Finding]:
    """Where a node has both GPUs and RDMA devices, GPUDirect RDMA is possible: the nvidia_peermem (or the
    older nv_peer_mem) module is loaded, or DMA-BUF can take its place (Linux 5.12 or newer with NVIDIA's
    open kernel modules).

    Without it NCCL cannot let the HCA read and write GPU memory: every transfer between nodes is staged
    through host memory ('GPU Direct RDMA Disabled' in NCCL's INFO lines), costing bandwidth and CPU.

    Load the module (`modprobe nvidia_peermem`, and list it in /etc/modules-load.d/ so that it loads at
    boot), or install NVIDIA's open kernel modules on a 5.12+ kernel for DMA-BUF.
    """
    fabric, why = fabric_of(ctx.fact)
    if why:
        yield why
        return
    devices = sorted(fabric.get("rdma") or {})
    gpus = ctx.fact.get("gpus") or {}
    if not devices or not gpus.get("available") or not gpus.get("count"):
        yield skip("GPUDirect RDMA needs GPUs and RDMA devices on the node; this one has "
                   f"{'RDMA devices' if devices else 'no RDMA device'} and "
                   f"{'GPUs' if gpus.get('available') and gpus.get('count') else 'no GPU NVML sees'}")
        return
    modules = fabric.get("modules")
    loaded = [m for m in GPUDIRECT_MODULES if m in (modules or [])]
    driver = fabric.get("nvidia_driver") or ""
    dmabuf = _kernel_at_least(fabric.get("kernel"), 5, 12) and "Open Kernel Module" in driver
    evidence = {"modules": modules, "kernel": fabric.get("kernel"), "open_kernel_module": "Open Kernel Module" in driver}
    if loaded:
        yield passed(f"GPUDirect RDMA through {loaded[0]} for {', '.join(devices)}", **evidence)
    elif dmabuf:
        yield passed(f"GPUDirect RDMA through DMA-BUF (kernel {fabric.get('kernel')}, NVIDIA open kernel modules)",
                     **evidence)
    elif modules is None:
        yield skip("the loaded kernel modules cannot be read (/proc/modules)", **evidence)
    else:
        yield warn(f"GPUDirect RDMA is off: nvidia_peermem is not loaded, and DMA-BUF needs Linux 5.12+ with NVIDIA's "
                   f"open kernel modules (kernel {fabric.get('kernel')}): NCCL stages every transfer through host memory",
                   f"modprobe nvidia_peermem on {ctx.node} (and add it to /etc/modules-load.d/ for the next boot)",
                   **evidence)


@check("RDMA005", "hca-firmware", "cluster", tags=["rdma", "firmware"])
def hca_firmware(ctx) -> Iterator[Finding]:
    """HCAs of the same model run the same firmware on every node.

    Firmware releases change link training, congestion control and RoCE defaults; a node left behind at an
    update is a common cause of a link that flaps or a job that is slow on one node only.

    Update the named nodes' HCA firmware to the version the others run (mlxfwmanager / mstflint), then
    reboot or reset the HCA.
    """
    firmware: Dict[str, Dict[str, set]] = {}  # model -> version -> nodes
    for node in ctx.reachable:
        fabric, why = fabric_of(ctx.facts[node]["facts"])
        for device in ((fabric or {}).get("rdma") or {}).values():
            if device.get("fw_ver"):
                model = device.get("board_id") or device.get("hca_type") or "HCA"
                firmware.setdefault(model, {}).setdefault(device["fw_ver"], set()).add(node)
    if not firmware:
        yield skip("no node reports an RDMA device with a firmware version")
        return
    same = True
    for model, versions in sorted(firmware.items()):
        if len(versions) < 2:
            continue
        same = False
        usual = max(versions, key=lambda v: (len(versions[v]), ctx.plan.head in versions[v]))  # a tie: the head's
        for version, nodes in sorted(versions.items()):
            if version != usual:
                yield Finding(Status.WARN, f"{model} firmware {version} on {fold(sorted(nodes))}, {usual} on "
                              f"{fold(sorted(versions[usual]))}", f"update the {model} firmware to {usual} on "
                              f"{fold(sorted(nodes))} (mlxfwmanager)", nodes=tuple(sorted(nodes)),
                              evidence={"model": model, "version": version, "usual": usual})
    if same:
        yield passed("; ".join(f"{model} firmware {next(iter(v))} on every node" for model, v in sorted(firmware.items())))


@check("RDMA006", "rdma-errors", "node", tags=["rdma", "infiniband", "health"])
def rdma_errors(ctx) -> Iterator[Finding]:
    """The RDMA ports NCCL uses have counted no link errors (link_downed, symbol_error, port_rcv_errors and
    the others a healthy link keeps at zero) since the counters were last cleared.

    A link that went down or corrupts symbols retransmits and stalls: a job over it slows down or times out
    in a collective, at random, on this node only.

    Check the named port's cable, transceiver and switch port; clear the counters (`perfquery -x -R`) and
    watch whether they grow again.
    """
    fabric, ports, why = _rdma_ports(ctx)
    if why:
        yield why
        return
    counted = {}
    for device, port, facts in ports:
        errors = {k: v for k, v in (facts.get("counters") or {}).items() if k in ERROR_COUNTERS and isinstance(v, int) and v}
        if errors:
            counted[f"{device}:{port}"] = errors
    if counted:
        said = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in errors.items()) for name, errors in counted.items())
        yield warn(f"link errors counted: {said}", f"check the cable and switch port of {', '.join(counted)} on "
                   f"{ctx.node}, clear the counters (perfquery -x -R) and watch whether they grow", errors=counted)
    else:
        yield passed(f"no link error counted on {', '.join(f'{d}:{p}' for d, p, _ in ports)}")

