"""JOB: the job as each node will launch it (its own accelerate config, DeepSpeed JSON and launcher flags),
consistent across the nodes.

The effective launch of every node comes from preflight.job.view (probes["job"]["nodes"]): what that node's
files say, with the command's flags over them, each value with where it came from ("node02:/path:4").
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional

from preflight.api import Finding, Status, check, fold, grouped, holders, odd_ones_out, passed, skip, warn
from preflight.inputs import launchcmd
from preflight.report import redact
from preflight.inputs.configs import deepspeed_runner
from preflight.job.view import MUST_MATCH, NOT_DIGESTED_KEYS, plan_rows

FIELD_NAMES = {"main_ip": "main_process_ip", "main_port": "main_process_port", "world_size": "num_processes",
               "rdzv_backend": "rdzv_backend"}


def _job(ctx) -> Mapping[str, Any]:
    return (ctx.probes or {}).get("job") or {}


def _views(ctx) -> Dict[str, dict]:
    return {n: v for n, v in (_job(ctx).get("nodes") or {}).items() if isinstance(v, dict) and v.get("known")}


def _self_started(ctx) -> Dict[str, dict]:
    """The nodes whose launch is started on the node itself (by hand, pdsh, srun), in node order."""
    return {n: v for n, v in _views(ctx).items() if v.get("started_by") == "self" and v.get("launcher") != "other"}


def _where(view: dict, node: str, field: str) -> str:
    source = (view.get("sources") or {}).get(field) or "default"
    return f"{node}:{source}" if source.startswith("/") else f"{node} ({source})"


def _multi_node_or_skip(ctx) -> Optional[Finding]:
    if not ctx.plan.remote:
        return skip("this machine alone: no other node's launch to compare")
    if not _views(ctx):
        if not ctx.reachable:
            return skip("no node's launch was read (no node reached)")
        if not ctx.plan.command:
            return skip("no launch command given (after `--`)")
        return skip("no node's launch was read")
    return None


@check("JOB001", "launch-plan", "cluster", tags=["job", "accelerate", "multinode"])
def launch_plan(ctx) -> Iterator[Finding]:
    """Every node's effective launch can be read: its accelerate config (the one the command names, else
    that node's default under its HF_HOME) and the DeepSpeed config it names parse, and the plan (node,
    machine_rank, head address and port, processes, world, precision, digests, python, interface) is shown.

    The config on the head says little about what node 7 will run: each node launches with its own files
    and its own session's environment. A config that does not parse on one node stops only that node's
    launcher, and the others wait in the rendezvous until the timeout.

    Fix the file named on the node (the message gives its path there), or copy a good one from another
    node; compare the launch plan's rows (terminal, --json evidence, HTML) to see what differs.
    """
    views = _views(ctx)
    if not views:
        yield skip("no accelerate config on any node and no launch command (give it after `--`)")
        return
    rows = [row for row in plan_rows(_job(ctx)) if row["node"] in views]
    broken = []
    for node, view in views.items():
        for problem in view.get("problems") or ():
            broken.append(node)
            yield Finding(Status.FAIL, f"{problem} (on {node}): its launcher would stop there",
                          f"fix that file on {node}, or give the path of a good one (--config_file in the command)",
                          nodes=(node,), evidence={"problem": problem})
        for warning in view.get("warnings") or ():
            yield Finding(Status.WARN, f"{warning} (on {node})", "check the command's options against the launcher's "
                          "--help", nodes=(node,), evidence={"problem": warning})
    readable = tuple(n for n in views if n not in broken)
    if readable:
        yield Finding(Status.PASS, f"the launch of {len(readable)} node(s) read", nodes=readable,
                      evidence={"launch_plan": rows})


@check("JOB002", "machine-ranks", "cluster", tags=["job", "accelerate", "multinode", "rank"])
def machine_ranks(ctx) -> Iterator[Finding]:
    """The machine ranks (accelerate's machine_rank, torchrun's --node_rank) are unique and exactly
    0 to N-1 over the job's N nodes.

    Two nodes with the same rank never meet: with rank 0 on both, each hosts its own rendezvous store and
    waits there for the others forever; with another rank twice, the rendezvous waits for the missing rank
    until its 10-30 minute timeout. The deadlock prints nothing that names the cause.

    Give each node its own machine_rank from 0 (the head) to N-1, in its own config or with
    --machine_rank in its command; `preflight launch` sets the ranks for you.
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = {n: v for n, v in _self_started(ctx).items() if v.get("rdzv_backend") == "static"}
    if not views:
        yield skip("no node sets its own rank (an elastic rendezvous assigns them, or the head's launcher starts "
                   "every node)")
        return
    own = [n for n, v in views.items() if v.get("own_rank")]  # `launch` runs the head's launch alone
    ranks = {n: v.get("machine_rank") for n, v in views.items() if isinstance(v.get("machine_rank"), int)}
    if not ranks:
        yield _no_rank(views)
        return
    views = {n: v for n, v in views.items() if n in ranks}  # a rank that is not a number is JOB001's finding
    count = len(ctx.plan.nodes)
    by_rank: Dict[Any, List[str]] = {}
    for node, rank in ranks.items():
        by_rank.setdefault(rank, []).append(node)
    bad = set()
    for rank, nodes in by_rank.items():
        if len(nodes) > 1:
            bad.update(nodes)
            where = "; ".join(_where(views[n], n, "machine_rank") for n in nodes)
            wait = ("each hosts its own rendezvous store and waits there for the others, forever" if rank == 0 else
                    f"both join as rank {rank}, and the rendezvous waits for the rank nobody has until its timeout")
            yield Finding(Status.FAIL, f"machine_rank {rank} on {len(nodes)} nodes, {fold(nodes)} ({where}): {wait}",
                          f"give each node its own machine_rank from 0 to {count - 1}", nodes=tuple(nodes),
                          evidence={"machine_rank": rank, "nodes": nodes})
        elif not (isinstance(rank, int) and 0 <= rank < count):
            bad.update(nodes)
            yield Finding(Status.FAIL, f"machine_rank {rank} on {nodes[0]} ({_where(views[nodes[0]], nodes[0], 'machine_rank')}) "
                          f"is outside 0 to {count - 1} for {count} nodes", f"set it between 0 and {count - 1}",
                          nodes=tuple(nodes), evidence={"machine_rank": rank})
    if len(views) == count:  # every node starts on its own: each rank from 0 to N-1 must be one of theirs
        missing = [r for r in range(count) if r not in by_rank]
        if missing:
            yield Finding(Status.FAIL, f"no node has machine_rank {', '.join(map(str, missing))}: the rendezvous "
                          f"waits for {'it' if len(missing) == 1 else 'them'} until its timeout",
                          "give each node its own machine_rank from 0 to " + str(count - 1),
                          nodes=tuple(sorted(bad)) or tuple(views), evidence={"missing": missing})
            return
    good = tuple(n for n in views if n not in bad)
    if good and not bad and own:
        yield Finding(Status.PASS, "; ".join(f"machine_rank {ranks[n]} on {_where(views[n], n, 'machine_rank')}"
                                             for n in good) + f"; {fold(own)} start(s) its own launch with its rank",
                      nodes=good, evidence={"ranks": ranks, "own_launch": own})
    elif good and not bad:
        yield Finding(Status.PASS, f"machine ranks 0 to {count - 1}, one per node", nodes=good,
                      evidence={"ranks": ranks})


def _no_rank(views: Mapping[str, dict]) -> Finding:
    """The skip when no node's machine_rank is a number: JOB001 fails a rank it cannot read, and warns of one that
    is not known here (a SLURM task variable with several tasks per node)."""
    if any(v.get("problems") for v in views.values()):
        return skip("no node's machine_rank is a number (see JOB001)", blocked_by="JOB001")
    return skip("machine_rank is not known here on any node (see JOB001)")


def _host(ctx, node: str) -> Mapping[str, Any]:
    host = ctx.facts[node]["facts"].get("host")
    return host if isinstance(host, dict) else {}


def _owner(ctx, address: str) -> Optional[str]:
    """The node whose interfaces hold `address`, or whose name or hostname it is."""
    for node in ctx.reachable:
        host = _host(ctx, node)
        interfaces = host.get("interfaces") if isinstance(host.get("interfaces"), dict) else {}
        names = {node, host.get("hostname"), host.get("fqdn")}
        if address in names or any(address in (a or []) for a in interfaces.values() if isinstance(a, list)):
            return node
    return None


def _resolved(ctx, name: str) -> Optional[str]:
    """An address the workers resolved `name` to, when it is the head address they were asked about."""
    probe = (ctx.probes or {}).get("head") or {}
    if name != probe.get("address"):
        return None
    for node in ctx.reachable:
        found = _host(ctx, node).get("head_resolves_to")
        if isinstance(found, list) and found:
            return found[0]
    return None


@check("JOB003", "rank-zero-host", "cluster", tags=["job", "accelerate", "multinode", "network"])
def rank_zero_host(ctx) -> Iterator[Finding]:
    """The node with machine_rank 0 is the node that owns main_process_ip (torchrun's --master_addr), and
    the address is not loopback on a multi-node job.

    Rank 0 hosts the rendezvous store at that address: when the address belongs to another node, every
    worker connects to a node where nothing listens; with 127.0.0.1 (torchrun's default) each node
    connects to itself and hosts its own rendezvous.

    Set main_process_ip (--master_addr) to the rank 0 node's address on the training network, or give
    machine_rank 0 to the node that owns it.
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = _self_started(ctx)
    static = [n for n, v in views.items() if v.get("rdzv_backend") == "static"]
    if not static:
        yield skip("no node sets its own rank (an elastic rendezvous assigns them, or the head's launcher starts "
                   "every node)")
        return
    # The nodes JOB002 judges: those whose rank is a number (another rank is JOB001's finding)
    ranked = [n for n in static if isinstance(views[n].get("machine_rank"), int)]
    zero = [n for n in ranked if views[n].get("machine_rank") == 0]
    own = [n for n in static if views[n].get("own_rank")]
    if not ranked:
        yield _no_rank(views)
        return
    if len(zero) > 1 or not zero and len(ranked) == len(ctx.plan.nodes):  # JOB002 fails on it
        yield skip(f"machine_rank 0 is on {len(zero) or 'no'} node(s), not one (see JOB002)", blocked_by="JOB002")
        return
    if not zero:
        yield skip(f"machine_rank 0 is none of {fold(ranked)}: it is one of {fold(own or static)}, whose own launch "
                   "is not read here")
        return
    for node in zero:
        view = views[node]
        address = view.get("main_ip")
        if address is None:
            yield Finding(Status.FAIL, f"no main_process_ip on {node}, the rank 0 node: accelerate stops with "
                          "'you need to specify the main process IP'", "set main_process_ip to this node's address",
                          nodes=(node,))
            continue
        loopback = str(address).startswith("127.") or address in ("localhost", "::1")
        if loopback and len(ctx.plan.nodes) > 1:
            yield Finding(Status.FAIL, f"the head address is {address} on {node} ({_where(view, node, 'main_ip')}): "
                          "each node would look for the rendezvous on itself", f"set it to {node}'s address on the "
                          "training network (--master_addr / main_process_ip)", nodes=tuple(views),
                          evidence={"address": address})
            continue
        owner = _owner(ctx, str(address))
        resolved = view.get("main_resolved") if isinstance(view.get("main_resolved"), list) else []
        for found in resolved + [_resolved(ctx, str(address))]:  # as this node resolves it, else as the workers do
            owner = owner or (_owner(ctx, found) if found else None)
        if owner is None:
            yield skip(f"cannot tell which node owns {address} (not an address or name of any node reached)")
        elif owner != node:
            rank = (views.get(owner) or {}).get("machine_rank")
            yield Finding(Status.FAIL, f"main_process_ip {address} is {owner}'s address, but machine_rank 0 is {node} "
                          f"({owner} has machine_rank {rank}): the workers connect to {owner}, where no store listens",
                          f"set main_process_ip to {node}'s address, or give machine_rank 0 to {owner}",
                          nodes=(node, owner), evidence={"address": address, "owner": owner, "rank0": node})
        else:
            yield Finding(Status.PASS, f"rank 0 is {node}, which owns {address}", nodes=(node,),
                          evidence={"address": address})


@check("JOB004", "num-machines", "cluster", tags=["job", "accelerate", "multinode"])
def num_machines(ctx) -> Iterator[Finding]:
    """num_machines (torchrun's --nnodes) on every node equals the number of nodes of the job, and
    num_processes divides by it; when DeepSpeed's runner on the head starts every node, its hostfile
    lists exactly the job's nodes.

    The rendezvous waits for num_machines nodes: with fewer than the nodes started, the extra ones are
    refused or wait outside it; with more, it waits for nodes that never come, until the timeout. The
    runner starts the hosts of its hostfile, not the nodes you checked.

    Set num_machines to the number of nodes (in every node's config, or --num_machines in the command),
    num_processes to a multiple of it, and list the job's nodes in the hostfile (`host slots=N` a line).
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = {n: v for n, v in _self_started(ctx).items() if v.get("num_machines") is not None}
    count = len(ctx.plan.nodes)

    def fits(view: dict) -> bool:
        low, high = (view.get("nnodes_range") or [None, None])
        if isinstance(low, int) and isinstance(high, int):  # torchrun --nnodes MIN:MAX: any count in between
            return low <= count <= high
        return view.get("num_machines") == count

    wrong = {n: v.get("num_machines") for n, v in views.items() if not fits(v)}
    for value in dict.fromkeys(map(repr, wrong.values())):
        nodes = [n for n, v in wrong.items() if repr(v) == value]
        where = "; ".join(_where(views[n], n, "num_machines") for n in nodes[:4])
        yield Finding(Status.FAIL, f"num_machines is {value} on {fold(nodes)} ({where}), but the job has {count} nodes",
                      f"set num_machines: {count}", nodes=tuple(nodes), evidence={"num_machines": wrong[nodes[0]],
                                                                                     "nodes": count})
    for node, view in views.items():
        procs, machines = view.get("num_processes"), view.get("num_machines")
        if view.get("accelerate_launcher") in ("torchrun", "deepspeed") and isinstance(procs, int) and isinstance(machines, int) and machines > 0 and procs % machines:
            wrong[node] = machines
            yield Finding(Status.FAIL, f"num_processes {procs} ({_where(view, node, 'num_processes')}) does not divide by "
                          f"num_machines {machines}: accelerate starts {procs // machines} per node, "
                          f"{procs // machines * machines} in all", f"set num_processes to a multiple of {machines}",
                          nodes=(node,), evidence={"num_processes": procs, "num_machines": machines})
    right = tuple(n for n in views if n not in wrong)
    if right:
        yield Finding(Status.PASS, f"num_machines {count}", nodes=right)
    head = _views(ctx).get(ctx.plan.head) or {}
    if head.get("started_by") == "head":
        yield from _hostfile_nodes(ctx, head)
    elif not views:
        yield skip("no node launches on its own")


def _hostfile_nodes(ctx, view: dict) -> Iterator[Finding]:
    """The hostfile DeepSpeed's runner reads on the head lists the job's nodes (it starts exactly those)."""
    head, hosts = ctx.plan.head, view.get("hosts")
    if not isinstance(hosts, dict):
        yield skip(f"DeepSpeed's runner on {head} starts the nodes; its hostfile was not read")
        return
    if hosts.get("error"):
        yield Finding(Status.FAIL, f"DeepSpeed's runner on {head} reads the hostfile {hosts.get('path')}: {hosts['error']}",
                      f"write the hostfile there (`host slots=N` a line), or name it with --hostfile", nodes=(head,))
        return
    listed = [h for h, _ in hosts.get("hosts") or ()]
    names = {}
    for node in ctx.plan.nodes:
        facts = (ctx.facts.get(node) or {}).get("facts") or {}
        host = facts.get("host") if isinstance(facts.get("host"), dict) else {}
        interfaces = host.get("interfaces") if isinstance(host.get("interfaces"), dict) else {}
        addresses = {a for found in interfaces.values() if isinstance(found, list) for a in found if isinstance(a, str)}
        names[node] = ({node, host.get("hostname"), host.get("fqdn")} | addresses) - {None}
    missing = [n for n in ctx.plan.nodes if not names[n] & set(listed)]
    # --num_nodes, --include, --exclude (and accelerate's filters) choose among the hosts: extra ones are fine.
    extra = [] if view.get("host_filter") is not None else \
        [h for h in listed if not any(h in known for known in names.values())]
    if missing or extra:
        parts = ([f"{fold(missing)} {'is' if len(missing) == 1 else 'are'} not in it"] if missing else []) + \
                ([f"it lists {', '.join(extra[:8])}, not a node of this job"] if extra else [])
        yield Finding(Status.FAIL, f"DeepSpeed's runner on {head} starts the hosts of {hosts.get('path')} "
                      f"({len(listed)}), the job has {len(ctx.plan.nodes)} nodes: {'; '.join(parts)}",
                      f"list exactly the job's nodes in {hosts.get('path')} (`host slots=N` a line)", nodes=(head,),
                      evidence={"hostfile": hosts.get("path"), "hosts": listed, "missing": missing, "extra": extra})
    else:
        yield Finding(Status.PASS, f"the hostfile {hosts.get('path')} on {head} lists the job's {len(listed)} nodes",
                      nodes=(head,))


@check("JOB005", "launch-consistency", "cluster", tags=["job", "accelerate", "multinode", "precision"])
def launch_consistency(ctx) -> Iterator[Finding]:
    """The main address and port, the number of machines and processes, the distributed type, the mixed
    precision, the ZeRO stage and the rendezvous backend are the same in every node's launch; other keys
    of the nodes' accelerate configs are compared too (machine_rank and gpu_ids may differ). Values are
    compared as the launcher uses them (bf16 and BF16 alike), and the main address by the host it reaches
    as each node resolves it (a name and an address of the head are the same head).

    Nodes that disagree on the head or the world wait for each other until the timeout; bf16 on one node
    and fp16 on another trains with mismatched buffers or hangs in the first collective.

    Make every node's config the same except machine_rank (copy one file, then set the rank), or pass
    the differing value on the command line of every node; the message names the file and line on each node.
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = _self_started(ctx)
    if len(views) < 2:
        yield skip("fewer than two nodes launch on their own: nothing to compare")
        return
    head = ctx.plan.head
    differ = set()
    for node, view in views.items():
        resolved = view.get("main_resolved")
        if isinstance(resolved, dict):  # {"error"}: this node's resolver does not know the name
            differ.add(node)
            address = view.get("main_ip")
            yield Finding(Status.FAIL, f"main_process_ip {address!r} does not resolve on {node} ({resolved.get('error')}; "
                          f"{_where(view, node, 'main_ip')}): its launcher cannot reach the head",
                          f"add {address} to {node}'s /etc/hosts or DNS, or give the head's address instead",
                          nodes=(node,), evidence={"key": "main_process_ip", "value": address,
                                                   "error": resolved.get("error")})
    for field in MUST_MATCH:
        values = {n: _reaches(ctx, v) if field == "main_ip" else v.get(field)
                  for n, v in views.items() if n not in differ or field != "main_ip"}
        majority, odd = odd_ones_out(values, head)
        if not odd:
            continue
        differ.update(odd)
        shown = FIELD_NAMES.get(field, field)
        others = f"{holders(values, majority)} {majority!r}" if field != "main_ip" else \
            f"{holders(values, majority)} one that reaches {majority}"
        for value in dict.fromkeys(map(repr, odd.values())):
            nodes = [n for n, v in odd.items() if repr(v) == value]
            where = "; ".join(_where(views[n], n, field) for n in nodes[:4])
            if field == "main_ip":  # compared by where it reaches: say the spelling and the host
                spelled, resolved = views[nodes[0]].get("main_ip"), views[nodes[0]].get("main_resolved")
                value = f"{spelled!r}" + (f", which reaches {odd[nodes[0]]} there" if isinstance(resolved, list) else "")
            yield Finding(Status.FAIL, f"{shown} differs: {fold(nodes)} {'has' if len(nodes) == 1 else 'have'} {value} "
                          f"({where}), {others}", f"set {shown} to {majority!r} on {fold(nodes)}",
                          nodes=tuple(nodes), evidence={"key": shown, "value": odd[nodes[0]], "expected": majority})
    # The view's settings are as the launcher uses them (preflight.job.view.as_launched); main_process_ip was
    # compared above by where it reaches, the per-node and unread keys differ by design.
    configs = {n: v.get("accelerate_settings") for n, v in views.items() if isinstance(v.get("accelerate_settings"), dict)}
    configs = {n: {k: (_same_meaning(v), line) for k, (v, line) in c.items() if k not in NOT_DIGESTED_KEYS}
               for n, c in configs.items() if n not in differ}
    for node, key, value, majority, others, line in _differing(configs, ctx.plan.head):
        value, majority = redact.value(key, value), redact.value(key, majority)
        yield Finding(Status.WARN, f"{key} is {value!r} on {node} ({node}:{views[node].get('config')}"
                      f"{':' + str(line) if line else ''}), {others} {majority!r}",
                      f"make {key} the same in every node's accelerate config", nodes=(node,),
                      evidence={"key": key, "value": value, "expected": majority})
    same = tuple(n for n in views if n not in differ)
    if same:
        yield Finding(Status.PASS, "the same head, world, distributed type, precision and ZeRO stage", nodes=same)


def _same_meaning(value: Any) -> Any:
    """A config value (already as the launcher uses it) in a form that compares: mappings whatever their key order."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return value


def _reaches(ctx, view: dict) -> Any:
    """Where a node's main_process_ip takes its launcher, as that node resolved it: the node of the job that holds
    the address (a name and an address of one head are the same head; torch's TCPStore listens on every address
    of it), else the first address it resolved to; the name as written when the node did not resolve it."""
    address, resolved = view.get("main_ip"), view.get("main_resolved")
    if not isinstance(resolved, list) or not resolved:
        return address
    for found in resolved:
        try:
            if ipaddress.ip_address(found.split("%")[0]).is_loopback:
                return found  # every node has one: never another node's address (JOB003 judges it)
        except ValueError:
            pass
        owner = _owner(ctx, found)
        if owner is not None:
            return owner
    return resolved[0]


def _differing(settings: Mapping[str, Mapping[str, Any]], head: str) -> Iterator[tuple]:
    """For each key of the nodes' settings ({node: {key: (value, line)}}), every node whose value is not the
    majority's: (node, key, value, majority, "n[..] have", line on that node)."""
    for key in sorted(set().union(*settings.values())) if settings else ():
        values = {n: (s.get(key) or (None, None))[0] for n, s in settings.items()}
        majority, odd = odd_ones_out(values, head)
        others = holders(values, majority) if odd else ""
        for node, value in odd.items():
            yield node, key, value, majority, others, (settings[node].get(key) or (None, None))[1]


@check("JOB006", "deepspeed-consistency", "cluster", tags=["job", "deepspeed", "multinode"])
def deepspeed_consistency(ctx) -> Iterator[Finding]:
    """Every node's launch reads a DeepSpeed config with the same settings (the file its accelerate config
    or command names, read on that node).

    A DeepSpeed JSON edited on one node only gives that node another batch size, ZeRO stage or precision:
    DeepSpeed asserts on the batch arithmetic, or the ranks partition differently and hang in the first
    collective.

    Use one DeepSpeed config for all nodes (a shared filesystem, or copy it to every node); the message
    names the setting, its value and line on each node.
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = {n: v for n, v in _self_started(ctx).items() if v.get("distributed_type") == "DEEPSPEED"}
    if not views:
        yield skip("no node launches with DeepSpeed on its own (none, or the head's runner starts every node)")
        return
    settings = {n: v.get("deepspeed_settings") for n, v in views.items()}
    missing = [n for n, s in settings.items() if s is None]
    present = {n: s for n, s in settings.items() if s is not None}
    if missing and present:
        yield Finding(Status.FAIL, f"{fold(missing)} {'reads' if len(missing) == 1 else 'read'} no DeepSpeed config "
                      f"file, {fold(list(present))} {'reads' if len(present) == 1 else 'read'} one",
                      "name the same DeepSpeed config file on every node", nodes=tuple(missing))
    if len(present) < 2:
        if not missing:
            yield skip("fewer than two nodes read a DeepSpeed config file")
        return
    differ = set()
    for node, key, value, majority, others, line in _differing(present, ctx.plan.head):
        differ.add(node)
        where = f"{node}:{views[node].get('deepspeed_path')}{':' + str(line) if line else ''}"
        value, majority = redact.value(key, value), redact.value(key, majority)
        others = others if not redact.secret_name(key.rsplit(".", 1)[-1]) else "the others have"
        yield Finding(Status.FAIL, f"DeepSpeed setting {key} is {value!r} on {node} ({where}), {others} {majority!r}",
                      f"make {key} the same in every node's DeepSpeed config", nodes=(node,),
                      evidence={"key": key, "value": value, "expected": majority})
    same = tuple(n for n in present if n not in differ)
    if same:
        yield Finding(Status.PASS, "the same DeepSpeed settings", nodes=same)


@check("JOB007", "same-files", "cluster", tags=["job", "files", "multinode"])
def same_files(ctx) -> Iterator[Finding]:
    """The training script and the files named on the launch command exist on every node with the same
    content (a SHA-256 digest read on each node); a config file the launch reads (accelerate's
    --config_file, a DeepSpeed config) has the same settings as its launcher reads them, less the keys
    that differ per node by design (machine_rank).

    Without a shared filesystem, a train.py edited on one node and not copied to the others runs different
    code per rank: a different model or a collective the others never reach, which hangs.

    Copy the files to every node (rsync), or run from a shared filesystem; the message names the node
    with the other content.
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    views = _views(ctx)
    names = list(dict.fromkeys(name for v in views.values() for name in (v.get("files") or {})))
    if not names:
        yield skip("no file on the launch command (give it after `--`)")
        return
    command = ctx.plan.launch
    # The script and the files the launcher reads must match; other arguments may be outputs, logs or
    # per-node shards: a difference there is only a warning.
    critical = {command.script} | {v for k, v in command.options.items() if k in launchcmd.FILE_OPTIONS} \
        if command is not None else set()
    # A config file is compared by its settings as its launcher reads them (preflight.job.view settings_files:
    # accelerate's without machine_rank and the other per-node keys, DeepSpeed's parsed), not byte for byte.
    critical |= {name for v in views.values() for name, e in (v.get("files") or {}).items() if e.get("settings_of")}
    bad, compared = set(), []
    for name in names:
        shown = redact.text(name)
        status = Status.FAIL if name in critical else Status.WARN
        entries = {n: (v.get("files") or {}).get(name) or {} for n, v in views.items()}
        missing = [n for n, e in entries.items() if e.get("error") == "missing"]
        if len(missing) == len(entries):
            continue  # on no node: not a file the job reads (an output to be written, a name)
        compared.append(shown)
        if missing:
            bad.update(missing)
            yield Finding(status, f"{shown} is missing on {fold(missing)} "
                          f"({redact.text(str(entries[missing[0]].get('path')))}), present on the others",
                          f"copy {shown} to {fold(missing)}", nodes=tuple(missing), evidence={"file": shown})
        digests = {n: e.get("settings_sha") or e.get("sha256") for n, e in entries.items() if e.get("sha256")}
        majority, odd = odd_ones_out(digests, ctx.plan.head)
        for value in dict.fromkeys(odd.values()):
            nodes = [n for n, d in odd.items() if d == value]
            bad.update(nodes)
            reference = next(n for n in digests if n not in odd)
            read_as = entries[nodes[0]].get("settings_of") or entries[reference].get("settings_of")
            what = f"settings {value[:8]} as {read_as};" if read_as else f"sha256 {value[:8]},"
            yield Finding(status, f"{shown} differs on {fold(nodes)} ({redact.text(str(entries[nodes[0]].get('path')))}, "
                          f"{what} {entries[nodes[0]].get('size')} bytes against "
                          f"{entries[reference].get('size')}; {holders(digests, majority)} {majority[:8]})",
                          f"copy the right {shown} to {fold(nodes)} (rsync), or run from a shared filesystem",
                          nodes=tuple(nodes), evidence={"file": shown, "sha256": value, "expected": majority})
    same = tuple(n for n in views if n not in bad)
    if same and compared:
        yield Finding(Status.PASS, f"the same {len(compared)} file(s): {', '.join(compared[:4])}", nodes=same)
    elif not compared:
        yield skip("no file of the launch command exists on any node (outputs, or names that are not files)")


def _visible_gpus(facts: Mapping[str, Any]) -> Optional[List[str]]:
    """The GPU indices the job's processes can use: NVML's, narrowed by CUDA_VISIBLE_DEVICES."""
    gpus = facts.get("gpus") or {}
    if not gpus.get("available"):
        return None
    devices = gpus.get("devices") if isinstance(gpus.get("devices"), list) else []
    indices = [str(d.get("index")) for d in devices if isinstance(d, dict)]
    visible = (facts.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    if isinstance(visible, str):
        uuids = {str(d.get("uuid")): str(d.get("index")) for d in devices if isinstance(d, dict)}
        chosen = [uuids.get(v.strip(), v.strip()) for v in visible.split(",") if v.strip()]
        return [c for c in chosen if c in indices]
    return indices


@check("JOB008", "processes-and-gpus", "cluster", tags=["job", "gpu", "accelerate"])
def processes_and_gpus(ctx) -> Iterator[Finding]:
    """The processes the node's launch starts fit its GPUs: no more than the GPUs it sees (NVML, narrowed
    by CUDA_VISIBLE_DEVICES), and every index of gpu_ids exists there.

    A process without its own GPU fails with 'invalid device ordinal' or shares a GPU and runs out of memory;
    the other nodes then wait in the first collective.

    Lower the processes (num_processes / num_machines, --nproc-per-node) to the GPUs of the node, or list
    existing GPUs in gpu_ids; every node needs the same number of processes.
    """
    views = _views(ctx)
    if not views:
        yield skip("no node's launch was read")
        return
    yield from grouped(lambda node: _processes_and_gpus(views[node], node, ctx.facts[node]["facts"]),
                       [n for n in views if n in ctx.reachable]) or [skip("no node's launch was read")]


def _processes_and_gpus(view: dict, node: str, facts: Mapping[str, Any]) -> Iterator[Finding]:
    use_cpu = ((view.get("accelerate_settings") or {}).get("use_cpu") or (False,))[0] is True
    if view.get("accelerate_launcher") in ("simple", "xla") or use_cpu:
        yield skip("the processes do not run on GPUs here (use_cpu, --cpu, or no multi-GPU distributed_type)")
        return
    gpus = _visible_gpus(facts)
    if gpus is None:
        yield skip("no GPUs seen through NVML on this node")
        return
    procs = view.get("processes")
    ids = view.get("gpu_ids")
    if deepspeed_runner(view.get("accelerate_launcher"), view.get("num_machines"), view.get("multinode_launcher")):
        ids = None  # each node uses the GPUs of its hostfile slots, gpu_ids is never read
    if isinstance(ids, (str, int)) and str(ids).strip() not in ("all", ""):
        listed = [i.strip() for i in str(ids).split(",") if i.strip()]
        absent = [i for i in listed if i not in gpus]
        if absent:
            yield Finding(Status.FAIL, f"gpu_ids {ids!r} ({_where(view, node, 'gpu_ids')}) names GPU "
                          f"{', '.join(absent)}, which this node does not have (it sees {', '.join(gpus) or 'none'})",
                          f"list GPUs of this node in gpu_ids ({', '.join(gpus)}), or 'all'", evidence={"gpus": gpus})
            return
        gpus = listed
    if isinstance(procs, int) and procs > len(gpus):
        yield Finding(Status.FAIL, f"{procs} processes on this node ({_where(view, node, 'processes')}), but it "
                      f"has {len(gpus)} usable GPU(s)", f"start at most {len(gpus)} processes per node (num_processes "
                      f"= {len(gpus)} x num_machines), on every node alike", evidence={"processes": procs, "gpus": len(gpus)})
    elif isinstance(procs, int):
        yield passed(f"{procs} process(es) on {len(gpus)} usable GPU(s)", processes=procs, gpus=len(gpus))
    else:
        yield skip("the number of processes on this node is not known (num_processes not set)")


@check("JOB009", "quiet-session", "cluster", tags=["job", "ssh", "shell"])
def quiet_session(ctx) -> Iterator[Finding]:
    """The node's non-interactive SSH session prints nothing on stdout before the command runs.

    A start-up file that echoes (a ~/.bashrc banner, `conda activate` chatter, BASH_ENV) corrupts every
    tool that reads a remote command's output: rsync and scp stop with 'protocol version mismatch',
    DeepSpeed's runner reads the banner as `hostname -I`, and launch scripts parse the wrong line.

    Print only in interactive shells: put `[[ $- == *i* ]] || return` at the top of ~/.bashrc (before
    anything that prints), or send the output to stderr.
    """
    if not ctx.plan.remote:
        yield skip("this machine alone: no SSH session")
        return
    yield from grouped(lambda node: _quiet_session(ctx.facts[node]["facts"]), ctx.reachable) or \
        [skip("no node was reached")]


def _quiet_session(facts: Mapping[str, Any]) -> Iterator[Finding]:
    session = facts.get("session") if isinstance(facts.get("session"), dict) else {}
    printed = session.get("stdout")
    if printed:
        lines = str(printed).strip().splitlines() or [""]
        shown = lines[0][:80] + (f" (and {len(lines) - 1} more line(s))" if len(lines) > 1 else "")
        yield warn(f"the non-interactive SSH session prints {shown!r} on stdout before any command",
                   "print only in interactive shells: `[[ $- == *i* ]] || return` at the top of ~/.bashrc, or "
                   "send it to stderr", printed=str(printed)[:400])
    else:
        yield passed("the non-interactive SSH session prints nothing on stdout")


@check("JOB010", "launcher-on-path", "cluster", tags=["job", "python", "ssh"])
def launcher_on_path(ctx) -> Iterator[Finding]:
    """The launch command's program (accelerate, torchrun, deepspeed, python) is found on every node's
    non-interactive SSH PATH, and runs the same interpreter on every node, the one given with --python; so are
    the programs the launch runs by name there: `deepspeed` under accelerate's DeepSpeed runner, and on the
    head the backend of DeepSpeed's multinode launcher (pdsh, mpirun, ...).

    Non-interactive SSH sessions skip the profile that activates the environment: `accelerate` is not
    found, or another one runs (a system Python, another venv) with other versions than the ones
    preflight read with --python.

    Call the launcher by its full path (/opt/venv/bin/accelerate launch ...), or put the environment's
    bin folder first on PATH for non-interactive sessions (sshd's SetEnv, ~/.ssh/environment, the top of
    ~/.bashrc); pass --python with the interpreter the launcher runs.
    """
    views = _views(ctx)
    if not ctx.plan.command:
        yield skip("no launch command given (after `--`)")
        return
    yield from _run_by_name(views)
    programs = {n: v.get("program") for n, v in views.items() if isinstance(v.get("program"), dict)}
    if not programs:
        yield skip("no node's launch was read")
        return
    name = next(iter(programs.values())).get("name")
    missing = [n for n, p in programs.items() if not p.get("path")]
    if missing:
        yield Finding(Status.FAIL, f"{name} is not found on the non-interactive SSH PATH of {fold(missing)}: the "
                      "launch stops there with 'command not found'", f"call it by its full path, or put its folder "
                      "on PATH for non-interactive sessions", nodes=tuple(missing), evidence={"program": name})
    found = {n: p.get("interpreter") or p.get("real") for n, p in programs.items() if p.get("path")}
    majority, odd = odd_ones_out(found, ctx.plan.head)
    for node, interpreter in odd.items():
        yield Finding(Status.WARN, f"{name} on {node} runs {interpreter}, {holders(found, majority)} {majority}",
                      f"install the same environment at the same path on {node}", nodes=(node,),
                      evidence={"program": programs[node].get("path"), "interpreter": interpreter, "expected": majority})
    python = ctx.plan.python
    is_python = re.fullmatch(r"python[0-9.]*", os.path.basename(str(name or ""))) is not None
    # A launcher whose #! runs a Python (accelerate, torchrun) tells the interpreter; a shell or a wrapper script
    # (bash run.sh, ./run.sh) does not: the Python it starts is its own business, and --python is not the shell.
    runs_python = isinstance(majority, str) and re.fullmatch(r"python[0-9.]*", os.path.basename(majority))
    if python and runs_python and not is_python and not _same_environment(majority, python):
        nodes = tuple(n for n in found if n not in odd)
        yield Finding(Status.WARN, f"{name} runs {majority}, but the versions were read with --python {python}",
                      f"pass --python {majority}", nodes=nodes, evidence={"interpreter": majority, "python": python})
        return
    ok = tuple(n for n in found if n not in odd)
    if ok:
        wrapper = "" if runs_python or is_python else ": a shell or wrapper, so the Python it starts is not known here"
        yield Finding(Status.PASS, f"{name} is {programs[ok[0]].get('path')}" +
                      (f", run by {majority}" if programs[ok[0]].get("interpreter") else "") + wrapper, nodes=ok)


def _run_by_name(views: Mapping[str, dict]) -> Iterator[Finding]:
    """A program the launch runs by name on a node (preflight.job.view, "runs"), not on that node's PATH."""
    missing: Dict[str, List[str]] = {}
    for node, view in views.items():
        for name, found in (view.get("runs") if isinstance(view.get("runs"), dict) else {}).items():
            if isinstance(found, dict) and not found.get("path"):  # None: the node was not asked
                missing.setdefault(name, []).append(node)
    for name, nodes in missing.items():
        why = ("accelerate runs DeepSpeed's runner by that name, and stops with FileNotFoundError: 'deepspeed'"
               if name == "deepspeed" else
               "DeepSpeed's runner looks for it to start the nodes, and stops with \"launcher '...' not installed\"")
        yield Finding(Status.FAIL, f"{name} is not found on the non-interactive SSH PATH of {fold(nodes)}, where the "
                      f"launch runs it by name: {why}", f"put the folder of {name} on PATH for non-interactive "
                      "sessions (sshd's SetEnv, the top of ~/.bashrc)", nodes=tuple(nodes),
                      evidence={"program": name})


def _same_environment(a: str, b: str) -> bool:
    """Two interpreter paths of one environment: the same bin folder (python and python3.11 of one venv)."""
    return os.path.dirname(a) == os.path.dirname(b)


@check("JOB011", "deepspeed-master-address", "cluster", tags=["job", "deepspeed", "network"])
def deepspeed_master_address(ctx) -> Iterator[Finding]:
    """Without --master_addr, DeepSpeed's runner tells every node to meet at the first address `hostname -I`
    prints on the first host; that address is one the other nodes reach the head at.

    On hosts with a docker bridge, a management network or several NICs, the first address is often not on
    the training network: every rank waits in the rendezvous for an address it cannot reach.

    Pass --master_addr with the head's address on the training network to `deepspeed` (accelerate passes
    main_process_ip for you).
    """
    gate = _multi_node_or_skip(ctx)
    if gate:
        yield gate
        return
    head = ctx.plan.head
    view = _views(ctx).get(head) or {}
    if view.get("launcher") != "deepspeed":
        yield skip("the launch command is not DeepSpeed's runner")
        return
    if view.get("main_ip"):
        yield passed(f"--master_addr {view['main_ip']} is given", nodes=[head])
        return
    interfaces = _host(ctx, head).get("interfaces") if head in ctx.reachable else {}
    interfaces = interfaces if isinstance(interfaces, dict) else {}
    first = next((a for addrs in interfaces.values() if isinstance(addrs, list) for a in addrs
                  if _ipv4(a) and not a.startswith("127.")), None)
    reached = {n: _host(ctx, n).get("head_resolves_to") for n in ctx.reachable if n != head}
    reached = {n: a[0] for n, a in reached.items() if isinstance(a, list) and a}
    used = [a for a in reached.values() if isinstance(a, str)]
    if first is None or not used:
        yield skip("the head's first address or the workers' view of the head is not known")
    elif first in used:
        yield Finding(Status.PASS, f"`hostname -I` on {head} starts with {first}, the address the workers reach",
                      nodes=(head,), evidence={"address": first})
    else:
        owner = next((n for n, addrs in interfaces.items() if isinstance(addrs, list) and first in addrs), "?")
        yield Finding(Status.WARN, f"DeepSpeed's runner would give every node MASTER_ADDR={first} (the first address "
                      f"of `hostname -I` on {head}, on {owner}), but the workers reach {head} at {used[0]}",
                      f"pass --master_addr {used[0]} to deepspeed", nodes=(head,),
                      evidence={"address": first, "interface": owner, "expected": used[0]})


def _ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False
