"""The fabric: RDMA devices and ports, GPUDirect modules, NCCL libraries, Xid events. All from sysfs and
procfs under SYSROOT ("/" on a node; a recorded tree in the tests)."""
import os
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


def facts(root=None):
    root = root or SYSROOT
    modules = _loaded_modules(root)
    fabric = {"rdma": _rdma_devices(root), "modules": modules, "nccl": _nccl_libraries(),
              "kernel": _sys_text(os.path.join(root, "proc", "sys", "kernel", "osrelease")),
              "nvidia_driver": _sys_text(os.path.join(root, "proc", "driver", "nvidia", "version"))}
    if fabric["nvidia_driver"]:  # Xids come from the NVIDIA driver only
        fabric["xid"] = xid_events(root)
    return fabric
