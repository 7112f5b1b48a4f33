"""Node facts for the check tests: the real collector's document of this machine, copied to three nodes
(n01 the head) and altered per node, and the runner over them (one check at a time, as the engine runs it).

- `facts(**per_node)`: three healthy nodes on 10.0.0.0/24 (eth0), clocks in sync.
- `linked_facts(**per_node)`: the same with each interface's link state, a management interface eth1 on
  192.168.9.0/24, and no NCCL_/GLOO_/CUDA_ variables of this machine (the tests of NET005 and PKG004 set theirs).
- `run(check_id, states, probes, plan)`: the Results of one check; `by_node(results)`: a node's Result.
- `leaves(doc)`: every path into a document; `changed(doc, path, value)`: a copy with that value there (TAKEN:
  the key taken away), for the tests of facts of another shape.
"""
import copy

from preflight import registry, runner
from preflight.node import collector
from preflight.plan import Plan

NODES = ("n01", "n02", "n03")
BASE = collector.collect({"head": "127.0.0.1", "port": 29500, "paths": {}})
SPECS = {c.id: c for c in registry.load().checks}


def facts(**per_node):
    """Three healthy nodes; per_node maps a node to a function that alters its facts state."""
    states = {}
    for node in NODES:
        doc = copy.deepcopy(BASE)
        doc["host"].update(hostname=node, resolves_to=["10.0.0.%d" % (NODES.index(node) + 1)],
                           head_resolves_to=["10.0.0.1"],
                           interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.%d" % (NODES.index(node) + 1)]},
                           route_to_head={"head": "10.0.0.1", "source": "10.0.0.%d" % (NODES.index(node) + 1),
                                          "interface": "eth0"}, rdma_devices=[])
        doc["clock"].update(synchronised=True, esterror_s=0.001)
        state = {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}
        if node in per_node:
            per_node[node](state)
        states[node] = state
    return states


def link(address, up=True, running=True, prefix=24):
    return {"up": up, "running": running, "ipv4": [f"{address}/{prefix}"] if address else [], "ipv6": []}


def linked_facts(**per_node):
    """Three healthy nodes on 10.0.0.0/24 (eth0), each with a management interface eth1 on 192.168.9.0/24;
    per_node maps a node to a function that alters its facts state."""
    states = {}
    for k, node in enumerate(NODES):
        doc = copy.deepcopy(BASE)
        own, mgmt = f"10.0.0.{k + 1}", f"192.168.9.{k + 1}"
        doc["env"] = {name: value for name, value in doc["env"].items()
                      if not name.startswith(("NCCL_", "GLOO_", "CUDA_"))}
        doc["host"].update(hostname=node, resolves_to=[own], head_resolves_to=["10.0.0.1"],
                           interfaces={"lo": ["127.0.0.1"], "eth0": [own], "eth1": [mgmt]},
                           links={"lo": link("127.0.0.1", prefix=8), "eth0": link(own), "eth1": link(mgmt)},
                           route_to_head={"head": "10.0.0.1", "source": own, "interface": "eth0"},
                           rdma_devices=[])
        state = {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}
        if node in per_node:
            per_node[node](state)
        states[node] = state
    return states


def env(**variables):
    """A change of a node's facts: these environment variables set."""
    def change(state):
        state["facts"]["env"].update(variables)
    return change


def both(*changes):
    def change(state):
        for one in changes:
            one(state)
    return change


def run(check_id, states=None, probes=None, plan=None, make_facts=facts):
    plan = plan or Plan(nodes=NODES, remote=True)
    ctx = runner.CheckContext(plan, states if states is not None else make_facts(), probes or {})
    return runner.run_check(SPECS[check_id], ctx)


def by_node(results):
    return {node: r for r in results for node in r.nodes}


TAKEN = object()  # the key taken away


def leaves(value, path=()):
    """Every path into the document (a list's first item stands for all)."""
    if path:
        yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, path + (key,))
    elif isinstance(value, list) and value:
        yield from leaves(value[0], path + (0,))


def changed(doc, path, value):
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is TAKEN:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc
