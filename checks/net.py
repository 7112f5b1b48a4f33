"""NET: names, interfaces, the main port and its reachability."""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, replace
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

from preflight.api import Finding, Status, cause_of, check, fail, odd_ones_out, passed, skip
from preflight.inputs import launchcmd
from preflight.report import redact
from preflight.node import PROGRAM_MARK
from preflight.collective import datapath
from preflight.job.nccl import NcclEnv, choice_unknown, interface_spec, nccl_env_of, nccl_interfaces, nccl_list, \
    nccl_matches, selected_interfaces


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def _head_target(ctx) -> str:
    """What the nodes resolved as the head: main_process_ip, else the head's address as SSH reaches it."""
    return (ctx.probes.get("head") or {}).get("address") or ctx.plan.main_address or ctx.plan.head


def _multi_node(ctx) -> bool:
    accel = ctx.plan.accelerate
    machines = accel.integer("num_machines") if accel is not None else None
    return ctx.plan.remote or bool(machines and machines > 1)


@check("NET001", "hostname-resolution", "node", tags=["network", "dns"])
def hostname_resolution(ctx) -> Iterator[Finding]:
    """The node's own hostname resolves to an address of one of its interfaces, not to loopback.

    gloo, torch.distributed and DeepSpeed's launcher announce the address the hostname resolves to; on
    Debian and Ubuntu /etc/hosts maps it to 127.0.1.1, so the other nodes are told to connect to a dead
    address and the rendezvous hangs until its timeout.

    In /etc/hosts (or DNS), map the hostname to the node's address on the training network, not 127.0.1.1,
    or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to that network's interface.
    """
    host = ctx.fact.get("host", {})
    name, addresses = host.get("hostname"), host.get("resolves_to")
    if isinstance(addresses, dict) or not addresses:
        yield fail(f"hostname {name!r} does not resolve ({(addresses or {}).get('error', 'no address')})",
                   f"add {name} with the node's address to /etc/hosts or DNS", hostname=name)
        return
    routable = [a for a in addresses if not _is_loopback(a)]
    own = {a for addrs in host.get("interfaces", {}).values() for a in addrs}
    if not routable:
        if not _multi_node(ctx):
            yield passed(f"hostname {name!r} resolves to {addresses[0]} (loopback: fine for a one-node job)",
                         hostname=name, addresses=addresses)
            return
        yield fail(f"hostname {name!r} resolves to {addresses[0]}, a loopback address: the other nodes would be "
                   "told to connect to it", f"map {name} to its training-network address in /etc/hosts "
                   f"(not {addresses[0]})", hostname=name, addresses=addresses)
    elif not any(a in own for a in routable):
        yield fail(f"hostname {name!r} resolves to {', '.join(routable)}, which is not an address of this node "
                   f"(it has {', '.join(sorted(own - {'127.0.0.1', '::1'})) or 'none'})",
                   f"correct the entry for {name} in /etc/hosts or DNS", hostname=name, addresses=addresses)
    else:
        yield passed(f"hostname {name!r} resolves to {routable[0]}, an address of this node", hostname=name,
                     addresses=addresses)


@check("NET002", "head-resolution", "cluster", tags=["network", "dns"])
def head_resolution(ctx) -> Iterator[Finding]:
    """Every node resolves the head (main_process_ip, else the first node's name) to the same address.

    Each worker connects to the address it resolves; one node with a stale /etc/hosts entry or another
    DNS view connects elsewhere and the rendezvous waits for it until the timeout.

    Make the head's name resolve the same everywhere (same /etc/hosts entry or DNS), or set
    main_process_ip to the head's IP address.
    """
    if not ctx.plan.remote:
        yield skip("this machine alone: no other node resolves the head")
        return
    target = _head_target(ctx)
    resolved = {}
    for node in ctx.reachable:
        addresses = ctx.facts[node]["facts"].get("host", {}).get("head_resolves_to")
        if not isinstance(addresses, list) or not addresses:
            yield Finding(Status.FAIL, f"cannot resolve the head {target!r}",
                          f"add {target} to /etc/hosts or DNS on {node}", nodes=(node,))
            continue
        resolved[node] = addresses[0]
    majority, odd = odd_ones_out(resolved, ctx.plan.head)
    for node, address in odd.items():
        yield Finding(Status.FAIL, f"resolves the head {target!r} to {address}, the others to {majority}",
                      f"make {target} resolve to {majority} on {node} (/etc/hosts or DNS)", nodes=(node,),
                      evidence={"address": address, "expected": majority})
    agreeing = [n for n in resolved if n not in odd]
    if agreeing:
        yield Finding(Status.PASS, f"the head {target!r} resolves to {majority}", nodes=tuple(agreeing),
                      evidence={"address": majority})


# --- who holds the main port --------------------------------------------------------------------------

# Console scripts that start a launcher agent (`python .../bin/torchrun ...` as /proc shows them).
LAUNCHER_SCRIPTS = frozenset(("torchrun", "accelerate", "accelerate-launch", "deepspeed"))
DS_NODE_LAUNCH = "deepspeed.launcher.launch"  # what DeepSpeed's runner starts on each node: torchrun-like
ENV_WORD = launchcmd.ENV_ASSIGNMENT
LOCAL_RANK_ARG = re.compile(r"^--local[-_]rank(=(\d+))?$")


redact_argv = redact.argv
REDACTED = redact.REDACTED


def redact_holder(holder: Mapping) -> dict:
    """A holder from the collector with its command lines redacted (what evidence may carry)."""
    shown = dict(holder)
    argv = holder.get("argv")
    shown["argv"] = redact_argv(argv) if argv else []
    shown["command"] = " ".join(redact_argv(argv if argv else (holder.get("command") or "").split()))[:200]
    if holder.get("parent_argv"):
        shown["parent_argv"] = redact_argv(holder["parent_argv"])
    return shown


def _one_line(words: Sequence[str], limit: int = 200) -> str:
    """A command line as shown in a message: redacted, on one line, at most `limit` characters."""
    words = redact_argv(words)
    text = " ".join(w if w and not re.search(r"[\s'\"]", w) or w == REDACTED else shlex.quote(w) for w in words)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[:limit - 4].rstrip() + " ..."


@dataclass(frozen=True)
class Launch:
    """A launcher agent's command line: which launcher, the words from its name on, and what it says of
    the job (None: not on the command line, e.g. in accelerate's config file)."""

    launcher: str  # torchrun, accelerate, deepspeed, deepspeed.launcher.launch
    words: Tuple[str, ...]
    node_rank: Optional[int] = None
    nnodes: Optional[str] = None  # as given: "2", or "1:4" for an elastic torchrun
    master: Optional[str] = None  # address:port of the rendezvous, as given

    @property
    def min_nodes(self) -> Optional[int]:
        first = (self.nnodes or "").split(":")[0].strip()
        return int(first) if first.isdigit() else None

    @property
    def agent(self) -> bool:
        """It holds the rendezvous itself and starts its ranks only once every node has joined."""
        return self.launcher in ("torchrun", "accelerate")

    def where(self) -> str:
        rank = f"node rank {self.node_rank}" if self.node_rank is not None else "node rank not on its command line"
        return rank + (f" of {self.nnodes} nodes" if self.nnodes else "")


def launch_of(argv: Sequence[str]) -> Optional[Launch]:
    """The launcher agent a command line runs (accelerate launch, torchrun, python -m torch.distributed.run,
    DeepSpeed's runner, python -m deepspeed.launcher.launch), or None."""
    argv = [str(a) for a in argv]
    if not argv:
        return None
    command = launchcmd.parse(argv)
    start = next((k for k, w in enumerate(argv) if w != "env" and not ENV_WORD.match(w)), 0)
    words = [os.path.basename(argv[start])] + argv[start + 1:] if start < len(argv) else []
    label = command.launcher
    if label == "python" and command.script and os.path.basename(command.script) in LAUNCHER_SCRIPTS:
        words = [os.path.basename(command.script), *command.script_args]  # python .../bin/torchrun ARGS
        command = launchcmd.parse(words)
        label = command.launcher
    elif label == "other" and words and re.fullmatch(r"python[0-9.]*", words[0]):
        for k, word in enumerate(words):
            if word in ("-m" + DS_NODE_LAUNCH,) or (word == DS_NODE_LAUNCH and words[k - 1] == "-m"):
                command, label = launchcmd.parse(["deepspeed", *words[k + 1:]]), DS_NODE_LAUNCH
                break
    if label not in ("torchrun", "accelerate", "deepspeed", DS_NODE_LAUNCH):
        return None
    names = {"torchrun": ("node_rank", "nnodes", "master_addr", "master_port"),
             "accelerate": ("machine_rank", "num_machines", "main_process_ip", "main_process_port"),
             "deepspeed": ("node_rank", "num_nodes", "master_addr", "master_port"),
             DS_NODE_LAUNCH: ("node_rank", None, "master_addr", "master_port")}[label]
    nnodes = command.get(names[1]) if names[1] else _world_info_nodes(command.get("world_info"))
    address, port = command.get(names[2]), command.get(names[3])
    master = f"{address or '?'}:{port or '?'}" if isinstance(address, str) or isinstance(port, str) else None
    if master is None and isinstance(command.get("rdzv_endpoint"), str):
        master = command.get("rdzv_endpoint")
    return Launch(label, tuple(words), command.integer(names[0]), nnodes if isinstance(nnodes, str) else None, master)


def _world_info_nodes(value) -> Optional[str]:
    """How many nodes deepspeed.launcher.launch's --world_info names (base64 JSON {host: [slots]})."""
    if not isinstance(value, str):
        return None
    try:
        import base64

        return str(len(json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))))
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Holder:
    """A process that holds the main port, as far as its command line, parent and job variables tell."""

    pid: int
    shown: str  # its command line, redacted, on one line
    launch: Optional[Launch] = None  # it is this launcher agent
    parent: Optional[Launch] = None  # it is a rank process started by this launcher
    ppid: Optional[int] = None
    rank: Optional[str] = None  # "rank 3" (RANK) or "local rank 0" (LOCAL_RANK, --local_rank) of a rank process
    rank_evidence: Optional[str] = None  # how we know it is a rank of a job, None when it is not known
    children: Optional[int] = None
    preflight: bool = False  # preflight's own program: another run's agent (its NET004 listener) or all-reduce

    @property
    def of_a_job(self) -> bool:
        return self.launch is not None or self.rank_evidence is not None

    @property
    def waiting(self) -> Optional[bool]:
        """True: a launcher agent of a multi-node job that has started no ranks (it waits in the rendezvous
        for nodes that never joined); False: it is not waiting; None: its command line cannot tell."""
        launch = self.launch
        if launch is None or not launch.agent or launch.min_nodes is None or self.children is None:
            return None
        return launch.min_nodes > 1 and self.children == 0

    def describe(self) -> str:
        if self.launch is not None:
            text = f"{_one_line(self.launch.words)} (pid {self.pid}, {self.launch.where()})"
            if self.waiting:
                others = self.launch.min_nodes - 1
                nodes = "the other node" if others == 1 else f"the other {others} nodes"
                return text + f"; it has started no ranks: it waits for {nodes} of the job, which never joined"
            if self.children:
                return text + f"; it runs {self.children} process(es)"
            return text
        rank = self.rank or "a rank"
        if self.parent is not None:
            return (f"{rank} ({self.shown}, pid {self.pid}) of a job started by {_one_line(self.parent.words)} "
                    f"(pid {self.ppid}, {self.parent.where()})")
        return f"{rank} ({self.shown}, pid {self.pid}; {self.rank_evidence})"

    def remediation(self) -> str:
        if self.launch is not None:
            stop = f"kill {self.pid} (the {self.launch.launcher} launcher: its ranks stop with it)"
        elif self.parent is not None:
            stop = f"kill {self.ppid} (its launcher, {self.parent.launcher}: every rank stops with it)"
        else:
            stop = f"kill {self.pid}, and the launcher that started it (so that the job's other ranks stop too)"
        if self.waiting:
            missing = [r for r in range(self.launch.min_nodes) if r != self.launch.node_rank]
            ranks = (f" (node rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
                     f"{', ...' if len(missing) > 8 else ''})" if self.launch.node_rank is not None else "")
            wait = f"it is waiting for nodes that never joined: start the job on the other node(s){ranks}, or stop it"
        elif self.waiting is False:
            wait = ""
        else:
            wait = "if it waits for other nodes, they never joined: start the job on them, or stop it"
        return f"if that job should not be running, stop it: {stop}; " + (f"{wait}; " if wait else "") + \
            "or choose another main_process_port"

    def evidence(self) -> dict:
        launch = self.launch or self.parent
        found = {"pid": self.pid, "kind": "launcher" if self.launch is not None else "rank",
                 "waiting_for_nodes": self.waiting, "children": self.children}
        if launch is not None:
            found.update(launcher=launch.launcher, launcher_pid=self.pid if self.launch is not None else self.ppid,
                         node_rank=launch.node_rank, nnodes=launch.nnodes, master=launch.master)
        if self.launch is None:
            found.update(rank=self.rank, known_by=self.rank_evidence)
        return found


def classify_holder(holder: Mapping, port: int) -> Holder:
    """What a holder from the collector is: a launcher agent (its command line says which), a rank process
    of a running job (only when its launcher, its job variables or a --local_rank argument say so), or a
    process we cannot tell anything about."""
    argv = list(holder.get("argv") or ())
    shown = _one_line(argv or (holder.get("command") or "").split())
    base = dict(pid=holder.get("pid"), shown=shown, ppid=holder.get("ppid"), children=holder.get("children"))
    if any(isinstance(a, str) and a.startswith(PROGRAM_MARK) for a in argv[1:4]):  # python [-u] -c PROGRAM
        return Holder(preflight=True, **base)
    launch = launch_of(argv) if argv else None
    if launch is not None:
        return Holder(launch=launch, **base)
    env = holder.get("env") or {}
    parent = launch_of(holder.get("parent_argv") or ())
    local_rank = next((m.group(2) or (argv[k + 1] if k + 1 < len(argv) else None)
                       for k, m in ((k, LOCAL_RANK_ARG.match(a)) for k, a in enumerate(argv)) if m), None)
    rank = (f"rank {env['RANK']}" if env.get("RANK") else f"local rank {env['LOCAL_RANK']}" if env.get("LOCAL_RANK")
            else f"local rank {local_rank}" if local_rank is not None else None)
    if parent is not None:
        evidence = f"started by {parent.launcher}"
    elif "RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        evidence = "its environment has the RANK a launcher gives its ranks"
    elif env.get("MASTER_PORT") == str(port):
        evidence = f"its environment has MASTER_PORT={port}"
    elif local_rank is not None:
        evidence = "it was given --local_rank, as a launcher starts its ranks"
    else:
        return Holder(**base)
    return Holder(parent=parent, rank=rank, rank_evidence=evidence, **base)


@check("NET003", "main-port-free", "cluster", tags=["network", "port"])
def main_port_free(ctx) -> Iterator[Finding]:
    """The main port is free on the head.

    The head's rank 0 binds the main port for the rendezvous (the TCPStore); when another process holds it,
    accelerate stops with 'port in use' or, worse, the workers talk to the old job's store and hang. The
    holder is often an earlier job still running, or stuck in its rendezvous waiting for nodes that never
    joined: the message names its launcher (accelerate, torchrun, deepspeed), node rank and number of nodes.

    Stop the process that holds the port (the message names it; for a job, kill its launcher's PID so that
    every rank stops), start the nodes a waiting job expects, or choose another main_process_port.
    """
    probe = (ctx.probes or {}).get("port") or {}
    listen, head, port = probe.get("listen"), probe.get("head", ctx.plan.head), probe.get("number", ctx.plan.port)
    if listen is None:
        yield skip(f"the head {head} was not reached", blocked_by=cause_of(ctx, head))
        return
    if listen.get("bound"):
        yield Finding(Status.PASS, f"port {port} is free on the head {head}", nodes=(head,), evidence={"port": port})
        return
    raw = listen.get("holders") or []
    found = [classify_holder(h, port) for h in raw]
    shown = [redact_holder(h) for h in raw]
    runs = [h for h in found if h.preflight]
    if runs:  # the port is free for the job once that run ends: nothing about the nodes is judged
        yield Finding(Status.ERROR, f"port clash, not judged: port {port} on the head {head} is held by another "
                      f"preflight run checking this node (pid {runs[0].pid}, its temporary listener or its "
                      "all-reduce); it frees the port when it ends, within its --timeout",
                      "run again when the other run has ended, or give this run another --port",
                      evidence={"port": port, "holders": shown})
        return
    jobs = [h for h in found if h.of_a_job]
    if not jobs:
        held = "; ".join(f"pid {h.pid} ({h.shown or '?'})" for h in found) or "a process this user cannot see"
        yield Finding(Status.FAIL, f"port {port} on the head {head} is taken ({listen.get('error')}): held by {held}",
                      f"stop {'pid ' + str(found[0].pid) if found else 'that process'}, or set main_process_port "
                      "to a free port", nodes=(head,), evidence={"port": port, "holders": shown})
        return
    job = jobs[0]
    others = "".join(f"; also held by pid {h.pid} ({h.shown or '?'})" for h in found if h is not job)
    yield Finding(Status.FAIL, f"port {port} on the head {head} is held by a running job: {job.describe()}{others}",
                  f"{job.remediation()}; to see why that job is stuck on each of its nodes: preflight doctor "
                  f"--port {port} with its nodes (--hosts, --slurm-job)", nodes=(head,),
                  evidence={"port": port, "holders": shown, "job": job.evidence()})


@check("NET004", "main-port-reachable", "cluster", tags=["network", "port", "firewall"])
def main_port_reachable(ctx) -> Iterator[Finding]:
    """Every worker can open a TCP connection to the main port on the head (a temporary listener there).

    A firewall or security group that drops the port makes every rank wait in the rendezvous until the
    10-30 minute timeout, with no error that names the cause.

    Open the main port (and the NCCL/gloo port range) between the nodes in the firewall, or choose a port
    that is open; check that main_process_ip is the head's address on a network the workers reach.
    """
    probe = (ctx.probes or {}).get("port") or {}
    if not ctx.plan.remote:
        yield skip("this machine alone: no worker connects to the head")
        return
    listen = probe.get("listen")
    if listen is None:  # the head was not reached: nothing listened
        head = probe.get("head", ctx.plan.head)
        yield skip(f"no listener: the head {head} was not reached", blocked_by=cause_of(ctx, head))
        return
    if not listen.get("bound"):
        yield skip("no listener on the head (see NET003)", blocked_by="NET003")
        return
    port, head, ok = probe.get("number", ctx.plan.port), probe.get("head"), []
    for node, answer in sorted(probe.get("workers", {}).items()):
        if answer.get("ok"):
            ok.append(node)
            continue
        yield Finding(Status.FAIL, f"cannot connect to the head {head} at {answer.get('address')}:{port}: "
                      f"{answer.get('error')}", f"open TCP port {port} on {head} to {node} (firewall, security group), "
                      "or use an address of the head that the workers reach", nodes=(node,),
                      evidence={"address": answer.get("address"), "port": port, "error": answer.get("error")})
    if ok:
        yield Finding(Status.PASS, f"connect to the head {head} on port {port}", nodes=tuple(ok), evidence={"port": port})
    elif not probe.get("workers"):
        yield skip("no worker node was reached")


def _network_to_head(host: Mapping, links: Optional[Mapping]):
    """(the network of the address this node reaches the head from, the interface, the address) or
    (None, why it is not known)."""
    import ipaddress

    route = host.get("route_to_head")
    if not isinstance(route, dict) or not route.get("source"):
        return None, "the route to the head is not known (see NET006)"
    source, via = route["source"], route.get("interface")
    if _is_loopback(source):
        return None, "this node reaches the head over loopback"
    names = ([via] if via in links else []) + [n for n in links if n != via]
    for name in names:
        link = links.get(name) or {}
        for entry in (link.get("ipv4") or []) + (link.get("ipv6") or []):
            if not isinstance(entry, str) or not entry.startswith(source) or entry.split("/", 1)[0] != source:
                continue  # parse only the address it reaches the head from: thousands of nodes, several each
            try:
                address = ipaddress.ip_interface(entry)
            except ValueError:
                continue
            return (address.network, name, source), None
    return None, f"the address {source} it reaches the head from has no netmask in the facts"


def _judge_link(name: str, link: Mapping, network) -> Optional[str]:
    """What is wrong with an interface for traffic to the head, None when nothing is."""
    import ipaddress

    if link.get("up") is False:
        return f"{name} is DOWN"
    if link.get("running") is False:
        return f"{name} is UP but has no carrier (NO-CARRIER)"
    if network is None:
        return None
    addresses = [a for a in (link.get("ipv4") or []) + (link.get("ipv6") or [])]
    inside = []
    for entry in addresses:
        try:
            inside.append(ipaddress.ip_interface(entry).ip in network)
        except ValueError:
            continue
    if not any(inside):
        have = ", ".join(a for a in addresses if not a.startswith("fe80:")) or "no address"
        return f"{name} ({have}) is not on {network}"
    return None


@check("NET005", "socket-ifname", "node", tags=["network", "nccl", "gloo"])
def socket_ifname(ctx) -> Iterator[Finding]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, when set, select an existing interface with an address; unset on
    a node with GPUs, NCCL's own choice is on the network to the head.

    NCCL and gloo bind to the interfaces these name (NCCL by prefix, `=` for an exact name, `^` to exclude);
    a name that matches nothing on one node makes NCCL fail with 'no socket interface found' or gloo
    hang, on that node only. They may differ between nodes (interfaces are named per node), so PKG004
    does not compare their text: here the selected interface must also be UP and have an address on the
    network this node reaches the head through, and NCCL_IB_HCA must name RDMA devices this node has
    (else NCCL falls back to TCP sockets, or fails, on this node only). Unset, NCCL picks by its own rules (an
    ib* interface first, else the first but docker*, lo and virbr* in the kernel's order, IPv4 before IPv6): an
    IPoIB interface with only a link-local address, a management NIC or a container bridge that comes first puts
    the address every other rank connects to where they may not reach it. Since 2.28.3 NCCL also skips an
    interface without carrier and sets virbr* apart: where the node's NCCL is not known and the two rules pick
    differently, its choice is not judged. NCCL also reads its variables from
    files (the one NCCL_CONF_FILE names, else ~/.nccl.conf, then /etc/nccl.conf; the environment wins): a value
    from one is judged as NCCL reads it and named with its file and line.

    Set them to the interface of the training network as it is named on each node (`ip -br addr`),
    e.g. NCCL_SOCKET_IFNAME=eth0 or ==eth0 (that name exactly); bring a DOWN interface up (`ip link set IF up`);
    set NCCL_IB_HCA to this node's HCAs (`ibv_devices`), or unset it; a value from a file is changed there.
    """
    nccl_vars = nccl_env_of(ctx)  # the environment, and what NCCL's files (~/.nccl.conf, ...) add to it
    env = nccl_vars.values
    host = ctx.fact.get("host", {})
    interfaces: Mapping[str, list] = host.get("interfaces", {})
    usable = [n for n, addrs in interfaces.items() if addrs]
    links = host.get("links")
    links = links if isinstance(links, dict) and "error" not in links else None
    found = False
    for var, nccl in (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False)):
        spec = interface_spec(env, var)
        if spec is None:  # unset, or too short to select anything: NCCL and gloo use their default
            continue
        found = True
        chosen = selected_interfaces(spec, usable, nccl)
        if not chosen:
            yield _from_file(fail(f"{var}={spec} selects no interface with an address (this node has "
                                  f"{', '.join(usable)})", f"set {var} to one of: "
                                  f"{', '.join(n for n in usable if n != 'lo') or ', '.join(usable)}",
                                  variable=var, value=spec, interfaces=usable), nccl_vars, var)
            continue
        yield _from_file(_judge_selection(ctx, var, spec, nccl, chosen, interfaces, host, links), nccl_vars, var)
    if (ctx.fact.get("gpus") or {}).get("available") and interface_spec(env, "NCCL_SOCKET_IFNAME") is None:
        found = True  # the ranks here run NCCL: its default choice decides the address the others connect to
        yield _judge_nccl_default(ctx, host, links, nccl_vars.unread)
    hca = env.get("NCCL_IB_HCA")
    if hca is not None:
        found = True
        yield _from_file(_judge_ib_hca(ctx, hca, host.get("rdma_devices")), nccl_vars, "NCCL_IB_HCA")
    if not found:
        yield skip("none of NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA is set (and no GPU for NCCL here)")


def _from_file(finding: Finding, nccl_vars: NcclEnv, var: str) -> Finding:
    """The finding, naming the file and line of NCCL's configuration that set `var` where one did: that is where
    the user changes it (the environment wins over the file: setting it there works too)."""
    where = nccl_vars.sources.get(var)
    if where is None:
        return finding
    said = f"{var}={nccl_vars.values[var]}"
    fix = f"{finding.remediation} ({var} comes from {where}: change it there, or set it in the job's environment, " \
        "which NCCL reads first)" if finding.remediation else None
    if said.endswith("\r"):  # a file with Windows line ends: NCCL before 2.30 keeps the CR in the value
        fix = f"{fix}; the file ends its lines with CR LF, and this NCCL keeps the CR in the value: `dos2unix " \
            f"{where.rsplit(' line ', 1)[0]}`"
    message = finding.message.replace(said, f"{said} (from {where})", 1).replace("\r", "\\r")
    return replace(finding, message=message, remediation=fix, evidence=dict(finding.evidence, source=where))


# Interfaces container runtimes and CNI plugins make (NCCL's default sets apart only docker*, lo and virbr*)
CONTAINER_BRIDGES = ("cni", "flannel", "cali", "cilium", "br-", "veth", "lxc", "podman", "kube", "weave")


def _judge_nccl_default(ctx, host: Mapping, links: Optional[Mapping], unread: Sequence[str]) -> Finding:
    """NCCL's own choice, NCCL_SOCKET_IFNAME unset: the interface it bootstraps over holds the address every other
    rank connects to, so it must be on the network the nodes reach each other over."""
    import ipaddress

    if unread:  # a file NCCL reads may set NCCL_SOCKET_IFNAME: its choice is not known
        return skip(f"NCCL_SOCKET_IFNAME is unset in the environment, and NCCL's configuration could not be read "
                    f"({'; '.join(unread)}): the interface NCCL picks is not judged", unread=list(unread))
    unknown = choice_unknown(ctx.fact)
    if unknown:
        return skip(f"NCCL_SOCKET_IFNAME is unset, and the interface NCCL picks is not judged: {unknown}",
                    rule=unknown)
    chosen, rule = nccl_interfaces(ctx.fact)
    if not chosen:
        return fail(f"NCCL_SOCKET_IFNAME is unset and NCCL's default finds no interface with an address here "
                    f"({rule}): NCCL stops with 'no socket interface found'",
                    f"bring the training interface up on {ctx.node}, or set NCCL_SOCKET_IFNAME to it")
    name, address = chosen[0]
    said = f"NCCL_SOCKET_IFNAME is unset: NCCL bootstraps over {name} ({address}), {rule}"
    evidence = {"variable": "NCCL_SOCKET_IFNAME", "value": None, "interfaces": [n for n, _ in chosen],
                "address": address, "rule": rule}
    if links is None:
        return passed(f"{said} (the head's network not checked: these facts have no host.links)", **evidence)
    found, why = _network_to_head(host, links)
    if not found:
        return passed(f"{said} (the head's network not checked: {why})", **evidence)
    network, route_interface, source = found
    evidence.update(network=str(network), route_interface=route_interface, source=source)
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # what the node sent is no address: not judged
        return skip(f"NCCL_SOCKET_IFNAME is unset: NCCL bootstraps over {name}, whose address {address!r} does not "
                    "parse", **evidence)
    if ip in network:
        return passed(f"{said}: on {network}, the network this node reaches the head over", **evidence)
    if ip.is_link_local:
        why = "a link-local address: it reaches only the hosts on that one link"
    elif name.startswith(CONTAINER_BRIDGES):
        why = "a container network's bridge: each node's is its own, which the other nodes do not reach"
    else:  # a second network every node may have (IPoIB, a dedicated fabric): NET009 probes it from the others
        return passed(f"{said}, not {network} (the network to the head): the other ranks connect to {address} "
                      "(NET009 probes it from the other nodes)", **evidence)
    return Finding(Status.WARN, f"{said}, which is not on {network}, the network this node reaches the head "
                   f"{_head_target(ctx)} over from {source} on {route_interface} ({why}): every other rank connects "
                   f"to {address}", f"set NCCL_SOCKET_IFNAME=={route_interface} on {ctx.node} (the interface to the "
                   "head)", evidence=evidence)


def _judge_selection(ctx, var: str, spec: str, nccl: bool, chosen: List[str], interfaces: Mapping,
                     host: Mapping, links: Optional[Mapping]) -> Finding:
    selected = ", ".join(f"{c} ({interfaces[c][0]})" for c in chosen)
    evidence = {"variable": var, "value": spec, "interfaces": chosen}
    if links is None:
        return passed(f"{var}={spec} selects {selected} (UP state and the head's network not checked: these "
                      "facts have no host.links, from an older collector)", **evidence)
    found, why = _network_to_head(host, links)
    network = found[0] if found else None
    if found:
        where = f"{network} (this node reaches the head {_head_target(ctx)} from {found[2]} on {found[1]})"
        evidence.update(network=str(network), route_interface=found[1], source=found[2])
    else:
        where = None
        evidence.update(network=None, network_unknown=why)
    judged = {c: _judge_link(c, links.get(c) or {}, network) for c in chosen}
    problems = [p for p in judged.values() if p]
    good = [c for c, p in judged.items() if p is None]
    link_down = [c for c in chosen if _judge_link(c, links.get(c) or {}, None)]
    if problems and not link_down:
        # Up, but on another network than the one to the head: NCCL and gloo exchange the addresses they
        # bind through the store, so a second network (IPoIB, a dedicated fabric) works when every node has it.
        return Finding(Status.WARN, f"{var}={spec} selects {selected}, which is not on the network this node reaches "
                       f"the head over ({'; '.join(problems)}): the ranks connect to each other over it, so every node "
                       "must reach it", f"check that the other nodes reach {ctx.node} on {', '.join(chosen)} (the same "
                       "network on every node), or select the interface to the head", evidence=evidence)
    if not problems:
        tail = f"UP, on {where}" if where else f"UP; the head's network not checked: {why}"
        return passed(f"{var}={spec} selects {selected}: {tail}", **evidence)
    evidence.update(problems=problems, usable=good)
    expected = f"expected an UP interface on {where}" if where else "expected an UP interface with carrier"
    expected = expected.replace(" (this node", ": this node").rstrip(")") if where else expected
    fixes = [f"ip link set {c} up" for c in chosen
             if (links.get(c) or {}).get("up") is False and _judge_link(c, {**links[c], "up": True}, network) is None]
    target = found[1] if found else (good[0] if good else None)
    if target is None:
        fixes.append(f"set {var} to an UP interface of the training network")
    elif chosen != [target]:  # not what it already selects
        fixes.append(f"set {var}={'=' if nccl else ''}{target}" + (" (the interface to the head)" if found else ""))
    if not fixes:  # it selects the interface to the head, which has no carrier
        fixes.append(f"restore the link of {', '.join(c for c, p in judged.items() if p)} (cable, switch port; "
                     "`ip -br link` shows its state)")
    fix = " or ".join(fixes) + f" on {ctx.node}"
    if good and nccl:  # NCCL bootstraps over one of them and uses every one for its socket transport
        return Finding(Status.WARN, f"{var}={spec} selects {selected}, and {'; '.join(problems)}: NCCL may use it "
                       f"for traffic between nodes ({expected})", fix, evidence=evidence)
    return fail(f"{var}={spec} selects {selected}, but {'; '.join(problems)} ({expected})", fix, **evidence)


def _judge_ib_hca(ctx, spec: str, devices) -> Finding:
    evidence = {"variable": "NCCL_IB_HCA", "value": spec, "rdma_devices": devices}
    if not isinstance(devices, list):
        return skip(f"NCCL_IB_HCA={spec}: these facts do not list the RDMA devices", **evidence)
    if not devices:
        return Finding(Status.WARN, f"NCCL_IB_HCA={spec} is set, but this node has no RDMA device "
                       "(/sys/class/infiniband is empty): NCCL falls back to TCP sockets here",
                       f"load the RDMA driver on {ctx.node} (ibv_devices lists the HCAs), or unset NCCL_IB_HCA "
                       "there if the job is meant to run over TCP", evidence=evidence)
    exclude, exact, entries = nccl_list(spec)
    hit = [d for d in devices if nccl_matches(d, None, exact, entries)]
    if exclude:  # NCCL drops port by port: a device is gone only when an entry without a port names it
        whole = [e for e in entries if e[1] is None]
        selected = [d for d in devices if entries and not (whole and nccl_matches(d, None, exact, whole))]
    else:
        selected = hit
    evidence.update(selected=selected)
    if not exclude:
        missing = [f"{name}:{port}" if port is not None else name for name, port in entries
                   if not any(nccl_matches(d, None, exact, [(name, None)]) for d in devices)]
        if missing:
            # NCCL uses the devices that match: a list written for every node may name some this one lacks.
            status = Status.FAIL if not hit else Status.WARN
            return Finding(status, f"NCCL_IB_HCA={spec} names {', '.join(missing)}, which "
                           f"{'is' if len(missing) == 1 else 'are'} not an RDMA device of this node (it has "
                           f"{', '.join(devices)})" + ("" if hit else ": NCCL finds no HCA it may use here"),
                           f"set NCCL_IB_HCA={'=' if exact else ''}{','.join(devices)} on {ctx.node} (or the HCAs of "
                           "the training network among them), or unset it",
                           evidence=dict(evidence, missing=missing))
    if not selected:
        return Finding(Status.WARN, f"NCCL_IB_HCA={spec} excludes every RDMA device of this node "
                       f"({', '.join(devices)}): NCCL falls back to TCP sockets here",
                       f"remove the exclusion on {ctx.node}, or unset NCCL_IB_HCA", evidence=evidence)
    return passed(f"NCCL_IB_HCA={spec} selects {', '.join(selected)} (ports not checked)", **evidence)


@check("NET006", "route-to-head", "node", tags=["network"])
def route_to_head(ctx) -> Iterator[Finding]:
    """The node has a route to the head's address, and says which interface and address it uses.

    Without a route the rendezvous cannot start; a route over an unexpected interface (a management
    network, docker0) is the usual reason for slow or hanging collectives.

    Fix the node's routes, or point main_process_ip at the head's address on the training network.
    """
    host = ctx.fact.get("host", {})
    route = host.get("route_to_head")
    target = _head_target(ctx)
    if route is None:
        resolved = host.get("head_resolves_to")
        problem = resolved.get("error") if isinstance(resolved, dict) else "no address"
        yield fail(f"cannot resolve the head {target!r} ({problem})", f"make {target} resolvable on this node")
    elif "error" in route:
        yield fail(f"no route to the head {target} at {route.get('head')}: {route['error']}",
                   "add a route to the head's network, or use another main_process_ip")
    else:
        yield passed(f"reaches the head {target} at {route['head']} from {route['source']} "
                     f"via {route['interface'] or 'an unknown interface'}", **route)


# --- the data path between every pair of nodes (remote/gather.py `_probe_paths`, node/paths.py) --------------

def _paths_probe(ctx):
    """(the data-path probe, each node's facts, the route anomalies, None), or (None, None, None, why there is
    nothing to judge)."""
    if not ctx.plan.remote:
        return None, None, None, "this machine alone: there is no path between nodes"
    probe = (ctx.probes or {}).get("paths")
    if not probe:
        return None, None, None, "the data-path probe did not run"
    if not probe.get("peers"):
        return None, None, None, "fewer than two nodes answered the data-path probe"
    facts = {node: (state or {}).get("facts") or {} for node, state in (ctx.facts or {}).items()}
    return probe, facts, datapath.route_anomalies(probe, facts), None


def _port_range_text(probe, node: str) -> str:
    low_high = ((probe.get("opened") or {}).get(node) or {}).get("port_range")
    return f"{low_high[0]}-{low_high[1]}" if isinstance(low_high, list) and len(low_high) == 2 else "32768-60999"


@check("NET007", "interface-mtu", "cluster", tags=["network", "mtu"])
def interface_mtu(ctx) -> Iterator[Finding]:
    """The interface each node reaches the others over has the same MTU on every node.

    TCP announces an MSS from each end's own MTU: two nodes with jumbo frames (9000) talk in 9000-byte
    segments, which vanish where a switch or another node carries only 1500. Small messages (the rendezvous)
    pass, large ones (the first all-reduce) hang. NET008 probes what each path really carries.

    Set the same MTU on the training interface of every node (`ip link set IF mtu N`), and on the switch
    ports between them.
    """
    probe, facts, routed, why = _paths_probe(ctx)
    if probe is None:
        yield skip(why)
        return
    mtus = {n: m for n, m in (probe.get("mtu") or {}).items() if isinstance(m, int)}
    if len(mtus) < 2:
        yield skip("the MTU of the training interface is known on fewer than two nodes")
        return
    # What the paths were measured to carry decides which side is odd; without a black hole, the majority.
    carried = [m["carried"] for _, _, f in datapath.pairs(probe) for m in [f.get("mtu")]
               if isinstance(m, dict) and not m.get("ok") and m.get("carried")]
    majority, odd = odd_ones_out(mtus, ctx.plan.head)
    if carried and any(m > min(carried) for m in mtus.values()):
        majority = min(carried)
        odd = {n: m for n, m in mtus.items() if m > majority}
    for node, mtu in sorted(odd.items()):
        interface = datapath.interface_of(facts, node, probe["address"].get(node)) or "its training interface"
        than = f"the {majority} that the paths carry" if carried else f"the other nodes' {majority}"
        effect = "full-size packets from here vanish on the way (see NET008)" if carried else \
            f"{'larger' if mtu > majority else 'smaller'} packets than the others take (NET008 says whether the paths carry them)"
        yield Finding(Status.WARN, f"the MTU of {interface} is {mtu}, not {than}: {effect}",
                      f"ip link set {interface} mtu {majority} on {node}, or set {mtu} on every node and the "
                      "switch between them", nodes=(node,), evidence={"mtu": mtu, "expected": majority,
                                                                       "interface": interface, "measured": bool(carried)})
    same = sorted(n for n in mtus if n not in odd)
    if same:
        yield Finding(Status.PASS, f"the training interface has MTU {majority}", nodes=tuple(same),
                      evidence={"mtu": majority})


@check("NET008", "path-mtu", "cluster", tags=["network", "mtu"])
def path_mtu(ctx) -> Iterator[Finding]:
    """The path between every pair of nodes carries packets of the MTU both ends have (do-not-fragment
    datagrams of that size, sent from each node to a peer's answerer).

    A path that carries less than the ends' MTU (jumbo frames on the nodes, 1500 on a switch) black-holes
    TCP's full-size segments: the rendezvous and small collectives pass, the first large all-reduce hangs
    until NCCL's timeout, with no error.

    Lower the MTU of both nodes to what the path carries, or raise the MTU of the switch ports between them.
    """
    probe, facts, routed, why = _paths_probe(ctx)
    if probe is None:
        yield skip(why)
        return
    bad, good, unknown = datapath.path_mtus(probe, routed)
    for pair, seen in sorted(bad.items()):
        node, peer, mtu = seen[0]
        both = " (both ways)" if len(seen) == 2 else f" (from {node} to {peer})"
        yield Finding(Status.FAIL, f"packets of {mtu['size']} bytes, the MTU of both ends, do not pass between "
                      f"{pair[0]} and {pair[1]}{both}: the path carries {mtu['carried']}; TCP between them "
                      "negotiates segments for the larger MTU, so small messages pass and large ones hang",
                      f"set the MTU of the interface between them to {mtu['carried']} on {pair[0]} and {pair[1]} "
                      f"(ip link set IF mtu {mtu['carried']}), or make every switch port between them carry "
                      f"{mtu['size']}", nodes=pair,
                      evidence={"size": mtu["size"], "carried": mtu["carried"], "from": node, "to": peer})
    for pair, error in sorted(unknown.items()):
        yield Finding(Status.SKIP, f"path MTU between {pair[0]} and {pair[1]} not measured: {error}", nodes=pair)
    blamed = {n for pair in bad for n in pair}
    clean = sorted(good - blamed)
    if clean:
        yield Finding(Status.PASS, "the paths to the other nodes carry full-size packets of the interface's MTU",
                      nodes=tuple(clean), evidence={"probe_s": probe.get("seconds")})


@check("NET009", "ephemeral-ports", "cluster", tags=["network", "port", "firewall"])
def ephemeral_ports(ctx) -> Iterator[Finding]:
    """Every node accepts TCP connections from the others on an ephemeral port (a listener on a port the
    kernel picks from its ip_local_port_range, as NCCL and gloo pick theirs).

    A firewall opened for SSH and the main port only lets the main-port probe and the rendezvous pass; then
    the ranks cannot connect to each other and the job hangs at its first collective. NCCL and gloo bind
    port 0 (NCCL's ncclSocketListen, gloo's tcp Listener): only NCCL_COMM_ID fixes a port, that of NCCL's
    bootstrap root, and gloo has no port setting.

    Open the node's ip_local_port_range (TCP) to the other nodes in its firewall, or narrow
    net.ipv4.ip_local_port_range to a range the firewall opens.
    """
    probe, facts, routed, why = _paths_probe(ctx)
    if probe is None:
        yield skip(why)
        return
    dialled, closed, failed = datapath.dials(probe, routed)
    for target in closed:
        answers = dialled[target]
        port = ((probe.get("opened") or {}).get(target) or {}).get("tcp_port")
        ports = _port_range_text(probe, target)
        reach = "SSH and the main port reach it" if target == ctx.plan.head else "SSH reaches it"
        first = next(iter(answers.values())).get("error")
        yield Finding(Status.FAIL, f"no other node can connect to {target} on an ephemeral port ({port}, from "
                      f"its ip_local_port_range {ports}): {first}; {reach}, but NCCL and gloo also "
                      f"listen on ports {ports} (the kernel picks them; NCCL_COMM_ID fixes only NCCL's bootstrap "
                      "root port, gloo has no port setting), so the ranks cannot connect to each other",
                      f"open TCP ports {ports} on {target} to the other nodes (firewall, security group), or "
                      f"narrow net.ipv4.ip_local_port_range on {target} to a range its firewall opens",
                      nodes=(target,), evidence={"port": port, "port_range": ports, "from": sorted(answers)})
    for pair, seen in sorted(failed.items()):  # one result a pair, whichever end dialled (each end named once)
        node, target, answer = seen[0]
        others = sum(1 for a in dialled[target].values() if a.get("ok"))
        both = " (both ways)" if len(seen) == 2 else ""
        yield Finding(Status.FAIL, f"{node} cannot connect to {target} on an ephemeral port{both}: "
                      f"{answer.get('error')} ({others} other node(s) can)",
                      f"open TCP ports {_port_range_text(probe, target)} between {node} and {target}",
                      nodes=pair, evidence={"from": node, "to": target, "error": answer.get("error"),
                                            "both_ways": len(seen) == 2})
    fine = sorted(t for t, answers in dialled.items() if all(a.get("ok") for a in answers.values()))
    if fine:
        yield Finding(Status.PASS, "the other nodes connect to an ephemeral port here", nodes=tuple(fine),
                      evidence={"probe_s": probe.get("seconds")})


@check("NET010", "routes-between-nodes", "cluster", tags=["network", "route"])
def routes_between_nodes(ctx) -> Iterator[Finding]:
    """Each node reaches every other node over the same interface as it reaches the rest, from an address of
    that interface.

    A second interface, a bridge or a container network with a more specific route to part of the training
    subnet captures the traffic to some nodes: those pairs time out while every node reaches the head (a
    failure; where the peer still answers over the other way, a warning).

    Remove the route that captures the traffic (`ip route get ADDRESS` shows it), or move that network
    off the training subnet.
    """
    probe, facts, routed, why = _paths_probe(ctx)
    if probe is None:
        yield skip(why)
        return
    by_node = {}
    for (node, peer), text in sorted(routed.items()):
        by_node.setdefault(node, []).append((peer, text))
    for node, items in sorted(by_node.items()):
        peers = [p for p, _ in items]
        results = [probe["peers"][node][p] for p in peers]
        address = results[0].get("address")
        # Another way out is a failure where it loses the peer; where the peer still answers over it (two
        # rails, a routed second network) the job may run, so it is said, not refused.
        lost = [p for p, r in zip(peers, results) if datapath.lost(r)]
        captured = next((r.get("route") for r in results if r.get("route") and r.get("route") != "default"), None)
        fix = (f"on {node}: delete the route that captures it (ip route del {captured}), or take "
               f"{captured.rsplit(' dev ', 1)[-1]} off the training subnet" if captured and not captured.startswith(
                   "default") else f"on {node}: `ip route get {address}` shows the route that captures it; delete "
               "it (ip route del ...) or take that interface off the training subnet")
        yield Finding(Status.FAIL if lost else Status.WARN, "; ".join(text for _, text in items) + ": the traffic to "
                      f"{'it' if len(peers) == 1 else 'them'} leaves where the peer{'s are' if len(peers) > 1 else ' is'} "
                      "not" + ("" if lost else f", and {'it answers' if len(peers) == 1 else 'they answer'} there: "
                               "NCCL and gloo connect over it too"),
                      fix, nodes=(node,), evidence={"peers": peers, "unreachable": lost, "route": captured})
    fine = sorted(n for n in probe.get("peers", {}) if n not in by_node)
    if fine:
        yield Finding(Status.PASS, "reaches every other node over the same interface", nodes=tuple(fine))


def _shown_addresses(addresses) -> List[str]:
    return sorted(a for a in addresses if not _is_loopback(a) and not a.startswith("fe80:"))


@check("NET011", "peer-names", "cluster", tags=["network", "dns"])
def peer_names(ctx) -> Iterator[Finding]:
    """Every node resolves every other node's name (as given, and its hostname) to an address that node has.

    A stale /etc/hosts entry on one node sends what it starts by name (DeepSpeed's launcher, a MASTER_ADDR
    by name, the hostnames gloo announces) to another machine, from that node only.

    Correct the entry for the peer in /etc/hosts (or DNS) on the node that resolves it wrongly.
    """
    probe, facts, routed, why = _paths_probe(ctx)
    if probe is None:
        yield skip(why)
        return
    wrong, checked = {}, set()
    for node, peer, found in datapath.pairs(probe):
        peer_facts = facts.get(peer) or {}
        own = {a for addrs in (peer_facts.get("host", {}).get("interfaces") or {}).values() for a in addrs}
        hostname = peer_facts.get("host", {}).get("hostname")
        for name, addresses in sorted((found.get("names") or {}).items()):
            if isinstance(addresses, dict):
                if name == hostname:  # a name given only to SSH (its HostName) need not resolve elsewhere
                    wrong.setdefault(node, []).append((Status.WARN, f"cannot resolve {peer}'s hostname {name!r} "
                                                       f"({addresses.get('error')})", peer))
                continue
            if own and addresses and addresses[0] not in own:
                wrong.setdefault(node, []).append((Status.FAIL, f"resolves {name!r} to {addresses[0]}, which is not "
                                                   f"an address of {peer} ({', '.join(_shown_addresses(own))})",
                                                   peer))
        checked.add(node)
    for node, items in sorted(wrong.items()):
        status = Status.FAIL if any(s == Status.FAIL for s, _, _ in items) else Status.WARN
        yield Finding(status, "; ".join(text for _, text, _ in items),
                      f"correct the entries for {', '.join(sorted({p for _, _, p in items}))} in /etc/hosts (or DNS) "
                      f"on {node}", nodes=(node,), evidence={"peers": sorted({p for _, _, p in items})})
    fine = sorted(checked - set(wrong))
    if fine:
        yield Finding(Status.PASS, "resolves the other nodes' names to their addresses", nodes=tuple(fine))
