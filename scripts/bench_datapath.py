"""What the data path costs on the test cluster (scripts/bench, section "datapath"): the path probes between
every pair of nodes (NET007-NET011) and the pairwise phase at the all-reduce's rendezvous (COL004) on 4, 16 and
32 healthy test hosts, and the time to a verdict with one slow link (`tc tbf`, as the test cluster plants it).

Every figure comes from a real `preflight check --json` over the test hosts: the probe's own seconds from its
evidence (`probe_s` of NET008, `elapsed_s` of COL004's matrix), the whole check's wall time around it. A
healthy run must pass every check it selects, and the slow link must be named (COL004's straggler): a run that
says anything else is an error, not a time.
"""
from __future__ import annotations

import json
import sys
import time
from statistics import median
from typing import Callable, Dict, List, Sequence

PATH_CHECKS = "NET007,NET008,NET009,NET010,NET011"
SIZES = (4, 16, 32)
PAIRWISE_TIMEOUT_S = 300  # a cap: 32 test hosts import torch and meet in pairs on this machine's few cores
SLOW_HOSTS = 4  # a slow link is judged from 4 nodes on (collective.pairwise.SLOW_LINK_NODES)
SLOW_RATE = "100mbit"
SLOW_TIMEOUT_S = 20
DESCRIPTION = (
    f"Healthy test hosts: `preflight check --only {PATH_CHECKS}` (routes, names, a TCP connect on an ephemeral port "
    "and do-not-fragment UDP at the interface MTU, every pair up to 33 nodes), the probe's own time (NET008's "
    "`probe_s`) and the whole check's; `preflight check --only COL004 --col-sizes 1M` once per size, the pairwise "
    "phase's time (COL004's matrix `elapsed_s`: the slowest node's time in it, which includes waiting for a peer still "
    "importing torch) and the whole check's. The verdict with one slow link: `tc tbf` at "
    f"{SLOW_RATE} on one of {SLOW_HOSTS} hosts, `preflight check --only COL,{PATH_CHECKS} --timeout {SLOW_TIMEOUT_S}`, "
    "timed to its verdict (COL004 must name the straggler, without `--min-busbw`). The probes run in parallel on "
    "every node, each node's peers at once (its N-1 peers up to 33 nodes, the next 32 in a ring of the nodes above): "
    "their time grows with N up to 33 nodes and stays that of 32 peers above, the pairs with N^2 up to 33 nodes and "
    "with 32N above; the pairwise phase has N-1 rounds of N/2 simultaneous pairs (31 sampled rounds above 32 "
    "nodes), so it grows with N up to 32 nodes and stays 31 rounds above, but here every test host shares this "
    "machine's cores: the torch import of N workers, not the pairs, sets the whole check's time.")


class DataPathError(Exception):
    """A run that did not give the healthy (or the planted) answer."""


def _statuses(doc: dict, ids: Sequence[str]) -> Dict[str, List[dict]]:
    return {i: [r for r in doc["results"] if r["id"] == i] for i in ids}


def _all_pass(doc: dict, ids: Sequence[str], what: str) -> None:
    for check_id, found in _statuses(doc, ids).items():
        wrong = [(r["status"], r["nodes"], r["message"][:160]) for r in found if r["status"] != "pass"]
        if not found or wrong:
            raise DataPathError(f"{what}: {check_id} is not a pass on the healthy test hosts: {wrong or 'no result'}")


def path_probes(run: Callable, argv: Callable, hosts: Sequence[str], repeat: int) -> dict:
    """{probe_s: [...], check_s: [...], pairs}: the path probes on these hosts, `repeat` times."""
    probe, whole = [], []
    for _ in range(repeat):
        elapsed, out = run(argv(hosts, "--only", PATH_CHECKS, "--timeout", "10"), ok=(0, 1), timeout=120)
        doc = json.loads(out)
        _all_pass(doc, PATH_CHECKS.split(","), f"{len(hosts)} hosts")
        probe.append(next(r for r in doc["results"] if r["id"] == "NET008")["evidence"]["probe_s"])
        whole.append(elapsed)
    return {"probe_s": probe, "check_s": whole, "pairs": len(hosts) * min(len(hosts) - 1, 32)}


def pairwise_phase(run: Callable, argv: Callable, hosts: Sequence[str]) -> dict:
    """{phase_s, check_s, pairs, rounds, slow_links, retested}: one all-reduce with its pairwise phase on these
    hosts."""
    elapsed, out = run(argv(hosts, "--only", "COL004", "--col-sizes", "1M", "--timeout", str(PAIRWISE_TIMEOUT_S)),
                       ok=(0, 1), timeout=PAIRWISE_TIMEOUT_S + 60)
    found = _statuses(json.loads(out), ["COL004"])["COL004"]
    # A slow link is a warning that test hosts sharing this machine's cores can still cause (a link busy in its
    # round and again when measured alone): counted, with the links measured again, not an error; a failed
    # link, a straggler or no matrix is.
    wrong = [(r["status"], r["nodes"], r["message"][:160]) for r in found if r["status"] not in ("pass", "warn")]
    if not found or wrong or "matrix" not in found[0]["evidence"]:
        raise DataPathError(f"{len(hosts)} hosts: COL004 on the healthy test hosts: {wrong or 'no matrix'}")
    matrix = found[0]["evidence"]["matrix"]
    return {"phase_s": matrix["elapsed_s"], "check_s": elapsed, "pairs": matrix["pairs_measured"],
            "rounds": matrix["rounds"], "slow_links": sum(r["status"] == "warn" for r in found),
            "retested": len(matrix.get("retested") or [])}


def slow_link_verdict(run: Callable, argv: Callable, cluster, hosts: Sequence[str], repeat: int) -> dict:
    """{check_s: [...], probe_s: [...]}: the verdict with one slow link, named as COL004's straggler."""
    slow = hosts[-1]
    whole, probe = [], []
    with cluster.slowed_link(slow, SLOW_RATE):
        for _ in range(repeat):
            started = time.perf_counter()
            _, out = run(argv(hosts, "--only", f"COL,{PATH_CHECKS}", "--col-sizes", "1M,8M", "--timeout",
                              str(SLOW_TIMEOUT_S)), ok=(0, 1), timeout=SLOW_TIMEOUT_S + 60)
            whole.append(time.perf_counter() - started)
            doc = json.loads(out)
            named = [r for r in _statuses(doc, ["COL004"])["COL004"] if r["status"] == "fail"]
            if [r["nodes"] for r in named] != [[slow]] or "straggler" not in named[0]["message"]:
                raise DataPathError(f"one slow link on {slow}: COL004 named {[(r['nodes'], r['message'][:120]) for r in named]}")
            probe.append(next(r for r in doc["results"] if r["id"] == "NET008")["evidence"].get("probe_s"))
    return {"check_s": whole, "probe_s": [p for p in probe if p is not None]}


def measure(run: Callable, argv: Callable, cluster, sizes: Sequence[int] = SIZES, repeat: int = 3) -> dict:
    """Every figure of the section, on the first `size` hosts of the cluster for each size."""
    return {"paths": {n: path_probes(run, argv, cluster.nodes[:n], max(1, min(repeat, 3))) for n in sizes},
            "pairwise": {n: pairwise_phase(run, argv, cluster.nodes[:n]) for n in sizes},
            "slow": slow_link_verdict(run, argv, cluster, cluster.nodes[:SLOW_HOSTS], max(1, min(repeat, 3)))}


def _secs(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.995 else f"{value * 1000:.0f} ms"


def _spread(values: Sequence[float]) -> str:
    return f"{_secs(median(values))} ({_secs(min(values))}-{_secs(max(values))})" if len(values) > 1 \
        else _secs(values[0])


def table(measured: dict) -> List[List[str]]:
    rows = [["hosts", "pairs probed", "path probes, median (min-max)", "their whole check",
             "pairwise phase (pairs, rounds)", "its whole check", "slow links warned"]]
    for n, paths in measured["paths"].items():
        pair = measured["pairwise"][n]
        rows.append([str(n), f"{paths['pairs']:,}", _spread(paths["probe_s"]), _spread(paths["check_s"]),
                     f"{_secs(pair['phase_s'])} ({pair['pairs']}, {pair['rounds']})", _secs(pair["check_s"]),
                     f"{pair['slow_links']} ({pair.get('retested', 0)} measured again alone)"])
    slow = measured["slow"]
    rows.append([f"{SLOW_HOSTS}, one slow link", "", _spread(slow["probe_s"]) if slow["probe_s"] else "-",
                 f"verdict {_spread(slow['check_s'])}", "named the straggler", "", ""])
    return rows


if __name__ == "__main__":
    sys.exit("run it through scripts/bench: scripts/bench --only datapath --no-write")
