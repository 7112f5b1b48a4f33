"""NET: names, interfaces, the main port and its reachability."""
from __future__ import annotations

from typing import Iterator, List, Mapping

from preflight.compare import odd_ones_out
from preflight.registry import check
from preflight.result import Finding, Status, fail, passed, skip


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


@check("NET003", "main-port-free", "cluster", tags=["network", "port"])
def main_port_free(ctx) -> Iterator[Finding]:
    """The main port is free on the head.

    The head's rank 0 binds the main port for the rendezvous (the TCPStore); when another process holds it,
    accelerate stops with 'port in use' or, worse, the workers talk to the old job's store and hang.

    Stop the process that holds the port (the message names it), or choose another main_process_port.
    """
    probe = (ctx.probes or {}).get("port") or {}
    listen, head, port = probe.get("listen"), probe.get("head", ctx.plan.head), ctx.plan.port
    if listen is None:
        yield skip(f"the head {head} was not reached")
        return
    if listen.get("bound"):
        yield Finding(Status.PASS, f"port {port} is free on the head {head}", nodes=(head,), evidence={"port": port})
        return
    holders = listen.get("holders") or []
    held = "; ".join(f"pid {h['pid']} ({h['command'] or '?'})" for h in holders) or "a process this user cannot see"
    yield Finding(Status.FAIL, f"port {port} on the head {head} is taken ({listen.get('error')}): held by {held}",
                  f"stop {'pid ' + str(holders[0]['pid']) if holders else 'that process'}, or set main_process_port "
                  "to a free port", nodes=(head,), evidence={"port": port, "holders": holders})


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
    if not listen or not listen.get("bound"):
        yield skip("no listener on the head (see NET003)")
        return
    port, head, ok = ctx.plan.port, probe.get("head"), []
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


def selected_interfaces(spec: str, names: List[str], nccl: bool) -> List[str]:
    """The interfaces NCCL (prefixes; `=` exact; `^` excludes) or gloo (exact names) would use."""
    spec = spec.strip()
    exclude = nccl and spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = not nccl or spec.startswith("=")
    spec = spec[1:] if nccl and spec.startswith("=") else spec
    patterns = [p.strip() for p in spec.split(",") if p.strip()]

    def matches(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [n for n in names if matches(n) != exclude]


@check("NET005", "socket-ifname", "node", tags=["network", "nccl", "gloo"])
def socket_ifname(ctx) -> Iterator[Finding]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, when set, select an existing interface with an address.

    NCCL and gloo bind to the interfaces these name (NCCL by prefix, `=` for an exact name, `^` to exclude);
    a name that matches nothing on one node makes NCCL fail with 'no socket interface found' or gloo
    hang, on that node only.

    Set them to the interface of the training network as it is named on every node (`ip -br addr`),
    e.g. NCCL_SOCKET_IFNAME=eth0 or =ib0.
    """
    env = ctx.fact.get("env", {})
    interfaces: Mapping[str, list] = ctx.fact.get("host", {}).get("interfaces", {})
    usable = [n for n, addrs in interfaces.items() if addrs]
    found = False
    for var, nccl in (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False)):
        spec = env.get(var)
        if spec is None:
            continue
        found = True
        chosen = selected_interfaces(spec, usable, nccl)
        if chosen:
            yield passed(f"{var}={spec} selects {', '.join(f'{c} ({interfaces[c][0]})' for c in chosen)}",
                         variable=var, interfaces=chosen)
        else:
            yield fail(f"{var}={spec} selects no interface with an address (this node has {', '.join(usable)})",
                       f"set {var} to one of: {', '.join(n for n in usable if n != 'lo') or ', '.join(usable)}",
                       variable=var, value=spec, interfaces=usable)
    if not found:
        yield skip("neither NCCL_SOCKET_IFNAME nor GLOO_SOCKET_IFNAME is set")


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
