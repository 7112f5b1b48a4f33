"""What the data-path probes (preflight.remote.gather `_probe_paths`, preflight.node.paths on the nodes) say about
each pair of nodes, read in one place: NET008-NET010 report it, and a failed all-reduce blames from it
(preflight.collective.allreduce), so that a pair the probes found broken is named at once, not found again by
the pairwise phase or a bisect. Pure: the probe document and each node's facts in, plain values out.

A pair is judged once, however many of its ends saw it: a route that loses a peer is the fault of the node
that has the route alone (NET010); a node that no other node can dial on an ephemeral port is its own fault
(NET009); a pair that cannot connect while both ends reach their other peers, or whose path carries less than
the ends' MTU (NET008), names its two ends. A pair a route anomaly explains is judged by NET010 alone.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

Pair = Tuple[str, str]


def pairs(probe: Mapping) -> Iterator[Tuple[str, str, Mapping]]:
    """(prober, peer, what the prober found) for every pair probed."""
    for node, peers in sorted((probe.get("peers") or {}).items()):
        for peer, found in sorted(peers.items()):
            yield node, peer, found


def _host(facts: Mapping, node: str) -> Mapping:
    return (facts.get(node) or {}).get("host") or {}


def interface_of(facts: Mapping, node: str, address: Optional[str]) -> Optional[str]:
    """The interface of `node` (facts: {node: its facts document}) that holds `address`, or None."""
    interfaces = _host(facts, node).get("interfaces") or {}
    return next((n for n, addrs in sorted(interfaces.items()) if address in addrs), None)


def route_anomalies(probe: Mapping, facts: Mapping) -> Dict[Pair, str]:
    """{(node, peer): why} for each peer a node reaches over another device than its other peers and the head
    (a more specific route captures it), over a device that does not hold the source address the kernel picks,
    or not at all."""
    found = {}
    for node, peers in (probe.get("peers") or {}).items():
        host = _host(facts, node)
        route = host.get("route_to_head") if isinstance(host.get("route_to_head"), dict) else {}
        devices = Counter(p.get("device") for p in peers.values() if p.get("device"))
        if route.get("interface") and route.get("interface") != "lo":
            devices[route["interface"]] += 1
        usual = max(devices, key=lambda d: (devices[d], d == route.get("interface"))) if devices else None
        for peer, result in peers.items():
            device, source = result.get("device"), result.get("source")
            own = interface_of(facts, node, source)
            where = f"{peer} ({result.get('address')})"
            if result.get("route_error"):
                found[(node, peer)] = f"has no route to {where}: {result['route_error']}"
            elif device and usual and device != usual:
                captured = f" (the route {result['route']})" if result.get("route") else ""
                found[(node, peer)] = (f"routes to {where} over {device}{captured}, not over {usual} as to its other "
                                       "peers" + (" and the head" if route.get("interface") == usual else ""))
            elif device and own and own != "lo" and device != own:  # an address on lo (unnumbered) is no capture
                found[(node, peer)] = f"routes to {where} over {device}, from {source}, an address of {own}"
    return found


def lost(result: Mapping) -> bool:
    """The probe lost the peer over the route it took: no route, or no TCP connection."""
    return bool(result.get("route_error")) or (result.get("tcp") or {}).get("ok") is False


def unrouted(probe: Mapping, routed: Mapping, key: str) -> Iterator[Tuple[str, str, Mapping]]:
    """(prober, peer, its result for `key`) for the pairs whose route is not an anomaly (that is NET010's to
    judge: what the probe found over a captured route says nothing of the pair)."""
    for node, peer, found in pairs(probe):
        if isinstance(found.get(key), dict) and (node, peer) not in routed and (peer, node) not in routed:
            yield node, peer, found[key]


def dials(probe: Mapping, routed: Mapping) -> Tuple[Dict[str, dict], List[str], Dict[Pair, List[tuple]]]:
    """The TCP connections to each node's ephemeral port: ({target: {prober: answer}}, the targets no prober
    could connect to, {sorted pair: [(prober, target, answer), ...]} the other failed connections, one entry
    per pair whichever end dialled)."""
    dialled: Dict[str, dict] = {}
    for node, peer, tcp in unrouted(probe, routed, "tcp"):
        dialled.setdefault(peer, {})[node] = tcp
    closed = sorted(t for t, answers in dialled.items() if all(not a.get("ok") for a in answers.values()))
    failed: Dict[Pair, List[tuple]] = {}
    for target, answers in sorted(dialled.items()):
        for node, answer in sorted(answers.items()):
            if target not in closed and not answer.get("ok"):
                failed.setdefault(tuple(sorted((node, target))), []).append((node, target, answer))
    return dialled, closed, failed


def path_mtus(probe: Mapping, routed: Mapping) -> Tuple[Dict[Pair, List[tuple]], set, Dict[Pair, str]]:
    """The do-not-fragment probes: ({sorted pair: [(prober, peer, result)]} where the path carries less than the
    size both ends have, the nodes with a path that carried it, {sorted pair: why} where nothing was measured)."""
    bad: Dict[Pair, List[tuple]] = {}
    good, unknown = set(), {}
    for node, peer, mtu in unrouted(probe, routed, "mtu"):
        pair = tuple(sorted((node, peer)))
        if mtu.get("ok"):
            good.update(pair)
        elif mtu.get("carried"):
            bad.setdefault(pair, []).append((node, peer, mtu))
        else:
            unknown.setdefault(pair, mtu.get("error") or "no answer")
    return bad, good, unknown


def broken(probe: Optional[Mapping], facts: Mapping) -> Dict[str, dict]:
    """The nodes the data-path probes name: {node: {"own": what is wrong on the node itself, or None; "links":
    [[peer, why], ...] the broken pairs it is an end of; "checks": the NET checks that say so}}. Empty when the
    probes found nothing broken (or did not run)."""
    if not probe or not probe.get("peers"):
        return {}
    named: Dict[str, dict] = {}

    def name(node: str, check: str, own: Optional[str] = None, peer: Optional[str] = None, why: str = "") -> None:
        entry = named.setdefault(node, {"own": None, "links": [], "checks": []})
        if own and not entry["own"]:
            entry["own"] = own
        if peer is not None:
            entry["links"].append([peer, why])
        if check not in entry["checks"]:
            entry["checks"].append(check)

    routed = route_anomalies(probe, facts)
    for (node, peer), why in sorted(routed.items()):
        if lost(probe["peers"][node][peer]):
            name(node, "NET010", own=f"{node} {why}")
    dialled, closed, failed = dials(probe, routed)
    for target in closed:
        first = next(iter(dialled[target].values())).get("error")
        name(target, "NET009", own=f"no other node can connect to {target} on an ephemeral port: {first}")
    for (a, b), seen in sorted(failed.items()):
        node, target, answer = seen[0]
        why = f"{node} cannot connect to {target} on an ephemeral port: {answer.get('error')}"
        name(a, "NET009", peer=b, why=why)
        name(b, "NET009", peer=a, why=why)
    bad, _, _ = path_mtus(probe, routed)
    for (a, b), seen in sorted(bad.items()):
        mtu = seen[0][2]
        why = f"packets of {mtu['size']} bytes do not pass between {a} and {b}: the path carries {mtu['carried']}"
        name(a, "NET008", peer=b, why=why)
        name(b, "NET008", peer=a, why=why)
    return named
