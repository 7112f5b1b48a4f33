"""COL: the all-reduce smoke test across the nodes (probes["collective"], from preflight.collective.allreduce)."""
from __future__ import annotations

import re
from typing import Iterator, Optional

from preflight.api import Finding, Status, cause_of, check, fold, skip
from preflight.job.nccl import rdma_devices_nccl_may_use
from preflight.collective.options import format_size
from preflight.collective.nccllog import over_sockets
from preflight.collective.pairwise import SLOWER, findings

FIXES = {
    "import": "make `{python} -c 'import torch'` work on {node}: install torch there (the same version as on the "
              "other nodes), or fix what the error names (a PYTHONPATH that shadows torch, a broken install)",
    "start": "make the training interpreter run on {node} (--python); the tail in the evidence says why it stopped",
    "died": "a rank process on {node} crashed (see the tail in the evidence): check its memory, its GPUs (GPU "
            "checks) and its torch install",
    "no-answer": "{node} did not answer in time: check its load and its sshd, then run again",
    "slow-import": "find out why `{python} -c 'import torch'` is slow on {node} (a cold network filesystem, an "
                   "overloaded node), or raise --timeout",
    "rendezvous-head": "open TCP port {port} on the head {node} to the other nodes (firewall, security group: see "
                       "NET004), check that nothing else holds it (NET003), or choose another port (--port / "
                       "main_process_port)",
    "rendezvous": "check the route and the firewall from {node} to the head {head} on port {port} (NET004, NET006)",
    "bisect": "check {node}'s network for the collective: its hostname must resolve to its training-network "
              "address (NET001), GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME must name that interface (NET005), and "
              "the firewall must let the nodes connect to each other on any port (gloo and NCCL use ephemeral ports)",
    "failed": "run the job's backend by hand on {node} to see the error; the tail in the evidence is its output",
    "link": "check the path between {node} and {peers}: a firewall or security group between them (gloo and NCCL "
            "connect on ephemeral ports), a route that takes another interface, a switch port; `preflight check "
            "--only COL` again shows the matrix (COL004)",
    "path": "fix what {checks} say(s) of {node}: the route that takes the traffic elsewhere (NET010), the firewall "
            "on the ephemeral ports NCCL and gloo listen on (NET009), the MTU the path carries (NET008); `preflight "
            "check --only NET008,NET009,NET010` shows each",
    "link-row": "check {node}'s network: the other nodes cannot exchange data with it point to point (a firewall on "
                "{node} that lets in only some ports, its training interface, its route to the others)",
}


def _line(text: Optional[str], limit: int = 300) -> str:
    text = re.sub(r"\s+", " ", str(text or "")).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _probe(ctx):
    return (ctx.probes or {}).get("collective")


def _figures(probe) -> dict:
    """The evidence every COL result carries: the passing run's bandwidth (None when nothing was measured),
    and rank 0's check of the sums: {"ok", "expected" (the exact sum), "mismatches", "first"}."""
    result = (probe or {}).get("result") or {}
    return {"algbw_gbps": result.get("algbw_gbps"), "busbw_gbps": result.get("busbw_gbps"),
            "bytes": result.get("bytes"), "world_size": result.get("world_size"),
            "backend": (probe or {}).get("backend"), "procs_per_node": (probe or {}).get("procs_per_node"),
            "per_size": result.get("per_size") or [], "sum_check": result.get("sum_check"),
            "phase_s": (probe or {}).get("duration_s")}


def _collective(ctx):
    """(the all-reduce's probe, the evidence figures), or (None, None, a skip) when it did not run."""
    probe = _probe(ctx)
    if not ctx.plan.remote:
        reason = "this machine alone: the all-reduce runs across the job's nodes (give --hosts, --hostfile or --slurm)"
    else:
        reason = "the all-reduce did not run" if probe is None else probe.get("not_run")
    if reason:
        # Not run for a problem found on the way: the check that reports it (a skip, not a pass, only when
        # that check fails: preflight.runner.unhidden).
        cause = {"blocked_by": _cause(ctx)} if ctx.plan.remote and probe is not None else {}
        return None, None, skip(reason, algbw_gbps=None, busbw_gbps=None, **cause)
    return probe, _figures(probe), None


def _cause(ctx) -> str:
    """The check that reports why the gathering did not run the all-reduce (a node not reached, else the
    main port: taken on the head, NET003, or unreachable from a worker, NET004)."""
    for node, state in ctx.facts.items():
        if state.get("error") is not None or not state.get("facts"):
            return cause_of(ctx, node) or "SSH001"
    listen = ((ctx.probes or {}).get("port") or {}).get("listen") or {}
    return "NET004" if listen.get("bound") else "NET003"


def _measured(result: dict) -> str:
    sizes = ", ".join(f"{format_size(s['bytes'])} {s['busbw_gbps']:.3g}" for s in result.get("per_size") or [])
    return (f"busbw {result['busbw_gbps']:.3g} GB/s, algbw {result['algbw_gbps']:.3g} GB/s at "
            f"{format_size(result['bytes'])}" + (f" (busbw per size: {sizes})" if sizes else ""))


@check("COL001", "allreduce", "cluster", tags=["collective", "network", "gloo", "nccl"])
def allreduce(ctx) -> Iterator[Finding]:
    """An all-reduce across every node, one process per GPU with NCCL (else per node with gloo), joins all
    ranks and gives the exact sum on each; a node that does not join, breaks or hangs it is named.

    This is the first thing a multi-node job does: a node whose torch does not import, whose firewall drops
    the main port, or whose interfaces the others cannot reach makes every rank wait 10-30 minutes in the
    rendezvous or the first collective, with an error that names no node.

    Follow the remediation of the node named: make torch import there, open the main port on the head and
    the ephemeral ports between the nodes, set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the training
    network's interface; the evidence holds the tail of the failing rank's output (NCCL_DEBUG=INFO with nccl).
    """
    probe, figures, skipped = _collective(ctx)
    if skipped:
        yield skipped
        return
    head, port, python = probe.get("head"), probe.get("port"), probe.get("python") or "python"
    if probe.get("clash"):  # another run (or process) had the port: the nodes are not judged
        yield Finding(Status.FAIL, f"port clash, no node judged: {_line(probe['clash'])}", "run again once the other "
                      "run has ended, or give this run another port (--col-port PORT)", evidence=figures)
    for node, why in sorted((probe.get("untested") or {}).items()):
        # Untested because of a node at fault (named below: a failure of COL001), or because the node was not
        # reached; a deadline with nobody at fault leaves COL001 without a failure, so the skip becomes an error.
        state = (ctx.facts or {}).get(node) or {}
        cause = cause_of(ctx, node) if state.get("error") is not None or not state.get("facts") else "COL001"
        yield Finding(Status.SKIP, f"not tested: {why}", nodes=(node,), evidence=dict(figures, blocked_by=cause))
    for node, fault in sorted((probe.get("blamed") or {}).items()):
        yield _blame(node, fault, head, port, python, probe, figures)
    passed = list(probe.get("passed") or [])
    if passed:
        result = probe.get("result") or {}
        what = f"all-reduce of {result.get('world_size')} rank(s) on {len(passed)} node(s) over {probe.get('backend')}"
        done = f"{what}: every rank joined and the sums are exact"
        if result.get("busbw_gbps") is not None:
            done += f"; {_measured(result)}"
        yield Finding(Status.PASS, done, nodes=tuple(passed), evidence=figures)
    cleared = list(probe.get("cleared") or [])
    kinds = {f.get("kind") for f in (probe.get("blamed") or {}).values()}
    if cleared and "path" in kinds:
        yield Finding(Status.PASS, "reaches every peer it probed on the data path, and no probe names it (the full "
                      "group failed: see the nodes named, and NET008-NET010)", nodes=tuple(cleared), evidence=figures)
    elif cleared and kinds & {"link", "link-row"}:
        yield Finding(Status.PASS, "passes point to point with every peer it met in pairs of nodes (the full group "
                      "failed: see the nodes named, and COL004)", nodes=tuple(cleared), evidence=figures)
    elif cleared:
        yield Finding(Status.PASS, f"passes an all-reduce with the head {head} (the full group failed: see the node "
                      "named)", nodes=tuple(cleared), evidence=figures)


def _blame(node, fault, head, port, python, probe, figures) -> Finding:
    kind = fault.get("kind")
    error = _line(fault.get("error"))
    if kind == "import":
        message = error if error.startswith("cannot import torch") else f"cannot import torch: {error}"
    elif kind == "rendezvous":
        message = f"the rendezvous failed: {error}"
        kind = "rendezvous-head" if node == head else kind
    elif kind == "bisect":
        suspects = fault.get("suspects") or [node]
        bis = probe.get("bisect") or {}
        if bis.get("inconclusive"):
            message = (f"the all-reduce fails with all of {fold(suspects)} together, and passes in every smaller "
                       f"group with the head: {error}")
        elif node == head and len(suspects) == 1:
            message = f"the all-reduce fails in every pair with the head {head}, which makes it the suspect: {error}"
        elif len(suspects) == 2 and head in suspects:
            message = f"the all-reduce between {fold(suspects)} fails (two nodes: either can be at fault): {error}"
        else:
            found = "" if bis.get("complete", True) else " (the bisect ran out of time: the fault is among these)"
            message = f"the all-reduce fails in the groups with {node}, and passes without it{found}: {error}"
        stage = fault.get("stage")
        if stage:
            message = f"{message} (stage {stage})"
    elif kind == "link":
        links = fault.get("links") or []
        message = (f"the all-reduce fails, and in pairs of nodes the link(s) {node} - {fold([p for p, _ in links])} "
                   f"fail while {node} passes with its other peers: {_line(links[0][1]) if links else error}")
    elif kind == "path":
        # Found before the run by the data-path probes (preflight.collective.datapath): no bisect looked again.
        links, checks = fault.get("links") or [], ", ".join(fault.get("checks") or [])
        if fault.get("own"):
            message = f"the all-reduce fails, and the data-path probes name {node} itself ({checks}): {_line(fault['own'])}"
        else:
            message = (f"the all-reduce fails, and the data-path probes found the link(s) {node} - "
                       f"{fold(sorted({p for p, _ in links}))} broken ({checks}): {_line(links[0][1] if links else error)}")
    elif kind == "link-row":
        message = (f"the all-reduce fails, and in pairs of nodes {node} fails with every peer "
                   f"({fold(fault.get('peers') or [])}) while they pass with each other: {error}")
    elif kind == "died":
        message = f"a rank process died: {error}"
    elif kind == "start":
        message = f"the all-reduce worker did not start: {error}"
    elif kind == "slow-import":
        message = f"torch imports too slowly: {error}"
    elif kind == "no-answer":
        message = f"the node's all-reduce worker did not answer: {error}"
    else:
        message = f"the all-reduce failed: {error}"
        kind = "failed"
    peers = fold([p for p, _ in fault.get("links") or []]) or "its peers"
    fix = FIXES.get(kind, FIXES["failed"]).format(node=node, head=head, port=port, python=python, peers=peers,
                                                  checks=", ".join(fault.get("checks") or []) or "NET008-NET010")
    evidence = dict(figures, kind=fault.get("kind"), stage=fault.get("stage"), error=fault.get("error"),
                    tail=fault.get("tail"))
    if fault.get("kind") == "path":
        evidence.update(own=fault.get("own"), links=fault.get("links"), checks=fault.get("checks"))
    return Finding(Status.FAIL, message, fix, nodes=(node,), evidence=evidence)


@check("COL002", "allreduce-bandwidth", "cluster", tags=["collective", "network", "bandwidth"])
def allreduce_bandwidth(ctx) -> Iterator[Finding]:
    """The all-reduce's bus bandwidth over a size sweep (algbw and busbw as nccl-tests compute them), and,
    with --min-busbw GBPS, that it is not below that; a slow result is bisected to name the slow node.

    One node on a slow or misconfigured link (a 1 GbE management network instead of InfiniBand, a
    degraded port, TCP instead of RDMA) slows every collective of the job to its speed: training runs, but
    at a fraction of the expected throughput, and nothing says why.

    Check the network of the node named: its link speed and errors (ethtool, ip -s link), the interface
    NCCL or gloo chose (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, NCCL_DEBUG=INFO), and RDMA (NCCL_IB_*);
    or lower --min-busbw to what this fabric can do.
    """
    probe, figures, skipped = _collective(ctx)
    if skipped:
        yield skipped
        return
    result = probe.get("result") or {}
    if result.get("busbw_gbps") is None:
        yield skip("no bandwidth measured: the all-reduce did not complete (see COL001)", blocked_by="COL001",
                   **figures)
        return
    nodes = tuple(result.get("nodes") or ())
    if (result.get("world_size") or 0) < 2:
        yield Finding(Status.SKIP, "one rank: no bandwidth between ranks to measure", nodes=nodes, evidence=figures)
        return
    threshold = ctx.plan.limits.min_busbw_gbps
    measured = f"{_measured(result)}, {result['world_size']} ranks"
    skipped = result.get("skipped_sizes") or []
    if skipped:
        measured += f"; not measured for lack of time: {', '.join(format_size(s) for s in skipped)}"
    evidence = dict(figures, min_busbw_gbps=threshold)
    if threshold is None:
        yield Finding(Status.PASS, f"{measured} (no --min-busbw threshold)", nodes=nodes, evidence=evidence)
        return
    if result["busbw_gbps"] >= threshold:
        yield Finding(Status.PASS, f"{measured}, at least the --min-busbw {threshold:g} GB/s", nodes=nodes,
                      evidence=evidence)
        return
    bis = probe.get("bisect") or {}
    pairs = {t["nodes"][1]: t for t in bis.get("tests") or [] if len(t.get("nodes") or []) == 2}
    suspects = list(bis.get("suspects") or nodes)
    shown = "; ".join(f"{fold(t['nodes'])} " + (f"{t['busbw_gbps']:.3g} GB/s" if t.get("busbw_gbps") is not None
                                                   else "failed") for t in bis.get("tests") or [])
    named = f"the bisect names {fold(suspects)}" if bis and bis.get("complete", True) and not bis.get("inconclusive") \
        else "bisect"
    where = f"; {named}: {shown}" if shown else ""
    if bis and not bis.get("complete", True):
        where += " (the bisect ran out of time: the slow node is among those named)"
    elif bis.get("inconclusive"):
        where += " (every smaller group is fast enough: only the whole group is slow)"
    message = f"busbw {result['busbw_gbps']:.3g} GB/s at {format_size(result['bytes'])} over {fold(list(nodes))}, " \
              f"below the --min-busbw {threshold:g} GB/s{where}"
    fix = (f"check the network of {fold(suspects)}: link speed and errors (ethtool, ip -s link), the interface "
           "NCCL/gloo use (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), competing traffic; or lower --min-busbw")
    for node in suspects:
        pair = pairs.get(node) or {}
        yield Finding(Status.FAIL, message, fix, nodes=(node,),
                      evidence=dict(evidence, pair_busbw_gbps=pair.get("busbw_gbps"), bisect=bis.get("tests")))
    good = [t for t in pairs.values() if not t.get("bad") and t.get("busbw_gbps") is not None]
    for node in nodes:
        if node in suspects:
            continue
        pair = pairs.get(node) or (max(good, key=lambda t: t["busbw_gbps"]) if node == probe.get("head") and good
                                   else None)
        if pair and pair.get("busbw_gbps") is not None:
            yield Finding(Status.PASS, f"in a pair ({fold(pair['nodes'])}): busbw {pair['busbw_gbps']:.3g} GB/s, "
                          f"at least the --min-busbw {threshold:g} GB/s", nodes=(node,),
                          evidence=dict(evidence, pair_busbw_gbps=pair["busbw_gbps"]))


@check("COL003", "nccl-transport", "cluster", tags=["collective", "nccl", "rdma"])
def nccl_transport(ctx) -> Iterator[Finding]:
    """After the all-reduce with NCCL, NCCL moved data between the nodes over the RDMA devices they have, not
    over TCP sockets (read from its INFO lines: 'Using network IB', the channels 'via NET/IB'), and with
    GPUDirect RDMA where the node has HCAs.

    NCCL falls back to sockets without an error when it finds no usable HCA (a port down, no libibverbs in
    the training environment, NCCL_IB_HCA naming nothing, a container without the devices), and to staging
    every transfer through host memory when it sees no peer-memory client (RDMA004): the job runs, several
    times slower, and nothing says why.

    Read the INFO lines in the evidence: 'NET/IB : No device found' means NCCL saw no HCA; bring the ports up
    (RDMA001), install rdma-core / libibverbs in the training environment, or set NCCL_IB_HCA to the HCAs.
    """
    probe, _, skipped = _collective(ctx)
    if skipped:
        yield skipped
        return
    if probe.get("backend") != "nccl":
        yield skip(f"the all-reduce ran with {probe.get('backend')}, not NCCL (not every node has a GPU, or "
                   "--backend gloo): there is no NCCL transport to read")
        return
    result = probe.get("result")
    if not result:
        yield skip("the all-reduce with NCCL did not pass (see COL001): no transport to read", blocked_by="COL001")
        return
    chosen = result.get("nccl") or {}
    passes = {}  # message -> (nodes, the first node's evidence): one result per network, nodes folded
    for node in result.get("nodes") or []:
        found = chosen.get(node) or {}
        if not found.get("network") and not found.get("channels"):
            theirs = found.get("debug")
            why = (f"the environment sets NCCL_DEBUG={theirs}, which preflight keeps: NCCL's INFO lines about "
                   "the network may be missing (unset it, or set NCCL_DEBUG=INFO)" if theirs else
                   "NCCL printed no INFO line that names its network")
            yield Finding(Status.SKIP, why, nodes=(node,), evidence={"lines": found.get("lines") or []})
            continue
        evidence = {k: found.get(k) for k in ("network", "channels", "gdr", "ib_devices", "version", "lines")}
        devices = rdma_devices_nccl_may_use((ctx.facts.get(node) or {}).get("facts") or {})
        if over_sockets(found) and devices:
            yield Finding(Status.WARN, f"NCCL used TCP sockets between the nodes although {node} has RDMA devices "
                          f"NCCL may use ({', '.join(devices)}): its INFO lines say why (evidence)",
                          f"bring the ports up on {node} (RDMA001), install rdma-core / libibverbs in the training "
                          "environment there, or set NCCL_IB_HCA to its HCAs", nodes=(node,),
                          evidence=dict(evidence, rdma_devices=devices))
            continue
        said = f"NCCL network {found.get('network') or ', '.join(found.get('channels') or [])}"
        if not over_sockets(found) and found.get("gdr") is False and devices:
            # Over the HCAs, but every transfer between nodes staged through host memory: a job that runs slowly.
            yield Finding(Status.WARN, f"{said} without GPUDirect RDMA on {node}, which has HCAs NCCL may use "
                          f"({', '.join(devices)}): NCCL stages every transfer between nodes through host memory",
                          f"see RDMA004 on {node}: load nvidia_peermem, or install NCCL 2.23 or newer where it is loaded",
                          nodes=(node,), evidence=dict(evidence, rdma_devices=devices))
            continue
        if over_sockets(found):
            said += " (TCP sockets: no RDMA device NCCL may use on this node)"
        elif found.get("gdr") is not None:
            said += " with GPUDirect RDMA" if found["gdr"] else " without GPUDirect RDMA (RDMA004)"
        passes.setdefault(said, ([], evidence))[0].append(node)
    for said, (nodes, evidence) in passes.items():
        yield Finding(Status.PASS, said, nodes=tuple(nodes), evidence=evidence)




@check("COL004", "pairwise-links", "cluster", tags=["collective", "network", "pairwise", "bandwidth"])
def pairwise_links(ctx) -> Iterator[Finding]:
    """Every pair of nodes moves data point to point (a gloo group of two per pair, in rounds of disjoint pairs
    that cover every pair, or a sample of rounds on large clusters), and no node is several times slower against
    every peer than the links between the other nodes (a straggler); the node x node matrix of bandwidth and
    failures is in the evidence and drawn in the HTML report.

    One link that drops traffic (a firewall rule between two nodes, a route over the wrong interface) breaks
    every collective with an error that names no node, and one node on a slow link makes the whole job run at
    its speed; the all-reduce alone says only that the group fails or crawls, the matrix says which link. A busy
    moment is not a fault: a single link several times slower than both ends' other links is a warning (from four
    nodes on) once the nodes have measured it again alone, every other pair idle; a link that was only busy in
    its round (hosts that share cores, a busy switch port) is fast alone and not named, and the matrix keeps both
    figures of a link measured again ("retested"). The most suspect links are measured again first; when all of
    those were fast, the suspects past the limit on retests (16, or one per node) are taken as busy too.

    Check the path between the nodes named (firewall rules between them on any port, their routes and
    interfaces: ip route get ADDR, ethtool, ip -s link); a straggler row is the node's own link.
    """
    probe, figures, skipped = _collective(ctx)
    if skipped:
        yield skipped
        return
    matrix = probe.get("pairwise")
    if not matrix:
        nodes = len(probe.get("nodes") or [])
        why = ("one node: no pair to measure" if nodes < 2 else
               "the pairwise phase did not run (the all-reduce failed at a node COL001 names, or no time was left: "
               "raise --timeout)")
        yield skip(why, blocked_by="COL001", **figures)
        return
    said = findings(matrix)
    evidence = dict(figures, matrix=matrix)
    named = set()
    out = []
    for node in said["failed_rows"]:
        named.add(node)
        errors = [e for e in matrix["errors"][matrix["nodes"].index(node)] if e]
        out.append(Finding(Status.FAIL, f"fails point to point with every peer it was paired with, while they pass "
                           f"with each other: {_line(errors[0] if errors else None)}",
                           f"check {node}'s network: its firewall (gloo and NCCL connect on ephemeral ports), its "
                           "training interface and its routes to the other nodes", nodes=(node,)))
    blamed = probe.get("blamed") or {}
    for a, b, why in said["failed_links"]:
        # An end the data-path probes found at fault on its own (its route, its firewall: COL001) is the link's
        # cause: that end is named, not its peer.
        own = tuple(n for n in (a, b) if (blamed.get(n) or {}).get("own"))
        named.update(own or (a, b))
        cause = f"; the data-path probes name {' and '.join(own)} itself (COL001)" if own else \
            "; both pass with their other peers"
        out.append(Finding(Status.FAIL, f"the link {a} - {b} fails point to point ({_line(why)}){cause}",
                           f"check the path between {a} and {b}: a firewall rule between them, a route that takes "
                           "another interface (ip route get on each), the switch ports", nodes=own or (a, b)))
    for node, row in sorted(said["stragglers"].items()):
        named.add(node)
        ratio = row["peers_median_gbps"] / row["gbps"] if row["gbps"] else float("inf")
        out.append(Finding(Status.FAIL, f"a straggler: every link of {node} is at most {row['gbps']:.3g} GB/s, "
                           f"{ratio:.0f}x below the {row['peers_median_gbps']:.3g} GB/s median of the links between "
                           f"the other nodes (more than {SLOWER:g}x)",
                           f"check {node}'s link: its speed and errors (ethtool, ip -s link), a shaper (tc qdisc), "
                           "the interface NCCL/gloo use (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)", nodes=(node,)))
    in_round = {frozenset(link[:2]): link[2] for link in matrix.get("retested") or [] if link[3] is not None}
    for a, b, gbps, expected in said["slow_links"]:
        # Measured again alone by the nodes (no other pair's traffic): still slow, so not a busy moment.
        again = (f" measured again alone ({in_round[frozenset((a, b))]:.3g} GB/s in its round)"
                 if frozenset((a, b)) in in_round else "")
        out.append(Finding(Status.WARN, f"the link {a} - {b} moves {gbps:.3g} GB/s{again}, over {SLOWER:g}x below "
                           f"the {expected:.3g} GB/s of both ends' other links", f"check the path between {a} and {b}",
                           nodes=(a, b)))
    rest = [n for n in matrix["nodes"] if n not in named]
    if rest:
        rates = [v for row in matrix["gbps"] for v in row if v is not None]
        span = f", {min(rates):.3g}-{max(rates):.3g} GB/s" if rates else ""
        sample = (f" (a sample of {matrix['rounds']} of {matrix['tournament_rounds']} rounds)"
                  if matrix["sampled"] else "")
        retested = len(matrix.get("retested") or [])
        busy = (f"; {len(said['busy_links'])} more link(s) looked slow in a busy round, as the {retested} measured "
                "again alone did, and those were fast" if said["busy_links"] else "")
        out.append(Finding(Status.PASS, f"{matrix['pairs_measured']} pair(s) of {len(matrix['nodes'])} node(s) "
                           f"measured point to point{sample}{span}: no failed link, no straggler{busy}",
                           nodes=tuple(rest)))
    for i, finding in enumerate(out):  # the matrix once, in the first result (it grows with the nodes squared)
        yield Finding(finding.status, finding.message, finding.remediation, nodes=finding.nodes,
                      evidence=evidence if i == 0 else dict(figures, matrix_in_first_result=True))
