"""The all-reduce smoke test (COL): its arithmetic, its diagnosis and bisect, the worker on this machine, and
the real test cluster (healthy, two ranks per node, a dropped main port, a node without torch, a node behind a
slow link, a node whose firewall refuses the other ranks: named by the pairwise phase, COL004)."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import preflight_json, results
from preflight import cli, engine, registry, runner
from preflight.collective import allreduce as collective
from preflight.collective import pairwise
from preflight.node import allreduce as colworker
from preflight.collective.allreduce import (
    CollectiveOptions,
    bisect,
    bus_factor,
    busbw,
    choose_backend,
    diagnose,
    local_processes,
)
from preflight.collective.options import parse_sizes
from preflight.plan import Limits, Plan
from preflight.result import Status
from preflight.remote.shipping import ALLREDUCE, shipped_command, shipped_input

MIB = 1 << 20
SPECS = {c.id: c for c in registry.load().checks}


# --- arithmetic ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world,factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75), (64, 126 / 64)])
def test_bus_factor_is_nccl_tests_2_n_minus_1_over_n(world, factor):
    assert bus_factor(world) == pytest.approx(factor)
    assert busbw(10.0, world) == pytest.approx(10.0 * factor)


@pytest.mark.parametrize("text,sizes", [
    ("1M,64M,256M", (MIB, 64 * MIB, 256 * MIB)),
    ("256M, 1M", (MIB, 256 * MIB)),
    ("512K,1MiB,1048576,2GB", (512 << 10, MIB, 2 << 30)),
    ("1.5m", (int(1.5 * MIB),)),
    ("4", (4,)),
])
def test_sizes_parse_binary_units_sorted_and_unique(text, sizes):
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", ",", "abc", "1T", "-1M", "2", "64M,x", "32G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(Exception):
        parse_sizes(text)


def test_bad_collective_options_are_a_bad_invocation(capsys):
    for extra in (["--col-sizes", "64Q"], ["--backend", "mpi"], ["--min-busbw", "0"], ["--col-port", "70000"]):
        code = cli.main(["check", "--hosts", "n1,n2", "--only", "COL", *extra])
        assert code == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("preflight: error:") and "Traceback" not in err


def test_backend_auto_means_nccl_only_when_every_node_has_gpus():
    gpu = {"gpus": [{"index": 0}]}
    nvml = {"gpus": {"available": True, "devices": [{"index": 0}, {"index": 1}]}}
    assert choose_backend("auto", [{}, {}]) == "gloo"
    assert choose_backend("auto", [gpu, gpu]) == "nccl"
    assert choose_backend("auto", [gpu, {"gpus": []}]) == "gloo"
    assert choose_backend("auto", [nvml, gpu]) == "nccl"
    assert choose_backend("auto", [{"gpus": {"available": False, "reason": "no driver"}}]) == "gloo"
    assert choose_backend("gloo", [gpu]) == "gloo" and choose_backend("nccl", [{}]) == "nccl"
    assert local_processes(CollectiveOptions(), "gloo", [nvml]) == 1
    assert local_processes(CollectiveOptions(), "nccl", [nvml, gpu]) == 1
    assert local_processes(CollectiveOptions(planned_per_node=2), "nccl", [nvml]) == 2
    assert local_processes(CollectiveOptions(procs_per_node=3), "gloo", [{}]) == 3


# --- bisect and diagnosis -----------------------------------------------------------------------

def fake_test(bad_nodes, head="n01", calls=None):
    def test(group):
        if calls is not None:
            calls.append(group)
        return {"bad": bool(bad_nodes & ({head} | set(group)))}
    return test


WORKERS = [f"n{i:02d}" for i in range(2, 10)]  # eight workers besides the head n01


@pytest.mark.parametrize("bad,suspects", [({"n05"}, ["n05"]), ({"n02"}, ["n02"]), ({"n09"}, ["n09"]),
                                          ({"n03", "n08"}, ["n03", "n08"]), ({"n01"}, ["n01"])])
def test_bisect_names_the_bad_workers_or_the_head(bad, suspects):
    calls = []
    found = bisect("n01", WORKERS, fake_test(bad, calls=calls), lambda: True)
    assert found["suspects"] == suspects and found["complete"] and not found["inconclusive"]
    if len(bad) == 1 and "n01" not in bad:
        assert len(calls) == 6  # two halves per level, three levels for eight workers
    assert all(t["nodes"][0] == "n01" for t in found["tests"])


def test_bisect_with_one_worker_cannot_tell_the_pair_apart():
    found = bisect("n01", ["n02"], fake_test({"n02"}), lambda: True)
    assert found["suspects"] == ["n01", "n02"]


def test_bisect_when_only_the_whole_group_fails_is_inconclusive():
    found = bisect("n01", ["n02", "n03", "n04"], fake_test(set()), lambda: True)
    assert found["inconclusive"] and found["suspects"] == ["n02", "n03", "n04"]


def test_bisect_out_of_time_keeps_the_untested_half_suspect():
    budget = [3]

    def have_time():
        budget[0] -= 1
        return budget[0] >= 0

    found = bisect("n01", WORKERS, fake_test({"n07"}), have_time)
    assert not found["complete"] and "n07" in found["suspects"] and len(found["tests"]) == 3
    assert "n02" not in found["suspects"]


def rank(rank, ok=True, stage="done", kind=None, error=None):
    return {"rank": rank, "ok": ok, "stage": stage, "kind": kind, "error": error, "tail": "t%d" % rank}


def run_doc(*reports, ok=False):
    nodes = ["n01", "n02", "n03"]
    return {"ok": ok, "nodes": nodes, "master_addr": "10.0.0.1", "port": 29500,
            "reports": {n: {"ok": all(r["ok"] for r in rs), "kind": None, "ranks": rs}
                        for n, rs in zip(nodes, reports)}}


def test_diagnose_names_the_node_without_torch_not_the_ones_left_waiting():
    run = run_doc([rank(0, False, "init", "timeout")], [rank(1, False, "init", "aborted")],
                  [rank(2, False, "import", "import", "cannot import torch: ImportError: x")])
    assert list(diagnose(run, "n01")) == ["n03"]


def test_diagnose_blames_the_head_when_nobody_reaches_its_rendezvous():
    run = run_doc(*[[rank(i, False, "store", "timeout", "DistNetworkError: timed out")] for i in range(3)])
    blamed = diagnose(run, "n01")
    assert list(blamed) == ["n01"] and "10.0.0.1:29500" in blamed["n01"]["error"]
    workers_only = run_doc([rank(0, False, "init", "timeout")], [rank(1, False, "store", "killed")],
                           [rank(2, False, "store", "timeout")])
    assert list(diagnose(workers_only, "n01")) == ["n01"]


def test_diagnose_blames_one_worker_that_cannot_reach_the_rendezvous():
    run = run_doc([rank(0, False, "init", "timeout")], [rank(1, False, "init", "timeout")],
                  [rank(2, False, "store", "timeout")])
    assert list(diagnose(run, "n01")) == ["n03"]


def test_diagnose_leaves_a_hang_after_meeting_to_the_bisect():
    run = run_doc(*[[rank(i, False, "init", "timeout")] for i in range(3)])
    assert diagnose(run, "n01") == {}
    wrong = run_doc(*[[rank(i, False, "done", "wrong-values")] for i in range(3)])
    assert diagnose(wrong, "n01") == {}
    died = run_doc([rank(0, False, "sweep", "error")], [rank(1, False, "sweep", "died")], [rank(2)])
    assert list(diagnose(died, "n01")) == ["n02"]


def test_diagnose_names_a_node_still_importing_torch_or_leaves_it_to_the_timeout():
    slow = run_doc([rank(0, False, "init", "timeout")], [rank(1, False, "init", "timeout")],
                   [rank(2, False, "import", "killed")])
    assert list(diagnose(slow, "n01")) == ["n03"] and diagnose(slow, "n01")["n03"]["kind"] == "slow-import"
    slow_head = run_doc([rank(0, False, "import", "killed")], [rank(1, False, "store", "killed")],
                        [rank(2, False, "store", "killed")])
    assert list(diagnose(slow_head, "n01")) == ["n01"]
    everyone = run_doc(*[[rank(i, False, "import", "killed")] for i in range(3)])
    assert diagnose(everyone, "n01") == {}


# --- the phase's decisions, over runs made up per group -----------------------------------------

class FakePhase:
    """What _drive needs of preflight.collective.allreduce._Phase, with runs made up by `outcome(names)`."""

    def __init__(self, outcome, min_busbw=None, dead_links=()):
        self.col = CollectiveOptions(sizes=(MIB, 8 * MIB), min_busbw_gbps=min_busbw)
        self.outcome, self.runs, self.clash, self.port = outcome, [], None, 29500
        self.dead_links = {frozenset(link) for link in dead_links}

    def left(self):
        return 100.0

    def run(self, names, budget, sizes, purpose):
        if purpose == "pairwise":  # every pair passes but the dead links
            return self.pairs_run(list(names), budget)
        ranks = self.outcome(list(names))
        reports = {n: {"ok": all(r["ok"] for r in rs), "kind": None, "ranks": rs} for n, rs in zip(names, ranks)}
        ok = all(r["ok"] for r in reports.values())
        bw = 0.01 if "n03" in names and self.col.min_busbw_gbps else 1.0
        per_size = [{"bytes": s, "iters": 3, "time_s": 0.01, "algbw_gbps": bw, "busbw_gbps": bw} for s in sizes]
        run = {"ok": ok, "nodes": list(names), "world_size": len(names), "purpose": purpose, "budget_s": budget,
               "master_addr": "10.0.0.1", "port": 29500, "elapsed_s": 1.0, "sizes": list(sizes), "reports": reports,
               "figures": collective.figures(per_size) if ok else None, "skipped_sizes": [],
               "clash": None if ok else collective.port_clash(reports, names[0])}
        self.clash = self.clash or run["clash"]
        self.runs.append(run)
        return run

    def pairs_run(self, names, budget):
        given = pairwise.spec(len(names), MIB)
        reports = {}
        for i, name in enumerate(names):
            pairs = [{"round": r, "peer": b if a == i else a, **(
                {"ok": False, "stage": "connect", "error": "DistStoreError: timed out"}
                if frozenset((names[a], names[b])) in self.dead_links else {"ok": True, "gbps": 1.0})}
                for r, rnd in enumerate(given["rounds"]) for a, b in rnd if i in (a, b)]
            reports[name] = {"ok": True, "kind": None, "ranks": [dict(rank(i), pairs=pairs)]}
        run = {"ok": True, "nodes": list(names), "purpose": "pairwise", "budget_s": budget, "sizes": [],
               "reports": reports, "clash": None, "pairwise": pairwise.matrix(names, reports, given, 0.1)}
        self.runs.append(run)
        return run


def drive(outcome, min_busbw=None, dead_links=(), broken=None):
    """_drive over FakePhase; broken: what the data-path probes named (collective.datapath.broken)."""
    phase = FakePhase(outcome, min_busbw, dead_links)
    doc = {"nodes": list(NODES), "untested": {}, "blamed": {}, "passed": [], "cleared": [], "result": None,
           "bisect": None}
    collective._drive(phase, doc, list(NODES), "n01", broken)
    return doc, phase.runs


def test_drive_reruns_without_the_node_that_cannot_import_torch():
    def outcome(names):
        if "n03" in names:
            return [[rank(i, False, "import" if n == "n03" else "init", "import" if n == "n03" else "aborted")]
                    for i, n in enumerate(names)]
        return [[rank(i)] for i in range(len(names))]

    doc, runs = drive(outcome)
    assert list(doc["blamed"]) == ["n03"] and doc["passed"] == ["n01", "n02"]
    assert [r["nodes"] for r in runs] == [list(NODES), ["n01", "n02"]] and doc["result"]["world_size"] == 2


def test_drive_bisects_a_slow_run_to_its_node():
    doc, runs = drive(lambda names: [[rank(i)] for i in range(len(names))], min_busbw=0.1)
    assert doc["passed"] == list(NODES) and doc["result"]["below_threshold"]
    assert doc["bisect"]["suspects"] == ["n03"] and doc["bisect"]["reason"] == "slow"
    assert [r["nodes"] for r in runs[1:]] == [["n01", "n02"], ["n01", "n03"]]
    assert all(r["sizes"] == [8 * MIB] for r in runs[1:])  # the bisect measures the largest size only


def test_drive_bisects_a_hang_that_names_nobody():
    def outcome(names):
        ok = "n02" not in names
        return [[rank(i) if ok else rank(i, False, "init", "timeout")] for i in range(len(names))]

    doc, runs = drive(outcome)
    assert list(doc["blamed"]) == ["n02"] and doc["blamed"]["n02"]["kind"] == "bisect"
    assert sorted(doc["cleared"]) == ["n01", "n03"] and doc["passed"] == []
    assert runs[1]["purpose"] == "pairwise" and doc["pairwise"]["pairs_measured"] == 3  # every pair passed
    assert all(r["sizes"] == [MIB] for r in runs[2:])


def test_drive_out_of_time_while_importing_torch_everywhere_blames_nobody():
    doc, runs = drive(lambda names: [[rank(i, False, "import", "killed")] for i in range(len(names))])
    assert doc["blamed"] == {} and set(doc["untested"]) == set(NODES) and len(runs) == 1
    assert "raise --timeout" in doc["untested"]["n02"]


def test_drive_a_port_clash_blames_nobody_and_neither_reruns_nor_bisects():
    """The head's rank 0 found its port held by another run: every node is untested, none is blamed."""
    def outcome(names):
        return [[rank(i, False, "store", "clash" if i == 0 else "aborted",
                      "port 29500 on the head is in use by another process (another preflight run, or a job)")]
                for i in range(len(names))]

    doc, runs = drive(outcome)
    assert doc["blamed"] == {} and doc["cleared"] == [] and doc["bisect"] is None and len(runs) == 1
    assert doc["clash"].startswith("port 29500 on the head is in use by another process")
    assert set(doc["untested"]) == set(NODES) and "port clash" in doc["untested"]["n02"]


def test_a_port_clash_fails_col001_on_no_node():
    doc = probe(passed=[], result=None, clash="port 29500 on the head is in use by another process (another "
                "preflight run, or a job)", untested={n: "the rendezvous port 29500 was not this run's (port "
                                                      "clash)" for n in NODES})
    failed = [r for r in run_check("COL001", doc) if r.status == Status.FAIL]
    assert [(r.nodes, r.message) for r in failed] == [((), "port clash, no node judged: port 29500 on the head is "
                                                       "in use by another process (another preflight run, or a job)")]
    assert "--col-port" in failed[0].remediation


# --- the checks over probe documents ------------------------------------------------------------

NODES = ("n01", "n02", "n03")
RESULT = {"nodes": list(NODES), "world_size": 3, "bytes": 8 * MIB, "algbw_gbps": 0.6, "busbw_gbps": 0.8,
          "per_size": [{"bytes": MIB, "iters": 20, "time_s": 0.005, "algbw_gbps": 0.2, "busbw_gbps": 0.27},
                       {"bytes": 8 * MIB, "iters": 10, "time_s": 0.014, "algbw_gbps": 0.6, "busbw_gbps": 0.8}],
          "skipped_sizes": [], "below_threshold": False}


def probe(**changes):
    doc = {"backend": "gloo", "port": 29500, "head": "n01", "python": "/venv/bin/python", "nodes": list(NODES),
           "untested": {}, "blamed": {}, "passed": list(NODES), "cleared": [], "result": dict(RESULT),
           "bisect": None, "duration_s": 4.2}
    doc.update(changes)
    return doc


def run_check(check_id, doc, plan=None):
    plan = plan or Plan(nodes=NODES, remote=True)
    return runner.run_check(SPECS[check_id], runner.CheckContext(plan, {}, {"collective": doc}))


def by_node(results):
    return {node: r for r in results for node in r.nodes}


def test_every_col_result_carries_the_contract_keys():
    plans = [Plan(nodes=NODES, remote=True), Plan(nodes=("here",)), Plan(nodes=NODES, remote=True,
                                                                        limits=Limits(min_busbw_gbps=5))]
    docs = [probe(), probe(result=None, passed=[], blamed={"n03": {"kind": "import", "error": "cannot import torch"}})]
    for plan in plans:
        for doc in docs:
            for check_id in ("COL001", "COL002"):
                for result in run_check(check_id, doc, plan):
                    assert "busbw_gbps" in result.evidence and "algbw_gbps" in result.evidence, result


def test_healthy_probe_passes_with_the_figures():
    [allreduce] = run_check("COL001", probe())
    assert allreduce.status == Status.PASS and allreduce.nodes == NODES
    assert allreduce.evidence["busbw_gbps"] == 0.8 and "exact" in allreduce.message
    [bandwidth] = run_check("COL002", probe())
    assert bandwidth.status == Status.PASS and "0.8 GB/s" in bandwidth.message


def test_this_machine_alone_is_skipped():
    for check_id in ("COL001", "COL002"):
        [result] = run_check(check_id, None, Plan(nodes=("here",)))
        assert result.status == Status.SKIP and "this machine alone" in result.message


def test_a_node_without_torch_fails_and_the_others_pass():
    doc = probe(passed=["n01", "n02"], blamed={"n03": {"kind": "import", "stage": "import", "tail": "Traceback",
                                                       "error": "cannot import torch: ImportError: broken"}})
    results = by_node(run_check("COL001", doc))
    assert results["n03"].status == Status.FAIL and "cannot import torch" in results["n03"].message
    assert "n03" in results["n03"].remediation and results["n03"].evidence["tail"] == "Traceback"
    assert results["n01"].status == Status.PASS and results["n02"].status == Status.PASS


def test_below_the_threshold_names_the_bisected_node():
    tests = [{"nodes": ["n01", "n02"], "bad": False, "busbw_gbps": 0.9},
             {"nodes": ["n01", "n03"], "bad": True, "busbw_gbps": 0.01}]
    doc = probe(result=dict(RESULT, busbw_gbps=0.011),
                bisect={"reason": "slow", "suspects": ["n03"], "tests": tests, "complete": True, "inconclusive": False})
    results = by_node(run_check("COL002", doc, Plan(nodes=NODES, remote=True, limits=Limits(min_busbw_gbps=0.1))))
    assert results["n03"].status == Status.FAIL and "bisect names n03" in results["n03"].message
    assert results["n03"].evidence["pair_busbw_gbps"] == 0.01
    assert results["n01"].status == Status.PASS and results["n02"].status == Status.PASS


def test_collective_runs_only_when_a_col_check_is_selected(monkeypatch):
    seen = []
    monkeypatch.setattr("preflight.remote.gather.gather_ssh", lambda names, options: (seen.append(options), ({}, {}))[1])
    args = cli.build_parser().parse_args(["check", "--hosts", "n1,n2", "--col-sizes", "1M,8M", "--min-busbw", "2"])
    plan = Plan(nodes=("n1", "n2"), remote=True, limits=Limits(min_busbw_gbps=2.0))
    engine.gather_for(plan, args, [SPECS["NET004"]])
    engine.gather_for(plan, args, [SPECS["NET004"], SPECS["COL002"]])
    assert seen[0].collective is None
    assert seen[1].collective.sizes == (MIB, 8 * MIB) and seen[1].collective.min_busbw_gbps == 2.0


# --- the worker on this machine: two ranks over loopback ----------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(ranks, world, budget=20.0, env=None, sizes=(4096, MIB), **extra):
    options = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": world, "ranks": ranks,
               "backend": "gloo", "sizes": list(sizes), "timeout_s": 30, "budget_s": budget, "env": {}, **extra}
    proc = subprocess.Popen(["bash", "-c", shipped_command(sys.executable)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))
    proc.stdin.write(shipped_input(ALLREDUCE, options))
    proc.stdin.flush()
    return proc


def finish(proc, timeout=30):
    """The worker's report; stdin stays open until it comes (its end would abort the worker)."""
    first = proc.stdout.readline()  # the worker ends by its own budget
    proc.stdin.close()
    out = first + proc.stdout.read()
    proc.wait(timeout=timeout)
    lines = out.splitlines()
    assert len(lines) == 1, out  # exactly one JSON line, nothing else on stdout
    return json.loads(lines[0])


def test_worker_two_local_ranks_give_exact_sums_and_figures():
    report = finish(start_worker([0, 1], 2))
    assert report["ok"] and [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        assert r["check"] == {"ok": True, "expected": 3.0, "mismatches": 0, "first": None}
        assert [s["bytes"] for s in r["sizes"]] == [4096, MIB]
        for s in r["sizes"]:
            assert s["busbw_gbps"] == pytest.approx(s["algbw_gbps"] * bus_factor(2)) and s["busbw_gbps"] > 0


def test_worker_missing_rank_ends_by_its_deadline():
    started = time.monotonic()
    report = finish(start_worker([0], 2, budget=5.0))
    assert time.monotonic() - started < 5.0 + 2
    [r] = report["ranks"]
    assert not report["ok"] and r["stage"] == "init" and r["kind"] in ("timeout", "killed")
    assert r["joined"] in ([0], None) and r["tail"] is not None


def test_worker_without_a_store_says_timeout_by_its_deadline_without_stopping_the_run():
    """A rank that finds no store waits for it to the end of its budget and says timeout (kind "error" would
    stop the run, aborting a head that is still importing torch)."""
    started = time.monotonic()
    [r] = finish(start_worker([1], 2, budget=5.0, run="t0"))["ranks"]
    assert r["stage"] == "store" and r["kind"] == "timeout", r
    assert not collective.stops_the_run({"ranks": [r]})
    assert r["import_s"] + r["elapsed_in_stage_s"] > 5.0 - 0.9, r  # it waited to the end, less time to report
    assert time.monotonic() - started < 5.0 + 2


def test_worker_joins_a_store_that_opens_just_before_its_deadline():
    """A bisect's run is short: the head's store may open a moment before the worker's deadline (its rank 0
    imports torch as slowly), and the worker must still join it, not give up seconds early."""
    import datetime

    import torch.distributed as dist

    budget = 6.0
    port = free_port()
    proc = start_worker([1], 2, budget=budget, run="t1", master_port=port)
    started = time.monotonic()
    time.sleep(budget - 1.0)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    store.set(colworker.RUN_KEY, "t1")
    [r] = finish(proc)["ranks"]
    assert time.monotonic() - started < budget + 2
    assert r["stage"] == "init", r  # joined, then waited for a rank 0 that never comes
    assert dist.PrefixStore("preflight/t1/", store).check([colworker.JOIN_KEY % 1])


def test_worker_aborts_at_once_when_asked():
    proc = start_worker([0], 2, budget=30.0)
    time.sleep(1.0)
    started = time.monotonic()
    proc.stdin.write("abort\n")
    proc.stdin.flush()
    report = finish(proc)
    assert time.monotonic() - started < 2 and report["aborted"]
    assert report["ranks"][0]["kind"] == "aborted"


def node_reader(command, payload=None):
    """_Phase._read over a node that is a local process running `command` (the worker's input on its stdin)."""
    import threading
    from types import SimpleNamespace

    from preflight.remote.local import LocalProcess

    proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    step = LocalProcess(proc)
    if payload is not None:
        step.send_raw(shipped_input(ALLREDUCE, payload).encode())
    phase = collective._Phase([SimpleNamespace(name="n01", facts={})], "127.0.0.1", SimpleNamespace(
        collective=CollectiveOptions(), port=0, timeout=30, python=sys.executable), "gloo", 2)
    seen = []
    try:
        return phase._read(step, time.monotonic() + 60, threading.Event(), [0, 1], 2, seen.append), seen
    finally:
        step.close()


WRONG_PROGRESS = ['{"progress": {"rank": 0, "stage": "sweep", "size": 9, "sizes": 2}}',  # past the sizes
                  '{"progress": {"rank": 5, "stage": "sweep", "size": 2, "sizes": 2}}',  # not the node's rank
                  '{"progress": {"rank": 0, "stage": "sweep", "size": 2, "sizes": 7}}',  # not the run's sizes
                  '{"progress": {"rank": 0, "stage": "sweep", "size": "2", "sizes": 2}}',
                  '{"progress": {"rank": 0, "stage": "import", "size": 0, "sizes": 2}}',
                  '{"progress": "soon"}', '{"progress": null}', '{"progress": [[[]]]}']


def test_the_reader_takes_the_workers_progress_lines_then_its_report_and_ignores_bad_ones():
    """A real worker asked for progress (two ranks, two sizes) says the rendezvous and each size before its
    report; lines of progress of the wrong shape, put after its first line, are ignored, not its report."""
    bad = " ".join(f"'{line}'" for line in WRONG_PROGRESS)
    command = f'{shipped_command(sys.executable)} | {{ IFS= read -r first; printf "%s\\n" "$first" {bad}; exec cat; }}'
    options = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 2, "ranks": [0, 1],
               "backend": "gloo", "sizes": [4096, MIB], "timeout_s": 30, "budget_s": 30, "env": {}, "run": "t2",
               "progress": True}
    report, seen = node_reader(command, options)
    assert report["ok"] and [r["rank"] for r in report["ranks"]] == [0, 1], report
    assert seen == [(1, 0), (2, 1), (2, 2)]  # the rendezvous, size 1 of 2, size 2 of 2; nothing else
    for line in WRONG_PROGRESS:
        assert collective.progress_position(json.loads(line)["progress"], [0, 1], 2) is None, line


def test_a_line_with_progress_and_more_is_judged_as_the_report():
    report, seen = node_reader("""printf '%s\\n' '{"progress": {"rank": 0, "stage": "rendezvous", "size": 0, \
"sizes": 2}, "ok": true}'""")
    assert report["kind"] == "protocol" and "the report has no 'ranks'" in report["error"] and not seen, report


def test_worker_without_torch_says_so_with_the_traceback(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: no such file')\n")
    report = finish(start_worker([0, 1], 2, env={"PYTHONPATH": str(tmp_path)}))
    for r in report["ranks"]:
        assert r["kind"] == "import" and r["error"].startswith("cannot import torch: ImportError")
        assert "libtorch_cpu.so" in r["tail"]


# --- the real test cluster ----------------------------------------------------------------------

def check(cluster, *extra, timeout="20"):
    return preflight_json("check", "--hosts", ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
                          "--python", sys.executable, "--only", "COL", "--timeout", timeout, "--col-sizes", "1M,8M",
                          *extra)


PLAIN_LOOP = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method="tcp://10.77.0.11:%d" % port, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out = {}
    for size in (1 << 20, 8 << 20):
        buf = torch.zeros(size // 4)
        dist.all_reduce(buf)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(buf)
        per = (time.perf_counter() - start) / 5
        out[size] = size / per / 1e9 * 2 * (world - 1) / world
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def plain_loop_busbw(cluster, tmp_path) -> float:
    """busbw at 8 MiB of a plain torch.distributed all-reduce loop over the same hosts, started with ssh."""
    script = tmp_path / "plain_allreduce.py"
    script.write_text(PLAIN_LOOP)
    world = len(cluster.nodes)
    procs = [subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), node, sys.executable, str(script), str(i),
                               str(world), "29517"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, node in enumerate(cluster.nodes)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    return min(json.loads(o[0].strip().splitlines()[-1])[str(8 << 20)] for o in outs)


@pytest.mark.cluster
def test_three_healthy_nodes_pass_at_the_bandwidth_of_a_plain_loop(cluster, tmp_path):
    doc, elapsed = check(cluster)
    assert doc["verdict"] == "pass", [(r["id"], r["status"], r["message"]) for r in doc["results"]]
    [allreduce] = [r for r in doc["results"] if r["id"] == "COL001"]
    [bandwidth] = [r for r in doc["results"] if r["id"] == "COL002"]
    assert allreduce["nodes"] == list(cluster.nodes) and bandwidth["nodes"] == list(cluster.nodes)
    evidence = bandwidth["evidence"]
    assert evidence["busbw_gbps"] > 0 and evidence["algbw_gbps"] > 0 and evidence["world_size"] == 3
    assert evidence["bytes"] == 8 << 20 and evidence["backend"] == "gloo"
    assert evidence["busbw_gbps"] == pytest.approx(evidence["algbw_gbps"] * 4 / 3)
    plain = plain_loop_busbw(cluster, tmp_path)
    print(f"busbw at 8 MiB: preflight {evidence['busbw_gbps']:.3f} GB/s, plain loop {plain:.3f} GB/s")
    assert plain / 10 < evidence["busbw_gbps"] < plain * 10


@pytest.mark.cluster
def test_two_gloo_ranks_per_node_make_a_world_of_twice_the_nodes(cluster):
    """--col-procs-per-node 2: each node forks two local ranks (global ranks 2i, 2i+1) that meet the others."""
    doc, elapsed = check(cluster, "--col-procs-per-node", "2", timeout="40")  # 6 ranks import torch on 2 cores
    assert doc["verdict"] == "pass", [(r["id"], r["status"], r["message"]) for r in doc["results"]]
    [allreduce] = [r for r in doc["results"] if r["id"] == "COL001"]
    [bandwidth] = [r for r in doc["results"] if r["id"] == "COL002"]
    world = 2 * len(cluster.nodes)
    assert allreduce["nodes"] == list(cluster.nodes) and bandwidth["nodes"] == list(cluster.nodes)
    # Every rank checked each reduced value against the exact sum 1 + ... + world (rank 0's check is in the evidence).
    assert f"all-reduce of {world} rank(s) on {len(cluster.nodes)} node(s) over gloo: every rank joined and the " \
           "sums are exact" in allreduce["message"], allreduce["message"]
    evidence = bandwidth["evidence"]
    assert evidence["world_size"] == world and evidence["backend"] == "gloo" and evidence["procs_per_node"] == 2
    assert evidence["sum_check"] == {"ok": True, "expected": world * (world + 1) / 2, "mismatches": 0, "first": None}
    assert evidence["busbw_gbps"] > 0 and evidence["algbw_gbps"] > 0
    assert evidence["busbw_gbps"] == pytest.approx(evidence["algbw_gbps"] * bus_factor(world))
    assert [s["bytes"] for s in evidence["per_size"]] == [MIB, 8 * MIB]
    assert elapsed < 20 + 5 + 5


@pytest.mark.cluster
def test_a_worker_whose_firewall_refuses_the_other_ranks_is_named_by_its_pairs(cluster):
    """node02 lets in SSH and the main port, not the ephemeral ports the ranks connect to each other on: all
    ranks meet at the rendezvous, then the all-reduce hangs. Each pair with the head passes an all-reduce (in a
    pair, node02 connects out to the head), so a bisect could not tell; the pairs measured at the rendezvous (TCP
    both ways, then gloo) fail for node02 with every peer and pass between the others: node02 alone is named."""
    with cluster.blocked_incoming("node02", 29500):
        doc, elapsed = check(cluster)
    allreduce = {node: r for r in doc["results"] if r["id"] == "COL001" for node in r["nodes"]}
    assert {n: r["status"] for n, r in allreduce.items()} == {"node01": "pass", "node02": "fail", "node03": "pass"}
    assert "in pairs of nodes node02 fails with every peer (node[01,03]) while they pass with each other" \
        in allreduce["node02"]["message"], allreduce["node02"]["message"]
    assert "a firewall on node02 that lets in only some ports" in allreduce["node02"]["remediation"]
    links = results(doc, "COL004")
    assert links["node02"]["status"] == "fail" and links["node01"]["status"] == "pass"
    assert doc["verdict"] == "fail"
    assert elapsed < 20 + 5 + 5


@pytest.mark.cluster
def test_a_dropped_rendezvous_port_names_the_head_within_the_timeout(cluster):
    # --col-port: the port probe (main port) passes, so the all-reduce itself meets the dropped port.
    # 10 s: three nodes import torch at once before they meet, which took over 5 s on a loaded 2-core machine.
    with cluster.dropped_port("node01", 29600):
        doc, elapsed = check(cluster, "--col-port", "29600", timeout="10")
    allreduce = results(doc, "COL001")
    assert allreduce["node01"]["status"] == "fail" and "rendezvous" in allreduce["node01"]["message"], allreduce
    assert "10.77.0.11:29600" in allreduce["node01"]["message"]
    assert allreduce["node02"]["status"] == "skip" and allreduce["node03"]["status"] == "skip"
    assert allreduce["node01"]["evidence"]["phase_s"] <= 10 + 5
    assert elapsed < 10 + 5 + 5  # the collective (at most 10 + 5 s), and the rest


@pytest.mark.cluster
def test_a_dropped_main_port_fails_within_the_timeout_without_waiting_for_the_all_reduce(cluster):
    with cluster.dropped_port("node01", 29500):
        doc, elapsed = check(cluster, "--only", "NET004,COL", timeout="5")
    assert {r["status"] for r in results(doc, "NET004").values()} == {"fail"}
    [allreduce] = [r for r in doc["results"] if r["id"] == "COL001"]
    assert allreduce["status"] == "skip" and "NET004" in allreduce["message"]
    assert elapsed < 5 + 5  # the port probe's connects (5 s) and no all-reduce


@pytest.mark.cluster
def test_a_node_that_cannot_import_torch_is_named_and_the_others_pass(cluster, tmp_path):
    overlay = tmp_path / "overlay"
    (overlay / "torch").mkdir(parents=True)
    (overlay / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared "
                                                   "object file (preflight test)')\n")
    with cluster.env("node03", PYTHONPATH=str(overlay)):
        doc, elapsed = check(cluster)
    allreduce = results(doc, "COL001")
    assert allreduce["node03"]["status"] == "fail" and "cannot import torch" in allreduce["node03"]["message"]
    assert "libtorch_cpu.so" in allreduce["node03"]["evidence"]["tail"]
    assert allreduce["node01"]["status"] == "pass" and allreduce["node02"]["status"] == "pass"
    assert [r["nodes"] for r in doc["results"] if r["status"] == "fail"] == [["node03"]]
    assert allreduce["node03"]["evidence"]["phase_s"] < 20
