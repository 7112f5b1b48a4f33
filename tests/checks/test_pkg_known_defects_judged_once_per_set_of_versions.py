"""PKG008 judges each set of versions once, however many nodes have it (thousands of nodes have a few sets), and
still gives each node the verdict of its own versions."""
import copy

import pytest

from preflight.checks import pkg
from node_facts import BASE, run
from preflight.plan import Plan
from preflight.result import Status

NODES = tuple(f"n{i:03d}" for i in range(1, 41))
REQUIRES = {"transformers": ['accelerate>=1.1.0; extra == "torch"']}


def cluster(accelerate_on=None, versions_on=None):
    """NODES with transformers requiring accelerate>=1.1.0; ACCELERATE_ON: node -> its accelerate version
    (1.1.0 elsewhere); VERSIONS_ON: node -> what its packages.versions holds instead."""
    states = {}
    for node in NODES:
        doc = copy.deepcopy(BASE)
        doc["packages"].update(requires=REQUIRES, distributions={
            "transformers": "5.24.0", "torch": "2.9.0", "accelerate": (accelerate_on or {}).get(node, "1.1.0")})
        if node in (versions_on or {}):
            doc["packages"]["versions"] = versions_on[node]
        states[node] = {"facts": doc, "error": None, "clock": None}
    return states


@pytest.fixture
def judged(monkeypatch):
    """The number of times the requirements were judged."""
    calls = []
    real = pkg.unmet_requirements
    monkeypatch.setattr(pkg, "unmet_requirements", lambda *args: calls.append(args) or real(*args))
    pkg._judged.cache_clear()
    yield calls
    pkg._judged.cache_clear()


def test_each_set_of_versions_is_judged_once_and_each_node_gets_its_own_verdict(judged):
    found = run("PKG008", cluster(accelerate_on={"n017": "1.0.1"}), plan=Plan(nodes=NODES, remote=True))
    assert len(judged) == 2  # the nodes with accelerate 1.1.0, and n017
    failed = [r for r in found if r.status is Status.WARN]  # the [torch] extra's lower bound
    assert [r.nodes for r in failed] == [("n017",)] and "accelerate 1.0.1" in failed[0].message
    assert "n017" in failed[0].remediation
    passed = {n for r in found if r.status is Status.PASS for n in r.nodes}
    assert passed == set(NODES) - {"n017"}


def test_healthy_identical_nodes_all_pass(judged):
    found = run("PKG008", cluster(), plan=Plan(nodes=NODES, remote=True))
    assert {r.status for r in found} == {Status.PASS} and {n for r in found for n in r.nodes} == set(NODES)
    assert len(judged) == 1


def test_a_malformed_version_fact_is_judged_as_before_without_an_error(judged):
    odd = dict(BASE["packages"]["versions"], torch=["2.13.0"], accelerate={"v": 1})
    found = run("PKG008", cluster(versions_on={"n003": odd}), plan=Plan(nodes=NODES, remote=True))
    assert Status.ERROR not in {r.status for r in found}, [r.message for r in found]
    assert {n for r in found for n in r.nodes} == set(NODES)
