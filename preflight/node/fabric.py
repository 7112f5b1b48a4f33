"""The fabric: RDMA devices and ports, GPUDirect modules, NCCL libraries, Xid events, the PCIe path between
GPUs and HCAs (bridges and their ACS, NUMA nodes, IOMMU groups). All from sysfs and procfs under SYSROOT ("/" on
a node; a recorded tree in the tests)."""
import os
import re
import stat
import sys
import time


SYSROOT = "/"
RDMA_ERROR_COUNTERS = ("link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors",
                       "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_xmit_discards")
FABRIC_MODULES = ("nvidia", "nvidia_peermem", "nv_peer_mem", "ib_core", "ib_uverbs", "mlx5_core", "mlx5_ib",
                  "rdma_ucm", "efa", "irdma", "bnxt_re")
XID_LIMIT = 200  # events kept per node: a GPU in an Xid storm logs thousands
XID_READ_S, XID_READ_BYTES = 2.0, 32 << 20  # the kernel's largest log buffer is 32 MiB (log_buf_len)
# What NCCL's ncclIbGdrSupport tests for GPUDirect RDMA by a peer-memory module: MOFED's peer-memory clients
# (nv_peer_mem, or nvidia_peermem registered through MOFED) and, since NCCL 2.23, nvidia_peermem itself.
MEMORY_PEERS = os.path.join("sys", "kernel", "mm", "memory_peers")
NVIDIA_PEERMEM_VERSION = os.path.join("sys", "module", "nvidia_peermem", "version")
PCI_DEVICES = os.path.join("sys", "bus", "pci", "devices")
PCI_NAME = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
PCI_LIMIT = 4096  # devices looked at: a large server has a few hundred
NVIDIA_VENDOR, DISPLAY_CLASSES = "0x10de", ("0x0300", "0x0302")  # VGA and 3D controllers
NVSWITCH_CLASS = "0x0680"  # an NVSwitch is an NVIDIA "other bridge" (HGX A100, H100, H200, B200)
DPKG_STATUS = os.path.join("var", "lib", "dpkg", "status")
DPKG_STATUS_LIMIT = 64 << 20  # a large image's dpkg status is a few MB
# PCIe extended capabilities start at 0x100 of config space; the kernel gives the first 64 bytes to a user
# without CAP_SYS_ADMIN (drivers/pci/pci-sysfs.c, pci_read_config), so ACS is read only as root (as lspci).
CONFIG_BYTES, EXTENDED_CAPS, ACS_CAP_ID = 4096, 0x100, 0x000D
IOMMU_ARGS = ("iommu", "intel_iommu", "amd_iommu", "iommu.passthrough", "iommu.strict")
# IMEX channels (NVIDIA's IMEX guide): character devices of the major /proc/devices lists as
# nvidia-caps-imex-channels, made by the administrator (mknod; gone after a reboot) or by a container runtime.
IMEX_CHANNELS = os.path.join("dev", "nvidia-caps-imex-channels")
IMEX_DEVICE = "nvidia-caps-imex-channels"
IMEX_CHANNEL_LIMIT = 64  # channels listed: one the job may open is enough


def _sys_text(path):
    """A sysfs attribute's text, None when it is absent or the kernel refuses it (an empty GID's type)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4096).decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return None


def _sys_list(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _numbered(text):
    """'4: ACTIVE' -> 'ACTIVE' (the kernel's state and phys_state format)."""
    return text.split(":", 1)[1].strip() if text and ":" in text else text


def _rate_gbps(text):
    """'200 Gb/sec (4X HDR)' -> 200.0, '2.5 Gb/sec (1X SDR)' -> 2.5."""
    try:
        rate = float(text.split()[0])
    except (AttributeError, IndexError, ValueError):
        return None
    return rate if rate == rate and abs(rate) != float("inf") else None  # sysfs text 'nan' or 'inf' is no rate


def _rdma_port(folder):
    layer = _sys_text(os.path.join(folder, "link_layer"))
    port = {"state": _numbered(_sys_text(os.path.join(folder, "state"))),
            "phys_state": _numbered(_sys_text(os.path.join(folder, "phys_state"))),
            "rate": _sys_text(os.path.join(folder, "rate")), "link_layer": layer, "gids": [], "counters": {}}
    port["rate_gbps"] = _rate_gbps(port["rate"])
    # InfiniBand addresses by LID and GID 0; RoCE picks a GID table entry (NCCL_IB_GID_INDEX).
    indices = [i for i in _sys_list(os.path.join(folder, "gids")) if i.isdigit()] if layer == "Ethernet" else ["0"]
    for index in sorted(indices, key=int):
        gid = _sys_text(os.path.join(folder, "gids", index))
        if not gid or not gid.replace("0", "").replace(":", ""):
            continue  # an empty entry
        port["gids"].append({"index": int(index), "gid": gid,
                             "type": _sys_text(os.path.join(folder, "gid_attrs", "types", index)),
                             "ndev": _sys_text(os.path.join(folder, "gid_attrs", "ndevs", index))})
    for name in RDMA_ERROR_COUNTERS:
        value = _sys_text(os.path.join(folder, "counters", name))
        if value is not None:
            port["counters"][name] = int(value) if value.isdigit() else None  # "N/A (no PMA)"
    return port


def _rdma_devices(root):
    devices = {}
    base = os.path.join(root, "sys", "class", "infiniband")
    for name in _sys_list(base):
        folder = os.path.join(base, name)
        device = {key: _sys_text(os.path.join(folder, key)) for key in ("fw_ver", "hca_type", "board_id", "node_guid")}
        device["node_type"] = _numbered(_sys_text(os.path.join(folder, "node_type")))
        device["netdevs"] = _sys_list(os.path.join(folder, "device", "net"))
        # RoCE's active MTU follows its netdev's MTU (the kernel's iboe_get_mtu); InfiniBand's is not in sysfs.
        mtus = dict((n, _sys_text(os.path.join(folder, "device", "net", n, "mtu"))) for n in device["netdevs"])
        device["netdev_mtu"] = dict((n, int(v) if v and v.isdigit() else None) for n, v in mtus.items())
        device["pci"] = os.path.basename(os.path.realpath(os.path.join(folder, "device")))
        device["ports"] = {p: _rdma_port(os.path.join(folder, "ports", p)) for p in _sys_list(os.path.join(folder, "ports"))}
        devices[name] = device
    return devices


def _loaded_modules(root):
    """The fabric's kernel modules that /proc/modules lists as loaded (None: not readable)."""
    try:
        with open(os.path.join(root, "proc", "modules")) as handle:
            loaded = {line.split(" ", 1)[0] for line in handle}
    except OSError:
        return None
    return sorted(loaded.intersection(FABRIC_MODULES))


def _gpudirect(root):
    """The files NCCL tests for a peer-memory module: the memory_peers clients that have a version file, and
    nvidia_peermem's module version."""
    base = os.path.join(root, MEMORY_PEERS)
    peers = [n for n in _sys_list(base) if os.path.exists(os.path.join(base, n, "version"))]
    return {"memory_peers": peers, "nvidia_peermem_version": _sys_text(os.path.join(root, NVIDIA_PEERMEM_VERSION))}


def acs_control(config):
    """The ACS Control register from a device's config space (the walk lspci's cap_acs does over the extended
    capability list: a 32-bit header, ID in bits 0-15, the next offset in bits 20-31; Control at +6), None
    where the device has no ACS capability. Only meaningful with all 4096 bytes (root)."""
    offset, seen = EXTENDED_CAPS, 0
    while EXTENDED_CAPS <= offset <= len(config) - 8 and seen < 512:
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[offset + 6:offset + 8], "little")
        offset, seen = (header >> 20) & 0xFFC, seen + 1
    return None


def _pci_node(root, folder, kind):
    """Where a PCI device sits: its host bridge (pciDDDD:BB), the bridges above it (the root port first), its
    NUMA node (None for the kernel's -1) and its IOMMU group's type (None: no group, the IOMMU is off for it)."""
    devices = os.path.join(os.path.realpath(root), "sys", "devices") + os.sep
    path = os.path.realpath(folder)
    parts = path[len(devices):].split(os.sep) if path.startswith(devices) else []
    numa = _sys_text(os.path.join(path, "numa_node"))
    group = os.path.join(path, "iommu_group")
    return {"kind": kind, "host_bridge": parts[0] if parts and parts[0].startswith("pci") else None,
            "bridges": [p for p in parts[1:-1] if PCI_NAME.match(p)],
            "numa_node": int(numa) if numa and numa.isdigit() else None,
            "iommu_group": (_sys_text(os.path.join(os.path.realpath(group), "type")) or "unknown")
            if os.path.islink(group) else None}


def _config_space(path):
    try:
        with open(path, "rb") as handle:
            return handle.read(CONFIG_BYTES)
    except OSError:
        return b""


def _pci(root, rdma):
    """The NVIDIA GPUs (by vendor and class, as NCCL's topology finds them in sysfs) and the RDMA devices, where
    each sits on the PCIe tree, and the ACS Control of every bridge above them (None where not readable)."""
    base = os.path.join(root, PCI_DEVICES)
    nodes = {}
    for name in _sys_list(base)[:PCI_LIMIT]:
        folder = os.path.join(base, name)
        vendor, klass = _sys_text(os.path.join(folder, "vendor")), _sys_text(os.path.join(folder, "class")) or ""
        if vendor == NVIDIA_VENDOR and klass[:6] in DISPLAY_CLASSES:
            nodes[name] = _pci_node(root, folder, "gpu")
        elif vendor == NVIDIA_VENDOR and klass[:6] == NVSWITCH_CLASS:
            nodes[name] = _pci_node(root, folder, "nvswitch")
    for name, device in sorted(rdma.items()):
        if PCI_NAME.match(device.get("pci") or ""):
            nodes[device["pci"]] = _pci_node(root, os.path.join(root, "sys", "class", "infiniband", name, "device"),
                                             "hca")
    acs = {}
    for bridge in sorted(set(b for n in nodes.values() for b in n["bridges"])):
        config = _config_space(os.path.join(base, bridge, "config"))
        full = len(config) > EXTENDED_CAPS
        acs[bridge] = {"config_bytes": len(config), "ctl": acs_control(config) if full else None}
    return {"devices": nodes, "acs": acs}


def _iommu(root):
    """The kernel's IOMMU arguments (/proc/cmdline) and the IOMMU units it registered (/sys/class/iommu)."""
    cmdline = (_sys_text(os.path.join(root, "proc", "cmdline")) or "").split()
    return {"cmdline": [a for a in cmdline if a.split("=", 1)[0] in IOMMU_ARGS],
            "units": _sys_list(os.path.join(root, "sys", "class", "iommu"))}


def _nccl_libraries():
    """The libnccl the job's torch loads (torch's own lib folder, else the nvidia-nccl wheel), and any NCCL
    net plugin (libnccl-net*.so) on LD_LIBRARY_PATH or in the system library folders, as dlopen finds it."""
    import glob

    found = []
    for folder in sys.path:
        for pattern in ("torch/lib/libnccl.so*", "nvidia/nccl/lib/libnccl.so*"):
            found.extend(glob.glob(os.path.join(folder or ".", pattern)))
    folders = [f for f in os.environ.get("LD_LIBRARY_PATH", "").split(":") if f]
    folders += ["/usr/local/lib", "/usr/lib64", "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    plugins = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "libnccl-net*.so*"))):
            name = os.path.basename(path)
            if name not in [p["name"] for p in plugins]:  # the first folder wins, as for dlopen
                try:
                    size = os.path.getsize(path)
                except OSError:  # a dangling link: dlopen fails on it as well
                    size = None
                plugins.append({"name": name, "path": path, "bytes": size})
    # CUDA's forward compatibility package: a newer libcuda that lets a newer CUDA run on an older driver.
    compat = [p for f in folders + glob.glob("/usr/local/cuda*/compat") if "compat" in f
              for p in glob.glob(os.path.join(f, "libcuda.so.*"))]
    return {"libraries": sorted(set(os.path.realpath(p) for p in found)), "plugins": plugins,
            "net_plugin": os.environ.get("NCCL_NET_PLUGIN"), "cuda_compat": sorted(set(compat))}


def xid_events(root):
    """NVIDIA Xid events in the kernel log: /dev/kmsg, read without blocking (one record per read), since the
    driver last loaded (a reload starts the GPUs afresh; a reboot empties the log). At most XID_READ_S
    seconds and XID_READ_BYTES: a log that floods faster than it is read is cut there, and said so.
    {"readable": False, "reason"} where the log is closed to this user (dmesg_restrict)."""
    import errno
    import re

    pattern = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?(.*)")
    path = os.path.join(root, "dev", "kmsg")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return {"readable": False, "reason": "%s: %s" % (path, exc.strerror or exc)}
    events, count, pending, read, cut = [], 0, b"", 0, False
    deadline = time.monotonic() + XID_READ_S
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):  # a recorded log: plain text, one record per line
            os.lseek(fd, 0, os.SEEK_SET)
        while True:
            if read > XID_READ_BYTES or time.monotonic() > deadline:
                cut = True
                break
            try:
                chunk = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:  # the end of the ring buffer
                    break
                if exc.errno == errno.EPIPE:  # the record was overwritten while reading; go on
                    continue
                raise
            if not chunk:
                break
            read += len(chunk)
            pending += chunk
            records = pending.split(b"\n")
            pending = records.pop()
            for record in records:
                head, _, message = record.decode("utf-8", "replace").partition(";")
                if message.startswith("NVRM: loading NVIDIA"):
                    events, count = [], 0  # what the driver logged before it was reloaded is over
                    continue
                found = pattern.search(message)
                if found:
                    count += 1
                    if len(events) < XID_LIMIT:
                        fields = head.split(",")
                        seconds = int(fields[2]) / 1e6 if len(fields) > 2 and fields[2].isdigit() else None
                        events.append({"pci": found.group(1).lower(), "xid": int(found.group(2)),
                                       "text": found.group(3).strip()[:200], "uptime_s": seconds})
    finally:
        os.close(fd)
    return {"readable": True, "events": events, "count": count, "cut": cut}


def _running(root, found):
    """Whether a process whose /proc/PID/comm (cut to 15 characters) `found` accepts runs; None where this user does
    not see other users' processes (/proc mounted with hidepid, PID 1 hidden) and nobody else is seen."""
    proc = os.path.join(root, "proc")
    if not _sys_text(os.path.join(proc, "1", "comm")):
        return None
    return any(pid.isdigit() and found(_sys_text(os.path.join(proc, pid, "comm")) or "") for pid in _sys_list(proc))


def fabric_manager(root):
    """Fabric Manager, on a node with NVSwitches: whether nv-fabricmanager runs (None where not seen: _running) and
    the version of its package (dpkg's status: Debian, Ubuntu, DGX OS; None elsewhere)."""
    running = _running(root, lambda comm: comm.startswith("nv-fabricmanag"))
    version = package = None
    try:
        with open(os.path.join(root, DPKG_STATUS), "rb") as handle:
            stanzas = handle.read(DPKG_STATUS_LIMIT).decode("utf-8", "replace").split("\n\n")
    except OSError:
        stanzas = []
    for stanza in stanzas:
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line[:1].isspace())
        name = fields.get("Package", "")
        if re.fullmatch(r"nvidia-fabricmanager(-\d+)?", name) and fields.get("Status", "").endswith(" installed"):
            package, version = name, fields.get("Version", "").split("-", 1)[0] or None
    return {"running": running, "version": version, "package": package}


def imex(root):
    """What CUDA needs to share GPU memory across a multi-node NVLink domain (FABRIC handles), as NVIDIA's IMEX guide
    sets it up: the channel devices /dev/nvidia-caps-imex-channels/channelN (each one's kind, its major and minor,
    and whether this user may open it for reading and writing: access(2); never opened), the major the driver
    registered for them in /proc/devices (None: not registered; "registered" None: /proc/devices unreadable), and
    whether the nvidia-imex daemon runs (None where not seen: _running)."""
    folder = os.path.join(root, IMEX_CHANNELS)
    channels = []
    for name in _sys_list(folder)[:IMEX_CHANNEL_LIMIT]:
        path = os.path.join(folder, name)
        try:
            mode = os.stat(path)
        except OSError:  # a dangling link
            channels.append({"name": name, "char": False, "major": None, "minor": None, "usable": False})
            continue
        char = stat.S_ISCHR(mode.st_mode)
        channels.append({"name": name, "char": char, "major": os.major(mode.st_rdev) if char else None,
                         "minor": os.minor(mode.st_rdev) if char else None,
                         "usable": os.access(path, os.R_OK | os.W_OK)})
    try:
        with open(os.path.join(root, "proc", "devices")) as handle:
            listed = [line.split() for line in handle.read(65536).splitlines()]
        majors = [int(f[0]) for f in listed if len(f) == 2 and f[1] == IMEX_DEVICE and f[0].isdigit()]
        registered, major = bool(majors), (majors[0] if majors else None)
    except (OSError, ValueError):
        registered = major = None
    return {"directory": os.path.isdir(folder), "channels": channels, "registered": registered, "major": major,
            "running": _running(root, lambda comm: comm == "nvidia-imex")}  # (not nvidia-imex-ctl)


def facts(root=None):
    root = root or SYSROOT
    modules = _loaded_modules(root)
    rdma = _rdma_devices(root)
    fabric = {"rdma": rdma, "modules": modules, "nccl": _nccl_libraries(), "gpudirect": _gpudirect(root),
              "pci": _pci(root, rdma), "iommu": _iommu(root),
              "kernel": _sys_text(os.path.join(root, "proc", "sys", "kernel", "osrelease")),
              "nvidia_driver": _sys_text(os.path.join(root, "proc", "driver", "nvidia", "version"))}
    if fabric["nvidia_driver"]:  # Xids and IMEX channels come from the NVIDIA driver only
        fabric["xid"] = xid_events(root)
        fabric["imex"] = imex(root)
    if any(d["kind"] == "nvswitch" for d in fabric["pci"]["devices"].values()):
        fabric["fabric_manager"] = fabric_manager(root)
    return fabric
