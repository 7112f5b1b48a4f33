"""The pairwise phase (COL004): its schedule, the node x node matrix and what it says, the phase's place in the
all-reduce's decisions (with what the data-path probes found broken, collective.datapath), the worker's pairs on
this machine, the heat map in headless Chromium, and the real test cluster (healthy, a slow link shaped with tc
tbf, a dead link between two nodes dropped with nft, a route that captures the traffic to a peer)."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_up, make_cluster_fixtures  # noqa: F401  (fixtures)
from conftest import preflight_json, results
from node_facts import facts as node_facts
from preflight import registry, runner
from preflight.collective import datapath, pairwise
from preflight.collective.pairwise import findings, matrix, schedule
from preflight.plan import Plan
from preflight.remote.shipping import ALLREDUCE, shipped_command, shipped_input
from preflight.report import files as reports
from preflight.result import Status
from test_col import drive, probe, rank, run_check
from test_net_paths import probe as path_probe

MIB = 1 << 20
SPECS = {c.id: c for c in registry.load().checks}
NODES = ("n01", "n02", "n03")


# --- the schedule -------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [2, 3, 4, 5, 8, 17, 32])
def test_the_schedule_meets_every_pair_once_in_rounds_of_disjoint_pairs(count):
    rounds = schedule(count)
    assert len(rounds) == count - 1 + count % 2  # N-1 rounds (N with a bye each when N is odd)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(count) for b in range(a + 1, count)]
    for r in rounds:
        busy = [n for p in r for n in p]
        assert len(busy) == len(set(busy)) and len(r) == count // 2


def test_above_32_nodes_a_bounded_sample_of_rounds_still_meets_every_node():
    rounds = schedule(200)
    assert len(rounds) == pairwise.MAX_ROUNDS
    for node in range(200):
        assert sum(node in p for r in rounds for p in r) == pairwise.MAX_ROUNDS  # one peer in every round
    spec = pairwise.spec(200, 256 * MIB)
    assert spec["tournament_rounds"] == 199 and spec["bytes"] == pairwise.PAIR_BYTES


def test_one_node_has_no_pair():
    assert schedule(1) == [] and schedule(0) == []


# --- the matrix and what it says ----------------------------------------------------------------

def reports_for(names, rate=lambda a, b: 1.0, dead=(), silent=(), retests=None):
    """Each node's report as the worker writes it, both ends of every pair (a dead link fails at both);
    `retests` {(a, b): gbps}: links measured again alone after the rounds, as the worker adds them."""
    given = pairwise.spec(len(names), MIB)
    out = {}
    for i, name in enumerate(names):
        if name in silent:
            out[name] = {"ok": False, "kind": "no-answer", "ranks": []}
            continue
        pairs = []
        for r, rnd in enumerate(given["rounds"]):
            for a, b in rnd:
                if i in (a, b):
                    link = frozenset((names[a], names[b]))
                    ok = link not in dead and not link & set(silent)
                    pairs.append({"round": r, "peer": b if a == i else a, "ok": ok,
                                  "stage": "connect", "error": None if link not in dead else "DistStoreError: timeout",
                                  "gbps": rate(names[a], names[b])})
        for r, ((a, b), gbps) in enumerate((retests or {}).items(), start=len(given["rounds"])):
            if name in (a, b):
                pairs.append({"round": r, "peer": names.index(b if name == a else a), "ok": True, "stage": "done",
                              "error": None, "gbps": gbps, "retest": True})
        out[name] = {"ok": True, "ranks": [dict(rank(i), pairs=pairs)]}
    return out, given


def names_of(count):
    return [f"n{i:02d}" for i in range(1, count + 1)]


@pytest.mark.parametrize("count", [3, 4, 8])
def test_a_healthy_matrix_names_nothing(count):
    names = names_of(count)
    m = matrix(names, *reports_for(names, lambda a, b: 1.0 + 0.3 * (hash(a + b) % 3)))
    assert m["pairs_measured"] == count * (count - 1) // 2 and not m["sampled"]
    assert findings(m) == {"failed_rows": [], "failed_links": [], "stragglers": {}, "slow_links": [], "busy_links": []}


@pytest.mark.parametrize("count", [3, 4, 8])
def test_a_node_slow_against_every_peer_is_a_straggler_and_no_link_is_blamed(count):
    names = names_of(count)
    m = matrix(names, *reports_for(names, lambda a, b: 0.05 if "n03" in (a, b) else 1.0))
    said = findings(m)
    assert list(said["stragglers"]) == ["n03"] and said["stragglers"]["n03"]["gbps"] == 0.05
    assert said["slow_links"] == [] and said["failed_links"] == [] and said["failed_rows"] == []


def test_a_node_twice_as_slow_is_no_straggler():
    names = names_of(4)
    m = matrix(names, *reports_for(names, lambda a, b: 0.5 if "n03" in (a, b) else 1.0))
    assert findings(m)["stragglers"] == {}


@pytest.mark.parametrize("count", [4, 8])
def test_one_slow_link_is_one_cell_not_a_row(count):
    names = names_of(count)
    m = matrix(names, *reports_for(names, lambda a, b: 0.05 if {a, b} == {"n02", "n03"} else 1.0))
    said = findings(m)
    assert said["slow_links"] == [["n02", "n03", 0.05, 1.0]] and said["stragglers"] == {}


def test_with_three_nodes_one_slow_link_is_not_judged():
    """Each end has one other link: one busy moment on a shared host would be enough to warn."""
    names = names_of(3)
    said = findings(matrix(names, *reports_for(names, lambda a, b: 0.05 if {a, b} == {"n02", "n03"} else 1.0)))
    assert said == {"failed_rows": [], "failed_links": [], "stragglers": {}, "slow_links": [], "busy_links": []}


@pytest.mark.parametrize("count", [3, 4, 8])
def test_a_dead_link_is_one_failed_cell(count):
    names = names_of(count)
    m = matrix(names, *reports_for(names, dead={frozenset(("n02", "n03"))}))
    said = findings(m)
    assert [link[:2] for link in said["failed_links"]] == [["n02", "n03"]] and said["failed_rows"] == []
    assert "DistStoreError" in said["failed_links"][0][2]
    i, j = names.index("n02"), names.index("n03")
    assert m["errors"][i][j] == m["errors"][j][i] and m["gbps"][i][j] is None


def test_a_node_that_sends_no_pairs_fails_its_row_alone():
    names = names_of(4)
    m = matrix(names, *reports_for(names, silent=("n04",)))
    said = findings(m)
    assert said["failed_rows"] == ["n04"] and said["failed_links"] == []
    assert m["errors"][0][3] == "connect: failed"  # as its peers' ends saw it


def test_two_nodes_whose_one_link_fails_are_both_named():
    names = names_of(2)
    said = findings(matrix(names, *reports_for(names, dead={frozenset(names)})))
    assert said["failed_rows"] == [] and [link[:2] for link in said["failed_links"]] == [names]


def test_rounds_the_time_did_not_allow_are_not_measured_not_failed():
    names = names_of(4)
    node_reports, given = reports_for(names)
    for report in node_reports.values():
        report["ranks"][0]["pairs"] = [p for p in report["ranks"][0]["pairs"] if p["round"] < 2]
    m = matrix(names, node_reports, given)
    assert m["pairs_measured"] == 4 and not any(e for row in m["errors"] for e in row)
    assert findings(m)["failed_links"] == []


def test_pair_results_of_the_wrong_shape_are_the_nodes_protocol_failure():
    good = {"ok": True, "ranks": [{"rank": 0, "ok": True, "pairs": [{"round": 0, "peer": 1, "ok": True, "gbps": 1.0}]}]}
    assert pairwise.report_problem(good, [0]) is None
    for wrong in ({"round": 0, "peer": 1, "ok": True, "gbps": "fast"}, {"round": -1, "peer": 1, "ok": True},
                  {"peer": 1, "ok": True}, {"round": 0, "peer": True, "ok": True}):
        bad = {"ok": True, "ranks": [{"rank": 0, "ok": True, "pairs": [wrong]}]}
        assert pairwise.report_problem(bad, [0]), wrong
    assert pairwise.report_problem(good, [1]).startswith("it reports ranks [0]")


# --- in the all-reduce's decisions --------------------------------------------------------------

def hang_between(a, b):
    """A full group that meets and hangs when both ends of the dead link are in it (gloo connects every pair)."""
    def outcome(names):
        ok = not {a, b} <= set(names)
        return [[rank(i) if ok else rank(i, False, "init", "timeout")] for i in range(len(names))]
    return outcome


def test_a_hang_whose_pairs_name_a_dead_link_blames_its_two_ends_and_skips_the_bisect():
    doc, runs = drive(hang_between("n02", "n03"), dead_links=[("n02", "n03")])
    assert sorted(doc["blamed"]) == ["n02", "n03"] and doc["cleared"] == ["n01"]
    assert doc["blamed"]["n02"]["kind"] == "link" and doc["blamed"]["n02"]["links"][0][0] == "n03"
    assert doc["bisect"] is None and [r["purpose"] for r in runs] == ["full", "pairwise"]
    failed = {n: r for r in run_check("COL001", {**probe(), **doc, "result": None, "passed": []}) for n in r.nodes}
    assert failed["n02"].status == Status.FAIL and "the link(s) n02 - n03 fail" in failed["n02"].message
    assert "between n02 and n03" in failed["n02"].remediation and failed["n01"].status == Status.PASS
    assert failed["n01"].message.startswith("passes point to point with every peer it met in pairs of nodes")


def test_a_hang_whose_pairs_all_pass_is_bisected_as_before():
    doc, runs = drive(hang_between("n02", "n03"))
    assert [r["purpose"] for r in runs[:2]] == ["full", "pairwise"] and doc["bisect"]["inconclusive"]
    assert sorted(doc["blamed"]) == ["n02", "n03"] and doc["blamed"]["n02"]["kind"] == "bisect"


def test_a_healthy_run_keeps_its_matrix_and_runs_no_pairs_of_its_own():
    def outcome(names):
        return [[rank(i)] for i in range(len(names))]
    doc, runs = drive(outcome)
    assert [r["purpose"] for r in runs] == ["full"] and doc["blamed"] == {}


# --- what the data-path probes found, in the all-reduce's decisions ------------------------------

def path_faults(changes):
    """What collective.datapath names in a data-path probe of three nodes (test_net_paths.probe) with changes."""
    return datapath.broken(path_probe(changes)["paths"], {n: s["facts"] for n, s in node_facts().items()})


TIMED_OUT = {"tcp": {"ok": False, "error": "timed out after 3s"}}
CAPTURED = {("n02", "n03"): {"device": "cap0", **TIMED_OUT}, ("n03", "n02"): TIMED_OUT}


def test_a_captured_route_is_the_fault_of_the_node_that_has_it_alone():
    named = path_faults(CAPTURED)
    assert list(named) == ["n02"] and named["n02"]["checks"] == ["NET010"] and named["n02"]["links"] == []
    assert named["n02"]["own"].startswith("n02 routes to n03 (10.0.0.3) over cap0, not over eth0")


def test_a_pair_that_cannot_connect_either_way_names_its_two_ends_once_and_nobody_else():
    refused = {"tcp": {"ok": False, "error": "Connection refused"}}
    named = path_faults({("n02", "n03"): refused, ("n03", "n02"): refused})
    assert sorted(named) == ["n02", "n03"] and [p for p, _ in named["n02"]["links"]] == ["n03"]
    assert [p for p, _ in named["n03"]["links"]] == ["n02"] and named["n03"]["own"] is None
    assert "cannot connect to" in named["n02"]["links"][0][1] and "Connection refused" in named["n02"]["links"][0][1]


def test_a_node_nobody_can_dial_and_a_black_holed_pair_are_named_as_net009_and_net008_say():
    named = path_faults({("n01", "n03"): TIMED_OUT, ("n02", "n03"): TIMED_OUT})
    assert list(named) == ["n03"] and named["n03"]["own"].startswith("no other node can connect to n03")
    jumbo = {"mtu": {"size": 9000, "ok": False, "carried": 1500}}
    named = path_faults({("n02", "n03"): jumbo, ("n03", "n02"): jumbo})
    assert sorted(named) == ["n02", "n03"] and named["n02"]["checks"] == ["NET008"]
    assert named["n02"]["links"] == [["n03", "packets of 9000 bytes do not pass between n02 and n03: the path "
                                              "carries 1500"]]


def test_a_healthy_path_probe_names_nobody():
    assert path_faults({}) == {} and datapath.broken(None, {}) == {}


def test_a_hang_the_path_probes_explain_is_blamed_from_them_without_a_pairwise_run_or_a_bisect():
    doc, runs = drive(hang_between("n02", "n03"), broken=path_faults(CAPTURED))
    assert list(doc["blamed"]) == ["n02"] and doc["blamed"]["n02"]["kind"] == "path"
    assert sorted(doc["cleared"]) == ["n01", "n03"] and doc["bisect"] is None
    assert [r["purpose"] for r in runs] == ["full"]
    found = by_node(run_check("COL001", {**probe(), **doc, "result": None, "passed": []}))
    assert found["n02"].status == Status.FAIL and found["n02"].nodes == ("n02",)
    assert "the data-path probes name n02 itself (NET010): n02 routes to n03 (10.0.0.3) over cap0" in \
        found["n02"].message and "NET010" in found["n02"].remediation
    assert found["n03"].status == Status.PASS and found["n01"].status == Status.PASS
    assert found["n03"].message.startswith("reaches every peer it probed on the data path")


def test_a_hang_with_a_pair_the_probes_found_closed_blames_its_two_ends():
    refused = {"tcp": {"ok": False, "error": "Connection refused"}}
    doc, runs = drive(hang_between("n02", "n03"), broken=path_faults({("n02", "n03"): refused}))
    assert sorted(doc["blamed"]) == ["n02", "n03"] and doc["cleared"] == ["n01"]
    assert [r["purpose"] for r in runs] == ["full"] and doc["bisect"] is None
    found = by_node(run_check("COL001", {**probe(), **doc, "result": None, "passed": []}))
    assert "the data-path probes found the link(s) n02 - n03 broken (NET009)" in found["n02"].message
    assert "the link(s) n03 - n02 broken (NET009)" in found["n03"].message


def test_what_the_path_probes_found_decides_nothing_when_the_run_passes():
    doc, runs = drive(lambda names: [[rank(i)] for i in range(len(names))], broken=path_faults(CAPTURED))
    assert doc["blamed"] == {} and doc["passed"] == list(NODES) and [r["purpose"] for r in runs] == ["full"]


def test_col004_names_only_the_end_the_path_probes_found_at_fault():
    m = matrix(list(NODES), *reports_for(list(NODES), dead={frozenset(("n02", "n03"))}))
    blamed = {"n02": {"kind": "path", "own": "n02 routes to n03 over cap0", "links": [], "checks": ["NET010"]}}
    found = run_check("COL004", probe(pairwise=m, blamed=blamed))
    [failed] = [r for r in found if r.status == Status.FAIL]
    assert failed.nodes == ("n02",) and "the data-path probes name n02 itself" in failed.message


# --- COL004 over probe documents ----------------------------------------------------------------

def with_matrix(**kwargs):
    names = list(NODES)
    return probe(pairwise=matrix(names, *reports_for(names, **kwargs), 0.05))


def by_node(found):
    return {node: r for r in found for node in r.nodes}


def test_col004_passes_a_healthy_matrix_and_carries_it_with_the_contract_keys():
    [passed] = run_check("COL004", with_matrix())
    assert passed.status == Status.PASS and passed.nodes == NODES
    assert "3 pair(s) of 3 node(s) measured point to point, 1-1 GB/s: no failed link, no straggler" in passed.message
    assert passed.evidence["matrix"]["nodes"] == list(NODES)
    assert "busbw_gbps" in passed.evidence and "algbw_gbps" in passed.evidence


def test_col004_names_a_straggler_without_a_threshold():
    found = run_check("COL004", with_matrix(rate=lambda a, b: 0.02 if "n03" in (a, b) else 0.9))
    named = by_node(found)
    assert named["n03"].status == Status.FAIL and "a straggler: every link of n03 is at most 0.02 GB/s" \
        in named["n03"].message and "45x below the 0.9 GB/s median" in named["n03"].message
    assert named["n01"].status == Status.PASS and named["n02"].status == Status.PASS
    assert found[0].evidence["matrix"]["gbps"][0][2] == 0.02  # the matrix in the first result
    assert "busbw_gbps" in found[1].evidence and "matrix" not in found[1].evidence


def test_col004_fails_a_dead_link_at_its_two_ends_only():
    found = run_check("COL004", with_matrix(dead={frozenset(("n02", "n03"))}))
    [failed] = [r for r in found if r.status == Status.FAIL]
    assert failed.nodes == ("n02", "n03") and failed.message.startswith("the link n02 - n03 fails point to point")
    assert by_node(found)["n01"].status == Status.PASS


def test_col004_warns_of_one_slow_link():
    names = ["n01", "n02", "n03", "n04"]
    doc = probe(nodes=names, pairwise=matrix(names, *reports_for(
        names, rate=lambda a, b: 0.05 if {a, b} == {"n01", "n04"} else 1.0)))
    found = run_check("COL004", doc, Plan(nodes=tuple(names), remote=True))
    [warned] = [r for r in found if r.status == Status.WARN]
    assert warned.nodes == ("n01", "n04") and "moves 0.05 GB/s, over 4x below the 1 GB/s" in warned.message


def busy_link(a, b):
    return lambda x, y: 0.05 if {x, y} == {"n02", "n03"} else 1.0


def test_a_link_slow_in_its_round_but_fast_alone_is_no_slow_link():
    names = names_of(8)
    m = matrix(names, *reports_for(names, busy_link("n02", "n03"), retests={("n02", "n03"): 0.9}))
    assert findings(m)["slow_links"] == [] and m["gbps"][1][2] == m["gbps"][2][1] == 0.9
    assert m["retested"] == [["n02", "n03", 0.05, 0.9]]  # the evidence: suspected, and what the retest found
    found = run_check("COL004", probe(nodes=names, pairwise=m), Plan(nodes=tuple(names), remote=True))
    assert {r.status for r in found} == {Status.PASS}


def test_a_link_still_slow_alone_is_warned_as_measured_again():
    names = names_of(8)
    m = matrix(names, *reports_for(names, busy_link("n02", "n03"), retests={("n02", "n03"): 0.04}))
    assert findings(m)["slow_links"] == [["n02", "n03", 0.04, 1.0]]
    found = run_check("COL004", probe(nodes=names, pairwise=m), Plan(nodes=tuple(names), remote=True))
    [warned] = [r for r in found if r.status == Status.WARN]
    assert warned.nodes == ("n02", "n03") and warned.message.startswith(
        "the link n02 - n03 moves 0.04 GB/s measured again alone (0.05 GB/s in its round), over 4x below")


def test_links_fast_alone_do_not_make_a_link_measured_in_its_round_look_slow():
    """A retest alone may be far faster than every link measured with the others' traffic: the links are judged
    from the rounds' figures, the retests only clear suspects (else n01 - n04 would be 8x below its ends' others)."""
    names = names_of(4)
    busy = {("n01", "n02"), ("n01", "n03"), ("n02", "n04"), ("n03", "n04")}
    m = matrix(names, *reports_for(names, lambda a, b: 0.05 if (a, b) in busy else 1.0,
                                   retests={link: 8.0 for link in sorted(busy)}))
    assert len(m["retested"]) == 4 and m["gbps"][0][3] == 1.0
    assert findings(m) == {"failed_rows": [], "failed_links": [], "stragglers": {}, "slow_links": [], "busy_links": []}


def test_a_retest_by_one_end_of_two_that_answered_does_not_clear_the_link():
    """As a round, a retest counts from both ends when both answered: one node cannot clear a link alone."""
    names = names_of(8)
    node_reports, given = reports_for(names, busy_link("n02", "n03"), retests={("n02", "n03"): 0.9})
    pairs = node_reports["n03"]["ranks"][0]["pairs"]
    pairs[:] = [p for p in pairs if not p.get("retest")]
    m = matrix(names, node_reports, given)
    assert m["retested"] == [] and findings(m)["slow_links"] == [["n02", "n03", 0.05, 1.0]]


def test_a_failed_retest_keeps_the_rounds_figure():
    names = names_of(8)
    node_reports, given = reports_for(names, busy_link("n02", "n03"), retests={("n02", "n03"): None})
    for name in ("n02", "n03"):
        node_reports[name]["ranks"][0]["pairs"][-1].update(ok=False, stage="connect", error="peer gone")
    m = matrix(names, node_reports, given)
    assert m["retested"] == [["n02", "n03", 0.05, None]] and findings(m)["slow_links"] == [["n02", "n03", 0.05, 1.0]]
    assert not any(e for row in m["errors"] for e in row)


def test_a_retest_of_the_wrong_shape_is_the_nodes_protocol_failure():
    for wrong in ("yes", 1, [True]):
        bad = {"ok": True, "ranks": [{"rank": 0, "ok": True, "pairs": [
            {"round": 0, "peer": 1, "ok": True, "gbps": 1.0},
            {"round": 3, "peer": 1, "ok": True, "gbps": 1.0, "retest": wrong}]}]}
        assert "retest" in pairwise.report_problem(bad, [0]), wrong


def test_the_node_and_the_head_judge_slow_links_by_the_same_rule():
    """The worker picks its suspects with preflight.node.pairlinks, the head judges with it: one rule."""
    from preflight.node import allreduce as worker, pairlinks

    assert pairwise.pairlinks is pairlinks and worker.pairlinks is pairlinks
    rates = {(a, b): 0.05 if (a, b) == (1, 2) else 1.0 for a in range(8) for b in range(a + 1, 8)}
    assert pairlinks.slow_links(rates, 8, pairlinks.stragglers(rates)) == [(1, 2, 0.05, 1.0)]


def test_suspects_past_the_retests_limit_are_busy_when_every_one_measured_again_was_fast():
    """Three links slow in their rounds, the nodes' limit let them measure one again: fast alone, so the two others,
    as slow in the same busy rounds, are not warned of either (COL004 says how many); had it stayed slow alone, the
    two others would still be warned."""
    names = names_of(8)
    busy = {frozenset(p) for p in (("n01", "n02"), ("n03", "n04"), ("n05", "n06"))}
    rate = lambda a, b: 0.1 if {a, b} in busy else 1.0  # noqa: E731
    m = matrix(names, *reports_for(names, rate, retests={("n01", "n02"): 1.2}))
    said = findings(m)
    assert said["slow_links"] == [] and [link[:2] for link in said["busy_links"]] == [["n03", "n04"], ["n05", "n06"]]
    found = run_check("COL004", probe(nodes=names, pairwise=m), Plan(nodes=tuple(names), remote=True))
    assert [r.status for r in found] == [Status.PASS]
    assert found[0].message.endswith("2 more link(s) looked slow in a busy round, as the 1 measured again alone "
                                     "did, and those were fast")
    still = findings(matrix(names, *reports_for(names, rate, retests={("n01", "n02"): 0.1})))
    assert [link[:2] for link in still["slow_links"]] == [["n01", "n02"], ["n03", "n04"], ["n05", "n06"]]
    assert still["busy_links"] == []


def test_the_nodes_measure_the_most_suspect_link_first():
    """A limit on the retests leaves out the least suspect: a link 20x below its ends' others before one 5x."""
    from preflight.node import pairlinks

    rates = {(a, b): 1.0 for a in range(8) for b in range(a + 1, 8)}
    rates[(0, 1)], rates[(2, 3)], rates[(4, 5)] = 0.2, 0.05, 0.15
    slow = pairlinks.slow_links(rates, 8, pairlinks.stragglers(rates))
    assert [link[:2] for link in slow] == [(0, 1), (2, 3), (4, 5)]
    assert [link[:2] for link in pairlinks.most_suspect_first(slow)] == [(2, 3), (4, 5), (0, 1)]


def test_col004_skips_without_a_matrix():
    [skipped] = run_check("COL004", probe())
    assert skipped.status == Status.SKIP and "pairwise phase did not run" in skipped.message
    [alone] = runner.run_check(SPECS["COL004"], runner.CheckContext(Plan(nodes=("here",)), {}, {}))
    assert alone.status == Status.SKIP and "this machine alone" in alone.message


# --- the worker's pairs on this machine ---------------------------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_nodes(count, absent=(), budget=15.0, port=None):
    """`count` workers in pairs mode over loopback, one rank each (the nodes in `absent` never start)."""
    port, given = port or free_port(), pairwise.spec(count, MIB)
    procs = {}
    for i in range(count):
        if i in absent:
            continue
        options = {"master_addr": "127.0.0.1", "master_port": port, "world_size": count, "ranks": [i],
                   "backend": "gloo", "sizes": [], "timeout_s": 5, "budget_s": budget, "env": {}, "run": "tp",
                   "mode": "pairs", "pairs": given}
        proc = subprocess.Popen(["bash", "-c", shipped_command(sys.executable)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        proc.stdin.write(shipped_input(ALLREDUCE, options))
        proc.stdin.flush()
        procs[f"n{i}"] = proc
    out = {}
    for name, proc in procs.items():
        line = proc.stdout.readline()
        proc.stdin.close()
        proc.wait(timeout=30)
        out[name] = json.loads(line)
    return [f"n{i}" for i in range(count)], out, given


def test_worker_pairs_of_three_local_nodes_all_pass():
    started = time.monotonic()
    names, node_reports, given = local_nodes(3)
    elapsed = time.monotonic() - started
    for name, report in node_reports.items():
        assert pairwise.report_problem(report, [names.index(name)]) is None, report
        [r] = report["ranks"]
        assert r["ok"] and len(r["pairs"]) == 2 and all(p["ok"] and p["gbps"] > 0 for p in r["pairs"]), r
    m = matrix(names, node_reports, given)
    assert m["pairs_measured"] == 3 and not any(e for row in m["errors"] for e in row)
    assert elapsed < 12, elapsed  # torch's import, then milliseconds per pair: not the 15 s budget


def test_the_first_round_waits_for_every_node_at_the_rendezvous_for_half_the_time_left():
    """A peer still importing torch would fail its first pair: the phase starts once every node is there, or
    once half the time left has passed (a node that never comes then fails its row)."""
    from preflight.node import allreduce as worker

    said = []

    class Store:
        count = 0

        def add(self, key, amount):
            self.count += amount
            return self.count

        def set(self, key, value):
            said.append(("set", key))

        def wait(self, keys, timeout):
            said.append(("wait", keys[0], timeout.total_seconds()))

    options = {"pairs": {"rounds": [], "bytes": 4}, "ranks": [0], "world_size": 4, "master_addr": "127.0.0.1",
               "master_port": 1}
    assert worker._pair_rounds(None, None, Store(), options, 0, worker._now() + 20, print) == []
    [(what, key, seconds)] = said
    assert (what, key) == ("wait", "pairs/start") and 9 < seconds <= 10
    said.clear()
    worker._pair_rounds(None, None, Store(), dict(options, world_size=1), 0, worker._now() + 20, print)
    assert said[0] == ("set", "pairs/start")  # the last node to come starts the phase


def test_worker_pairs_with_a_node_that_never_comes_fail_only_its_row_within_the_budget():
    started = time.monotonic()
    names, node_reports, given = local_nodes(4, absent=(3,), budget=12.0)
    assert time.monotonic() - started < 12 + 3
    node_reports["n3"] = {"ok": False, "kind": "no-answer", "ranks": []}
    said = findings(matrix(names, node_reports, given))
    assert said["failed_rows"] == ["n3"] and said["failed_links"] == [], said


def without_retests(node_reports):
    """The reports as they were before the retests: the rounds' figures alone."""
    return {name: dict(report, ranks=[dict(r, pairs=[p for p in r.get("pairs") or [] if not p.get("retest")])
                                      for r in report.get("ranks") or []]) for name, report in node_reports.items()}


HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def busy_cores_during_the_rounds(port, run="tp"):
    """A thread that, once the run's rounds start (its store's pairs/start), keeps every core of this machine
    busy with a process of its own (pinned to it) until the nodes have chosen the links to measure again
    (pairs/suspects): the rounds share the cores with other work, the retests do not."""
    import datetime
    import threading

    import torch.distributed as dist  # here, not in the thread: an import there raced the workers' start (EFAULT)

    def watch():
        try:
            store = dist.PrefixStore(f"preflight/{run}/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                                         timeout=datetime.timedelta(seconds=60)))
            store.wait(["pairs/start"])
        except Exception:  # the run's store never came, or went before the rounds: no rounds to keep busy
            return
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(cpu)]) for cpu in sorted(os.sched_getaffinity(0))]
        try:
            store.wait(["pairs/suspects"])
        except Exception:  # no retests in this run (the time ran short, a node went): the hogs stop all the same
            pass
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_worker_links_slow_only_while_their_round_shared_the_cores_are_measured_again_alone():
    """12 nodes on this machine's cores, every core kept busy by other processes during the rounds: some links
    look several times slower than their ends' others (0 to 15 of the 66 in each run measured here). Measured
    again alone after the rounds (the cores then free), they are as fast as the others: no slow link is warned."""
    started = time.monotonic()
    port = free_port()
    watcher = busy_cores_during_the_rounds(port)
    names, node_reports, given = local_nodes(12, budget=60.0, port=port)
    watcher.join(timeout=5)
    elapsed = time.monotonic() - started
    for name, report in node_reports.items():
        assert pairwise.report_problem(report, [names.index(name)]) is None, report
    suspects = findings(matrix(names, without_retests(node_reports), given))["slow_links"]
    m = matrix(names, node_reports, given)
    print(f"12 local nodes in {elapsed:.1f} s: {len(suspects)} link(s) slow in their round, retested "
          f"{m.get('retested')}")
    assert m["pairs_measured"] == 66
    assert findings(m)["slow_links"] == [], m.get("retested")
    assert sorted(link[:2] for link in m["retested"]) == sorted(link[:2] for link in suspects)  # each one, once
    assert all(again is not None for *_, again in m["retested"]), m["retested"]


# --- the heat map -------------------------------------------------------------------------------

def col004_results(names, **kwargs):
    m = matrix(names, *reports_for(names, **kwargs))
    doc = probe(nodes=names, pairwise=m)
    return runner.run_check(SPECS["COL004"], runner.CheckContext(Plan(nodes=tuple(names), remote=True), {},
                                                                 {"collective": doc}))


def test_heat_map_marks_the_straggler_row_and_the_dead_cell():
    names = names_of(4)
    page = reports.html_report(col004_results(names, rate=lambda a, b: 0.02 if "n03" in (a, b) else 0.9,
                                              dead={frozenset(("n01", "n02"))}), "fail", names, 1.0)
    assert '<table class="links">' in page and '<th scope="row" class="named">n03</th>' in page
    assert page.count('<td class="straggler"') == 6 and page.count('<td class="failed"') == 2
    assert 'title="n01 - n02: failed: connect: DistStoreError: timeout"' in page
    healthy = reports.html_report(col004_results(names), "pass", names, 1.0)
    assert healthy.count('<td class="fast"') == 12 and 'class="named"' not in healthy


def test_no_heat_map_without_a_matrix_or_above_its_size():
    assert '<table class="links">' not in reports.html_report(run_check("COL004", probe()), "pass", NODES, 1.0)
    names = names_of(65)
    assert '<table class="links">' not in reports.html_report(col004_results(names), "pass", names, 1.0)


def test_heat_map_read_at_a_glance_in_chromium(tmp_path):
    """Headless Chromium on the real page: the straggler's cells orange and the dead link red, on screen."""
    spec = importlib.util.spec_from_file_location("test_report_files", Path(__file__).parents[1] / "engine" /
                                                  "test_report_files.py")
    page_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_tests)
    browse, chromium, colours = page_tests.browse, page_tests.chromium, page_tests.colours
    browser = chromium()
    names = names_of(6)
    found = col004_results(names, rate=lambda a, b: 0.02 if "n05" in (a, b) else 0.9,
                           dead={frozenset(("n01", "n02"))})
    page = tmp_path / "report.html"
    reports.write_html(str(page), found, "fail", names, 1.0)
    shot, dom, _ = browse(browser, page, tmp_path, "links")
    assert "Links between the nodes" in dom and "a straggler: every link of n05" in dom
    size, painted = colours(shot)
    straggler, failed = bytes.fromhex("e8743b"), bytes.fromhex(reports.COLORS[Status.FAIL][0][1:])
    assert painted.get(straggler, 0) > 2000, painted.get(straggler, 0)  # ten cells, the row and the column
    assert painted.get(failed, 0) > 800, painted.get(failed, 0)


# --- the real test cluster ----------------------------------------------------------------------

def check(cluster, *extra, timeout="20"):
    return preflight_json("check", "--hosts", ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
                          "--python", sys.executable, "--only", "COL", "--timeout", timeout, "--col-sizes", "1M,8M",
                          *extra)


def drop_between(cluster, node, peer):
    """On `node`, drop every packet from `peer` (nft, in the node's namespace): the two cannot talk, each still
    talks to every other node (TCP both ways: the answers to `node`'s own connections come from `peer` too)."""
    table = "pfp_" + node
    subprocess.run(["ip", "netns", "exec", cluster.netns(node), "nft", "-f", "-"], check=True, text=True, input=(
        f"table inet {table} {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n"
        f"  ip saddr {cluster.ip(peer)} drop\n }}\n}}\n"))
    return lambda: subprocess.run(["ip", "netns", "exec", cluster.netns(node), "nft", "delete", "table", "inet",
                                   table], check=False)


PATHS = "COL,NET008,NET009,NET010"  # the all-reduce with the data-path probes it blames from


@pytest.mark.cluster
def test_healthy_cluster_passes_col004_within_a_bounded_pairwise_cost(cluster):
    doc, elapsed = check(cluster, "--only", PATHS)
    assert doc["verdict"] == "pass", [(r["id"], r["status"], r["message"]) for r in doc["results"]]
    [links] = [r for r in doc["results"] if r["id"] == "COL004"]
    assert links["status"] == "pass" and links["nodes"] == list(cluster.nodes)
    m = links["evidence"]["matrix"]
    assert m["pairs_measured"] == 3 and all(v is None or v > 0 for row in m["gbps"] for v in row)
    print(f"pairwise phase in the full run: {m['elapsed_s']} s for {m['pairs_measured']} pairs")
    assert m["elapsed_s"] < 5.0  # it includes waiting for a peer still importing torch (it would wait in init)


@pytest.mark.cluster
def test_a_slow_link_shows_as_a_straggler_row_without_a_threshold(cluster):
    with cluster.slowed_link("node03", "100mbit"):
        doc, elapsed = check(cluster)
    links = results(doc, "COL004")
    assert links["node03"]["status"] == "fail" and "a straggler: every link of node03" in links["node03"]["message"]
    assert links["node01"]["status"] == "pass" and links["node02"]["status"] == "pass"
    assert {r["status"] for r in results(doc, "COL001").values()} == {"pass"}
    print(f"verdict with one slow link in {elapsed:.1f} s")
    assert elapsed < 20 + 5 + 5


@pytest.mark.cluster
def test_a_dead_link_between_two_workers_is_named_and_the_head_is_cleared(cluster):
    undo = drop_between(cluster, "node02", "node03")
    try:
        doc, elapsed = check(cluster)
    finally:
        undo()
    links = results(doc, "COL004")
    first = next(r for r in doc["results"] if r["id"] == "COL004")
    print(json.dumps(first["evidence"].get("matrix")))
    assert links["node02"]["status"] == "fail" and links["node03"]["status"] == "fail", links
    assert links["node02"]["message"].startswith("the link node02 - node03 fails point to point")
    assert links["node01"]["status"] == "pass"
    allreduce = results(doc, "COL001")
    assert {n: r["status"] for n, r in allreduce.items()} == {"node01": "pass", "node02": "fail", "node03": "fail"}
    assert "the link(s) node02 - node03 fail" in allreduce["node02"]["message"]
    print(f"verdict with one dead link in {elapsed:.1f} s")
    assert elapsed < 20 + 5 + 5


@pytest.mark.cluster
def test_a_route_the_path_probes_found_is_named_on_its_node_alone_by_col001(cluster):
    """node02 reaches node03 over a more specific route into a dead end: the all-reduce hangs, and COL001 names
    node02 from what NET010 found, not the link's two ends."""
    with cluster.captured_route("node02", "node03"):
        doc, elapsed = check(cluster, "--only", PATHS)
    allreduce = results(doc, "COL001")
    assert {n: r["status"] for n, r in allreduce.items()} == {"node01": "pass", "node02": "fail", "node03": "pass"}
    assert "the data-path probes name node02 itself (NET010)" in allreduce["node02"]["message"]
    assert allreduce["node02"]["evidence"]["kind"] == "path"
    assert [(r["status"], r["nodes"]) for r in doc["results"] if r["id"] == "NET010" and r["status"] == "fail"] == \
        [("fail", ["node02"])]
    assert not [r for r in doc["results"] if r["status"] == "fail" and "node03" in r["nodes"]], doc["results"]
    print(f"verdict with a captured route in {elapsed:.1f} s")


# Four nodes: a single slow link is judged from pairwise.SLOW_LINK_NODES on, and the run's shared cluster has three.
# Per test, and the module's last test: the shared cluster is taken down while it is up (one on the bridge).
four_up, four = make_cluster_fixtures(nodes=4, prefix="four", scope="function", name="four")


@pytest.mark.cluster
def test_a_slow_link_between_two_workers_is_warned_once_measured_again_alone(four):
    """What node02 sends to node03 goes through a 100 Mbit/s class (tc htb), every other link at full speed: the
    rounds find it slow, the nodes measure it again alone, still slow, and COL004 warns of that link alone."""
    with four.slowed_path("four02", "four03", "100mbit"):
        doc, elapsed = check(four, timeout="30")
    first = next(r for r in doc["results"] if r["id"] == "COL004")
    assert "matrix" in first["evidence"], [(r["id"], r["status"], r["message"][:200]) for r in doc["results"]]
    m = first["evidence"]["matrix"]
    print(f"verdict in {elapsed:.1f} s; retested {m['retested']}")
    warned = [r for r in doc["results"] if r["id"] == "COL004" and r["status"] == "warn"]
    assert [r["nodes"] for r in warned] == [["four02", "four03"]], [(r["status"], r["message"]) for r in
                                                                     doc["results"] if r["id"] == "COL004"]
    assert "measured again alone" in warned[0]["message"]
    retested = {tuple(link[:2]): link for link in m["retested"]}
    assert ("four02", "four03") in retested and retested[("four02", "four03")][3] < 0.05
    # A link the rounds found slow only because this 2-core machine was busy is measured again alone too, and
    # cleared: only four02-four03 is warned (above).
    assert not [r for r in doc["results"] if r["id"] == "COL004" and r["status"] == "fail"]


def test_the_slow_link_rule_gives_the_answers_of_its_definition():
    """pairlinks reads each node's links once (a node's median without one link, the others' as all but its own;
    200 nodes' 3,100 sampled links take 0.1 s, the definition's walk over every link for every link 1.6 s): the
    same stragglers and slow links as the definition, written out link by link."""
    import random
    import statistics

    from preflight.node import pairlinks

    def definition(rates, count):
        def med(values):
            return statistics.median(values) if values else None
        strag = {}
        for x in sorted({n for link in rates for n in link}):
            own = [v for (a, b), v in rates.items() if x in (a, b)]
            others = [v for (a, b), v in rates.items() if x not in (a, b)]
            if len(own) >= 2 and others and max(own) * pairlinks.SLOWER < med(others):
                strag[x] = (max(own), med(others))
        slow = []
        for (a, b), v in sorted(rates.items()):
            if count < pairlinks.SLOW_LINK_NODES or a in strag or b in strag:
                continue
            ends = [med([w for (c, d), w in rates.items() if x in (c, d) and (c, d) != (a, b)]) for x in (a, b)]
            if all(e is not None for e in ends) and v * pairlinks.SLOWER < min(ends):
                slow.append((a, b, v, min(ends)))
        return strag, slow

    rng = random.Random(7)
    for count in (4, 5, 9, 12):
        for _ in range(10):
            rates = {(a, b): rng.choice((0.05, 0.2, 1.0, 1.0, 1.3)) for a in range(count) for b in range(a + 1, count)
                     if rng.random() < 0.8}
            strag = pairlinks.stragglers(rates)
            assert (strag, pairlinks.slow_links(rates, count, strag)) == definition(rates, count), rates
