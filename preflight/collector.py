"""The node agent: one JSON document of facts about the node it runs on, then answers to requests.

Stdlib only, Python 3.9+ (MIN_PYTHON): it is shipped over the transport and run by the node's training
interpreter, which may have nothing of preflight installed. It never imports torch or any other
training library: versions come from package metadata, torch's CUDA build from torch/version.py.
An older interpreter gets one line on stderr that names it and its version (UNSUPPORTED) and no facts:
so that Python 2 too can say so, this file is written in the syntax Python 2.7 still compiles (no
f-strings, no keyword-only arguments; tests/test_hardening_runs.py compiles it with a real 2.7).
A section that raises is kept as {"error": "collector section NAME failed on the node: ..."}.

Protocol when shipped (see preflight.transport): the source arrives on stdin after a length line,
OPTIONS is bound by the sender, and the node writes one line of JSON (the facts). Then, for each
JSON request line it reads, it writes one JSON answer line (see `serve`), until "done" or end of
input. One process per node serves every phase: clock samples, the port probe, the shared folder.
"""
import ctypes
import hashlib
import json
import os
import platform
import re
import resource
import socket
import stat
import struct
import sys
import time

# A name that looks secret, decided by its parts (split at - _ .): HF_TOKEN, WANDB_API_KEY, DB_PASSWD, NCCL_AUTH;
# not KEYBOARD, TOKENIZERS_PARALLELISM, NCCL_IB_HCA. Values under such names never leave the node; every
# output is redacted again by the same rule on the head (preflight.redact).
SECRET_NAME = re.compile(r"(^|[-_.])(token|secret|passwords?|passwd|passphrase|pwd|auth|authorization|api[-_]?key|"
                         r"key|credentials?)($|[-_.])", re.I)
NOT_SECRET = frozenset(("PWD", "OLDPWD"))  # the shell's working directories


def secret_name(name):
    name = name.lstrip("-+")
    return name.upper() not in NOT_SECRET and bool(SECRET_NAME.search(name))


ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "MASTER_", "CUDA_", "ACCELERATE_", "DEEPSPEED_", "DS_", "OMP_",
                "FI_", "UCX_", "HF_", "TRANSFORMERS_", "PYTORCH_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTHONPATH", "LD_LIBRARY_PATH",
             "LD_PRELOAD", "PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
KEY_DISTRIBUTIONS = ("torch", "deepspeed", "accelerate", "transformers")
MIN_PYTHON = (3, 9)  # pyproject.toml's requires-python: the oldest interpreter preflight is tested with
UNSUPPORTED = "preflight: unsupported interpreter"
SECTION_FAILED = "collector section %s failed on the node: "
# The first line of the shipped program's code on its command line (transport.BOOTSTRAP): it tells a port's
# holder, or a line of `ps` on the node, to be preflight's own program (its agent or its all-reduce worker).
PROGRAM_MARK = "# preflight\n"
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def collect(options):
    """Facts about this node. `options`: head (name), port, paths (name -> path to measure)."""
    facts = {"schema": 1, "collected_at": time.time()}
    for name, gather in (
        ("python", _python),
        ("packages", _packages),
        ("host", lambda: _host(options)),
        ("env", _environment),
        ("storage", lambda: _storage(options.get("paths") or {})),
        ("limits", _limits),
        ("memory", _memory),
        ("clock", _clock),
        ("gpus", _gpus),
        ("job", lambda: _job(options.get("job"))),
        ("fabric", _fabric),
        ("census", lambda: _census(options.get("census"))),
    ):
        try:
            facts[name] = gather()
        except Exception as exc:  # one broken fact must not lose the others
            facts[name] = {"error": SECTION_FAILED % name + "%s: %s" % (type(exc).__name__, exc)}
    return facts


def _python():
    return {"executable": sys.executable, "version": platform.python_version(), "cwd": os.getcwd()}


def _packages():
    dists = {}
    for folder in installed_distributions():
        name, version = name_and_version(folder)
        name = name.lower().replace("_", "-")
        if name and name not in dists:
            dists[name] = version
    versions = {name: dists.get(name) for name in KEY_DISTRIBUTIONS}
    versions["cuda"] = _torch_cuda_build()
    versions["nccl"] = next((dists[n] for n in NCCL_DISTRIBUTIONS if n in dists), None)
    return {"versions": versions, "distributions": dists}


DIST_NAME_RUN = re.compile(r"[-_.]+")
DIST_FILE_BYTES = 1 << 20  # more than any METADATA header or entry_points.txt a package ships


def installed_distributions():
    """The metadata folder of each installed distribution (.dist-info, .egg-info) in sys.path order: the walk of
    importlib.metadata.distributions(), without its import and its pathlib per file (40 ms less for every
    `preflight node` in an environment with torch and DeepSpeed)."""
    for entry in sys.path:
        try:
            names = sorted(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
        except (OSError, TypeError, ValueError):  # a missing folder, a zip, a NUL in a name
            continue
        for name in names:
            yield os.path.join(entry or ".", name)


def distribution_key(folder):
    """A metadata folder's distribution name as importlib.metadata compares them (from the folder's name)."""
    return DIST_NAME_RUN.sub("_", os.path.basename(folder).rsplit(".", 1)[0].partition("-")[0]).lower()


def distribution_file(folder, name, limit=DIST_FILE_BYTES):
    """The text of file NAME of a distribution's metadata folder (a single-file .egg-info is its PKG-INFO), at most
    LIMIT bytes, or None. Opened without blocking and read only when it is a regular file with a size, so a FIFO,
    a device or a /proc file there (whatever it is swapped for) cannot stall the run."""
    path = folder if os.path.isfile(folder) and name == "PKG-INFO" else os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (IOError, OSError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not info.st_size:
            return None
        return os.read(fd, min(info.st_size, limit)).decode("utf-8", "replace")
    except (IOError, OSError):
        return None
    finally:
        os.close(fd)


def name_and_version(folder):
    """Name and Version from the metadata's header (the lines before the first blank one, at the top of the
    file): the e-mail parser only for a header these lines cannot read (folded)."""
    text = distribution_file(folder, "METADATA", 65536) or distribution_file(folder, "PKG-INFO", 65536) or ""
    head = text.split("\n\n", 1)[0]
    header = dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)
    if "Name" in header and "Version" in header:
        return header["Name"].strip(), header["Version"].strip()
    from email.parser import HeaderParser

    parsed = HeaderParser().parsestr(head)
    return (parsed["Name"] or "").strip(), (parsed["Version"] or "").strip() or None


def _torch_cuda_build():
    """torch.version.cuda, read from torch/version.py without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "version.py")
        if os.path.isfile(path):
            for line in open(path, encoding="utf-8"):
                if line.startswith("cuda"):
                    value = line.split("=", 1)[1].strip().strip("'\"")
                    return None if value == "None" else value
    return None


def _host(options):
    hostname = socket.gethostname()
    links = {}
    interfaces = _interfaces(links)
    own = {a for addrs in interfaces.values() for a in addrs}
    facts = {"hostname": hostname, "fqdn": socket.getfqdn(), "interfaces": interfaces, "links": links,
             "resolves_to": _resolve(hostname), "kernel": platform.release(),
             "rdma_devices": sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []}
    facts["resolves_to_own_interface"] = any(a in own for a in facts["resolves_to"] if not a.startswith("127."))
    head = options.get("head")
    if head:
        facts["head_resolves_to"] = _resolve(head)
        facts["route_to_head"] = _route(facts["head_resolves_to"], options.get("port") or 29500, interfaces)
    return facts


def _resolve(name):
    try:
        infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return {"error": str(exc)}
    seen = []
    for info in infos:
        if info[4][0] not in seen:
            seen.append(info[4][0])
    return seen


def _interfaces(links=None):
    """Interface name -> addresses (IPv4 through an ioctl, IPv6 from /proc). When `links` is a dict, it is
    filled with name -> {"up": IFF_UP, "running": IFF_RUNNING (carrier), "ipv4": ["10.0.0.2/24"] (the
    interface's primary address and its netmask), "ipv6": ["fe80::1/64", ...]} from the same probe
    socket (SIOCGIFFLAGS, SIOCGIFNETMASK); an ioctl that fails leaves its field None."""
    import fcntl

    result = {}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            ipv4 = None
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
                result[name] = [socket.inet_ntoa(packed[20:24])]
            except OSError as exc:
                result[name] = []
                ipv4 = [] if exc.errno == 99 else None  # EADDRNOTAVAIL: no IPv4 address
            if links is None:
                continue
            link = links[name] = {"up": None, "running": None, "ipv4": ipv4, "ipv6": []}
            try:
                flags = struct.unpack("H", fcntl.ioctl(probe.fileno(), 0x8913, request)[16:18])[0]  # SIOCGIFFLAGS
                link["up"], link["running"] = bool(flags & 0x1), bool(flags & 0x40)  # IFF_UP, IFF_RUNNING
            except (OSError, struct.error):
                pass
            if result[name]:
                try:
                    mask = fcntl.ioctl(probe.fileno(), 0x891B, request)[20:24]  # SIOCGIFNETMASK
                    link["ipv4"] = ["%s/%d" % (result[name][0], bin(struct.unpack("!I", mask)[0]).count("1"))]
                except (OSError, struct.error):
                    pass
    finally:
        probe.close()
    try:
        for line in open("/proc/net/if_inet6"):
            hexaddr, _, prefix, _, _, name = line.split()
            address = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexaddr))
            result.setdefault(name, []).append(address)
            if links is not None:
                links.setdefault(name, {"up": None, "running": None, "ipv4": None, "ipv6": []})["ipv6"].append(
                    "%s/%d" % (address, int(prefix, 16)))
    except (OSError, ValueError):
        pass
    return result


def _route(head_addresses, port, interfaces):
    """Which local address and interface the kernel picks to reach the head (a UDP connect sends nothing)."""
    if not isinstance(head_addresses, list) or not head_addresses:
        return None
    target = head_addresses[0]
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.connect((target, int(port)))
        source = sock.getsockname()[0]
    except OSError as exc:
        return {"error": str(exc), "head": target}
    finally:
        sock.close()
    interface = next((name for name, addrs in interfaces.items() if source in addrs), None)
    return {"head": target, "source": source, "interface": interface}


def _environment():
    env = {}
    for name, value in os.environ.items():
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        env[name] = "<redacted>" if secret_name(name) else value
    return env


def _storage(paths):
    result = {}
    for name, path in dict(paths, shm="/dev/shm").items():
        entry = {"path": path, "exists": os.path.exists(path)}
        if entry["exists"]:
            st = os.statvfs(path)
            entry.update(total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize,
                         writable=os.access(path, os.W_OK))
        result[name] = entry
    return result


def _limits():
    def limit(which):
        soft, hard = resource.getrlimit(which)
        return [None if soft == resource.RLIM_INFINITY else soft, None if hard == resource.RLIM_INFINITY else hard]

    return {"nofile": limit(resource.RLIMIT_NOFILE), "memlock": limit(resource.RLIMIT_MEMLOCK),
            "nproc": limit(resource.RLIMIT_NPROC), "stack": limit(resource.RLIMIT_STACK)}


def _memory():
    info = {}
    for line in open("/proc/meminfo"):
        key, value = line.split(":", 1)
        if key in ("MemTotal", "MemAvailable", "SwapTotal"):
            info[key] = int(value.split()[0]) * 1024
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable"),
            "swap_bytes": info.get("SwapTotal"), "cpus": os.cpu_count()}


class _Timex(ctypes.Structure):
    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
                ("time_sec", ctypes.c_long), ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
                ("ppsfreq", ctypes.c_long), ("jitter", ctypes.c_long), ("shift", ctypes.c_int),
                ("stabil", ctypes.c_long), ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long),
                ("errcnt", ctypes.c_long), ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int),
                ("padding", ctypes.c_int * 11)]


def _clock():
    """The kernel's view of clock discipline (adjtimex with no changes): synchronised or not."""
    timex = _Timex()
    state = ctypes.CDLL(None, use_errno=True).adjtimex(ctypes.byref(timex))
    if state < 0:
        return {"error": os.strerror(ctypes.get_errno())}
    unsync = bool(timex.status & 0x0040) or state == 5  # STA_UNSYNC, TIME_ERROR
    return {"synchronised": not unsync, "maxerror_s": timex.maxerror / 1e6, "esterror_s": timex.esterror / 1e6,
            "time": time.time()}


# --- GPUs through NVML ---------------------------------------------------------------------------

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

    def clock_event_reasons(self, index):
        """The bit mask of why the clocks are below their maximum (idle, power cap, thermal, ...)."""
        return int(self._call(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
                              self._handle(index)))


COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
CLOCK_EVENT_REASONS = ((0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
                       (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
                       (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
                       (0x100, "display_clock_setting"), (0x200, "board_limit"), (0x400, "reliability"))


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _gpus(nvml=None):
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
                "count": nvml.count(), "devices": [_gpu(nvml, index) for index in range(nvml.count())]}
    finally:
        nvml.close()


def _gpu(nvml, index):
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
    }
    if errors:
        gpu["errors"] = errors
    return gpu


def _census(options):
    """The running job's processes on this node (preflight doctor); None: not asked. Shipped, census.py's
    source comes first and defines take_census; in-process, it is imported."""
    if not options:
        return None
    take = globals().get("take_census")
    if take is None:
        from preflight.census import take_census as take
    return take(options)


# --- the job as this node would launch it ---------------------------------------------------------

TEXT_LIMIT = 1 << 20  # a config file's text comes back up to this size; bigger files only as a digest
DIGEST_LIMIT = 256 << 20  # past this, a file is not read at all (a checkpoint named on the command line)


def _job(job):
    """What this node's launch would read, as its SSH session sees it: the accelerate config (the one
    named, else accelerate's default under this session's HF_HOME / XDG_CACHE_HOME), the files of the
    command line, and where the launcher and python resolve on this session's PATH. None: not asked.
    With "expand", $VAR in the command is this session's variable, as a shell on the node reads it."""
    if not job:
        return None
    cwd = job.get("cwd") or os.getcwd()

    def word(text):
        return os.path.expandvars(text) if job.get("expand") else text

    config = job.get("config")
    if config:
        config_file = read_file(word(config), cwd, True)
    elif job.get("default_config", True):
        env = dict(os.environ, **(job.get("env") or {}))  # `HF_HOME=/x accelerate launch ...` sets it for the launch
        config_file = dict(read_file(accelerate_default_config(env), cwd, True), default=True)
    else:
        config_file = None
    # Digests within a deadline: data files on a shared filesystem, read by every node at once, must not
    # hold back the facts past the run's timeout.
    until = time.monotonic() + float(job.get("deadline_s") or 5)
    files = {}
    for name in job.get("files") or ():
        if time.monotonic() > until:
            files[name] = {"path": name, "error": "not read: out of time (the run's deadline)"}
        else:
            files[name] = read_file(word(name), cwd, name in (job.get("text") or ()))
    return {
        "cwd": cwd, "cwd_exists": os.path.isdir(cwd), "argv": [word(a) for a in job.get("argv") or ()],
        "config": config_file, "files": files,
        "programs": dict((name, _program(word(name), cwd)) for name in job.get("programs") or ()),
    }


def accelerate_default_config(env=None):
    """accelerate's default config file (accelerate/commands/config/config_args.py): the YAML one,
    unless only the JSON one exists. `env`: the launch's environment (default: this process's)."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    home = os.path.expanduser(env.get("HF_HOME") or os.path.join(cache, "huggingface"))
    yaml_file = os.path.join(home, "accelerate", "default_config.yaml")
    json_file = os.path.join(home, "accelerate", "default_config.json")
    return yaml_file if os.path.isfile(yaml_file) or not os.path.isfile(json_file) else json_file


def read_file(path, cwd, text=False):
    """{"path", "sha256", "size"} of a regular file (relative: to the job's working directory), with its
    "text" when asked and small; {"path", "error"} otherwise. Never opens a FIFO or a device."""
    full = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
    entry = {"path": full}
    try:
        st = os.stat(full)
        if not stat.S_ISREG(st.st_mode):
            entry["error"] = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            return entry
        entry["size"] = st.st_size
        if st.st_size > DIGEST_LIMIT:
            entry["error"] = "larger than %d MiB: not read" % (DIGEST_LIMIT >> 20)
            return entry
        digest, data, kept = hashlib.sha256(), [], 0
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                if text and kept <= TEXT_LIMIT:
                    data.append(chunk)
                    kept += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        entry["error"] = "missing" if exc.errno == 2 else (exc.strerror or str(exc))
        return entry
    except ValueError:  # a NUL byte in the path: no file can have that name
        entry["error"] = "the path holds a NUL byte: no file has that name"
        return entry
    entry["sha256"] = digest.hexdigest()
    if text and kept <= TEXT_LIMIT:
        try:
            entry["text"] = b"".join(data).decode("utf-8-sig")
        except UnicodeDecodeError:
            entry["error"] = "not UTF-8 text"
    return entry


def _program(name, cwd="."):
    """Where `name` resolves on this session's PATH (a name with a / from the job's working directory, as
    the launch's shell would), and the interpreter its #! line runs."""
    import shutil

    if name and "/" in name:
        path = os.path.join(cwd, name)
        path = path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    else:
        path = shutil.which(name) if name else None
    if path is None:
        return {"name": name, "path": None}
    entry = {"name": name, "path": path, "real": os.path.realpath(path), "interpreter": None}
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return entry
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never wait on a FIFO that looks like a program
        try:
            lines = os.read(fd, 1024).split(b"\n")
        finally:
            os.close(fd)
    except OSError:
        return entry
    words = lines[0][2:].decode("utf-8", "replace").split() if lines[0].startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[-1]) or words[-1]]
    if words and os.path.basename(words[0]) == "sh" and len(lines) > 1 and lines[1].startswith(b"'''exec' "):
        words = [lines[1].split()[1].decode("utf-8", "replace")]  # pip's launcher for long interpreter paths
    entry["interpreter"] = words[0] if words else None
    return entry


# --- requests after the facts --------------------------------------------------------------------

def holders(port):
    """Processes listening on `port` (from /proc: what this user may see of them): "pid", "command" (the
    command line as one line, 200 characters), "argv" (each argument up to 200 characters, at most 64),
    "ppid" and "parent_argv" (the launcher of a rank process), "children" (how many processes it has
    started: None when unknown), and "env": only the variables a launcher gives its ranks (RANK,
    MASTER_PORT, ...), no other variable is read."""
    job_variables = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

    def argv_of(pid):
        try:
            raw = open("/proc/%s/cmdline" % pid, "rb").read()
        except OSError:
            return []
        return [a.decode(errors="replace")[:200] for a in raw.split(b"\0")[:-1 if raw.endswith(b"\0") else None]][:64]

    def parent_of(pid):
        try:
            return int(open("/proc/%s/stat" % pid, "rb").read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def job_env(pid):
        try:
            raw = open("/proc/%s/environ" % pid, "rb").read()
        except OSError:
            return None
        pairs = (item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        return dict((k, v[:200]) for k, v in pairs if k in job_variables)

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        links = []
        for fd in fds:
            try:
                links.append(os.readlink("/proc/%s/fd/%s" % (pid, fd)))
            except OSError:  # closed meanwhile (the listing's own descriptor, in this process)
                pass
        if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
            argv, ppid = argv_of(pid), parent_of(pid)
            found.append({"pid": int(pid), "command": " ".join(argv).strip()[:200], "argv": argv, "ppid": ppid,
                          "parent_argv": argv_of(ppid) if ppid else [], "children": None, "env": job_env(pid)})
    if found:  # one pass over /proc/*/stat: how many processes each holder has started
        counts = dict((h["pid"], 0) for h in found)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            ppid = parent_of(pid)
            if ppid in counts:
                counts[ppid] += 1
        for h in found:
            h["children"] = counts[h["pid"]]
    return found


def bindable(port):
    """A socket bound to the port on all addresses, as torch's TCPStore binds it (SO_REUSEADDR, so that
    connections in TIME_WAIT do not count); or, when it is taken, a dict that says by whom."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", port))
        return server
    except OSError as exc:
        server.close()
        return {"bound": False, "error": exc.strerror or str(exc), "holders": holders(port)}


def close_without_time_wait(sock):
    """Close with a reset, leaving no TIME_WAIT entry: one on the main port makes the job's own bind fail
    on some kernels (a probe must leave the port as it found it)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def connect(address, port, timeout_s):
    started = time.monotonic()
    try:
        sock = socket.create_connection((address, port), timeout=timeout_s)
    except socket.timeout:
        return {"ok": False, "error": "timed out after %gs" % timeout_s, "seconds": time.monotonic() - started}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc), "seconds": time.monotonic() - started}
    source = sock.getsockname()[0]
    close_without_time_wait(sock)
    return {"ok": True, "seconds": time.monotonic() - started, "source": source}


def shared_file(op, folder, name, token=None):
    """The shared-folder probe: the head writes a token, the others read it, the head removes it."""
    path = os.path.join(folder, name)
    try:
        if op == "write":
            with open(path, "w") as handle:
                handle.write(token)
                handle.flush()
                os.fsync(handle.fileno())
            return {"ok": True, "path": path}
        if op == "read":
            with open(path) as handle:
                same = handle.read() == token
            return {"ok": same, "path": path, "error": None if same else "the file holds another token"}
        os.unlink(path)
        return {"ok": True, "path": path}
    except OSError as exc:
        return {"ok": False, "path": path, "error": exc.strerror or str(exc)}


class Agent(object):
    """Answers requests: {"op": "time"}, {"op": "listen", "port"}, {"op": "unlisten"},
    {"op": "connect", "address", "port", "timeout_s"}, {"op": "write"|"read"|"remove", "folder", "name",
    "token"}, {"op": "files", "paths", "cwd"}. While a port is listened on, connections are accepted between requests."""

    def __init__(self):
        self.server, self.peers, self.conns = None, [], []

    def handle(self, request):
        op = request.get("op")
        if op == "time":
            return {"time": time.time()}
        if op == "listen":
            server = bindable(int(request["port"]))
            if isinstance(server, dict):
                return server
            server.listen(128)
            self.server, self.peers = server, []
            return {"bound": True}
        if op == "unlisten":
            self.stop_listening()
            return {"peers": self.peers}
        if op == "connect":
            return connect(request["address"], int(request["port"]), float(request["timeout_s"]))
        if op == "files":  # the files a node's own config names (asked once that config is parsed)
            return dict((p, read_file(p, request["cwd"], True)) for p in request["paths"][:16])
        if op in ("write", "read", "remove"):
            return shared_file(op, request["folder"], request["name"], request.get("token"))
        return {"error": "unknown request %r" % op}

    def on_readable(self, sock):
        if sock is self.server:
            conn, address = self.server.accept()
            self.peers.append(address[0])
            self.conns.append(conn)  # the worker closes first: no TIME_WAIT on the main port here
        else:
            self.conns.remove(sock)
            sock.close()

    def stop_listening(self):
        for conn in self.conns:
            close_without_time_wait(conn)
        if self.server is not None:
            self.server.close()
        self.server, self.conns = None, []


def serve(agent, fd_in, out):
    """One JSON answer line per request line, until "done" or end of input."""
    import select

    pending = b""
    try:
        while True:
            while b"\n" not in pending:
                watched = [fd_in] + ([agent.server] if agent.server else []) + agent.conns
                ready = select.select(watched, [], [])[0]
                for sock in ready:
                    if sock is not fd_in:
                        agent.on_readable(sock)
                if fd_in in ready:
                    chunk = os.read(fd_in, 65536)
                    if not chunk:
                        return
                    pending += chunk
            line, pending = pending.split(b"\n", 1)
            if line.strip() in (b"", b"done"):
                return
            try:
                answer = agent.handle(json.loads(line.decode()))
            except Exception as exc:  # a bad request gets an answer, not a dead agent
                answer = {"error": "%s: %s" % (type(exc).__name__, exc)}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        agent.stop_listening()


# --- the fabric: RDMA devices and ports, GPUDirect modules, NCCL libraries, Xid events -------------
# All from sysfs and procfs under SYSROOT ("/" on a node; a recorded tree in the tests).

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
        return float(text.split()[0])
    except (AttributeError, IndexError, ValueError):
        return None


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


def _xid_events(root):
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


def _fabric(root=None):
    root = root or SYSROOT
    modules = _loaded_modules(root)
    fabric = {"rdma": _rdma_devices(root), "modules": modules, "nccl": _nccl_libraries(),
              "kernel": _sys_text(os.path.join(root, "proc", "sys", "kernel", "osrelease")),
              "nvidia_driver": _sys_text(os.path.join(root, "proc", "driver", "nvidia", "version"))}
    if fabric["nvidia_driver"]:  # Xids come from the NVIDIA driver only
        fabric["xid"] = _xid_events(root)
    return fabric


def unsupported():
    """The line an interpreter older than MIN_PYTHON writes instead of facts, or None."""
    if sys.version_info >= MIN_PYTHON:
        return None
    return "%s: %s is Python %s; preflight needs Python %d.%d or newer\n" % (
        UNSUPPORTED, sys.executable, platform.python_version(), MIN_PYTHON[0], MIN_PYTHON[1])


if __name__ == "__main__":  # shipped: the sender binds OPTIONS before this runs
    if unsupported():  # no facts: an old interpreter's would be misread (Python 2's as "name not resolved")
        sys.stderr.write(unsupported())
        sys.exit(3)
    sys.stdout.write(json.dumps(collect(globals().get("OPTIONS") or {})) + "\n")
    sys.stdout.flush()
    serve(Agent(), 0, sys.stdout)
