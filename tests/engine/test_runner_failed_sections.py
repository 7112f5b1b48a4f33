"""A node's failed section as the runner sets it aside (runner._run): a cluster whose nodes all sent one
section of another shape costs one rerun of a check per section, not one per node."""
import time

from preflight import runner
from preflight.plan import build_plan
from preflight.registry import CheckSpec
from preflight.result import Finding, Status

FAILED = {"error": "collector section host failed on the node: what the node sent is not the collector's: x"}


def spec(func, scope="cluster"):
    return CheckSpec("TST001", "test-check", scope, (), "w", "y", "f", func, "test")


def cluster(n, failed_from=1):
    """n nodes; from `failed_from` on, each with a failed host section (as checked_facts leaves one)."""
    names = tuple(f"n{i:04d}" for i in range(n))
    states = {name: {"error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0, "rtt_s": 0.0},
                     "facts": {"host": FAILED if i >= failed_from else {"hostname": name}, "env": {}}}
              for i, name in enumerate(names)}
    return runner.CheckContext(build_plan(nodes=names), states, {})


def test_a_cluster_check_reruns_once_per_failed_section_not_once_per_node():
    """Every node but the head sent a host section of another shape (a whole cluster of one kind that the
    shapes refuse): the check that compares hostnames runs twice, not once per node, and each of those nodes
    has its own "not evaluated" error, while the head is still compared."""
    calls = []

    def hostnames(ctx):
        calls.append(1)
        names = {n: ctx.facts[n]["facts"]["host"]["hostname"] for n in ctx.reachable}
        yield Finding(Status.PASS, "hostnames read", nodes=tuple(names))

    n = 3000
    started = time.perf_counter()
    results = runner.run([spec(hostnames)], cluster(n))
    elapsed = time.perf_counter() - started
    assert len(calls) == 2, len(calls)  # was n: every rerun set aside one node, and read them all again
    errors = [r for r in results if r.status is Status.ERROR]
    assert sorted(r.nodes[0] for r in errors) == [f"n{i:04d}" for i in range(1, n)]
    assert all(r.message.startswith(f"not evaluated on {r.nodes[0]}: collector section host failed") for r in errors)
    assert [r.nodes for r in results if r.status is Status.PASS] == [("n0000",)]
    assert elapsed < 2.0, elapsed


def test_a_node_check_sets_aside_only_the_node_it_read():
    """A node check that reads the head's failed section names the head alone (never every node whose same
    section failed, as a cluster check does), and runs on without it."""
    def head_host(ctx):
        if "n0000" in ctx.reachable:
            ctx.facts["n0000"]["facts"].get("host")
        yield Finding(Status.PASS, f"read on {ctx.node}")

    ctx = cluster(4, failed_from=3)
    ctx.facts["n0000"]["facts"]["host"] = FAILED
    results = runner.run([spec(head_host, "node")], ctx)
    assert [r.nodes for r in results if r.status is Status.ERROR] == [("n0000",)]
    assert [r.nodes for r in results if r.status is Status.PASS] == [("n0001",), ("n0002",), ("n0003",)]
