"""The same finding of a node check on several nodes is one Result naming them all (runner.run), never merging
results that differ in status, message, fix or evidence; the terminal still counts a result per node."""
import io

import pytest

from preflight import runner
from preflight.plan import Plan
from preflight.registry import check
from preflight.report import render
from preflight.result import Finding, Result, Status, fail, passed

NODES = tuple(f"n{i:02d}" for i in range(1, 9))


def states(nodes=NODES, down=()):
    return {n: {"facts": None, "clock": None, "error": {"kind": "timeout", "message": "no answer within 30 s",
                                                        "remediation": "start sshd there"}}
            if n in down else {"facts": {"n": n}, "clock": None, "error": None} for n in nodes}


def run(func, facts, scope="node"):
    spec = check("TST010", "grouped", scope)(func).__preflight_check__
    return runner.run([spec], runner.CheckContext(Plan(nodes=tuple(facts)), facts, {}))


def node_check(judge):
    def func(ctx):
        """W.\n\nW.\n\nF."""
        yield judge(ctx.node)
    return func


def test_the_same_finding_on_every_node_is_one_result_naming_all_of_them_in_order():
    results = run(node_check(lambda node: passed("fine", size=1)), states())
    assert len(results) == 1
    assert results[0].nodes == NODES and results[0].status is Status.PASS and results[0].evidence == {"size": 1}


def test_one_odd_node_stays_a_result_of_its_own():
    results = run(node_check(lambda node: fail("small", "grow it") if node == "n05" else passed("fine")), states())
    assert [(r.status, r.nodes) for r in results] == [
        (Status.PASS, tuple(n for n in NODES if n != "n05")), (Status.FAIL, ("n05",))]


@pytest.mark.parametrize("odd", [
    Finding(Status.WARN, "same", "fix", evidence={"v": 1}),  # status
    Finding(Status.PASS, "other", "fix", evidence={"v": 1}),  # message
    Finding(Status.PASS, "same", "another fix", evidence={"v": 1}),  # fix
    Finding(Status.PASS, "same", None, evidence={"v": 1}),  # no fix
    Finding(Status.PASS, "same", "fix", evidence={"v": 2}),  # evidence
    Finding(Status.PASS, "same", "fix", evidence={"v": True}),  # equal to 1 in Python, not in the JSON
    Finding(Status.PASS, "same", "fix", evidence={"v": 1.0}),
    Finding(Status.PASS, "same", "fix", evidence={"v": "1"}),
    Finding(Status.PASS, "same", "fix", evidence={"v": 1, "w": None}),
])
def test_findings_that_differ_in_status_message_fix_or_evidence_are_never_merged(odd):
    usual = Finding(Status.PASS, "same", "fix", evidence={"v": 1})
    results = run(node_check(lambda node: odd if node == "n03" else usual), states())
    assert len(results) == 2
    alone = next(r for r in results if r.nodes == ("n03",))
    assert (alone.status, alone.message, alone.remediation, repr(alone.evidence)) == \
        (odd.status, odd.message, odd.remediation, repr(odd.evidence))


def test_a_grouped_result_lasts_as_long_as_the_results_it_stands_for():
    found = [Result("TST010", "t", Status.PASS, (n,), "ok", None, {}, 0.25) for n in NODES]
    (one,) = runner.grouped(found)
    assert one.nodes == NODES and one.duration_s == pytest.approx(0.25 * len(NODES))
    assert runner.grouped(found[:1]) == found[:1]  # a single result is left as it is


def test_a_cluster_checks_results_are_kept_as_it_gives_them():
    def twice(ctx):
        """W.\n\nW.\n\nF."""
        yield Finding(Status.FAIL, "same", "fix", nodes=("n01",))
        yield Finding(Status.FAIL, "same", "fix", nodes=("n02",))

    assert [r.nodes for r in run(twice, states(), scope="cluster")] == [("n01",), ("n02",)]


def test_unreachable_nodes_are_one_skip_that_keeps_their_own_fix():
    @check("TST011", "needs-facts", "node")
    def needs_facts(ctx):
        """W.\n\nW.\n\nF."""
        yield passed("fine")

    down = ("n02", "n07")
    results = runner.run([needs_facts.__preflight_check__], runner.CheckContext(Plan(nodes=NODES), states(down=down), {}))
    (skipped,) = [r for r in results if r.nodes == down]
    # SSH001, which reports why, was not selected: the skip becomes an error, with the nodes' own fix
    assert skipped.status is Status.ERROR and "no answer within 30 s" in skipped.message
    assert skipped.remediation == "start sshd there"
    (fine,) = [r for r in results if r.status is Status.PASS]
    assert fine.nodes == tuple(n for n in NODES if n not in down)


def test_the_terminal_counts_a_result_once_per_node_it_concerns():
    results = run(node_check(lambda node: fail("small", "grow it") if node == "n05" else passed("fine")), states())
    stream = io.StringIO()
    render.terminal(results, "fail", 1.0, stream=stream)
    assert stream.getvalue().splitlines()[-1] == "verdict: FAIL  1 failed, 7 passed in 1.00 s"
    skips = [Result("TST012", "t", Status.SKIP, NODES, "no GPU facts on this node", None, {}, 0.0),
             Result("TST013", "t", Status.SKIP, (), "no census", None, {}, 0.0)]
    assert render.skip_line(skips) == "9 skipped: 8 no GPU facts on this node, 1 no census"
    assert render.summary(skips) == "9 skipped"
