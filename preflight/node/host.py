"""The machine as the job meets it: the interpreter, names and interfaces, the route to the head, the job's
environment variables, storage, limits, memory and the clock's discipline."""
import ctypes
import os
import platform
import resource
import socket
import struct
import sys
import time

from preflight.node import procfs
from preflight.node.paths import port_range, resolve_one
from preflight.node.secret import REDACTED, secret_name

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "MASTER_", "CUDA_", "ACCELERATE_", "DEEPSPEED_", "DS_", "OMP_",
                "FI_", "UCX_", "HF_", "TRANSFORMERS_", "PYTORCH_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTHONPATH", "LD_LIBRARY_PATH",
             "LD_PRELOAD", "PATH", "VIRTUAL_ENV", "CONDA_PREFIX")


def python():
    return {"executable": sys.executable, "version": platform.python_version(), "cwd": os.getcwd()}


def host(options):
    hostname = socket.gethostname()
    links = {}
    interfaces = _interfaces(links)
    own = {a for addrs in interfaces.values() for a in addrs}
    facts = {"hostname": hostname, "fqdn": socket.getfqdn(), "interfaces": interfaces, "links": links,
             "resolves_to": resolve_one(hostname), "kernel": platform.release(),
             "rdma_devices": sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else [],
             "port_range": port_range(), "machine": platform.machine(), "container": container(),
             "sys_nice": has_capability(CAP_SYS_NICE),
             # what a hang would leave to read (JOB012): py-spy, and whether ptrace lets it attach from here
             "ptrace_scope": procfs.ptrace_scope(), "sys_ptrace": has_capability(CAP_SYS_PTRACE), "uid": os.getuid(),
             "py_spy": py_spy(), "listening": listening()}
    facts["resolves_to_own_interface"] = any(a in own for a in facts["resolves_to"] if not a.startswith("127."))
    head = options.get("head")
    if head:
        facts["head_resolves_to"] = resolve_one(head)
        facts["route_to_head"] = _route(facts["head_resolves_to"], options.get("port") or 0, interfaces)  # the head sends its port
    return facts


CAP_SYS_NICE = 23  # linux/capability.h
CAP_SYS_PTRACE = 19
MAX_LISTENING = 512
# What container runtimes leave behind: docker's /.dockerenv, podman's /run/.containerenv, the `container`
# variable systemd and podman set for PID 1 (environ of this session only when it inherits it), apptainer's.
CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")
CONTAINER_VARIABLES = ("container", "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "KUBERNETES_SERVICE_HOST")
CONTAINER_CGROUPS = ("docker", "kubepods", "containerd", "libpod", "lxc")


def container():
    """What marks this process as one in a container, or None where nothing does."""
    found = [f for f in CONTAINER_FILES if os.path.exists(f)] + [v for v in CONTAINER_VARIABLES if os.environ.get(v)]
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            cgroups = f.read(65536)
        found += [f"cgroup {word}" for word in CONTAINER_CGROUPS if word in cgroups]
    except OSError:
        pass
    return ", ".join(found) or None


def py_spy(given=None):
    """The py-spy doctor would run (given, else on PATH, else beside this interpreter), or None."""
    import shutil

    for candidate in (given, shutil.which("py-spy"),
                      os.path.join(os.path.dirname(os.path.realpath(sys.executable)), "py-spy"),
                      os.path.join(os.path.dirname(sys.executable), "py-spy")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def listening():
    """[[address, port]] of the TCP sockets listening in this network namespace (at most MAX_LISTENING): a port a
    job means to listen on that is already taken (NCCL's RAS, JOB012)."""
    found = sorted(set((s["local"], s["local_port"]) for s in procfs.tcp_sockets("LISTEN").values()
                       if isinstance(s["local_port"], int)))
    return [list(item) for item in found[:MAX_LISTENING]]


def has_capability(number):
    """Whether this process holds the capability (its effective set, /proc/self/status CapEff); None: unknown."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> number & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _interfaces(links=None):
    """Interface name -> addresses (IPv4 through an ioctl, IPv6 from /proc). When `links` is a dict, it is
    filled with name -> {"up": IFF_UP, "running": IFF_RUNNING (carrier), "ipv4": ["10.0.0.2/24"] (the
    interface's primary address and its netmask), "ipv6": ["fe80::1/64", ...], "mtu": 1500} from the same
    probe socket (SIOCGIFFLAGS, SIOCGIFNETMASK, SIOCGIFMTU); an ioctl that fails leaves its field None."""
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
            link = links[name] = {"up": None, "running": None, "ipv4": ipv4, "ipv6": [], "mtu": None}
            try:
                link["mtu"] = struct.unpack("i", fcntl.ioctl(probe.fileno(), 0x8921, request)[16:20])[0]  # SIOCGIFMTU
            except (OSError, struct.error):
                pass
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


def environment():
    env = {}
    for name, value in os.environ.items():
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        env[name] = REDACTED if secret_name(name) else value
    return env


def storage(paths):
    result = {}
    for name, path in dict(paths, shm="/dev/shm").items():
        entry = {"path": path, "exists": os.path.exists(path)}
        if entry["exists"]:
            st = os.statvfs(path)
            entry.update(total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize,
                         writable=os.access(path, os.W_OK))
        result[name] = entry
    return result


def limits():
    def limit(which):
        soft, hard = resource.getrlimit(which)
        return [None if soft == resource.RLIM_INFINITY else soft, None if hard == resource.RLIM_INFINITY else hard]

    return {"nofile": limit(resource.RLIMIT_NOFILE), "memlock": limit(resource.RLIMIT_MEMLOCK),
            "nproc": limit(resource.RLIMIT_NPROC), "stack": limit(resource.RLIMIT_STACK)}


def memory():
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


def clock():
    """The kernel's view of clock discipline (adjtimex with no changes): synchronised or not."""
    timex = _Timex()
    state = ctypes.CDLL(None, use_errno=True).adjtimex(ctypes.byref(timex))
    if state < 0:
        return {"error": os.strerror(ctypes.get_errno())}
    unsync = bool(timex.status & 0x0040) or state == 5  # STA_UNSYNC, TIME_ERROR
    return {"synchronised": not unsync, "maxerror_s": timex.maxerror / 1e6, "esterror_s": timex.esterror / 1e6,
            "time": time.time()}


