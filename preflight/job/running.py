"""A running job across its nodes, from each node's census (preflight.node.census): for `preflight doctor`.

Each process the nodes found becomes a `Proc` with what its launcher flags or its job variables say
(node rank, number of nodes, master address and port, rank, world size) and where its Python stack
stands (rendezvous, init_process_group, a collective and the user's line, data loading, idle or busy
elsewhere). The RUN checks read this model; no I/O here.
"""
from __future__ import annotations

import functools
import ipaddress
import marshal
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.inputs import launchcmd
from preflight.inputs.numbers import int_or_none

COLLECTIVES = frozenset("""all_reduce broadcast barrier monitored_barrier all_gather all_gather_into_tensor
all_gather_object reduce_scatter reduce_scatter_tensor all_to_all all_to_all_single reduce gather scatter send
recv isend irecv broadcast_object_list""".split())
RENDEZVOUS = frozenset("""_rendezvous next_rendezvous _assign_worker_ranks _share_and_gather _store_based_barrier
_barrier_nonblocking _create_c10d_store _wait_for_workers""".split())
DATA = frozenset("_next_data _get_data __next__ _try_get_data fetch".split())
LIBRARY = re.compile(r"(site-packages|dist-packages|/lib/python\d|<frozen|^<)")
C10D_PORT = 29400  # a c10d rendezvous endpoint without a port (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py)
NAMES = {  # launcher -> (node rank, number of nodes, master address, master port) among its flags
    "torchrun": ("node_rank", "nnodes", "master_addr", "master_port"),
    "accelerate": ("machine_rank", "num_machines", "main_process_ip", "main_process_port"),
    "deepspeed": ("node_rank", "num_nodes", "master_addr", "master_port"),
}


@dataclass(frozen=True)  # shared by every process whose stack stands there (where's `seen`)
class Where:
    """Where a process's stack stands."""

    phase: str  # rendezvous, init_process_group, collective, data, idle, busy, unknown
    op: Optional[str] = None  # the collective
    at: Optional[str] = None  # the innermost frame of the user's code: file:line (function)

    def text(self) -> str:
        what = f"in {self.op}" if self.phase == "collective" else PHASES[self.phase]  # once per process: no dict each
        return what + (f" at {self.at}" if self.at else "")


PHASES = {"rendezvous": "in the rendezvous", "init_process_group": "in init_process_group", "data": "loading data",
          "idle": "idle", "busy": "running", "unknown": "stack not read"}  # Where.text: "collective" names its op


# A Proc has 30 fields: past CPython's 29 attributes of a shared-key instance dict, each would take a dict of its
# own (1.6 kB; slots: 0.3 kB, and quicker to fill: 147,439 of them at 16,384 nodes). dataclass makes slots from 3.10.
SLOTS = {"slots": True} if sys.version_info >= (3, 10) else {}


@dataclass(**SLOTS)
class Proc:
    node: str
    pid: int
    kind: str  # launcher or rank
    argv: List[str]
    state: str
    age_s: Optional[float]
    cpu_percent: Optional[float]
    env: Mapping[str, str]
    sockets: List[Mapping[str, Any]]
    children: List[int]
    where: Where
    ppid: Optional[int] = None
    sockets_dropped: int = 0  # sockets the node held back (preflight.node.census MAX_SOCKETS): `sockets` is not all
    argv_dropped: int = 0  # the words past what the node sends (census MAX_ARGS, a launcher's MAX_LAUNCHER_ARGS)
    stable: Optional[bool] = None  # at the same place in both stack samples (None: one sample, or none)
    own_pid: Optional[int] = None  # its pid in a PID namespace of its own (a container), as NCCL's RAS names it
    launcher: Optional[str] = None  # torchrun, accelerate, deepspeed (for a launcher agent)
    node_rank: Optional[int] = None
    nnodes: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None
    nproc: Optional[int] = None  # a launcher's processes per node
    run_id: Optional[str] = None
    rdzv: Optional[str] = "static"  # None: not known (a launcher whose node cut its line before its script)
    gpu: Optional[str] = None  # the GPU NVML sees it on, and the memory it holds there
    # Where a launcher's master address comes from: "flag --master_addr", "PET_MASTER_ADDR", "default" (torchrun's
    # 127.0.0.1), an accelerate config's "PATH:LINE"; None where it is not known.
    master_from: Optional[str] = None
    # The port that names its job: a launcher's master port (its rendezvous endpoint's, elastic), and for a rank
    # its launcher's; an elastic launcher hands its ranks a store port of its own as MASTER_PORT.
    job_port: Optional[int] = None
    # The launcher's command as its parser reads it (_launch), parsed once: build, RUN001 and RUN008 all ask.
    launched: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def listens(self) -> bool:
        return self.listens_on(self.master_port)

    def listens_on(self, port: Optional[int]) -> bool:
        return any(s.get("state") == "LISTEN" and s.get("local_port") == port for s in self.sockets)

    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"


@dataclass
class Census:
    nodes: Sequence[str]
    procs: List[Proc] = field(default_factory=list)
    listeners: Dict[str, List[Mapping[str, Any]]] = field(default_factory=dict)  # node -> other holders of the port
    stacks: Dict[str, Mapping[str, Any]] = field(default_factory=dict)  # node -> how the stacks were read
    errors: Dict[str, str] = field(default_factory=dict)  # node -> why it has no census
    port: Optional[int] = None
    selected: bool = False  # --pid: only some processes were taken, the others of the job were not looked at
    dropped: Dict[str, int] = field(default_factory=dict)  # node -> job processes past the census's cap
    # node -> the flight-recorder dumps its census read (preflight.node.flightrec.collect; judged by job.flight)
    flight: Dict[str, Mapping[str, Any]] = field(default_factory=dict)
    # node -> what NCCL's RAS answered there (preflight.node.ras.collect; judged by job.ras)
    ras: Dict[str, Mapping[str, Any]] = field(default_factory=dict)
    _by_node: Dict[Any, List[Proc]] = field(default_factory=dict, repr=False)  # node, and (node, kind)
    _by_kind: Dict[str, List[Proc]] = field(default_factory=dict, repr=False)
    _indexed: tuple = field(default=(), repr=False)
    _other_jobs: Optional[list] = field(default=None, repr=False)  # other_jobs, asked by several checks

    def _index(self) -> None:
        """The processes by node and by kind, once they are in: checks ask node by node and kind by kind. Made
        again when build (or a test) puts another list in or adds to it."""
        if self._indexed != (id(self.procs), len(self.procs)):
            self._by_node, self._by_kind, self._other_jobs = {}, {"launcher": [], "rank": []}, None
            for p in self.procs:
                self._by_node.setdefault(p.node, []).append(p)
                self._by_node.setdefault((p.node, p.kind), []).append(p)
                self._by_kind.setdefault(p.kind, []).append(p)
            self._indexed = (id(self.procs), len(self.procs))

    def on(self, node: str, kind: Optional[str] = None) -> List[Proc]:
        self._index()
        return list(self._by_node.get(node if kind is None else (node, kind), ()))

    def has(self, node: str, kind: Optional[str] = None) -> bool:
        """Whether `on` has any: without its copy (checks ask it of every node)."""
        self._index()
        return (node if kind is None else (node, kind)) in self._by_node

    @property
    def launchers(self) -> List[Proc]:
        self._index()
        return list(self._by_kind["launcher"])

    @property
    def ranks(self) -> List[Proc]:
        self._index()
        return list(self._by_kind["rank"])


def where(threads: Any, launcher: bool = False, seen: Optional[dict] = None) -> Where:
    """The phase of a process from py-spy's threads (frames innermost first), the main thread first. A
    launcher's own "user" frame is its console script: not worth naming. `seen`: the stacks read so far
    ((their bytes, launcher) -> where), for a census whose ranks mostly stand at the same few places: the
    processes at one place share one Where (frozen)."""
    if seen is None:
        found = _where(threads)
        return Where(found.phase, found.op, None) if launcher else found
    try:  # marshal's version 0 (no references): a value's exact bytes, twice as quick as its repr; 1, True and
        key = (marshal.dumps(threads, 0), launcher)  # "1" stay apart, as _where reads them
    except ValueError:  # not a JSON value (a test's object): its repr
        key = (repr(threads), launcher)
    if key not in seen:
        seen[key] = where(threads, launcher)
    return seen[key]


def _where(threads: Any) -> Where:
    if not isinstance(threads, list) or not threads:
        return Where("unknown")
    ordered = sorted((t for t in threads if isinstance(t, dict)), key=lambda t: t.get("name") != "MainThread")
    best = None
    for thread in ordered:
        frames = [f for f in thread.get("frames") or () if isinstance(f, list) and len(f) == 3]
        user = next((f"{os.path.basename(str(f[1]))}:{f[2]} ({f[0]})" for f in frames
                     if not LIBRARY.search(str(f[1]))), None)
        names = [str(f[0]).rsplit(".", 1)[-1] for f in frames]
        op = next((n for n in names if n in COLLECTIVES), None)
        if op is not None:
            return Where("collective", op, user)
        if "init_process_group" in names:
            found = Where("init_process_group", None, user)
        elif any(n in RENDEZVOUS for n in names):
            found = Where("rendezvous", None, user)
        elif any(n in DATA for n in names) and "DataLoader" in " ".join(str(f[0]) for f in frames):
            found = Where("data", None, user)
        else:
            found = Where("busy" if thread.get("active") else "idle", None, user)
        if best is None:
            best = found
    return best or Where("unknown")


def _launch_of(p: Proc) -> Tuple[Optional[str], Optional[launchcmd.LaunchCommand]]:
    if p.launched is None:
        p.launched = _launch(p.argv, p.argv_dropped)
    return p.launched


def _launch(argv: List[str], dropped: int = 0) -> Tuple[Optional[str], Optional[launchcmd.LaunchCommand]]:
    """(the launcher, its command as its parser reads it); the command is None when the node cut the command line
    before its script (`dropped` words not sent): the launcher's own options may be among them."""
    launcher, i = launchcmd.launcher_of(argv)
    if launcher == "python" and i < len(argv) and os.path.basename(argv[i]) in ("torchrun", "accelerate", "deepspeed"):
        argv = [os.path.basename(argv[i]), *argv[i + 1:]]  # python .../bin/torchrun ARGS: /proc's console script
    command = launchcmd.parse(argv)  # once: 16,384 launchers at 16,384 nodes
    if command.launcher not in NAMES:
        return None, None
    return command.launcher, (None if dropped and not command.script else command)


def build(nodes: Sequence[str], facts: Mapping[str, Any], port: Optional[int]) -> Census:
    census = Census(list(nodes), port=port)
    seen: dict = {}  # stacks already placed: a stuck job's ranks stand at a few places
    for node in nodes:
        state = facts.get(node) or {}
        node_facts = state.get("facts") if isinstance(state.get("facts"), dict) else None
        raw = node_facts.get("census") if node_facts else None
        if state.get("error"):
            census.errors[node] = (state["error"] or {}).get("message") or "not reached"
            continue
        if not isinstance(raw, dict) or not isinstance(raw.get("processes"), list):
            census.errors[node] = (raw or {}).get("error") if isinstance(raw, dict) else "no census came back"
            continue
        census.stacks[node] = raw.get("stacks") if isinstance(raw.get("stacks"), dict) else {}
        if isinstance(raw.get("flight_recorder"), dict):
            census.flight[node] = raw["flight_recorder"]
        if isinstance(raw.get("nccl_ras"), dict):
            census.ras[node] = raw["nccl_ras"]
        census.listeners[node] = [h for h in raw.get("listeners") or () if isinstance(h, dict)]
        census.selected = census.selected or bool(raw.get("pids"))
        if isinstance(raw.get("processes_dropped"), int) and raw["processes_dropped"] > 0:
            census.dropped[node] = raw["processes_dropped"]
        on_gpu = _gpu_processes(node_facts)
        for item in raw["processes"]:
            proc = _proc(node, item, seen)
            if proc is not None:
                proc.gpu = on_gpu.get(proc.pid)
                census.procs.append(proc)
    for launcher in census.launchers:  # what its flags do not say, its ranks' variables do
        if launcher.node_rank is None:
            launcher.node_rank = next((p.node_rank for p in _ranks_of(census, launcher) if p.node_rank is not None),
                                      None)
        if launcher.master_port is None and launcher.rdzv is not None:  # an elastic one's ranks have its store's
            launcher.master_port = next((p.master_port for p in _ranks_of(census, launcher)
                                         if p.master_port is not None), None)
        launcher.job_port = launcher.master_port
    launchers = {}
    for p in census.launchers:  # (node, pid) -> the first launcher of that pid, as a scan of the node finds it
        launchers.setdefault((p.node, p.pid), p)
    for rank in census.ranks:
        parent = launchers.get((rank.node, rank.ppid))
        rank.job_port = parent.job_port if parent is not None and parent.job_port is not None else rank.master_port
    if port is not None:
        # The node keeps every launcher: a launcher's port may come from its config file, read here.
        others = [p for p in census.launchers if not _on_port(census, p, port)]
        gone = {(p.node, p.pid) for p in others}
        if gone:  # a new list is indexed again (Census._index): 150,000 processes at 16,384 nodes
            census.procs = [p for p in census.procs if (p.node, p.pid) not in gone and (p.node, p.ppid) not in gone]
    if census.port is None:  # one job found: its port, for the checks that look at who holds it
        ports = Counter(p.job_port for p in census.procs if p.job_port is not None)
        census.port = ports.most_common(1)[0][0] if len(ports) == 1 else None
    return census


def _ranks_of(census: Census, launcher: Proc) -> List[Proc]:
    return [p for p in census.on(launcher.node, "rank") if p.ppid == launcher.pid or p.pid in launcher.children]


def _on_port(census: Census, launcher: Proc, port: int) -> bool:
    """A launcher is of the job on `port` when the port it uses (flags over its config file, as its parser
    reads them) is that one, or it holds it, or its ranks were given it; one whose port is not known stays."""
    return launcher.job_port in (None, port) or launcher.listens_on(port) or any(
        r.master_port == port for r in _ranks_of(census, launcher))


def _gpu_processes(node_facts: Mapping[str, Any]) -> Dict[int, str]:
    """pid -> "GPU index (memory it holds)" from the node's NVML facts (a rank at 0 bytes while others
    hold gigabytes never got as far as the model)."""
    gpus = node_facts.get("gpus") if isinstance(node_facts.get("gpus"), dict) else {}
    found: Dict[int, str] = {}
    for device in gpus.get("devices") or () if isinstance(gpus.get("devices"), list) else ():
        if not isinstance(device, dict):
            continue
        for process in device.get("processes") or () if isinstance(device.get("processes"), list) else ():
            if isinstance(process, dict) and isinstance(process.get("pid"), int):
                used = process.get("used_memory_bytes")
                memory = f" ({used / 2**30:.1f} GiB)" if isinstance(used, (int, float)) else ""
                found[process["pid"]] = f"{device.get('index')}{memory}"
    return found


def _proc(node: str, item: Any, seen: Optional[dict] = None) -> Optional[Proc]:
    if not isinstance(item, dict) or not isinstance(item.get("pid"), int):
        return None
    get = item.get  # each key read once: a census of 16,384 nodes has 150,000 processes
    argv, env, sockets, children, ppid, dropped, kind = (
        get("argv"), get("env"), get("sockets"), get("children"), get("ppid"), get("argv_dropped"), get("kind"))
    env = env if isinstance(env, dict) else {}
    kind = "launcher" if kind == "launcher" else "rank"
    proc = Proc(node, item["pid"], kind, [str(a) for a in argv or () if a is not None], str(get("state") or "?"),
                get("age_s"), get("cpu_percent"), env,
                [s for s in sockets or () if isinstance(s, dict)] if sockets else [],
                [c for c in children or () if isinstance(c, int)] if children else [],
                where(item["threads"], kind == "launcher", seen) if "threads" in item else Where("unknown"),
                ppid if isinstance(ppid, int) else None,
                get("sockets_dropped") if isinstance(get("sockets_dropped"), int) else 0,
                max(0, dropped) if type(dropped) is int else 0,
                get("stable") if isinstance(get("stable"), bool) else None,
                get("own_pid") if type(get("own_pid")) is int else None)
    proc.run_id = env.get("TORCHELASTIC_RUN_ID")
    if proc.kind == "launcher":
        launcher, command = _launch_of(proc)
        proc.launcher = launcher
        if launcher is not None and command is None:  # cut before its script: its rendezvous, rank, port unknown
            proc.rdzv = None
        elif launcher == "accelerate" and isinstance(item.get("config"), dict):
            _from_accelerate(proc, item["config"], command)
        elif command is not None:
            rank_key, nodes_key, addr_key, port_key = NAMES[launcher]
            env_read = isinstance(item.get("env"), dict)  # else a PET_ variable may hold what the flags leave out

            def given(key: str) -> Tuple[Optional[str], Optional[str]]:
                """(value, where from): the flag, else torchrun's PET_<KEY> (torch/distributed/argparse_util.py,
                class env: each torchrun option's default is read from PET_<DEST> first)."""
                value = command.get(key)
                if isinstance(value, str):
                    return value, f"flag --{key}"
                if launcher == "torchrun" and env_read and isinstance(env.get("PET_" + key.upper()), str):
                    return env["PET_" + key.upper()], "PET_" + key.upper()
                return None, None

            rank_text = given(rank_key)[0]
            proc.node_rank = int_or_none(rank_text) if rank_text is not None else (
                0 if launcher == "torchrun" else None)
            proc.nnodes = given(nodes_key)[0]
            proc.master_addr, proc.master_from = given(addr_key)
            proc.master_port = int_or_none(given(port_key)[0])
            if launcher == "torchrun":  # run.py: --nproc-per-node defaults to "1"; auto, gpu, cpu are not known here
                nproc = given("nproc_per_node")[0]
                proc.nproc = int_or_none(nproc) if nproc is not None else (1 if env_read else None)
            rdzv = given("rdzv_backend")[0]
            proc.rdzv = rdzv if isinstance(rdzv, str) else ("c10d" if command.flag("standalone") else "static")
            endpoint, endpoint_from = given("rdzv_endpoint")
            if isinstance(endpoint, str) and endpoint and proc.rdzv != "static":
                # parse_rendezvous_endpoint (elastic/rendezvous/utils.py): HOST[:PORT], c10d's port by default
                host, colon, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
                proc.master_addr, proc.master_from = host.strip("[]") or None, endpoint_from
                proc.master_port = int_or_none(port_text) if colon else C10D_PORT
            if launcher == "torchrun" and proc.master_addr is None and proc.rdzv == "static" and env_read:
                # run.py: --master-addr defaults to 127.0.0.1 (and PET_MASTER_ADDR, read above, is not set)
                proc.master_addr, proc.master_from = "127.0.0.1", "default"
            if proc.master_port is None and launcher == "torchrun":
                proc.master_port = launchcmd.DEFAULT_PORT
    else:
        proc.rank, proc.world_size = int_or_none(env.get("RANK")), int_or_none(env.get("WORLD_SIZE"))
        proc.node_rank = int_or_none(env.get("GROUP_RANK"))
        proc.master_addr, proc.master_port = env.get("MASTER_ADDR"), int_or_none(env.get("MASTER_PORT"))
    return proc


def _from_accelerate(proc: Proc, config: dict, command: launchcmd.LaunchCommand) -> None:
    """A running `accelerate launch`: its config file (read on the node, as it read it) with its flags over
    it, as preflight.job.view works out a launch before the start."""
    from preflight.job import view

    effective = view.launch(proc.node, {"config": config, "files": {}}, command)
    proc.node_rank = effective.get("machine_rank") if isinstance(effective.get("machine_rank"), int) else None
    proc.nnodes = str(effective["num_machines"]) if effective.get("num_machines") is not None else None
    proc.master_addr = effective.get("main_ip") if isinstance(effective.get("main_ip"), str) else None
    proc.master_from = (effective.get("sources") or {}).get("main_ip") if proc.master_addr else None
    proc.master_port = effective.get("main_port") if isinstance(effective.get("main_port"), int) else None
    proc.nproc = effective.get("processes") if isinstance(effective.get("processes"), int) else None
    proc.rdzv = effective.get("rdzv_backend") if isinstance(effective.get("rdzv_backend"), str) else "static"


@functools.lru_cache(maxsize=1024)  # every launcher of a job names the same few addresses
def is_loopback(address: Optional[str]) -> bool:
    """127.0.0.0/8, ::1, localhost: every node has them, and each means the node itself."""
    if not address:
        return False
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def node_at(facts: Mapping[str, Any], address: Optional[str], seen_from: str) -> Optional[str]:
    """The node `address` means to a process on `seen_from`: that node itself for a loopback address (a worker
    left at torchrun's default 127.0.0.1 meets on its own node, not on the head), else node_of_address."""
    if not address:
        return None
    return seen_from if is_loopback(address) else node_of_address(facts, address)


def node_of_address(facts: Mapping[str, Any], address: str) -> Optional[str]:
    """The node whose interfaces hold `address` (or whose name or hostname it is); None for a loopback
    address, which every node holds (node_at tells whose it is)."""
    if is_loopback(address):
        return None
    for node, state in facts.items():
        node_facts = (state or {}).get("facts")
        host = node_facts.get("host") if isinstance(node_facts, dict) else None
        if not isinstance(host, dict):
            continue
        interfaces = host.get("interfaces") if isinstance(host.get("interfaces"), dict) else {}
        if address in (node, host.get("hostname"), host.get("fqdn")) or any(
                isinstance(a, list) and address in a for a in interfaces.values()):
            return node
    return None


def nodes_text(nnodes: Optional[str]) -> Optional[str]:
    """--nnodes as torchrun reads it (run.py, parse_min_max_nnodes): "2", "2:2" and " 2" are 2 nodes, "1:3" an
    elastic range; None when it is not numbers (the launcher stops on it)."""
    if nnodes is None:
        return None
    parts = [int_or_none(x) for x in str(nnodes).split(":")]
    if len(parts) > 2 or None in parts:
        return None
    return str(parts[0]) if len(parts) == 1 or parts[0] == parts[1] else f"{parts[0]}:{parts[1]}"


def job_of(p: Proc) -> Optional[Dict[str, Any]]:
    """What a launcher's job is, whatever the launcher and the spelling: its number of nodes, world size, script
    and port, each as the launcher's parser reads them (torchrun's --nnodes 2, --nnodes=2 and accelerate's
    --num_machines 2 or num_machines: 2 in its config are one value); a value not known is None and not compared.
    None when its node cut its command line before the script."""
    launcher, command = _launch_of(p)
    if launcher is None or command is None:
        return None
    nodes = nodes_text(p.nnodes)
    fixed = int_or_none(nodes)  # an elastic range has no one world size
    return {"nodes": nodes, "world size": p.nproc * fixed if p.nproc is not None and fixed is not None else None,
            # its file name: a relative and an absolute path of one script are one script
            "script": os.path.basename(command.script) if command.script else None, "port": p.job_port}


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """{what: (mine, theirs)} for each value of job_of known on both sides that differs."""
    return {k: (v, theirs.get(k)) for k, v in mine.items()
            if v is not None and theirs.get(k) is not None and v != theirs[k]}


@dataclass
class OtherJob:
    """A launcher holding the job's port that belongs to another job (RUN008 names it; the other RUN checks leave
    it out of the job)."""

    proc: Proc
    differs: Dict[str, Tuple[Any, Any]]  # what of its job (job_of) is not the first other node's: {what: (its, theirs)}
    older_s: Optional[float]  # how long before the other nodes' launchers it started


def other_jobs(census: Census) -> List[OtherJob]:
    """The launchers that hold the master port but are not of the job the other nodes run: a launcher left from an
    earlier run keeps the port, the new launcher on its node stops on EADDRINUSE, and the other nodes join the old
    store. It is another job when its job (job_of) is none of the other nodes' launchers', whatever its age. A
    command cut by its node is not known to differ; one that differs only in what job_of leaves out (script
    arguments, restarts, logs) makes the same rendezvous with them, so it is the job they run."""
    census._index()
    if census._other_jobs is None:
        census._other_jobs = _other_jobs(census)
    return list(census._other_jobs)


def _other_jobs(census: Census) -> List[OtherJob]:
    holders = [p for p in census.launchers if p.listens]
    if not holders:
        return []
    # Each launcher's job once, then per holder the other nodes' as counts less its own node's: every node may
    # hold the port (each launched as node rank 0), and a walk of the others for each holder is nodes x nodes.
    jobs = {id(p): job_of(p) for p in census.launchers}
    kinds: Dict[Any, int] = Counter()
    on_node: Dict[str, Counter] = {}
    oldest: Dict[str, float] = {}
    firsts: Dict[str, Proc] = {}  # node -> its first launcher: the first two nodes' give "the first other node"
    for p in census.launchers:
        kind = _frozen(jobs[id(p)])
        kinds[kind] += 1
        on_node.setdefault(p.node, Counter())[kind] += 1
        firsts.setdefault(p.node, p)
        if isinstance(p.age_s, (int, float)):
            oldest[p.node] = max(oldest.get(p.node, p.age_s), p.age_s)
    two_firsts, two_oldest = list(firsts.items())[:2], sorted(oldest.items(), key=lambda item: -item[1])[:2]
    found = []
    for holder in holders:
        mine, own = jobs[id(holder)], on_node[holder.node]
        theirs = [kind for kind, count in kinds.items() if count > own[kind]]
        if not theirs or mine is None or None in theirs:
            continue
        if all(differences(mine, dict(kind)) for kind in theirs):
            first = next(p for node, p in two_firsts if node != holder.node)
            ages = [age for node, age in two_oldest if node != holder.node][:1]
            older = holder.age_s - ages[0] if isinstance(holder.age_s, (int, float)) and ages else None
            found.append(OtherJob(holder, differences(mine, jobs[id(first)]), older))
    return found


def _frozen(job: Optional[Dict[str, Any]]) -> Optional[tuple]:
    return tuple(job.items()) if job is not None else None


def of_other_jobs(census: Census) -> set:
    """(node, pid) of the launchers other_jobs finds and of their ranks."""
    gone = {(o.proc.node, o.proc.pid) for o in other_jobs(census)}
    return gone | {(p.node, p.pid) for p in census.procs if (p.node, p.ppid) in gone} if gone else gone


def meets_on_itself(census: Census, p: Proc) -> bool:
    """Whether launcher p waits for a store on its own node that no process there hosts: its master address is
    loopback (known, not guessed: its flag, its config, or torchrun's default with no PET_MASTER_ADDR), its
    static rendezvous makes it a client (node rank other than 0: static_tcp_rendezvous.py, is_master = rank == 0)
    in a job of more than one node, and no launcher on its node has node rank 0 or listens on its port (two
    launchers of one job on one machine meet on loopback)."""
    if p.kind != "launcher" or p.rdzv != "static" or not is_loopback(p.master_addr) or p.master_from is None:
        return False
    nodes = expected_nodes(p.nnodes)
    if p.node_rank in (None, 0) or nodes is None or nodes < 2:
        return False
    return not any(q.node_rank == 0 or q.listens_on(p.master_port) for q in census.on(p.node, "launcher"))


class Addresses:
    """node_at for many addresses over the same facts (a check asks for every process of the job): each node's
    names and addresses indexed once, on the first question, where node_of_address scans every node each time."""

    def __init__(self, facts: Mapping[str, Any]):
        self.facts = facts
        self._index: Optional[Dict[str, str]] = None
        self._loopback: Dict[str, bool] = {}

    def node_at(self, address: Any, seen_from: str) -> Optional[str]:
        if not address:
            return None
        if not isinstance(address, str):  # not a name: compared as node_of_address compares it
            return node_at(self.facts, address, seen_from)
        if address not in self._loopback:
            self._loopback[address] = is_loopback(address)
        if self._loopback[address]:
            return seen_from
        if self._index is None:
            self._index = self._indexed()
        return self._index.get(address)

    def _indexed(self) -> Dict[str, str]:
        """name or address -> the first node that has it, in node_of_address's order."""
        index: Dict[str, str] = {}
        for node, state in self.facts.items():
            node_facts = (state or {}).get("facts")
            host = node_facts.get("host") if isinstance(node_facts, dict) else None
            if not isinstance(host, dict):
                continue
            interfaces = host.get("interfaces") if isinstance(host.get("interfaces"), dict) else {}
            for key in (node, host.get("hostname"), host.get("fqdn"), *(
                    a for held in interfaces.values() if isinstance(held, list) for a in held)):
                if isinstance(key, str):
                    index.setdefault(key, node)
        return index


def hosts_in_use(census: Census) -> set:
    """The nodes a DeepSpeed runner among the launchers starts ranks on, after its --include, --exclude and
    --num_nodes (deepspeed/launcher/runner.py main: parse_resource_filter, apply_num_nodes_and_gpus); every
    node without one. The slots are not known here: a filter by slot keeps its host."""
    from preflight.inputs.configs import MAX_SLOTS, runner_resources

    used = set()
    for p in census.launchers:
        launcher, command = _launch_of(p)
        if launcher != "deepspeed":
            continue
        if command is None:  # its filter was in the words its node did not send: any node may be one of its
            return set(census.nodes)
        text = {k: command.get(k) if isinstance(command.get(k), str) else "" for k in ("include", "exclude")}
        num_nodes = command.integer("num_nodes")
        hosts, _ = runner_resources({n: MAX_SLOTS for n in census.nodes}, text["include"], text["exclude"],
                                    num_nodes if num_nodes is not None else -1)
        if hosts is None:  # the runner stops on its filter: it started nothing anywhere
            continue
        used.update(hosts)
    return used or set(census.nodes)


def expected_nodes(nnodes: Optional[str]) -> Optional[int]:
    """The nodes a rendezvous needs to complete from --nnodes N or MIN:MAX (elastic: MIN; run.py's
    parse_min_max_nnodes), None when it is not a number."""
    try:
        return int(str(nnodes).split(":")[0])
    except ValueError:
        return None


def table(census: Census) -> List[dict]:
    """One row per process: what `doctor` shows (terminal, --json evidence, HTML)."""
    rows, order = [], {node: i for i, node in enumerate(census.nodes)}
    with_gpu = any(q.gpu for q in census.procs)
    last, text = None, None  # the ranks of a node mostly share one Where: its text once
    for p in sorted(census.procs, key=lambda p: (order.get(p.node, 0), p.kind != "launcher",
                                                 p.rank if p.rank is not None else -1)):
        if p.where is not last:
            last, text = p.where, p.where.text()
        # Every key in one literal (a dict made whole, not grown past its size: 147,439 rows at 16,384 nodes); the
        # GPU column only where some process holds a GPU.
        row = {"node": p.node, "pid": p.pid, "kind": p.launcher or p.kind, "node_rank": p.node_rank,
               "rank": p.rank, "world": p.world_size if p.kind == "rank" else (f"{p.nnodes} nodes" if p.nnodes else None),
               "master": f"{p.master_addr}:{p.master_port}" if p.master_addr or p.master_port else None,
               "state": p.state, "cpu": f"{p.cpu_percent:g}%" if isinstance(p.cpu_percent, (int, float)) else None,
               "age": f"{p.age_s:.0f}s" if isinstance(p.age_s, (int, float)) else None, "gpu": p.gpu, "where": text}
        if not with_gpu:
            del row["gpu"]
        rows.append(row)
    return rows
