"""GPU inventory and health through NVML (nvidia-ml-py's pynvml, imported in `Nvml` and nowhere else)."""
import sys


class NvmlUnsupported(Exception):
    """An NVML call that this GPU model, or this driver, does not have: its field is None."""


class Nvml(object):
    """The one seam between the collector and NVML. Each method is one NVML call (through
    nvidia-ml-py's pynvml, imported here and nowhere else) on the GPU with NVML index `index`, and
    returns plain Python values. NVMLError_NotSupported, or a function that this driver or this
    pynvml lacks, raises NvmlUnsupported; any other NVMLError passes through. Never nvidia-smi."""

    def __init__(self):
        import pynvml  # ImportError: nvidia-ml-py is not installed in this interpreter

        pynvml.nvmlInit()  # NVMLError_LibraryNotFound / DriverNotLoaded: no usable driver
        self.nv, self.handles = pynvml, {}

    def close(self):
        self.nv.nvmlShutdown()

    def _call(self, names, *args):
        """The first of `names` that this pynvml and this driver have, called with `args`."""
        nv = self.nv
        for name in (names,) if isinstance(names, str) else names:
            function = getattr(nv, name, None)
            if function is None:
                continue
            try:
                return function(*args)
            except nv.NVMLError_FunctionNotFound:
                continue
            except nv.NVMLError_NotSupported:
                raise NvmlUnsupported(name)
        raise NvmlUnsupported(names)

    def _handle(self, index):
        if index not in self.handles:
            self.handles[index] = self.nv.nvmlDeviceGetHandleByIndex(index)
        return self.handles[index]

    def driver_version(self):
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self):
        return self._call("nvmlSystemGetCudaDriverVersion")  # 12040 for CUDA 12.4

    def count(self):
        return self._call("nvmlDeviceGetCount")

    def name(self, index):
        return _text(self._call("nvmlDeviceGetName", self._handle(index)))

    def uuid(self, index):
        return _text(self._call("nvmlDeviceGetUUID", self._handle(index)))

    def pci_bus_id(self, index):
        return _text(self._call("nvmlDeviceGetPciInfo", self._handle(index)).busId)

    def memory(self, index):
        info = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return [int(info.total), int(info.used)]

    def compute_capability(self, index):
        return list(self._call("nvmlDeviceGetCudaComputeCapability", self._handle(index)))

    def ecc_mode(self, index):
        return [bool(mode) for mode in self._call("nvmlDeviceGetEccMode", self._handle(index))]  # current, pending

    def ecc_uncorrected(self, index, counter):
        """Uncorrectable ECC errors: counter "volatile" (since the driver loaded) or "aggregate" (lifetime)."""
        nv = self.nv
        which = nv.NVML_VOLATILE_ECC if counter == "volatile" else nv.NVML_AGGREGATE_ECC
        return int(self._call("nvmlDeviceGetTotalEccErrors", self._handle(index),
                              nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, which))

    def retired_pages(self, index, cause):
        """Pages retired for cause "single_bit" (multiple single-bit errors) or "double_bit"."""
        nv = self.nv
        which = (nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS if cause == "single_bit"
                 else nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        return len(self._call("nvmlDeviceGetRetiredPages", self._handle(index), which))

    def retired_pages_pending(self, index):
        return bool(self._call("nvmlDeviceGetRetiredPagesPendingStatus", self._handle(index)))

    def remapped_rows(self, index):
        rows = self._call("nvmlDeviceGetRemappedRows", self._handle(index))
        return [int(n) for n in rows]  # correctable, uncorrectable, pending, failure

    def persistence_mode(self, index):
        return bool(self._call("nvmlDeviceGetPersistenceMode", self._handle(index)))

    def mig_mode(self, index):
        return [bool(mode) for mode in self._call("nvmlDeviceGetMigMode", self._handle(index))]  # current, pending

    def compute_mode(self, index):
        return int(self._call("nvmlDeviceGetComputeMode", self._handle(index)))

    def processes(self, index, kind):
        """[pid, used bytes or None] of the "compute" or "graphics" processes on the GPU."""
        names = {"compute": ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
                 "graphics": ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")}
        return [[int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)]
                for p in self._call(names[kind], self._handle(index))]

    def pcie_link(self, index, which):
        """"generation", "max_generation", "width" or "max_width" of the PCIe link."""
        name = {"generation": "nvmlDeviceGetCurrPcieLinkGeneration",
                "max_generation": "nvmlDeviceGetMaxPcieLinkGeneration",
                "width": "nvmlDeviceGetCurrPcieLinkWidth", "max_width": "nvmlDeviceGetMaxPcieLinkWidth"}[which]
        return int(self._call(name, self._handle(index)))

    def nvlink_states(self, index):
        """Active (True) or not, for each NVLink link of the GPU, up to the first link it does not have."""
        nv, states = self.nv, []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                states.append(bool(self._call("nvmlDeviceGetNvLinkState", self._handle(index), link)))
            except (NvmlUnsupported, nv.NVMLError_InvalidArgument):
                break
        if not states:
            raise NvmlUnsupported("nvmlDeviceGetNvLinkState")
        return states

    def fabric(self, index):
        """The GPU's registration with the NVSwitch fabric (nvmlDeviceGetGpuFabricInfoV, else the first version):
        [state (NVML_GPU_FABRIC_STATE_*), status (an nvmlReturn_t), clique ID, health mask (None before V2),
        cluster UUID (the NVLink domain: its text, all zeros where the GPU is in none)]."""
        import ctypes

        nv, handle = self.nv, self._handle(index)
        versioned = getattr(nv, "c_nvmlGpuFabricInfoV_t", None)
        if versioned is not None and getattr(nv, "nvmlDeviceGetGpuFabricInfoV", None) is not None:
            info = versioned()
            try:
                self._call("nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info))
                return [int(info.state), int(info.status), int(info.cliqueId), int(info.healthMask),
                        cluster_uuid(info)]
            except (NvmlUnsupported, nv.NVMLError) as exc:  # a driver without V2 (or another struct version)
                if isinstance(exc, nv.NVMLError_GpuIsLost):
                    raise
        info = getattr(nv, "c_nvmlGpuFabricInfo_t", None)
        if info is None:
            raise NvmlUnsupported("nvmlDeviceGetGpuFabricInfo")
        info = info()
        try:
            self._call("nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info))
        except nv.NVMLError as exc:  # a GPU before Hopper, or a driver that has no fabric to tell of
            if isinstance(exc, nv.NVMLError_GpuIsLost):
                raise
            raise NvmlUnsupported("nvmlDeviceGetGpuFabricInfo")
        return [int(info.state), int(info.status), int(info.cliqueId), None, cluster_uuid(info)]

    def p2p(self, index, other):
        """Peer-to-peer from this GPU to GPU `other` (its NVML index, as text), as NVML reports it
        (nvmlDeviceGetP2PStatus): {"read", "write", "nvlink": an NVML_P2P_STATUS_* number}."""
        peer = self._handle(int(other))
        # NVML_P2P_CAPS_INDEX_READ, _WRITE, _NVLINK: 0, 1, 2 (pynvml writes the first as a one-item tuple)
        return {which: int(self._call("nvmlDeviceGetP2PStatus", self._handle(index), peer, caps))
                for which, caps in (("read", 0), ("write", 1), ("nvlink", 2))}

    def clock_event_reasons(self, index):
        """The bit mask of why the clocks are below their maximum (idle, power cap, thermal, ...)."""
        return int(self._call(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
                              self._handle(index)))


COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
MAX_P2P_PEERS = 16  # GPUs per node whose pairs are asked (3 calls a pair): 16 makes 720 calls, a few ms
P2P_STATUS = {0: "ok", 1: "chipset_not_supported", 2: "gpu_not_supported", 3: "ioh_topology_not_supported",
              4: "disabled_by_regkey", 5: "not_supported", 6: "unknown"}  # NVML_P2P_STATUS_*
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}  # NVML_GPU_FABRIC_STATE_*
FABRIC_UUID_BYTES = 16  # NVML_GPU_FABRIC_UUID_LEN
ZERO_UUID = "00000000-0000-0000-0000-000000000000"  # a GPU in no multi-node NVLink domain
# The health mask's fields (NVML_GPU_FABRIC_HEALTH_MASK_*): (shift, what a value of 1, "TRUE", means)
FABRIC_HEALTH = ((0, "degraded_bandwidth"), (2, "route_recovery"), (4, "route_unhealthy"),
                 (6, "access_timeout_recovery"))
CLOCK_EVENT_REASONS = ((0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
                       (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
                       (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
                       (0x100, "display_clock_setting"), (0x200, "board_limit"), (0x400, "reliability"))


def cluster_uuid(info):
    """clusterUuid of an nvmlGpuFabricInfo structure (NVML_GPU_FABRIC_UUID_LEN, 16 bytes) as UUID text, read from
    the structure's memory: pynvml releases that declare the field c_char give it cut at its first zero byte."""
    import ctypes
    import uuid

    field = getattr(type(info), "clusterUuid", None)
    if field is None or field.size != FABRIC_UUID_BYTES:
        return None
    return str(uuid.UUID(bytes=ctypes.string_at(ctypes.addressof(info) + field.offset, FABRIC_UUID_BYTES)))


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def facts(nvml=None):
    """GPU inventory and health through NVML. {"available": False, "reason"} when this interpreter has
    no pynvml or the node no NVIDIA driver; a call a GPU model does not support leaves its field None."""
    if nvml is None:
        try:
            nvml = Nvml()
        except ImportError as exc:
            return {"available": False, "reason": "pynvml is not importable in %s (install nvidia-ml-py): %s"
                    % (sys.executable, exc)}
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            return {"available": False, "reason": "NVML cannot start (%s: %s); is the NVIDIA driver installed "
                    "and loaded?" % (type(exc).__name__, exc)}
    try:
        cuda = nvml.cuda_driver_version()
        return {"available": True, "driver_version": nvml.driver_version(),
                "cuda_driver_version": "%d.%d" % (cuda // 1000, cuda % 1000 // 10),
                "count": nvml.count(), "devices": [_gpu(nvml, index, nvml.count()) for index in range(nvml.count())]}
    finally:
        nvml.close()


def _gpu(nvml, index, count=0):
    errors = {}

    def ask(method, *args):
        try:
            return getattr(nvml, method)(index, *args)
        except NvmlUnsupported:
            return None
        except Exception as exc:  # one failing call (a GPU that fell off the bus) must not lose the others
            errors[" ".join((method,) + args)] = "%s: %s" % (type(exc).__name__, exc)
            return None

    memory, ecc, mig = ask("memory") or [None, None], ask("ecc_mode") or [None, None], ask("mig_mode") or [None, None]
    rows = ask("remapped_rows") or [None] * 4
    processes = {}
    for kind in ("compute", "graphics"):
        for pid, used in ask("processes", kind) or []:
            processes.setdefault(pid, {"pid": pid, "used_memory_bytes": used})
    reasons = ask("clock_event_reasons")
    fabric = ask("fabric")
    peers = {}
    for other in (str(i) for i in range(min(count, MAX_P2P_PEERS)) if i != index):
        try:
            found = nvml.p2p(index, other)
        except Exception:  # unsupported, or the peer's own failure (a lost GPU), which its own calls report
            continue
        peers[other] = {which: P2P_STATUS.get(status, str(status)) for which, status in found.items()}
    gpu = {
        "index": index, "name": ask("name"), "uuid": ask("uuid"), "pci_bus_id": ask("pci_bus_id"),
        "memory_total_bytes": memory[0], "memory_used_bytes": memory[1],
        "compute_capability": ask("compute_capability"),
        "ecc_enabled": ecc[0], "ecc_uncorrected_volatile": ask("ecc_uncorrected", "volatile"),
        "ecc_uncorrected_aggregate": ask("ecc_uncorrected", "aggregate"),
        "retired_pages_single_bit": ask("retired_pages", "single_bit"),
        "retired_pages_double_bit": ask("retired_pages", "double_bit"),
        "retired_pages_pending": ask("retired_pages_pending"),
        "remapped_rows_uncorrectable": rows[1], "remapped_rows_pending": None if rows[2] is None else bool(rows[2]),
        "remapped_rows_failure": None if rows[3] is None else bool(rows[3]),
        "persistence_mode": ask("persistence_mode"), "mig_enabled": mig[0], "mig_pending": mig[1],
        "compute_mode": COMPUTE_MODES.get(ask("compute_mode")),
        "processes": sorted(processes.values(), key=lambda p: p["pid"]),
        "pcie_generation": ask("pcie_link", "generation"), "pcie_max_generation": ask("pcie_link", "max_generation"),
        "pcie_width": ask("pcie_link", "width"), "pcie_max_width": ask("pcie_link", "max_width"),
        "nvlink_active": ask("nvlink_states"),
        "clock_event_reasons": None if reasons is None else [n for bit, n in CLOCK_EVENT_REASONS if reasons & bit],
        "fabric": None if fabric is None else {
            "state": FABRIC_STATES.get(fabric[0], str(fabric[0])), "status": fabric[1], "clique": fabric[2],
            "health": None if fabric[3] is None else [n for shift, n in FABRIC_HEALTH if fabric[3] >> shift & 3 == 1],
            "cluster_uuid": fabric[4] if len(fabric) > 4 else None},  # (recordings made before it have none)
        "p2p": peers or None,
    }
    if errors:
        gpu["errors"] = errors
    return gpu

