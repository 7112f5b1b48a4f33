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
from preflight.inputs import launchcmd, manifests
from preflight.inputs.settings import job_variables, processes_per_machine
from preflight.inputs.versions import version
from preflight.job.nccl import nccl_env, nccl_version
from preflight.node import flightrec
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
                      "write the hostfile there (`host slots=N` a line), or name it with --hostfile", nodes=(head,))
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
                      "launch stops there with 'command not found'", "call it by its full path, or put its folder "
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


# ---- JOB012: what a hang would leave to read ------------------------------------------------------------------
# torch 2.13 reads each of these under its name, then its older one (c10d Utils.hpp getCvar*: the first set wins).
FR_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # FlightRecorder.hpp: 2000 entries; <= 0 off
FR_ENTRIES = 2000
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)  # ProcessGroupNCCL.cpp: dumpOnTimeoutOrEx_, default true
TRUE_WORDS, FALSE_WORDS = ("y", "yes", "1", "t", "true"), ("n", "no", "0", "f", "false")  # getCvarBool
TORCH_READ = "2.13"  # the release whose sources these rules and defaults were read from
RAS_ADDR = "NCCL_RAS_ADDR"
RAS_DEFAULT = "localhost:28028"  # NCCL 2.24+ (src/ras/client_support.cc), bound with SO_REUSEPORT
RAS_SINCE = (2, 24)
LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")
WILDCARD = ("0.0.0.0", "::")


def _first(env: Mapping[str, str], later: Mapping[str, str], names) -> tuple:
    """(name, value) of the first of `names` the job sets as torch reads them; value None: at run time (later);
    (None, None): none is set."""
    for name in names:
        if name in env:
            return name, env[name]
        if name in later:
            return name, None
    return None, None


def _stoi(text: str) -> Optional[int]:
    """The number std::stoi reads (leading blanks, a sign, digits; the rest ignored), None where it throws."""
    found = re.match(r"\s*([+-]?\d+)", text)
    return int(found.group(1)) if found and abs(int(found.group(1))) < 2 ** 31 else None


def _nccl_name(text: str) -> set:
    """What NCCL puts in NCCL_DEBUG_FILE's name (src/debug.cc): "h" for %h (the host), "p" for %p (the pid); %%
    is a %, anything else after % stays as written."""
    found, k = set(), 0
    while k < len(text):
        if text[k] == "%" and k + 1 < len(text):
            if text[k + 1] in "hp":
                found.add(text[k + 1])
            k += 2
        else:
            k += 1
    return found


def _per_node(plan) -> Optional[int]:
    """The processes one launch starts on its node, where the launch says it (torchrun --nproc_per_node,
    accelerate's num_processes over num_machines, deepspeed --num_gpus); None where not known."""
    cmd = plan.launch
    if cmd is None:
        return None
    if cmd.launcher == "torchrun":
        return cmd.integer("nproc_per_node") if cmd.get("nproc_per_node") is not None else 1
    if cmd.launcher == "accelerate" and plan.accelerate is not None:
        return processes_per_machine(plan.accelerate.data)
    return cmd.integer("num_gpus") if cmd.launcher == "deepspeed" else None


def _mount_of(container, folder: str):
    """(mountPath, volume name) of the container's mount that holds `folder`, the deepest; None: its own filesystem."""
    held = [(path, name) for path, name in container.mounts
            if folder == path.rstrip("/") or folder.startswith(path.rstrip("/") + "/")]
    return max(held, key=lambda m: len(m[0])) if held else None


def _dump_place(plan, name: Optional[str], prefix: str) -> tuple:
    """(a warning or None, a note) on where a Kubernetes container's ranks dump their records (PREFIX<rank>); the
    note None where the container asks for no GPU, so that no NCCL watchdog runs there to dump them."""
    main = plan.manifest.main if plan.manifest is not None else None
    if main is not None and manifests.gpus(main[2]) == 0:
        return None, None
    if main is None or not prefix.startswith("/"):
        return None, ""
    _, group, container = main
    mount = _mount_of(container, os.path.dirname(prefix) or "/")
    if mount is None:
        if name is None:
            return None, f"; in container {container.name}'s own filesystem unless $HOME is on a volume"
        return warn(f"{name}={prefix}: {os.path.dirname(prefix) or '/'} is on no volume of container "
                    f"{container.name}, so the records NCCL's watchdog dumps on a timeout stay in the container's "
                    "own filesystem: kubectl cannot copy them from a container that has exited, and they are gone "
                    "when it restarts or the pod is deleted",
                    f"point {name} into a mounted volume that outlives the pod (a hostPath or a persistent volume "
                    f"claim), e.g. {name}=/MOUNT/fr_rank_", variable=name, prefix=prefix,
                    container=container.name), ""
    volume = group.volumes.get(mount[1]) or {}
    kind = next((k for k in volume if k != "name"), "volume")
    kept = ": kept while the pod lives" if kind == "emptyDir" else ""
    return None, f"; on volume {mount[1]}, a {kind}, at {mount[0]}{kept}"


def _default(torch: Optional[str]) -> str:
    """Whose default a value left unset takes: torch 2.13's, said as such for an older torch of a node."""
    older = torch is not None and (version(torch) or version("0")).release < version(TORCH_READ).release
    return f"torch {TORCH_READ}'s default" + (f", not read for the node's torch {torch}: set it there" if older else "")


def _recorder(env, later, plan, torch=None) -> tuple:
    """(warnings, what a hang leaves by the flight recorder, in words; evidence) for one environment."""
    warnings, notes, evidence = [], [], {}
    name, size = _first(env, later, FR_SIZE)
    entries = FR_ENTRIES if name is None else _stoi(size) if size is not None else None
    if size is not None and entries is None:
        warnings.append(warn(f"{name}={size!r} is no number torch reads (std::stoi): each rank dies or hangs as its "
                             "first process group starts the flight recorder (torch 2.13 with gloo: \"terminate "
                             "called without an active exception\", or stuck in init_process_group)",
                             f"set {name} to a number of entries (torch's default {FR_ENTRIES}), or 0 to turn the "
                             "recorder off", variable=name, value=size))
        return warnings, [], {"flight_recorder": None}
    evidence["flight_recorder"] = entries
    if name is not None and size is None:
        return warnings, [f"the flight recorder's size ({name}) is set at run time"], evidence
    if entries == 0:
        return warnings, [f"no flight recorder ({name}={size})"], evidence
    made = f"{name}={size}" if name else _default(torch)
    if entries < 0:  # max_entries_ is a size_t: a negative number wraps, and the ring never wraps (record())
        warnings.append(warn(f"{name}={size} is negative: torch keeps it as a size_t, so the flight recorder's ring "
                             "never wraps and every collective's record stays for the job's life: each rank's host "
                             "memory grows with every collective", f"set {name} to a number of entries (torch's "
                             f"default {FR_ENTRIES}), or 0 to turn the recorder off", variable=name, value=size))
        entries, made = "all", f"{name}={size}"
    dump_name, dump = _first(env, later, DUMP_ON_TIMEOUT)
    dumps = True if dump_name is None else None if dump is None else \
        True if dump.lower() in TRUE_WORDS else False if dump.lower() in FALSE_WORDS else "bad"
    evidence["dump_on_timeout"] = dumps if dumps != "bad" else None
    if dumps == "bad":
        warnings.append(warn(f"{dump_name}={dump!r} is neither true nor false: torch raises \"Invalid value for "
                             f"environment variable: {dump_name}\" when it creates an NCCL process group",
                             f"set {dump_name}=1 (or 0)", variable=dump_name, value=dump))
        return warnings, [], evidence
    recorder = f"the flight recorder ({'every' if entries == 'all' else entries} entries per rank, {made})"
    if dumps is False:
        return warnings, [f"{recorder}, not dumped on a timeout ({dump_name}={dump}): read only while the job "
                          "runs"], evidence
    when = "on a timeout" if dumps else f"on a timeout if {dump_name} (set at run time) says so"
    prefix_name, prefix = _first(env, later, flightrec.PREFIX_VARS)
    if prefix_name is not None and prefix is None:
        notes.append(f"{recorder} dumped by NCCL's watchdog {when} to a place set at run time ({prefix_name})")
        return warnings, notes, evidence
    shown = prefix or "~/.cache/torch/" + flightrec.DEFAULT_NAME
    evidence["dump_prefix"] = shown
    found, place = _dump_place(plan, prefix_name, shown) if dumps else (None, "")
    warnings += [found] if found else []
    if place is None:
        notes.append(f"{recorder}, not dumped: container {plan.manifest.main[2].name} asks for no GPU, so no NCCL "
                     "watchdog runs there")
        return warnings, notes, evidence
    whose = prefix_name or "torch's default: each rank's $XDG_CACHE_HOME or $HOME"
    notes.append(f"{recorder} dumped by NCCL's watchdog {when} to {shown}<rank> ({whose}{place}); a gloo process "
                 "group records but never dumps on a timeout")
    return warnings, notes, evidence


def _nccl_log(env, later, plan, torch=None) -> tuple:
    """(warnings, what NCCL's log leaves, in words; evidence) for one environment."""
    name, value = _first(env, later, ("NCCL_DEBUG_FILE",))
    if name is None:
        return [], ["NCCL's log on each rank's stdout (NCCL_DEBUG_FILE not set)"], {"nccl_debug_file": None}
    written = value if value is not None else later.get(name) or ""
    folder, _, file = written.rpartition("/")
    evidence = {"nccl_debug_file": written}
    if value in ("/dev/stdout", "/dev/stderr"):
        return [], [f"NCCL's log on {value}"], evidence
    if value is None and ("$" in file or "`" in file or not file):  # the file's name is known only at run time
        return [], [f"NCCL's log in {written} (set at run time)"], evidence
    level = env.get("NCCL_DEBUG")
    if isinstance(level, str) and level.upper() in ("", "VERSION"):  # src/debug.cc opens the file above VERSION only
        return [], [f"no NCCL log file: NCCL_DEBUG={level} writes none to NCCL_DEBUG_FILE={written}"], evidence
    marks = _nccl_name(file if value is None else value)
    procs = _per_node(plan)
    if "p" not in marks and procs is not None and procs > 1:
        ranks = f"the {procs} ranks on a node" if "h" in marks else f"the {procs} ranks on a node (and every node's "\
            "in a shared folder)"
        stem, dot, ext = re.sub(r"[._-]*%h", "", file).rpartition(".")
        fix = (folder + "/" if folder else "") + (f"{stem}.%h.%p.{ext}" if dot and stem else f"{file or 'nccl'}.%h.%p")
        return [warn(f"NCCL_DEBUG_FILE={written} has no %p: {ranks} write the same file, each truncating it when "
                     "NCCL starts (fopen \"w\"), so their logs are lost or mixed (NCCL's documentation: the name must "
                     "be unique across the job's processes)", f"name each process's log: NCCL_DEBUG_FILE={fix}",
                     variable=name, value=written, processes_per_node=procs)], [], evidence
    unique = "per process" if {"h", "p"} <= marks else "per process on a node (%p; add %h for a shared folder)" \
        if "p" in marks else "per node (%h; one process per node)" if "h" in marks else "one for the job"
    return [], [f"NCCL's log in {written} ({unique})"], evidence


def _debuggable(env, later, plan, torch=None) -> tuple:
    warnings, notes, evidence = [], [], {}
    for part in (_recorder, _nccl_log):
        found, said, ev = part(env, later, plan, torch)
        warnings += found
        notes += said
        evidence.update(ev)
    pending = [n for n in sorted(later) if n in FR_SIZE + DUMP_ON_TIMEOUT + flightrec.PREFIX_VARS +
               ("NCCL_DEBUG_FILE", RAS_ADDR)]
    evidence["at_run_time"] = pending
    return warnings, "a hang leaves " + "; ".join(notes), evidence


def _ras_port(env, later) -> tuple:
    """(the address NCCL's RAS listens on, its port or None where not known here)."""
    name, value = _first(env, later, (RAS_ADDR,))
    if name is not None and value is None:
        return later[name], None
    address = value or RAS_DEFAULT
    host, _, port = address.rpartition(":")
    return address, int(port) if port.isdigit() and host else None


def _ras_taken(env, later, facts) -> Optional[Finding]:
    """A warning where NCCL's RAS address is already listened on on the node (another NCCL job there)."""
    release = nccl_version(facts)
    address, port = _ras_port(env, later)
    listening = _section(facts, "host").get("listening")
    if release is None or release < RAS_SINCE or port is None or not isinstance(listening, list):
        return None
    host = address.rpartition(":")[0].strip("[]")
    same = (lambda a: a in LOOPBACK or a in WILDCARD) if host in LOOPBACK else (lambda a: a == host or a in WILDCARD)
    if not any(isinstance(e, list) and len(e) == 2 and e[1] == port and same(str(e[0])) for e in listening):
        return None
    return warn(f"{address}, where NCCL {'.'.join(map(str, release))}'s RAS listens (NCCL_RAS_ADDR, default "
                f"{RAS_DEFAULT}), is already listened on on this node: another NCCL job runs here, and this job's RAS "
                "shares its socket (the same user: a RAS query reaches either job) or cannot listen at all (another "
                "user)", "give each job on a node its own address, e.g. export NCCL_RAS_ADDR=localhost:$((28028 + "
                "SLURM_JOB_ID % 1000)) (a port free on the node)", address=address, port=port)


def _section(facts: Mapping, name: str) -> Mapping:
    """A section of a node's facts, {} where the node sent something else (a hostile or broken node)."""
    value = facts.get(name)
    return value if isinstance(value, dict) else {}


def _stacks(facts) -> Finding:
    """Whether py-spy, run on the node as preflight was, can read a hung rank's Python stacks (Yama's ptrace_scope:
    0 the same user, 1 a descendant or CAP_SYS_PTRACE, 2 CAP_SYS_PTRACE, 3 no one)."""
    host = _section(facts, "host")
    if "py_spy" not in host:
        return skip("the node did not report py-spy and ptrace (a preflight older than this one collected its facts)")
    scope, capable, uid, tool = (host.get(k) for k in ("ptrace_scope", "sys_ptrace", "uid", "py_spy"))
    evidence = {k: host.get(k) for k in ("ptrace_scope", "sys_ptrace", "uid", "py_spy", "container")}
    if scope == 3:
        return warn("kernel.yama.ptrace_scope is 3: no process may attach to another, not even root's, so py-spy "
                    "(and doctor) cannot read a hung rank's Python stacks; the value holds until a reboot",
                    "boot with kernel.yama.ptrace_scope=1 (a sysctl.d file), and keep the flight recorder's dumps",
                    **evidence)
    if scope in (1, 2) and capable is False and uid == 0:
        inside = f" (in a container: {host['container']})" if host.get("container") else ""
        return warn(f"root here lacks CAP_SYS_PTRACE{inside} and kernel.yama.ptrace_scope is {scope}: py-spy run "
                    "here cannot attach to the job's ranks, so a hang's Python stacks cannot be read",
                    "start the container with SYS_PTRACE (docker run --cap-add SYS_PTRACE; Kubernetes: "
                    "securityContext.capabilities.add: [SYS_PTRACE]), or run doctor outside it", **evidence)
    how = ("as root or the job's user" if scope in (None, 0) else "as this user" if capable else
           f"as root only (sudo; ptrace_scope {scope})")
    found = f"py-spy ({tool}) reads a hang's Python stacks {how}" if tool else \
        f"py-spy is not installed (pip install py-spy in the training environment); it could read stacks {how}"
    return passed(found, **evidence)


@check("JOB012", "hang-debuggable", "config", tags=["job", "debug", "flight-recorder", "nccl", "py-spy"])
def hang_debuggable(ctx) -> Iterator[Finding]:
    """What a hang of the job would leave to find its cause: torch's flight recorder (TORCH_FR_BUFFER_SIZE, 2000
    entries by default in torch 2.13, gloo's collectives too), where NCCL's watchdog dumps it on a timeout
    (TORCH_NCCL_DUMP_ON_TIMEOUT, on by default; TORCH_FR_DUMP_TEMP_FILE, files PREFIX<rank>, by default under each
    rank's ~/.cache/torch; the older TORCH_NCCL_* names too), NCCL's log file (NCCL_DEBUG_FILE, %h the host, %p the
    pid) and, with `check`, py-spy and ptrace on every node (kernel.yama.ptrace_scope, CAP_SYS_PTRACE) and NCCL's
    RAS address (NCCL_RAS_ADDR, localhost:28028) already listened on there. The variables are the job's (a batch
    script's exports, a manifest's env, the launch's VAR=value), over each node's with `check`; one set at run time
    is named, not judged. torch's debug server and elastic's worker socket (worker_main, which doctor asks at each
    rank's TORCH_WORKER_SERVER_SOCKET) are started by the training code: whether it does is not seen here.

    The ranks' stacks of a hung job often cannot tell the culprit (asynchronous collectives wait together); the
    flight recorder's records can. A warning names what the job set that loses them or stops the job: a dump
    prefix on no volume of a Kubernetes container, an NCCL_DEBUG_FILE without %p that the ranks of a node truncate
    in turn, a value torch cannot read, a negative size, a RAS address another NCCL job on the node listens on,
    ptrace_scope 3, or root without CAP_SYS_PTRACE where ptrace_scope asks for it. The rest is a pass saying what a
    hang leaves, torch 2.13's defaults named as such (older releases keep the recorder or its dump off), and that
    doctor needs root where ptrace_scope is 1 or 2 for a user without CAP_SYS_PTRACE.

    Set TORCH_FR_DUMP_TEMP_FILE to a prefix in a folder that outlives the job, NCCL_DEBUG_FILE=/path/nccl.%h.%p,
    a distinct NCCL_RAS_ADDR per job on a shared node; install py-spy in the training environment and keep
    ptrace_scope below 3 (a container: add SYS_PTRACE).
    """
    known, later = job_variables(ctx.plan)
    if not ctx.facts:
        if ctx.plan.launch is None and ctx.plan.batch is None and ctx.plan.manifest is None:
            yield skip("no launch given (--sbatch, --k8s or -- COMMAND): the job's variables are not known")
            return
        warnings, said, evidence = _debuggable(known, later, ctx.plan)
        yield from warnings
        yield passed(said + " (as the job's files set it; the environment it starts in may set more)", **evidence)
        return
    nodes = [n for n in ctx.reachable if n in ctx.facts]
    if not nodes:
        yield skip("no node was reached")
        return

    def on(node):
        facts = ctx.facts[node]["facts"]
        env = nccl_env(facts, known).values  # the job's own settings over the node's, then NCCL's files
        versions = _section(_section(facts, "packages"), "versions")
        warnings, said, evidence = _debuggable(env, later, ctx.plan, versions.get("torch"))
        taken = _ras_taken(env, later, facts)
        return warnings + ([taken] if taken else []) + [_stacks(facts), passed(said, **evidence)]
    yield from grouped(on, nodes)
