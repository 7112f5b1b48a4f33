"""Nodes made of recorded fabric trees (tests/fixtures/sysfs, through sysfs_tree) and NVML recordings
(tests/fixtures/nvml, through nvml_fake) on this machine's real facts, for the RDMA, PKG (driver stack), GPU008
and COL003 tests: `node` one node's facts state, `recorded_nodes` several from one recording, `run_on` one
check over them, `statuses_by_nodes` the (nodes, status) pairs of its Results."""
import copy
import json
from unittest import mock

from nvml_fake import fake
from preflight import registry, runner
from preflight.node import collector
from preflight.node import gpus as gpu_facts
from preflight.plan import build_plan
from sysfs_tree import fabric_facts

BASE = collector.collect({"head": "127.0.0.1", "port": 29500, "paths": {}})
SPECS = {c.id: c for c in registry.load().checks}
IB0 = "sys/class/infiniband/mlx5_0/ports/1/"
IB1 = "sys/class/infiniband/mlx5_1/ports/1/"


def gpus(recording="h100x8.json"):
    with mock.patch.object(gpu_facts, "Nvml", fake(recording)):
        return json.loads(json.dumps(gpu_facts.facts()))


def node(tmp_path, name, recording, change=None, env=None, nvml="h100x8.json", versions=None):
    doc = copy.deepcopy(BASE)
    doc["fabric"] = fabric_facts(tmp_path / name, recording, change)
    doc["host"]["rdma_devices"] = sorted(doc["fabric"]["rdma"])
    doc["env"] = dict(env or {})
    doc["gpus"] = gpus(nvml) if nvml else {"available": False, "reason": "no NVIDIA driver"}
    doc["packages"]["versions"].update(versions or {})
    return {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}


def recorded_nodes(tmp_path, recording, changes=None, env=None, names=("n01", "n02"), **kw):
    """Nodes from one recording; changes: node -> the change to its tree."""
    return {n: node(tmp_path, n, recording, (changes or {}).get(n), env, **kw) for n in names}


def run_on(check_id, states, tmp_path):
    plan = build_plan(nodes=tuple(states))
    return runner.run_check(SPECS[check_id], runner.CheckContext(plan, states, {}))


def statuses_by_nodes(results):
    return {(r.nodes, r.status) for r in results}
