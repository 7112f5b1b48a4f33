"""RDMA: the fabric NCCL uses between nodes, InfiniBand or RoCE, from each node's sysfs (preflight.node.fabric).

NCCL uses every ACTIVE port of the HCAs that NCCL_IB_HCA selects (all of them when it is unset) and falls
back to TCP sockets, silently and about ten times slower, when it finds none; RoCE needs a GID table entry
of the right type; GPUDirect RDMA needs a kernel module or DMA-BUF.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

from preflight.api import Finding, Status, check, fail, fold, grouped, passed, skip, warn
from preflight.job.gpus import gpus_of, job_gpus
from preflight.job.nccl import (GID_CHOICE_SINCE, fabric_of, gid_kind, ib_disabled, nccl_env_of, nccl_version,
                                rdma_devices_nccl_may_use, selected_ports, used_gid)

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
    nccl_vars = nccl_env_of(ctx)
    env = nccl_vars.values
    if ib_disabled(env):
        return fabric, [], skip(f"{nccl_vars.said('NCCL_IB_DISABLE')}: NCCL does not use the RDMA devices")
    ports = selected_ports(env, devices)
    if not ports:
        return fabric, [], skip("NCCL_IB_HCA selects no port of this node (NET005 says why)")
    return fabric, ports, None


def _rdma_nodes(ctx) -> Iterator[Tuple[str, dict, dict, dict]]:
    """(node, its facts, its environment, its fabric) for every reached node whose fabric facts were read and
    where NCCL may use the RDMA devices (NCCL_IB_DISABLE not set): the nodes the cluster-wide RDMA checks compare."""
    for node in ctx.reachable:
        facts = ctx.facts[node]["facts"]
        fabric, why = fabric_of(facts)
        env = nccl_env_of(ctx, node).values
        if not why and not ib_disabled(env):
            yield node, facts, env, fabric


@check("RDMA001", "rdma-ports", "node", tags=["rdma", "infiniband", "roce", "nccl"],
       reads=["fabric", "env", "nccl_conf", "packages"])
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
    for node, _, env, fabric in _rdma_nodes(ctx):
        for device, port, found in selected_ports(env, fabric.get("rdma") or {}):
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
    """On the RoCE ports NCCL uses, the GID table entry it uses (NCCL_IB_GID_INDEX; unset, NCCL 2.21 and newer
    choose a RoCE v2 IPv4 entry, older NCCL uses index 0) exists on every node, is not link-local (fe80::),
    and is of the same kind (RoCE version, address family) there.

    RoCE addresses a peer by a GID table entry, and the table follows each node's addresses and VLANs: the
    same index can be RoCE v2 with an IPv4 address on one node and RoCE v1 or link-local on another. Ranks
    whose entries differ cannot connect their queue pairs: the job stops with 'NET/IB : Got completion with
    error' or hangs at its first collective. A link-local entry is not routed: queue pairs over it time out
    even where every node uses one (index 0 and 1 on ConnectX, the entries an older NCCL takes by default).

    Set NCCL_IB_GID_INDEX on each node to the index of its RoCE v2 entry with the node's IPv4 address
    (`show_gids`; the index may differ per node), or unset it (or -1) with NCCL 2.21 or newer to let NCCL
    choose.
    """
    used: Dict[str, Dict[str, tuple]] = {}  # node -> port -> (index, entry, how, usable indices)
    for node, facts, env, fabric in _rdma_nodes(ctx):
        for device, port, found in selected_ports(env, fabric.get("rdma") or {}):
            if found.get("link_layer") == "Ethernet" and active(found):
                index, entry, how = used_gid(env, found, nccl_version(facts))
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
            elif gid_kind(entry)[1] == "link-local":
                problems.append(f"{name}'s GID {index} ({how}) is the link-local {entry.get('gid')}, which is not "
                                "routed: queue pairs to the other nodes time out")
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
            nccl = nccl_version(ctx.facts[node]["facts"])
            if nccl is not None and tuple(nccl[:2]) < GID_CHOICE_SINCE:
                fix += " (or install NCCL 2.21 or newer, which chooses the entry itself)"
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


# NCCL finds GPUDirect RDMA by the files a peer-memory module leaves (ncclIbGdrSupport): MOFED's peer-memory
# clients, and since NCCL 2.23 /sys/module/nvidia_peermem/version as well (NVIDIA/nccl#1676: v2.22.3 and v2.23.4
# of src/transport/net_ib.cc).
PEER_CLIENTS = ("nv_mem", "nv_mem_nc")
PEERMEM_SINCE = (2, 23)


@check("RDMA004", "gpudirect-rdma", "node", tags=["rdma", "gpu", "nccl", "gpudirect"],
       reads=["fabric", "gpus", "env", "nccl_conf", "packages", "python"])
def gpudirect_rdma(ctx) -> Iterator[Finding]:
    """Where a node has both GPUs and RDMA devices, the NCCL it runs finds GPUDirect RDMA: a peer-memory module
    registered where NCCL looks (/sys/kernel/mm/memory_peers/nv_mem, nv_peer_mem or nvidia_peermem through
    MOFED; NCCL 2.23 and newer also /sys/module/nvidia_peermem), or DMA-BUF in its place (Linux 5.12 or newer
    with NVIDIA's open kernel modules).

    Without it NCCL cannot let the HCA read and write GPU memory: every transfer between nodes is staged
    through host memory ('GPU Direct RDMA Disabled for HCA' in NCCL's INFO lines), costing bandwidth and CPU,
    up to ten times slower. nvidia_peermem loaded without MOFED's peer memory is invisible to NCCL 2.22 and
    older.

    Load the module (`modprobe nvidia_peermem`, and list it in /etc/modules-load.d/ so that it loads at
    boot), install NCCL 2.23 or newer where nvidia_peermem is loaded but not found, or install NVIDIA's open
    kernel modules on a 5.12+ kernel for DMA-BUF.
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
    files = fabric.get("gpudirect")  # absent from an older collector: the loaded modules alone then
    nccl = nccl_version(ctx.fact)
    shown = ".".join(map(str, nccl)) if nccl else None
    evidence = {"modules": modules, "kernel": fabric.get("kernel"), "open_kernel_module": "Open Kernel Module" in driver,
                "gpudirect": files, "nccl": shown}
    found = loaded
    if isinstance(files, dict):
        peers = [f"memory_peers/{p}" for p in files.get("memory_peers") or [] if p in PEER_CLIENTS]
        peermem = bool(files.get("nvidia_peermem_version")) and (nccl is None or tuple(nccl[:2]) >= PEERMEM_SINCE)
        found = peers + (["nvidia_peermem"] if peermem else [])
    if found:
        yield passed(f"GPUDirect RDMA through {found[0]} for {', '.join(devices)}", **evidence)
    elif dmabuf:
        yield passed(f"GPUDirect RDMA through DMA-BUF (kernel {fabric.get('kernel')}, NVIDIA open kernel modules)",
                     **evidence)
    elif isinstance(files, dict) and (files.get("nvidia_peermem_version") or "nvidia_peermem" in loaded):
        yield warn(f"nvidia_peermem is loaded, but NCCL {shown} looks for GPUDirect RDMA only in "
                   "/sys/kernel/mm/memory_peers/nv_mem (NCCL 2.23 and newer also find /sys/module/nvidia_peermem), "
                   "and it is not there: NCCL turns GPUDirect RDMA off and stages every transfer through host memory",
                   f"install NCCL 2.23 or newer on {ctx.node} (the nvidia-nccl wheel torch loads), or load nvidia_peermem "
                   "over MOFED's peer memory (then /sys/kernel/mm/memory_peers/nv_mem exists)", **evidence)
    elif modules is None and not isinstance(files, dict):
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


@check("RDMA006", "rdma-errors", "node", tags=["rdma", "infiniband", "health"],
       reads=["fabric", "env", "nccl_conf", "packages"])
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



# --- the RoCE MTU ------------------------------------------------------------------------------------------

# The IB MTUs and the headers a RoCE v2 packet adds to its payload: GRH 40, UDP 8, BTH 12, XRC 4, AtomicETH 28,
# ICRC 4 (the kernel's iboe_get_mtu, include/rdma/ib_addr.h): a netdev at MTU 1500 gives an active_mtu of 1024,
# 4200 or more gives 4096.
IB_MTUS = (4096, 2048, 1024, 512, 256)
ROCE_HEADERS = 96
# NCCL 2.20 stopped lowering a queue pair's MTU to the peer's (its receive side uses its own active_mtu).
MTU_NOT_NEGOTIATED_SINCE = (2, 20)


def roce_active_mtu(netdev_mtu: Optional[int]) -> Optional[int]:
    """The active_mtu of a RoCE port whose netdev has this MTU, as the kernel derives it (iboe_get_mtu)."""
    if not isinstance(netdev_mtu, int) or isinstance(netdev_mtu, bool):
        return None
    return next((m for m in IB_MTUS if netdev_mtu - ROCE_HEADERS >= m), None)


def _roce_netdev(env: dict, device: dict, port: dict, nccl) -> Optional[str]:
    """The netdev of the port NCCL uses: that of the GID entry it uses, else the device's only one."""
    _, entry, _ = used_gid(env, port, nccl)
    if entry and entry.get("ndev"):
        return str(entry["ndev"])
    netdevs = device.get("netdevs") or []
    return str(netdevs[0]) if len(netdevs) == 1 else None


@check("RDMA007", "roce-mtu", "cluster", tags=["rdma", "roce", "mtu", "nccl"])
def roce_mtu(ctx) -> Iterator[Finding]:
    """The RoCE ports NCCL uses have the same active MTU on every node (the kernel derives it from the MTU of the
    port's network interface: 1500 gives 1024, 4200 or more gives 4096).

    NCCL 2.20 and newer set up each side of a queue pair with that side's own MTU: between a node at 1024 and
    one at 4096 the transfers fail with a local length error (IBV_WC_LOC_LEN_ERR) or the job hangs at its first
    large collective; older NCCL lowers both sides to the smaller MTU and runs slower. (The active MTU of an
    InfiniBand port is set by the subnet manager and is not in sysfs: `ibv_devinfo` shows it.)

    Set the same MTU on the RoCE interfaces of every node (`ip link set DEV mtu 4200`, and in the network
    configuration for the next boot), and on the switch ports between them.
    """
    ports: Dict[str, Dict[str, tuple]] = {}  # node -> port -> (active MTU, netdev, its MTU)
    older: Dict[str, bool] = {}
    for node, facts, env, fabric in _rdma_nodes(ctx):
        nccl = nccl_version(facts)
        older[node] = nccl is not None and tuple(nccl[:2]) < MTU_NOT_NEGOTIATED_SINCE
        devices = fabric.get("rdma") or {}
        for device, port, found in selected_ports(env, devices):
            if found.get("link_layer") == "Ethernet" and active(found):
                netdev = _roce_netdev(env, devices[device], found, nccl)
                mtu = (devices[device].get("netdev_mtu") or {}).get(netdev) if netdev else None
                ports.setdefault(node, {})[f"{device}:{port}"] = (roce_active_mtu(mtu), netdev, mtu)
    if not ports:
        yield skip("no node has an active RoCE port NCCL uses (the active MTU of an InfiniBand port is not in sysfs)")
        return
    seen: Dict[str, Counter] = {}
    for found in ports.values():
        for name, (mtu, _, _) in found.items():
            if mtu:
                seen.setdefault(name, Counter())[mtu] += 1
    # The usual MTU of a port: the most common; a tie goes to the larger (the smaller is what was left behind).
    usual = {name: max(counts, key=lambda m: (counts[m], m)) for name, counts in seen.items()}

    def judge(node: str) -> Iterator[Finding]:
        odd, netdevs, unread = {}, [], []
        for name, (mtu, netdev, netdev_mtu) in sorted(ports[node].items()):
            if not mtu:
                unread.append(f"{name} ({netdev or 'no single netdev'}: MTU {netdev_mtu})")
            elif mtu != usual[name]:
                odd[name] = f"{name} at {mtu} ({netdev} at MTU {netdev_mtu}; {usual[name]} on the other nodes)"
                netdevs.append(netdev)
        if odd:
            said = "; ".join(odd.values())
            fix = (f"set the MTU of {', '.join(netdevs)} on {node} to that of the other nodes (ip link set DEV mtu N), "
                   "and on the switch ports between them")
            if older[node]:
                yield warn(f"RoCE active MTU differs: {said}: NCCL lowers the queue pairs to the smaller MTU", fix,
                           odd=sorted(odd), usual={n: usual[n] for n in odd})
            else:
                yield fail(f"RoCE active MTU differs: {said}: NCCL sets up each side with its own MTU, and transfers "
                           "fail (local length error) or hang", fix, odd=sorted(odd), usual={n: usual[n] for n in odd})
        if unread:
            yield warn(f"the MTU of {', '.join(unread)} cannot be read (sysfs)",
                       f"check the RoCE interfaces of {node} with ip link", unread=unread)
        if not odd and not unread:
            yield passed("RoCE active MTU " + ", ".join(f"{name} {mtu}" for name, (mtu, _, _) in sorted(ports[node].items())))

    yield from grouped(judge, sorted(ports))


# --- the PCIe path between each GPU and its HCA --------------------------------------------------------------

# What the ACS Control register redirects (PCIe base specification, ACS Extended Capability): P2P Request
# Redirect (bit 2), P2P Completion Redirect (bit 3), P2P Egress Control (bit 5). Source Validation (bit 0)
# and Upstream Forwarding (bit 4) alone do not move peer-to-peer traffic.
ACS_BITS = ((0, "SrcValid"), (1, "TransBlk"), (2, "ReqRedir"), (3, "CmpltRedir"), (4, "UpstreamFwd"),
            (5, "EgressCtrl"), (6, "DirectTrans"))
ACS_REDIRECTS = (1 << 2) | (1 << 3) | (1 << 5)
EXTENDED_CONFIG = 0x100  # where the extended capabilities start: beyond what a user without root reads
TRANSLATED = ("DMA", "DMA-FQ")  # IOMMU group types that translate DMA (sysfs-kernel-iommu_groups)
SWITCH, HOST_BRIDGE, SOCKETS = "the same PCIe switch", "the same CPU socket", "across CPU sockets"


def _pci_of(ctx) -> Tuple[Dict[str, dict], Dict[str, dict], Dict[str, dict], Optional[Finding]]:
    """(GPUs by PCI address, the HCAs NCCL may use by name, ACS by bridge) on this node, or a skip: worked out
    once per node for the three checks that read it (callers do not change what it returns)."""
    return ctx.memo(_pci_of, lambda: _pci_on_node(ctx))


def _pci_on_node(ctx) -> Tuple[Dict[str, dict], Dict[str, dict], Dict[str, dict], Optional[Finding]]:
    fabric, why = fabric_of(ctx.fact)
    if why:
        return {}, {}, {}, why
    pci = fabric.get("pci")
    if not isinstance(pci, dict):
        return {}, {}, {}, skip("these fabric facts have no PCIe tree (a node running an older preflight)")
    devices = pci.get("devices") or {}
    gpus = {bdf: d for bdf, d in devices.items() if d.get("kind") == "gpu"}
    # The GPUs the job's ranks use (gpu_ids, CUDA_VISIBLE_DEVICES; NVML's 00000000:18:00.0 is sysfs' 0000:18:00.0);
    # without NVML facts, every GPU in the tree.
    chosen, _ = job_gpus(ctx)
    wanted = {str(d.get("pci_bus_id") or "").lower()[-12:] for d in chosen or []}
    gpus = {bdf: d for bdf, d in gpus.items() if bdf in wanted} or gpus
    rdma = fabric.get("rdma") or {}
    hcas = {name: devices[rdma[name].get("pci")] for name in rdma_devices_nccl_may_use(ctx.fact)
            if rdma[name].get("pci") in devices}
    if not gpus:
        return {}, {}, {}, skip("the PCIe tree shows no NVIDIA GPU on this node: no GPU path to judge")
    return gpus, hcas, pci.get("acs") or {}, None


def _paths_said(paths) -> str:
    kinds = {"peer" if other.startswith("GPU ") else "hca" for _, _, other, _ in paths}
    return " and ".join(said for kind, said in (("hca", "the GPUs and their HCAs"),
                                                 ("peer", "the GPUs that reach each other over PCIe")) if kind in kinds)


def _pcie_peers(ctx, gpus: Dict[str, dict]) -> List[Tuple[str, str]]:
    """The pairs of GPUs whose peer-to-peer traffic turns in a PCIe switch they share (where ACS can send it up
    to the root complex instead): both without an active NVLink, as NVML reports them (NVSwitch or bridge GPUs
    talk over NVLink), and peer-to-peer read and write allowed by the driver where NVML says
    (nvmlDeviceGetP2PStatus: else CUDA and NCCL copy through host memory); none where NVML did not answer. GPUs
    under different root ports meet in the root complex whatever ACS says."""
    nvml = {str(d.get("pci_bus_id") or "").lower()[-12:]: d for d in (gpus_of(ctx.fact) or {}).get("devices") or []}
    pcie = sorted(bdf for bdf in gpus if bdf in nvml and not any(nvml[bdf].get("nvlink_active") or []))

    def peer_to_peer(a, b) -> bool:  # NVML's word where it gave one: the driver lets them read and write each other
        status = (nvml[a].get("p2p") or {}).get(str(nvml[b].get("index")))
        return not isinstance(status, dict) or (status.get("read"), status.get("write")) == ("ok", "ok")

    return [(a, b) for i, a in enumerate(pcie) for b in pcie[i + 1:]
            if _shared(gpus[a], gpus[b]) and peer_to_peer(a, b)]


def _gpu_paths(ctx, gpus, hcas) -> Tuple[List[Tuple[str, dict, str, dict]], Optional[Finding]]:
    """The device pairs whose DMA crosses the PCIe tree: each GPU and its nearest HCAs (GPUDirect RDMA), and the
    GPUs that reach each other over PCIe (peer-to-peer); or a skip when there are none."""
    paths = [(f"GPU {bdf}", gpu, name, hcas[name]) for bdf, gpu in sorted(gpus.items())
             for name in (_nearest(gpu, hcas)[1] if hcas else [])]
    paths += [(f"GPU {a}", gpus[a], f"GPU {b}", gpus[b]) for a, b in _pcie_peers(ctx, gpus)]
    if not paths:
        return [], skip(f"no HCA NCCL may use and no GPUs that reach each other over PCIe ({len(gpus)} GPU(s), "
                        "NVLink or no NVML answer): no GPUDirect RDMA or peer-to-peer path to judge")
    return paths, None


def _shared(a: dict, b: dict) -> int:
    """How many bridges two devices have above them in common (from the root port down)."""
    count = 0
    for x, y in zip(a.get("bridges") or [], b.get("bridges") or []):
        if x != y:
            break
        count += 1
    return count


def distance(a: dict, b: dict) -> str:
    """NCCL's path types, read from the PCIe tree: a shared bridge is a PCIe switch (PIX/PXB), the same host
    bridge or NUMA node one CPU socket (PHB), else across the sockets (SYS)."""
    if _shared(a, b):
        return SWITCH
    if a.get("host_bridge") == b.get("host_bridge") or a.get("numa_node") == b.get("numa_node"):
        return HOST_BRIDGE
    return SOCKETS


def _nearest(gpu: dict, hcas: Dict[str, dict]) -> Tuple[str, List[str]]:
    order = (SWITCH, HOST_BRIDGE, SOCKETS)
    best = min((distance(gpu, h) for h in hcas.values()), key=order.index)
    return best, sorted(n for n, h in hcas.items() if distance(gpu, h) == best)


def acs_text(ctl: int) -> str:
    return " ".join(f"{name}{'+' if ctl >> bit & 1 else '-'}" for bit, name in ACS_BITS)


@check("RDMA008", "pcie-acs", "node", tags=["rdma", "gpu", "pcie", "gpudirect"],
       reads=["fabric", "gpus", "env", "nccl_conf", "packages"])
def pcie_acs(ctx) -> Iterator[Finding]:
    """PCIe Access Control Services (ACS) do not redirect peer-to-peer traffic on the bridges between each GPU
    and the HCA nearest to it, and between GPUs that reach each other over PCIe (no NVLink): ReqRedir,
    CmpltRedir, EgressCtrl off in ACSCtl.

    With ACS redirecting, every GPUDirect RDMA transfer between the GPU and its HCA goes up to the root complex
    instead of turning in the PCIe switch: bandwidth drops, and on many platforms the transfers fail (NET/IB
    completion errors) or NCCL hangs. The BIOS often leaves ACS on; a hypervisor needs it, a bare-metal
    training node does not. The config space that holds ACS is readable only as root.

    Disable ACS in the BIOS, or at each boot as root: `setpci -s BRIDGE ECAP_ACS+6.w=0000` for each named
    bridge; run `preflight node` as root (a SLURM prolog) to check it.
    """
    gpus, hcas, acs, why = _pci_of(ctx)
    paths, why = (None, why) if why else _gpu_paths(ctx, gpus, hcas)
    if why:
        yield why
        return
    between: Dict[str, List[str]] = {}  # bridge -> the pairs whose path crosses it
    for one, a, other, b in paths:
        shared = _shared(a, b)
        for bridge in (a.get("bridges") or [])[shared:] + (b.get("bridges") or [])[shared:]:
            between.setdefault(bridge, []).append(f"{one} - {other}")
    what = _paths_said(paths)
    if not between:
        yield passed(f"no PCIe bridge between {what}", bridges=[])
        return
    redirecting = {b: acs[b]["ctl"] for b in sorted(between) if isinstance((acs.get(b) or {}).get("ctl"), int)
                   and acs[b]["ctl"] & ACS_REDIRECTS}
    # 64 bytes (128 for CardBus) is what the kernel gives a user without root; 256 is all a device without
    # extended config space has (no ACS there).
    unread = [b for b in sorted(between) if (acs.get(b) or {}).get("config_bytes", 0) < EXTENDED_CONFIG]
    evidence = {"bridges": {b: sorted(set(p)) for b, p in sorted(between.items())},
                "acs_ctl": {b: (acs.get(b) or {}).get("ctl") for b in sorted(between)}, "unreadable": unread}
    if redirecting:
        said = "; ".join(f"{b} (ACSCtl {acs_text(ctl)}) between {', '.join(sorted(set(between[b])))}"
                         for b, ctl in redirecting.items())
        moved = " and ".join(w for w, on in (("GPUDirect RDMA", "the GPUs and their HCAs" in what),
                                             ("GPU peer-to-peer", "over PCIe" in what)) if on)
        yield warn(f"ACS redirects peer-to-peer traffic on {said}: {moved} goes through the root complex, slower, or "
                   "fails", f"disable ACS in the BIOS of {ctx.node}, or as root at each boot: "
                   + "; ".join(f"setpci -s {b} ECAP_ACS+6.w=0000" for b in redirecting), **evidence)
    elif unread:
        yield skip(f"the ACS of {len(unread)} bridge(s) between {what} cannot be read: the kernel "
                   "gives a user without root the first 64 bytes of PCI config space, and ACS lies beyond byte 256 "
                   "(run preflight node as root, as a SLURM prolog does)", **evidence)
    else:
        yield passed(f"ACS redirects nothing on the {len(between)} bridge(s) between {what}", **evidence)


@check("RDMA009", "iommu-mode", "node", tags=["rdma", "gpu", "pcie", "gpudirect"],
       reads=["fabric", "gpus", "env", "nccl_conf", "packages"])
def iommu_mode(ctx) -> Iterator[Finding]:
    """The IOMMU does not translate the DMA of the node's GPUs and HCAs: it is off, or in passthrough mode
    (`iommu=pt`: IOMMU group type identity in /sys/kernel/iommu_groups/N/type), where they use GPUDirect RDMA or
    reach each other over PCIe.

    With translation on (intel_iommu=on or amd_iommu=on without iommu=pt: group type DMA or DMA-FQ), every
    peer-to-peer and GPUDirect RDMA access goes through the IOMMU's page tables: NCCL runs slower, hangs in its
    first collectives, or GPU-to-GPU copies arrive as zeroes (IO_PAGE_FAULT in the kernel log).

    Boot the node with `iommu=pt` next to intel_iommu=on / amd_iommu=on (GRUB_CMDLINE_LINUX, then
    update-grub and reboot), or turn the IOMMU off in the BIOS where nothing on the node needs it.
    """
    gpus, hcas, _, why = _pci_of(ctx)
    why = why or _gpu_paths(ctx, gpus, hcas)[1]
    if why:
        yield why
        return
    fabric, _ = fabric_of(ctx.fact)
    iommu = fabric.get("iommu") if isinstance(fabric.get("iommu"), dict) else {}
    cmdline = [str(a) for a in iommu.get("cmdline") or []]
    passthrough = "iommu=pt" in cmdline or "iommu.passthrough=1" in cmdline
    named = dict({f"GPU {bdf}": d for bdf, d in gpus.items()}, **hcas)
    translated = {name: d.get("iommu_group") for name, d in sorted(named.items())
                  if d.get("iommu_group") in TRANSLATED or (d.get("iommu_group") == "unknown" and not passthrough)}
    evidence = {"cmdline": cmdline, "units": iommu.get("units"),
                "groups": {name: d.get("iommu_group") for name, d in sorted(named.items())}}
    if translated:
        kinds = ", ".join(sorted({str(t) for t in translated.values()}))
        listed = list(translated)
        shown = ", ".join(listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
        yield warn(f"the IOMMU translates the DMA of {shown} (IOMMU group type {kinds}; kernel "
                   f"arguments: {' '.join(cmdline) or 'none'}): GPUDirect RDMA and GPU peer-to-peer go through "
                   "its page tables: slower, or hangs", f"boot {ctx.node} with iommu=pt (next to intel_iommu=on or "
                   "amd_iommu=on), or turn the IOMMU off in the BIOS", **evidence)
    else:
        mode = "passthrough" if any(d.get("iommu_group") for d in named.values()) else "off"
        yield passed(f"the IOMMU does not translate the GPUs' and HCAs' DMA ({mode})", **evidence)


@check("RDMA010", "gpu-hca-locality", "node", tags=["rdma", "gpu", "pcie", "numa", "nccl"],
       reads=["fabric", "gpus", "env", "nccl_conf", "packages"])
def gpu_hca_locality(ctx) -> Iterator[Finding]:
    """Every GPU the job's ranks use (gpu_ids, CUDA_VISIBLE_DEVICES, else all) has an HCA that NCCL may use on
    its own CPU socket (its PCIe switch, or its NUMA node), read from the PCIe tree in sysfs as NCCL's topology
    reads it.

    A GPU whose nearest HCA is on the other socket sends all its traffic between nodes across the CPU
    interconnect (NCCL's path SYS), and NCCL does not use GPUDirect RDMA over it: that rank is the slow one in
    every collective. It happens when NCCL_IB_HCA leaves out the HCA beside the GPU, or when an HCA is missing
    or down on that socket.

    Let NCCL use the HCA beside each GPU (NCCL_IB_HCA naming every rail, or unset), or bring that HCA up.
    """
    gpus, hcas, _, why = _pci_of(ctx)
    if why or not hcas:
        yield why or skip(f"the PCIe tree shows {len(gpus)} NVIDIA GPU(s) and no HCA NCCL may use on this node: no "
                          "GPU-HCA path to judge")
        return
    fabric, _ = fabric_of(ctx.fact)
    devices = (fabric.get("pci") or {}).get("devices") or {}
    rdma = fabric.get("rdma") or {}
    left_out = {name: devices[d.get("pci")] for name, d in rdma.items() if name not in hcas and d.get("pci") in devices}
    nearest = {bdf: _nearest(gpu, hcas) for bdf, gpu in sorted(gpus.items())}
    evidence = {"nearest": {bdf: {"hcas": names, "path": path} for bdf, (path, names) in nearest.items()}}
    far = {bdf: names for bdf, (path, names) in nearest.items() if path == SOCKETS}
    if far:
        said = "; ".join(f"GPU {bdf} (NUMA node {gpus[bdf].get('numa_node')}) reaches {', '.join(names)} only across "
                         "the sockets" for bdf, names in far.items())
        beside = sorted({n for bdf in far for n, d in left_out.items() if distance(gpus[bdf], d) != SOCKETS})
        fix = (f"let NCCL use {', '.join(beside)} on {ctx.node} (NCCL_IB_HCA leaves it out)" if beside else
               f"bring up an HCA on the GPU's socket on {ctx.node}, or leave the node out of the job")
        yield warn(f"{said}: NCCL sends its traffic over the CPU interconnect, without GPUDirect RDMA", fix,
                   **evidence)
    else:
        counts = Counter(path for path, _ in nearest.values())
        yield passed("each GPU has an HCA on its socket: " + ", ".join(f"{n} on {path}" for path, n in counts.items()),
                     **evidence)
