"""RUN: why a running job is stuck (`preflight doctor`), from the census of its launchers and ranks on
every node (preflight.node.census on the nodes, preflight.job.running here)."""
from __future__ import annotations

from collections import Counter
from itertools import groupby
from operator import attrgetter
from typing import Any, Dict, Iterator, List, Mapping, Optional

from preflight.api import Finding, Status, check, fold, grouped, odd_ones_out, skip
from preflight.job import flight
from preflight.job import ras as nccl
from preflight.job.running import (Addresses, Census, Proc, expected_nodes, hosts_in_use, is_loopback,
                                   meets_on_itself, nodes_text, of_other_jobs, other_jobs, table)
from preflight.report import redact

_NODE = attrgetter("node")  # a process's node, in C: passes over 147,439 processes at 16,384 nodes


def _census(ctx) -> Optional[Census]:
    census = (ctx.probes or {}).get("census")
    return census if isinstance(census, Census) else None


def _addresses(ctx) -> Addresses:
    """The nodes' names and addresses, indexed once for the checks that ask for every process's master."""
    return ctx.probes.setdefault("addresses", Addresses(ctx.facts))


def _gate(ctx):
    """(census, None) or (None, the skip that says why there is nothing to diagnose)."""
    census = _census(ctx)
    if census is None:
        return None, skip("no census of a running job (run `preflight doctor`)")
    if not census.procs:
        return None, skip(f"no process of a job{_on_port(census)} on any node reached")
    return census, None


def _on_port(census: Census) -> str:
    return f" on port {census.port}" if census.port else ""


def _world(census: Census) -> Optional[int]:
    """The number of nodes the job's rendezvous needs: its launchers' --nnodes (the most common; MIN of an
    elastic MIN:MAX)."""
    values = [p.nnodes for p in census.launchers if p.nnodes]
    return expected_nodes(Counter(values).most_common(1)[0][0]) if values else None


def _shown(argv, limit: int) -> str:
    """A command line for a message: redacted first, then cut (a cut inside a password would hide it from
    the redaction)."""
    return " ".join(redact.argv([str(a) for a in argv]))[:limit]


@check("RUN001", "job-processes", "cluster", tags=["doctor", "job"])
def job_processes(ctx) -> Iterator[Finding]:
    """Every node of the job runs its launcher and its ranks; the census of them (launcher, node rank,
    ranks, master, state, CPU, where each stack stands) is shown.

    A node whose launcher was never started, or exited, leaves the others waiting in the rendezvous or in
    their first collective until the timeout (10 minutes with NCCL, 30 with gloo), with nothing that says
    which node is missing.

    Start the job on the node that has none (its log says why it exited, if it did); the census table
    (terminal, --json evidence, HTML) shows where every rank stands.
    """
    census = _census(ctx)
    if census is None:
        yield skip("no census of a running job (run `preflight doctor`)")
        return
    if not census.procs:
        reached = [n for n in census.nodes if n not in census.errors]
        left = any(isinstance(f, dict) and f.get("dumps") for f in census.flight.values())  # a job that died
        yield Finding(Status.WARN, f"no launcher and no rank of a job{_on_port(census)} on {fold(reached) or 'any node'}"
                      + (": the job is gone; RUN010 reads the flight records its ranks left" if left else ""),
                      "fix what RUN010 names, then start the job again" if left else
                      "check that the job runs on these nodes (--hosts, --slurm-job) and, with --port, on that port",
                      nodes=tuple(reached))
        return
    ports = sorted({p.job_port for p in census.procs if p.job_port is not None})
    if census.port is None and len(ports) > 1:
        on_port: Dict[int, set] = {}  # one pass: a job per node would be as many passes as nodes
        for p in census.procs:
            if p.job_port is not None:
                on_port.setdefault(p.job_port, set()).add(p.node)
        jobs = "; ".join(f"port {port} on {fold(sorted(on_port[port]))}" for port in ports)
        yield Finding(Status.WARN, f"{len(ports)} jobs run on these nodes ({jobs}): the findings below mix them",
                      f"pick one with --port ({', '.join(map(str, ports))}) or --pid",
                      nodes=tuple(dict.fromkeys(map(_NODE, census.procs))), evidence={"ports": ports})
    # With --pid the nodes without a chosen process were not looked at; hosts DeepSpeed's filter leaves out run nothing.
    unused = set(census.nodes) - hosts_in_use(census)
    missing = [] if census.selected else [n for n in census.nodes if n not in census.errors and not census.has(n)
                                          and n not in unused]
    if missing:
        yield Finding(Status.FAIL, f"no launcher and no rank of the job{_on_port(census)} on {fold(missing)}: "
                      "it was never started there, or it exited; the other nodes wait for it",
                      f"start the job on {fold(missing)} (or look at its log there for why it exited)",
                      nodes=tuple(missing), evidence={"missing": missing})
    rankless = [n for n in census.nodes if census.has(n, "launcher") and not census.has(n, "rank")]
    present = tuple(n for n in census.nodes if census.has(n))
    yield Finding(Status.PASS, f"{len(census.launchers)} launcher(s) and {len(census.ranks)} rank(s) on "
                  f"{len(present)} node(s)" + (f"; {fold(rankless)} {'has' if len(rankless) == 1 else 'have'} "
                                              "a launcher but no rank yet" if rankless else ""),
                  nodes=present, evidence={"census": table(census)})


@check("RUN002", "duplicate-node-rank", "cluster", tags=["doctor", "rank"])
def duplicate_node_rank(ctx) -> Iterator[Finding]:
    """No two nodes' launchers run with the same node rank (machine_rank, --node_rank) on a static
    rendezvous.

    With rank 0 twice, each of those nodes hosts its own rendezvous store and waits there for the others
    forever; with another rank twice, the rendezvous waits for the rank nobody has. The deadlock prints
    nothing that names the cause.

    Stop the job, give each node its own rank from 0 to N-1 (`preflight check -- <the launch command>`
    shows each node's before you start again), and start it again.
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    launchers = [p for p in census.launchers if p.rdzv == "static" and p.node_rank is not None]
    if not launchers:
        yield skip("no launcher with a static rendezvous (an elastic one assigns the ranks)")
        return
    by_rank: Dict[int, List[Proc]] = {}
    for p in launchers:
        by_rank.setdefault(p.node_rank, []).append(p)
    clean, order = True, {node: i for i, node in enumerate(census.nodes)}
    for rank, procs in sorted(by_rank.items()):
        nodes = sorted({p.node for p in procs}, key=order.__getitem__)  # every node launched as 0: one group of all
        if len(nodes) < 2:
            continue
        clean = False
        hosting = [p.node for p in procs if p.listens]
        store = (f"; {fold(hosting)} each host{'s' if len(hosting) == 1 else ''} a rendezvous store on port "
                 f"{procs[0].master_port} and wait there for the others, forever" if len(hosting) > 1 else
                 "; the rendezvous waits for a rank nobody has")
        pids = ", ".join(f"{p.node} pid {p.pid}" for p in procs)
        yield Finding(Status.FAIL, f"node rank {rank} on {len(nodes)} nodes, {fold(nodes)} ({pids}){store}",
                      f"stop the job ({pids}), give each node its own rank from 0 to "
                      f"{max(len(census.nodes), len(launchers)) - 1}, and start it again", nodes=tuple(nodes),
                      evidence={"node_rank": rank, "nodes": nodes, "hosting_a_store": hosting})
    if clean:
        yield Finding(Status.PASS, "each launcher has its own node rank",
                      nodes=tuple(dict.fromkeys(map(_NODE, launchers))))


@check("RUN003", "job-agreement", "cluster", tags=["doctor", "job"])
def job_agreement(ctx) -> Iterator[Finding]:
    """The launchers and ranks on every node agree on the master address and port, the number of nodes
    and the world size.

    A node told another master address or port waits for a store that the others never join; a worker left
    at 127.0.0.1 (torchrun's default without --master_addr) waits for one on itself; a node that expects
    another number of nodes or ranks waits for processes that never come.

    Start every node with the same head address, port and sizes (one launch script; `preflight check --
    COMMAND` compares them before the start).
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    gone = of_other_jobs(census)  # a launcher of another job holding the port is RUN008's, not a disagreement
    launchers, ranks = census.launchers, census.ranks
    if gone:
        launchers, ranks = ([p for p in procs if (p.node, p.pid) not in gone] for procs in (launchers, ranks))
    every = launchers + ranks  # a node's launcher first
    alone = [p for p in launchers if meets_on_itself(census, p)]
    odd_nodes, addresses = {p.node for p in alone}, _addresses(ctx)
    for p in alone:
        yield _on_itself(census, p, [q for q in every if q.node not in odd_nodes])
    met_alone = set(odd_nodes)

    def head(p: Proc):  # node01 and 10.0.0.1 are the same head when node01 owns that address; 127.0.0.1 is p's own
        return addresses.node_at(p.master_addr, p.node) or p.master_addr if p.master_addr else None

    for label, value_of, procs, left_out in (
            ("master address", head, every, met_alone),
            ("master port", lambda p: p.job_port, every, ()),
            ("number of nodes", lambda p: nodes_text(p.nnodes) or p.nnodes, launchers, ()),  # 2 and 2:2 are one
            ("world size", lambda p: p.world_size, ranks, ())):
        values = {}
        # Each node's first value: the processes after it on that node are not asked. build gives a node's processes
        # together, so they are skipped a node at a time (groupby, in C), not one at a time (131,072 ranks).
        for node, its in groupby(procs, key=_NODE):
            if node not in values and node not in left_out:
                for p in its:
                    value = value_of(p)
                    if value is not None:
                        values[node] = value
                        break
        if len(set(map(repr, values.values()))) < 2:
            continue
        majority, odd = odd_ones_out(values, census.nodes[0] if census.nodes else None)
        others = fold([n for n in values if n not in odd])  # once: the odd nodes may be half of them
        said_on: Dict[str, Any] = {}  # node -> the master address its first process was given
        for node, its in groupby(procs if label == "master address" else (), key=_NODE):
            if node not in said_on and node not in left_out:
                said_on[node] = next(its).master_addr
        for node, value in odd.items():
            odd_nodes.add(node)
            said = said_on.get(node)
            if is_loopback(said):  # every node has it: that node meets on itself
                value = f"{said} (that is, {node} itself)"
            yield Finding(Status.FAIL, f"{label} is {value} on {node}, {majority} on {others}: {node} waits "
                          "for a rendezvous the others are not part of", f"start {node} with the {label} {majority}",
                          nodes=(node,), evidence={"key": label, "value": value, "expected": majority})
    agreeing = tuple(n for n in dict.fromkeys(map(_NODE, every)) if n not in odd_nodes)
    if agreeing:
        yield Finding(Status.PASS, "the same master, number of nodes and world size", nodes=agreeing)


def _on_itself(census: Census, p: Proc, rest: List[Proc]) -> Finding:
    """A worker whose master address is loopback (running.meets_on_itself): which flag or key gave it, and the head
    address the other nodes use (else the node rank 0 launcher's node) to give it instead."""
    addresses = Counter(q.master_addr for q in rest if q.master_addr and not is_loopback(q.master_addr))
    zero = next((q.node for q in census.launchers if q.node_rank == 0 and q.node != p.node), None)
    head = addresses.most_common(1)[0][0] if addresses else zero or "the head's address"
    source = p.master_from or ""
    if source == "default":
        how, fix = f"{p.launcher} was started without --master_addr (its default is 127.0.0.1)", \
            f"start {p.launcher} on {p.node} with --master_addr {head}"
    elif source.startswith("flag "):
        how, fix = f"{p.launcher} was started with {source[5:]} {p.master_addr}", \
            f"start {p.launcher} on {p.node} with {source[5:]} {head}"
    elif source.startswith("PET_"):  # torchrun reads it when the flag is not given (argparse_util.py, env)
        how, fix = f"{source}={p.master_addr} in {p.launcher}'s environment", \
            f"set {source}={head} on {p.node} (or start {p.launcher} there with --master_addr {head})"
    else:  # accelerate's config file, PATH:LINE
        how, fix = f"main_process_ip is {p.master_addr} in its accelerate config ({source})", \
            f"set main_process_ip: {head} in {source.rsplit(':', 1)[0]} on {p.node} (or start it with " \
            f"--main_process_ip {head})"
    return Finding(Status.FAIL, f"{p.node} pid {p.pid}: {how}, that is {p.node} itself: as node rank {p.node_rank} of "
                   f"{p.nnodes} it waits for a store on {p.node} that nothing there hosts, not at the head ({head})",
                   f"stop pid {p.pid} and {fix}", nodes=(p.node,),
                   evidence={"key": "master address", "value": p.master_addr, "from": p.master_from,
                             "expected": head, "pid": p.pid})


@check("RUN004", "master-reachable", "cluster", tags=["doctor", "network", "firewall"])
def master_reachable(ctx) -> Iterator[Finding]:
    """No process of the job hangs in a connection to the master's port that is never answered (SYN_SENT).

    A firewall that drops the port, or a master address that points nowhere, leaves that node's launcher
    retrying its connection until the timeout; the other nodes wait for it in the rendezvous.

    Open the master port from that node to the head (firewall, security group), or correct the master
    address on that node.
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    stuck: Dict[str, List[str]] = {}
    addresses = _addresses(ctx)
    for p in census.procs:
        for s in p.sockets:
            if s.get("state") != "SYN_SENT":
                continue
            # A connection to the job's port or to the process's own master: another one that hangs (a metrics
            # endpoint, a dataset server) is not the master's.
            masters = {port for port in (census.port, p.master_port, p.job_port) if port is not None}
            if s.get("remote_port") in masters:
                stuck.setdefault(p.node, []).append(f"{s.get('remote')}:{s.get('remote_port')}")
    for node, targets in stuck.items():
        target = targets[0]
        owner = addresses.node_at(target.rsplit(":", 1)[0], node)
        yield Finding(Status.FAIL, f"{node} cannot reach the master at {target}"
                      f"{f' ({owner})' if owner else ' (no node of the job has that address)'}: its connection is "
                      "never answered (a firewall that drops the port, or a wrong address)",
                      f"open port {target.rsplit(':', 1)[1]} from {node} to the head, or correct the master address "
                      f"on {node}", nodes=(node,), evidence={"targets": targets})
    connected = tuple(n for n in dict.fromkeys(map(_NODE, census.procs)) if n not in stuck)
    if connected:
        yield Finding(Status.PASS, "no connection to the master hangs", nodes=connected)


@check("RUN005", "rendezvous-arrivals", "cluster", tags=["doctor", "rendezvous"])
def rendezvous_arrivals(ctx) -> Iterator[Finding]:
    """The node that hosts the rendezvous store (the launcher listening on the master port) has a
    connection from every node of the job.

    The rendezvous completes only when every node has joined (an elastic MIN:MAX one: MIN nodes); the
    store's connections say who did, so the nodes that never joined can be named instead of waited for.

    Start (or restart) the job on the nodes that never joined, and check that they can reach the head
    (RUN004, `preflight check`).
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    hosts = [p for p in census.launchers if p.listens]
    # The store the job meets at is the one on the node that owns the master address; another node's
    # (a duplicate rank 0) is RUN002's finding, and counting its guests would blame the wrong nodes.
    addresses = _addresses(ctx)
    real = [p for p in hosts if addresses.node_at(p.master_addr, p.node) == p.node]
    hosts = real or hosts
    if not hosts:
        yield skip("no launcher listens on the master port on any node reached")
        return
    for host in hosts:
        port = host.master_port
        peers = {s.get("remote") for s in host.sockets if s.get("state") == "ESTABLISHED"
                 and s.get("local_port") == port}
        joined = {addresses.node_at(a, host.node) or a for a in peers if a}
        joined.add(host.node)  # its own launcher joins through loopback or its own address
        expected = _world(census)
        absent = [n for n in census.nodes if n not in joined]
        if expected is not None and len(joined) < expected and host.sockets_dropped:
            yield skip(f"the store on {host.node}:{port} holds more connections than the census keeps "
                       f"({host.sockets_dropped} not read): who joined it is not known")
        elif expected is not None and len(joined) < expected:
            yield Finding(Status.FAIL, f"the store on {host.node}:{port} has {len(joined)} of {expected} nodes "
                          f"({fold(sorted(joined))}); {fold(absent) or 'the others'} never joined",
                          f"start the job on {fold(absent) or 'the missing nodes'}, or see why they cannot reach "
                          f"{host.node}:{port}", nodes=(host.node, *absent),
                          evidence={"joined": sorted(joined), "expected": expected, "absent": absent})
        else:
            yield Finding(Status.PASS, f"the store on {host.node}:{port} has {len(joined)} node(s)",
                          nodes=(host.node,), evidence={"joined": sorted(joined)})


@check("RUN006", "collective-stragglers", "cluster", tags=["doctor", "collective"])
def collective_stragglers(ctx) -> Iterator[Finding]:
    """When some ranks wait in a collective, every rank of the job is in it; the ranks that are elsewhere
    are named with the line they are at.

    A collective completes only when every rank calls it: one rank that sleeps, loads data, or took
    another branch holds all the others in all_reduce until the timeout, each of them at 100% CPU with
    NCCL.

    Look at the named rank's line (a branch taken on one rank only, a rank-dependent condition, data
    loading that hangs); with every rank in the same collective, the transport is the problem
    (NCCL_DEBUG=INFO, `preflight check` with the all-reduce).
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    ranks = [p for p in census.ranks if p.where.phase != "unknown"]
    waiting = [p for p in ranks if p.where.phase == "collective"]
    if not waiting:
        yield skip("no rank waits in a collective (or no stack was read)")
        return
    ops = Counter(p.where.op for p in waiting)
    op = ops.most_common(1)[0][0]
    waiting = [p for p in waiting if p.where.op == op]
    elsewhere = [p for p in ranks if p.where.phase != "collective" or p.where.op != op]
    if any(p.stable is False for p in waiting + elsewhere):  # it moved between the two samples: not stuck
        yield Finding(Status.PASS, "the ranks moved between the two stack samples: the job progresses",
                      nodes=tuple(dict.fromkeys(map(_NODE, ranks))))
        return
    # Seen at the same place in both samples; with one sample only, a warning (a snapshot cannot tell slow from stuck).
    status = Status.FAIL if all(p.stable for p in waiting + elsewhere) else Status.WARN
    at = f" at {waiting[0].where.at}" if waiting[0].where.at else ""
    for p in elsewhere:
        yield Finding(status, f"{p.label()} on {p.node} (pid {p.pid}) is {p.where.text()}, while {len(waiting)} "
                      f"rank(s) wait in {op}{at}", f"look at {p.where.at or 'that rank'}: it must reach {op} as the "
                      "others did", nodes=(p.node,), evidence={"rank": p.rank, "pid": p.pid, "where": p.where.text(),
                                                               "others_in": op})
    if not elsewhere:
        yield Finding(Status.WARN, f"all {len(waiting)} rank(s) read are in {op}{at}, and stay there: no rank is "
                      "elsewhere, so the transport (NCCL/gloo) or a missing rank holds them",
                      "rerun with NCCL_DEBUG=INFO, or `preflight check` the nodes (the all-reduce); see RUN001/RUN007 "
                      "for ranks that are gone", nodes=tuple(dict.fromkeys(map(_NODE, waiting))),
                      evidence={"op": op, "ranks": len(waiting)})


@check("RUN007", "dead-ranks", "cluster", tags=["doctor", "rank"])
def dead_ranks(ctx) -> Iterator[Finding]:
    """Every rank of the world is alive: no zombie rank, no launcher with fewer ranks than it started,
    and as many live ranks over the nodes as the world size.

    A rank that died (out of memory, a signal, an exception on one rank) leaves the others waiting in
    their next collective until the timeout; its own log has the cause.

    Read the dead rank's log (and `dmesg` for the OOM killer on that node), fix the cause, and restart the
    job.
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    found = False
    for p in census.ranks:
        if p.state in ("Z", "X"):
            found = True
            yield Finding(Status.FAIL, f"{p.label()} on {p.node} (pid {p.pid}) is dead (a zombie): the others wait "
                          "for it", "read that rank's log for why it died, then restart the job", nodes=(p.node,))
    worlds = [p.world_size for p in census.ranks if p.world_size]
    if worlds and _whole_job(census):
        world = Counter(worlds).most_common(1)[0][0]
        alive = {p.rank for p in census.ranks if p.state not in ("Z", "X") and p.rank is not None}
        missing = sorted(set(range(world)) - alive)
        waiting = [p for p in census.ranks if p.where.phase in ("collective", "init_process_group", "rendezvous")]
        if missing and waiting:
            found = True
            yield Finding(Status.FAIL, f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:16]))} of "
                          f"{world} {'are' if len(missing) > 1 else 'is'} not running on any node reached, while "
                          f"{len(waiting)} rank(s) wait ({waiting[0].where.text()})",
                          "find why that rank exited (its log on its node; dmesg for the OOM killer), then restart "
                          "the job", nodes=tuple(dict.fromkeys(map(_NODE, waiting))),
                          evidence={"missing": missing, "world_size": world})
    if not found:
        yield Finding(Status.PASS, "no rank found dead", nodes=tuple(dict.fromkeys(map(_NODE, census.ranks))))


def _whole_job(census: Census) -> bool:
    """Whether the census saw every process of the job: every node reached, none cut, no --pid, and at least
    as many nodes as the job has (GROUP_WORLD_SIZE, its launchers' --nnodes); a rank not seen is then not running."""
    if census.errors or census.dropped or census.selected:
        return False
    groups = [int(p.env["GROUP_WORLD_SIZE"]) for p in census.ranks
              if str(p.env.get("GROUP_WORLD_SIZE", "")).isdigit()]
    nodes = Counter(groups).most_common(1)[0][0] if groups else _world(census)
    return nodes is not None and len(census.nodes) >= nodes


@check("RUN008", "stale-port-holder", "cluster", tags=["doctor", "port"])
def stale_port_holder(ctx) -> Iterator[Finding]:
    """The master port is held by the job itself, not by a process of an older job or another program.

    A launcher from an earlier run (still waiting, or its ranks stuck) keeps the port: the new job's rank
    0 cannot host its store, or the new workers join the old job's store and wait there. A launcher holding
    the port is of another job when its number of nodes, world size, script or port, as its launcher's
    parser reads them, are none of the other nodes' launchers', whatever its age.

    Stop the old job (the message names its PID and command), then start the new one; or give the new
    job another main_process_port.
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    if not census.port:
        yield skip("no master port given (--port) or found")
        return
    found = False
    for node, holders in census.listeners.items():
        for h in holders:
            found = True
            argv = _shown(h.get("argv") or (), 160)
            yield Finding(Status.FAIL, f"port {census.port} on {node} is held by pid {h.get('pid')} ({argv}), "
                          f"started {h.get('age_s')} s ago, which is not a process of this job",
                          f"stop pid {h.get('pid')} (and its job), then start the job again; or use another port",
                          nodes=(node,), evidence={"pid": h.get("pid"), "age_s": h.get("age_s")})
    for other in other_jobs(census):
        found, holder, older = True, other.proc, other.older_s
        what, when = ("an older job", f", started {older:.0f} s before the other nodes' launchers") \
            if older is not None and older >= 1 else ("another job", "")
        why = (f"; its job ({', '.join(f'{k} {v[0]}' for k, v in other.differs.items())}) is not the other nodes' "
               f"({', '.join(f'{k} {v[1]}' for k, v in other.differs.items())})")
        yield Finding(Status.FAIL, f"port {census.port} on {holder.node} is held by {what}: {holder.launcher} pid "
                      f"{holder.pid} ({_shown(holder.argv, 120)}){when}{why}",
                      f"stop pid {holder.pid} on {holder.node} (the old job), then start the job again on every node",
                      nodes=(holder.node,), evidence={"pid": holder.pid, "age_s": holder.age_s, "older_s": older,
                                                      "differs": {k: list(v) for k, v in other.differs.items()}})
    if not found:
        yield Finding(Status.PASS, f"port {census.port} is held by the job only",
                      nodes=tuple(dict.fromkeys(map(_NODE, census.procs))))


@check("RUN009", "stacks-readable", "cluster", tags=["doctor", "py-spy"])
def stacks_readable(ctx) -> Iterator[Finding]:
    """The Python stacks of the job's processes on the node can be read (py-spy, and ptrace allowed).

    Without the stacks, doctor cannot say which collective a rank waits in or which line it is at; the
    rest of the diagnosis (processes, sockets) still holds.

    Install py-spy in the training environment (pip install py-spy), and run doctor as root (a container needs
    SYS_PTRACE), or as the job's user where kernel.yama.ptrace_scope is 0: at 1 (Ubuntu's default) and 2 only
    CAP_SYS_PTRACE attaches to a process that is not one's own child, at 3 nothing until a reboot (Yama).
    """
    census = _census(ctx)
    if census is None:
        yield skip("no census of a running job (run `preflight doctor`)")
        return
    nodes = [n for n in census.stacks if census.has(n)]
    if not nodes:
        yield skip(f"no process of a job{_on_port(census)} on any node reached")  # as _gate says it
        return
    yield from grouped(lambda node: _stacks_readable(census.stacks[node], ctx.facts[node]["facts"]), nodes)


def _stacks_readable(stacks: Mapping[str, Any], facts: Mapping[str, Any]) -> Iterator[Finding]:
    if stacks.get("error") and not stacks.get("read"):
        scope = (facts.get("census") or {}).get("ptrace_scope") if isinstance(facts.get("census"), dict) else None
        yield Finding(Status.WARN, f"the stacks cannot be read: {stacks['error']}"
                      + (f" (kernel.yama.ptrace_scope is {scope})" if scope not in (None, 0) else ""),
                      "pip install py-spy in the training environment; run doctor as root (a container needs "
                      "SYS_PTRACE), or as the job's user where kernel.yama.ptrace_scope is 0 (at 1 and 2 only "
                      "root attaches, at 3 nobody until a reboot)", evidence={"error": stacks["error"]})
    else:
        yield Finding(Status.PASS, f"py-spy read {stacks.get('read', 0)} stack(s) on each of these nodes",
                      evidence={"read_per_node": stacks.get("read")})


@check("RUN010", "flight-recorder", "cluster", tags=["doctor", "collective", "flight-recorder"])
def flight_recorder(ctx) -> Iterator[Finding]:
    """torch's flight-recorder records of every rank (the files PREFIX<rank> each rank wrote, read on every node
    while the job runs or after it died, or the records a running rank serves on its worker socket or its debug
    server) show no rank that holds the others: none behind the others' collective, none that issued another
    collective (op, sizes, dtypes) at the same sequence id, none without records.

    DDP, FSDP and DeepSpeed issue their collectives asynchronously and wait for them together, so every rank's
    stack shows the same wait and cannot name the culprit; the records say which collective each rank entered,
    and the one that waited past its timeout proves the job stuck, where a slow rank or a moving job is not.

    Look at the named rank's line: a rank-dependent branch, an uneven number of buckets, batches or steps, a
    parameter only some ranks have. To have records next time: TORCH_FR_BUFFER_SIZE=2000,
    TORCH_FR_DUMP_TEMP_FILE=PATH/fr_, TORCH_NCCL_DUMP_ON_TIMEOUT=1 (gloo: dump them in your timeout handler), or
    run the job in torch's worker_main with TORCH_WORKER_SERVER_SOCKET set per rank, or call
    torch.distributed.debug.start_debug_server() in it: doctor asks each rank live.
    """
    census = _census(ctx)
    if census is None:
        yield skip("no census of a running job (run `preflight doctor`)")
        return
    # Where the ranks run and their world are read only for records: none on any node, none asked (131,072 ranks at
    # 16,384 nodes).
    dumped = any(isinstance(f, dict) and f.get("dumps") for f in census.flight.values())
    live: Dict[int, List[tuple]] = {}
    for p in census.ranks if dumped else ():
        if p.rank is not None and p.state not in ("Z", "X"):
            live.setdefault(p.rank, []).append((p.node, p.pid))
    worlds = Counter(p.world_size for p in census.ranks if p.world_size) if dumped else Counter()
    found = flight.gather(census.flight, live, worlds.most_common(1)[0][0] if worlds else None)
    for node, path, why in found.errors:
        server = path.startswith(("socket:", "debug-server"))  # a rank's server, asked live; else a file
        yield Finding(Status.WARN, f"{node}: {path} {why}: not read as flight-recorder records",
                      "run doctor as root, or as the job's user where kernel.yama.ptrace_scope is 0 (as for py-spy)"
                      if "ptrace" in why else "check the rank's server (POST /handler/fr_trace_json), or raise "
                      "doctor's --timeout" if server else
                      f"remove or replace {path} on {node} (doctor reads PREFIX<rank> files as torch writes them)",
                      nodes=(node,), evidence={"path": path, "error": why})
    if not found.records:
        yield skip(_no_records(census, found))
        return
    blames, notes = flight.judge(found)
    everywhere = tuple(n for n in census.nodes if any(n in r.nodes for r in found.records))
    for blame in blames:
        waiting = {r.node for r in found.records if r.rank in blame.evidence.get("waiting", ()) and r.node}
        nodes = (blame.node,) if blame.node else tuple(n for n in census.nodes if n in waiting) or everywhere
        yield Finding(Status.WARN if blame.kind == "all-waiting" else Status.FAIL, blame.message, blame.remedy,
                      nodes=nodes, evidence={**blame.evidence, "node": blame.node, "at": blame.at})
    if not blames:
        ranks = [r.rank for r in found.records]
        yield Finding(Status.PASS, f"the flight records of {len(ranks)} rank(s) show no rank holding the others"
                      + (f": {'; '.join(notes[:4])}" if notes else ""), nodes=everywhere,
                      evidence={"ranks": ranks, "notes": notes})


def _no_records(census: Census, found: flight.Records) -> str:
    """Why nothing is judged; what to set next time, where the stacks could not tell either (a job that moves,
    or one whose straggler RUN006 names, is not told)."""
    looked = sorted({p for prefixes in found.looked.values() for p in prefixes})
    stale = sorted({p for paths in found.stale.values() for p in paths})
    if not census.procs and not looked:
        return "no job runs on these nodes, and no --flight-recorder PREFIX was given to read the records it left"
    said = "no flight-recorder records" + (f" at {', '.join(p + '<rank>' for p in looked[:3])}" if looked else "") + (
        f" (left out as older than their rank: {', '.join(stale[:3])})" if stale else "")
    for node, path in sorted(found.server_dumps.items())[:1]:
        # The folder a user would think of: torch's debug server's (dump_dir). Its table is no rank's records.
        return (f"{said}; {path} on {node} is a dump of torch's debug server (start_debug_server(dump_dir=...)): its "
                "own analysis of all ranks as a text table, which doctor does not read as records; read it there. "
                "While the job runs doctor asks each rank's debug server itself; for after it died, set "
                f"{' '.join(flight.SETTINGS[1:])} in the job's environment and give that prefix")
    ranks = [p for p in census.ranks if p.where.phase != "unknown"]
    moving = any(p.stable is False for p in census.ranks)
    straggler = any(p.where.phase == "collective" for p in ranks) and any(p.where.phase != "collective" for p in ranks)
    if not census.ranks or moving or straggler:
        return said
    return (f"{said}, and the stacks cannot tell which rank holds the others: to have the records next time set "
            f"{' '.join(flight.SETTINGS)} in the job's environment (gloo: call "
            "torch._C._distributed_c10d._dump_fr_trace() in its timeout handler), then preflight doctor "
            "--flight-recorder /a/local/or/shared/path/fr_")


@check("RUN011", "nccl-ras", "cluster", tags=["doctor", "collective", "nccl", "ras"])
def nccl_ras(ctx) -> Iterator[Finding]:
    """NCCL's RAS service (NCCL 2.24+), asked on every node where the job's ranks use NCCL as its own client
    ncclras asks it, shows no rank that holds the others: none behind the others' collective count in a
    communicator, none that launched another collective, none that RAS cannot reach or considers dead.

    DDP, FSDP and DeepSpeed wait for their NCCL collectives together, so every rank's stack shows the same wait;
    RAS counts the collectives each rank of each communicator launched. Counts a collective apart are normal
    while a job moves, so a rank is named only where RAS's two answers, a second apart, are the same and no
    rank's stack moved between them.

    Look at the named rank: its line in the stacks, a rank-dependent branch, an uneven number of buckets or
    steps, a process that died or hangs outside NCCL. RAS is on by default (NCCL_RAS_ENABLE=1, at
    localhost:28028); with several jobs on a node, give each its own NCCL_RAS_ADDR.
    """
    census, gate = _gate(ctx)
    if gate:
        yield gate
        return
    if not census.ranks:
        yield skip("no rank of the job on any node reached (NCCL's RAS runs in its ranks)")
        return
    found, none = nccl.answers(census.ras)
    for a in found:
        if a.error and not a.absent:
            yield Finding(Status.WARN, f"{a.node}: {a.error}: RAS's answer was not read",
                          f"check what listens at {a.address} on {a.node} (the job's NCCL_RAS_ADDR), or raise "
                          "doctor's --timeout", nodes=(a.node,), evidence={"address": a.address, "error": a.error})
    answered = [a for a in found if len(a.snapshots) > 1] or [a for a in found if a.snapshots]
    if not answered:
        absent = sorted({f"{a.error} on {a.node}" for a in found if a.absent})
        yield skip("; ".join(absent[:2]) + f" ({nccl.ADVICE})" if absent else
                   next(iter(sorted(set(none.values()))), "no answer from NCCL RAS"))
        return
    answer = answered[0]  # every node's RAS answers for the whole job: the first whole answer is the verdict
    addresses = Addresses(ctx.facts)
    by_pid = {(p.node, p.pid): p for p in census.ranks}
    by_pid.update(((p.node, p.own_pid), p) for p in census.ranks if p.own_pid is not None)  # RAS's, in a container

    def locate(host, pid, seen_from):
        node = addresses.node_at(host, seen_from) if host else None
        proc = by_pid.get((node, pid))
        return nccl.Place(node, proc.rank, proc.where.at, proc.pid) if proc else nccl.Place(node, None)

    blames, notes = nccl.judge(answer, locate, any(p.stable is False for p in census.ranks))
    for blame in blames:
        yield Finding(Status.FAIL, blame.message, blame.remedy, nodes=(blame.node or answer.node,),
                      evidence={**blame.evidence, "node": blame.node, "at": blame.at})
    if not blames:
        communicators = answer.snapshots[-1].get("communicators")
        yield Finding(Status.PASS, f"{answer.said()} ({answer.format}) shows no rank holding the others"
                      + (f" in {communicators} communicator(s)" if communicators is not None else "")
                      + (f": {'; '.join(notes[:4])}" if notes else ""), nodes=(answer.node,),
                      evidence={"source": answer.said(), "notes": notes, "answers": len(answer.snapshots)})
