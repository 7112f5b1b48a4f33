"""The shapes of what nodes send, the one place where a node's JSON is held to what preflight.node writes:
each facts section (preflight.node.collector), and the all-reduce worker's report (preflight.node.allreduce).

A node's facts are held to them once, when they arrive (gather.checked_facts): a section of another shape
becomes that node's failed section (PKG003 reports it, the checks that read it say "not evaluated"), so no
check ever reads a value of another type than the collector's and blames itself for what a node sent. A
worker report of another shape is that node's failure of the all-reduce (worker_report_problem).

A shape is a type or a tuple of types (bool is never a number here), or one of the classes below. The
keys of an Obj are optional, because the collector leaves some out (a node without GPUs has no devices),
unless their shape is a Need; a key it has must be of its shape. Keys no shape names are let through: the
checks never read them."""
import math
import re
from typing import Any, Callable, List, Optional, Sequence, Tuple

from preflight.inputs.numbers import is_int, is_number
from preflight.node.allreduce import NCCL_LINE_CHARS, NCCL_MAX_LINES
from preflight.node.census import MAX_PROCESSES
from preflight.node.fabric import IMEX_CHANNEL_LIMIT
from preflight.node.host import MAX_LISTENING

NONE = type(None)
UUID_TEXT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # str(uuid.UUID(...))
NUMBER = (int, float)
TEXT = (str, NONE)
COUNT = (int, NONE)

# What is wrong, from a shape's wrong(): (the path to it, innermost part first; what it is). The path is
# joined only when something is wrong: the facts of thousands of nodes are held to these shapes.
Wrong = Optional[Tuple[List[str], str]]


def kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", NONE: "null", bool: "a boolean"}.get(
        type(value), "a number")


def typed(value: Any, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    return isinstance(value, types) and (type(value) is not bool or bool in types)


class Leaf:
    """A value of one of these types (bool is never a number here)."""

    def __init__(self, types):
        self.types = types if isinstance(types, tuple) else (types,)
        self.bool_ok = bool in self.types
        # The exact classes of JSON's values it takes: a set lookup, where isinstance is the slow way.
        self.classes = frozenset(c for c in (dict, list, str, int, float, bool, NONE)
                                 if issubclass(c, self.types) and (c is not bool or self.bool_ok))

    def all(self, values) -> bool:
        """Whether every one of `values` is of these types."""
        return set(map(type, values)) <= self.classes or all(map(self.outer, values))

    def outer(self, value: Any) -> bool:
        return isinstance(value, self.types) and (value.__class__ is not bool or self.bool_ok)

    def wrong(self, value: Any) -> Wrong:
        return None if self.outer(value) else ([], f"is {kind(value)}")


def _shape(shape):
    return shape if hasattr(shape, "wrong") else Leaf(shape)


class Need:
    """A key of an Obj that must be there (a check reads it with [key])."""

    def __init__(self, shape):
        self.shape = _shape(shape)


_ABSENT = object()


class Obj:
    def __init__(self, **keys):
        self.keys = []
        for key, shape in keys.items():
            needed = isinstance(shape, Need)
            shape = shape.shape if needed else _shape(shape)
            leaf = shape if isinstance(shape, Leaf) else None  # tested inline: most keys are plain values
            self.keys.append((key, needed, shape, leaf.classes if leaf else ()))

    def outer(self, value: Any) -> bool:
        return isinstance(value, dict)

    def wrong(self, value: Any) -> Wrong:
        if not isinstance(value, dict):
            return [], f"is {kind(value)}"
        for key, needed, shape, classes in self.keys:
            item = value.get(key, _ABSENT)
            if item is _ABSENT:
                if needed:
                    return [], f"has no {key!r}"
                continue
            if item.__class__ in classes:
                continue
            found = shape.wrong(item)
            if found:
                found[0].append(f".{key}")
                return found
        return None


class Is:
    """Exactly this value (the branch of an Either: a path that does not exist has no sizes)."""

    def __init__(self, value):
        self.value = value

    def outer(self, value: Any) -> bool:
        return type(value) is type(self.value)

    def wrong(self, value: Any) -> Wrong:
        return None if self.outer(value) and value == self.value else ([], f"is not {self.value!r}")


def _first_wrong(shape, items, values) -> Wrong:
    """What is wrong with the first of `items` ((index or key, value)) that is not of `shape`; `values`, the
    same values, tested at once where the shape is a Leaf (most lists and objects hold only plain values)."""
    if isinstance(shape, Leaf) and shape.all(values):
        return None
    for where, item in items:
        found = shape.wrong(item)
        if found:
            found[0].append(f"[{where!r}]")
            return found
    return None


class Each:
    """A list whose every item is of one shape; `length`: of exactly that many items; `most`: of at most that
    many (the collector's own cap, where the checks' cost grows faster than the list)."""

    def __init__(self, item, length: Optional[int] = None, most: Optional[int] = None):
        self.item, self.length, self.most = _shape(item), length, most

    def outer(self, value: Any) -> bool:
        return isinstance(value, list)

    def wrong(self, value: Any) -> Wrong:
        if not isinstance(value, list):
            return [], f"is {kind(value)}"
        if self.length is not None and len(value) != self.length:
            return [], f"has {len(value)} items, not {self.length}"
        if self.most is not None and len(value) > self.most:
            return [], f"has {len(value)} items, more than the {self.most} the collector sends"
        return _first_wrong(self.item, enumerate(value), value)


class Keyed:
    """An object of any keys, whose every value is of one shape (interfaces, environment variables)."""

    def __init__(self, value):
        self.value = _shape(value)

    def outer(self, value: Any) -> bool:
        return isinstance(value, dict)

    def wrong(self, value: Any) -> Wrong:
        if not isinstance(value, dict):
            return [], f"is {kind(value)}"
        return _first_wrong(self.value, ((key[:40], item) for key, item in value.items()), value.values())


class Either:
    """One of these shapes. What is wrong is said by the first of the value's own kind: the richest first."""

    def __init__(self, *shapes):
        self.shapes = [_shape(s) for s in shapes]

    def outer(self, value: Any) -> bool:
        return any(s.outer(value) for s in self.shapes)

    def wrong(self, value: Any) -> Wrong:
        first = None
        for shape in self.shapes:
            if shape.outer(value):
                found = shape.wrong(value)
                if found is None:
                    return None
                first = first or found
        return first or ([], f"is {kind(value)}")


class Test:
    """A value for which `holds(value)` is true; `what` says what that is, for the message."""

    def __init__(self, holds: Callable[[Any], bool], what: str):
        self.holds, self.what = holds, what

    def outer(self, value: Any) -> bool:
        return self.holds(value)

    def wrong(self, value: Any) -> Wrong:
        return None if self.holds(value) else ([], f"is {kind(value)}, not {self.what}")


def problem(value: Any, shape, where: str) -> Optional[str]:
    """What in `value` is not of `shape` ("gpus.devices[0].name is a number"), or None."""
    found = _shape(shape).wrong(value)
    return None if found is None else f"{where}{''.join(reversed(found[0]))} {found[1]}"


def _uuid_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str) and UUID_TEXT.fullmatch(value) is not None


ERROR = str  # {"error": why}: how the collector says that it could not read a fact
RESOLVED = Either(Each(str), Obj(error=Need(ERROR)))
GPU = Obj(
    index=Need(int), name=TEXT, uuid=TEXT, pci_bus_id=TEXT, memory_total_bytes=COUNT, memory_used_bytes=COUNT,
    compute_capability=Either(NONE, Each(int)), ecc_enabled=(bool, NONE), ecc_uncorrected_volatile=COUNT,
    ecc_uncorrected_aggregate=COUNT, retired_pages_single_bit=COUNT, retired_pages_double_bit=COUNT,
    retired_pages_pending=(bool, NONE), remapped_rows_uncorrectable=COUNT, remapped_rows_pending=(bool, NONE),
    remapped_rows_failure=(bool, NONE), persistence_mode=(bool, NONE), mig_enabled=(bool, NONE),
    mig_pending=(bool, NONE), compute_mode=TEXT, processes=Each(Obj(pid=int, used_memory_bytes=COUNT)),
    pcie_generation=COUNT, pcie_max_generation=COUNT, pcie_width=COUNT, pcie_max_width=COUNT,
    nvlink_active=Either(NONE, Each(bool)), clock_event_reasons=Either(NONE, Each(str)), errors=Keyed(str),
    fabric=Either(NONE, Obj(state=Need(str), status=Need(int), clique=COUNT, health=Either(NONE, Each(str)),
                            cluster_uuid=Test(_uuid_or_none, "a UUID's text or null"))),
    p2p=Either(NONE, Keyed(Obj(read=TEXT, write=TEXT, nvlink=TEXT))))
# A GID table entry: preflight.node.fabric writes index and gid for every entry it keeps (it skips the empty
# ones), and NCCL_IB_GID_INDEX is looked up by index: an entry without them is not one of the collector's.
GID = Obj(index=Need(int), gid=Need(str), type=TEXT, ndev=TEXT)
RDMA_PORT = Obj(state=TEXT, phys_state=TEXT, rate=TEXT, rate_gbps=(int, float, NONE), link_layer=TEXT,
                gids=Each(GID), counters=Keyed(COUNT))
FABRIC = Obj(
    rdma=Keyed(Obj(fw_ver=TEXT, hca_type=TEXT, board_id=TEXT, node_guid=TEXT, node_type=TEXT, netdevs=Each(str),
                   netdev_mtu=Keyed(COUNT), pci=TEXT, ports=Keyed(RDMA_PORT))),
    modules=Either(NONE, Each(str)),
    gpudirect=Obj(memory_peers=Each(str), nvidia_peermem_version=TEXT),
    pci=Obj(devices=Keyed(Obj(kind=TEXT, host_bridge=TEXT, bridges=Each(str), numa_node=COUNT, iommu_group=TEXT)),
            acs=Keyed(Obj(config_bytes=int, ctl=COUNT))),
    iommu=Obj(cmdline=Each(str), units=Each(str)),
    nccl=Obj(libraries=Each(str), plugins=Each(Obj(name=str, path=str, bytes=COUNT)), net_plugin=TEXT,
             cuda_compat=Each(str)),
    kernel=TEXT, nvidia_driver=TEXT, fabric_manager=Obj(running=(bool, NONE), version=TEXT, package=TEXT),
    imex=Obj(directory=bool, registered=(bool, NONE), major=COUNT, running=(bool, NONE),
             channels=Each(Obj(name=Need(str), char=Need(bool), major=COUNT, minor=COUNT, usable=Need(bool)),
                           most=IMEX_CHANNEL_LIMIT)),
    xid=Obj(readable=bool, reason=str, count=int, cut=bool,
            events=Each(Obj(pci=str, xid=int, text=str, uptime_s=(int, float, NONE)))),
    error=ERROR)

# A file as collector.read_file reports it (also the answer to the "files" request).
FILE = Obj(path=str, sha256=str, size=int, text=str, error=str, default=bool)
ENV = Either(NONE, Keyed(str))
SECONDS = (int, float, NONE)
PROCESS = Obj(pid=Need(int), ppid=COUNT, argv=Each(str), argv_dropped=COUNT, state=TEXT, cpu_s=SECONDS, age_s=SECONDS,
              kind=TEXT, env=ENV,
              sockets=Each(Obj(local=TEXT, local_port=COUNT, remote=TEXT, remote_port=COUNT, state=TEXT)),
              children=Each(int), stable=(bool, NONE), cpu_percent=SECONDS, config=FILE, sockets_dropped=COUNT,
              own_pid=COUNT, nccl_from=Keyed(str), nccl_unread=Each(str),
              # py-spy's frames: [function, file, line]
              threads=Each(Obj(name=TEXT, active=(bool, NONE), frames=Each(Each((str, int, NONE), length=3)))))
# A flight-recorder dump as preflight.node.flightrec reduces it: per process group, its last collectives.
FR_ENTRY = Obj(seq=Need(int), op=str, backend=TEXT, sizes=Either(NONE, Each(Each(int))),
               out_sizes=Either(NONE, Each(Each(int))), dtypes=Either(NONE, Each(TEXT)), state=TEXT,
               created_ns=COUNT, timeout_ms=COUNT, frames=Each(Each((str, int, NONE), length=3)))
FR_GROUP = Obj(pg=Need(str), desc=TEXT, pg_id=COUNT, ranks=Either(NONE, Each(int)), entries=Need(Each(FR_ENTRY)),
               enqueued=COUNT, started=COUNT, completed=COUNT)
FLIGHT_RECORDER = Obj(looked=Each(Obj(prefix=str, source=str, server_dump=str)), stale=Each(str), skipped=str,
                      dumps=Each(Obj(path=Need(str), rank=Need(int), size=int, mtime_ns=int, version=TEXT, p2p=int,
                                     groups=Need(Each(FR_GROUP)))),
                      errors=Each(Obj(path=Need(str), rank=int, error=Need(str))))
# What NCCL's RAS answered, as preflight.node.ras reduces it: per answer its two snapshots of the communicators
# whose ranks disagree, miss a rank or report an error.
RAS_WHO = dict(rank=COUNT, pid=COUNT, host=TEXT)
RAS_COMM = Obj(hash=TEXT, size=COUNT, ranks_count=COUNT, missing_count=COUNT, launched=COUNT, usual=Keyed(int),
               ops=Keyed(Each(Obj(value=Need(int), count=Need(int), ranks=Either(NONE, Each(Obj(**RAS_WHO)))))),
               missing=Each(Obj(unresponsive=bool, dead=bool, **RAS_WHO)),
               errors=Each(Obj(error=TEXT, init_state=COUNT, async_error=COUNT, **RAS_WHO)))
RAS_PROCESS = Each((int, str), length=2)  # [pid, host]
NCCL_RAS = Obj(skipped=str, error=str, uses=TEXT, answers=Each(Obj(
    address=Need(str), source=str, format=TEXT, version=TEXT, protocol=COUNT, error=TEXT, absent=bool,
    interval_s=NUMBER,
    snapshots=Each(Obj(communicators=COUNT, comms=Need(Each(RAS_COMM)), comms_dropped=COUNT, dead=Each(RAS_PROCESS),
                       unreachable=Each(RAS_PROCESS), timeouts=COUNT)))))
CENSUS = Obj(
    processes=Each(PROCESS, most=MAX_PROCESSES),  # the collector's cap: the RUN checks pair the processes up
    listeners=Each(Obj(pid=int, argv=Each(str), argv_dropped=COUNT, age_s=SECONDS, env=ENV)),
    stacks=Obj(tool=TEXT, read=int, failed=int, error=TEXT, samples=int, skipped=str),
    elsewhere=int, port=COUNT, seconds=SECONDS, ptrace_scope=COUNT, uid=COUNT, error=ERROR,
    processes_dropped=COUNT, pids=Each(int), flight_recorder=FLIGHT_RECORDER, nccl_ras=NCCL_RAS)

NCCL_CONF_FILE = Obj(path=str, entries=Each(Obj(line=Need(int), name=Need(str), value=Need(str))), cut_at=COUNT,
                     long_lines=Each(int), error=TEXT, nothing=bool)
NCCL_CONF = Obj(conf_file=TEXT, home=TEXT, passwd_home=TEXT, files=Keyed(NCCL_CONF_FILE), job_env=Keyed(str),
                later=Keyed(str), error=ERROR)

# Each section as the checks read it. "job" is read key by key with its types where it is used
# (preflight.job.view): a node's launch is open-ended.
SECTIONS = {
    "python": Obj(executable=TEXT, version=str, cwd=str, error=ERROR),  # sys.executable: None where unknown
    "packages": Obj(versions=Keyed(TEXT), distributions=Keyed(TEXT), requires=Keyed(Each(str)), nccl_library=TEXT,
                    error=ERROR),
    "host": Obj(hostname=str, fqdn=str, interfaces=Keyed(Each(str)),
                links=Keyed(Obj(up=(bool, NONE), running=(bool, NONE), ipv4=Either(NONE, Each(str)), ipv6=Each(str),
                                mtu=COUNT)),
                resolves_to=RESOLVED, kernel=str, rdma_devices=Each(str), resolves_to_own_interface=bool,
                port_range=Either(NONE, Each(int, length=2)), machine=str, container=TEXT, sys_nice=(bool, NONE),
                ptrace_scope=COUNT, sys_ptrace=(bool, NONE), uid=int, py_spy=TEXT,
                listening=Each(Each((str, int), length=2), most=MAX_LISTENING),
                head_resolves_to=RESOLVED,
                route_to_head=Either(NONE, Obj(head=Need(str), source=Need(str), interface=Need(TEXT)),
                                     Obj(head=str, error=Need(ERROR))), error=ERROR),
    "env": Keyed(str),
    "storage": Keyed(Either(Obj(path=Need(str), exists=Need(Is(True)), total_bytes=Need(int), free_bytes=Need(int),
                                writable=Need(bool)),
                            Obj(path=Need(str), exists=Need(Is(False))))),
    "limits": Keyed(Each(COUNT, length=2)),  # [soft, hard], None for unlimited
    "memory": Obj(total_bytes=COUNT, available_bytes=COUNT, swap_bytes=COUNT, cpus=COUNT, error=ERROR),
    "clock": Obj(synchronised=bool, maxerror_s=NUMBER, esterror_s=NUMBER, time=NUMBER, error=ERROR),
    "gpus": Obj(available=bool, reason=str, driver_version=TEXT, cuda_driver_version=TEXT, count=int,
                devices=Each(GPU), error=ERROR),
    "fabric": Either(NONE, FABRIC),
    "census": Either(NONE, CENSUS),
    "nccl_conf": Either(NONE, NCCL_CONF),
}


# The data-path probe's answers (preflight.node.paths): the responder's ports, then each peer as probed.
PATHS_OPEN = Obj(open=Need(bool), tcp_port=int, udp_port=int, port_range=Either(NONE, Each(int, length=2)), error=TEXT)
PATH_PEER = Obj(address=TEXT, source=TEXT, route_error=TEXT, device=TEXT, route=TEXT, names=Keyed(RESOLVED),
                tcp=Obj(ok=Need(bool), error=TEXT, seconds=NUMBER),
                mtu=Obj(size=Need(int), ok=Need(bool), carried=COUNT, refused=bool, lossy=bool, error=TEXT), error=TEXT)
PATHS_PROBE = Obj(paths=Need(Keyed(PATH_PEER)))


def _positive_int(value: Any) -> bool:
    return is_int(value) and value > 0


def _finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _nccl_lines(value: Any) -> bool:
    # The worker sends at most so many, so short: longer ones would only cost the head time to parse.
    return (isinstance(value, dict) and isinstance(value.get("lines"), list) and len(value["lines"]) <= NCCL_MAX_LINES
            and all(isinstance(line, str) and len(line) <= NCCL_LINE_CHARS for line in value["lines"])
            and (value.get("debug") is None or isinstance(value.get("debug"), str)))


# The all-reduce worker's report (preflight.node.allreduce's docstring): every field the head reads.
WORKER_SIZE = Obj(bytes=Need(Test(_positive_int, "a positive integer")),
                  iters=Need(Test(_positive_int, "a positive integer")),
                  time_s=Need(Test(_finite, "a number")), algbw_gbps=Need(Test(_finite, "a number")),
                  busbw_gbps=Need(Test(_finite, "a number")))
WORKER_RANK = Obj(rank=Need(int), ok=Need(bool), stage=TEXT, kind=TEXT, error=TEXT, tail=TEXT,
                  sizes=Either(NONE, Each(WORKER_SIZE)),
                  skipped_sizes=Either(NONE, Each(Test(_positive_int, "a size in bytes"))),
                  check=(dict, NONE),
                  nccl=Test(lambda v: v is None or _nccl_lines(v), f"null or an object of lines (at most "
                                                                    f"{NCCL_MAX_LINES}, of {NCCL_LINE_CHARS} characters "
                                                                    "each) and a debug text"))
WORKER_REPORT = Obj(ok=Need(bool), ranks=Need(Each(WORKER_RANK)), kind=TEXT, stage=TEXT, error=TEXT, tail=TEXT)


def worker_report_problem(report: Any, ranks: Sequence[int]) -> Optional[str]:
    """Why a node's all-reduce report is not what preflight.node.allreduce writes (None when it is): its shape,
    one rank result per rank the node was given, and results that agree with each other."""
    wrong = problem(report, WORKER_REPORT, "the report")
    if wrong:
        return wrong
    got = [r["rank"] for r in report["ranks"]]
    if got != list(ranks):
        return f"it reports ranks {got!r:.80}, not the ranks {list(ranks)} it was given"
    for r in report["ranks"]:
        if r["ok"] and not r.get("sizes") and not r.get("skipped_sizes"):
            return f"rank {r['rank']}: it passed without measuring any size"
    if report["ok"] and not all(r["ok"] for r in report["ranks"]):
        return "it says ok while a rank failed"
    return None
