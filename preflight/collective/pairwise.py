"""The pairwise phase: which link, not only which node.

A round-robin tournament of simultaneous disjoint pairs (the circle method: N-1 rounds of N/2 pairs, N rounds
with a bye each when N is odd), each pair a short point-to-point gloo transfer of its own 2-rank group under a
deadline (preflight.node.allreduce, `_pair_rounds`). Above MAX_ROUNDS rounds, a sample of MAX_ROUNDS of them,
spread over the tournament: each node still meets MAX_ROUNDS peers, which is enough to see a row that is slow
or failing against every peer (a straggler, a node nobody can reach), while the phase's cost stays bounded
(about one connect and a few round trips per round: see BENCHMARKS.md); a single bad link is then found only
when its pair is in the sample, and the matrix says it was sampled.

The phase runs inside the all-reduce's workers at the rendezvous, before the whole group's init (the
healthy cost: a bounded, measured time, no second start of torch; and a dead link, which makes gloo's init
hang, is measured by then), and as a run of its own when a failed all-reduce measured no pair. Everything here is pure: the schedule, the node x node matrix from the nodes' reports, and what the
matrix says (failed links, a node that fails with every peer, a straggler row, a slow link).

A link that looks slow in its round may only have been busy (the other pairs' traffic on hosts that share cores,
a switch port): after the rounds the nodes find the suspects themselves, by the same rule as the head
(preflight.node.pairlinks), and measure each again alone, every other node idle (preflight.node.allreduce,
`_retests`: at most MAX_RETESTS or one per node, none when the time is short). The matrix takes a retest's figure
for its cell and keeps the round's ("retested"); the links are judged from the rounds' figures, and a suspect
fast alone is not a slow link, one still slow alone is warned.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from preflight.node import pairlinks
from preflight.node.pairlinks import SLOW_LINK_NODES, SLOWER  # noqa: F401  (the rule's figures, named here too)
from preflight.remote.shapes import (
    NONE, TEXT, WORKER_REPORT, Each, Either, Need, Obj, Test, problem,
)

MAX_ROUNDS = 31  # the whole tournament up to 32 nodes; a sample of rounds above
PAIR_BYTES = 1 << 20  # each way, per round trip: enough to move past TCP's first windows, small enough to be cheap
PAIR_REPS = 8  # round trips per pair at most, the best one counts (a busy core delays some, rarely all)
PAIR_REP_S = 0.1  # no further round trip once a pair has spent this long


def schedule(count: int, max_rounds: int = MAX_ROUNDS) -> List[List[Tuple[int, int]]]:
    """Rounds of disjoint pairs of node indices (circle method: 0 stays, the others rotate); every pair of the
    `count` nodes meets once over the whole tournament. Above `max_rounds`, that many rounds evenly spread."""
    if count < 2:
        return []
    players = list(range(count)) + ([None] if count % 2 else [])
    total = len(players) - 1
    rounds = []
    for r in range(total):
        circle = [players[0]] + players[1:][r:] + players[1:][:r]
        pairs = [(circle[i], circle[-1 - i]) for i in range(len(circle) // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
    if total > max_rounds:
        rounds = [rounds[(i * total) // max_rounds] for i in range(max_rounds)]
    return rounds


def spec(count: int, largest: int, max_rounds: int = MAX_ROUNDS) -> dict:
    """What a worker is given for the pairwise phase (options["pairs"])."""
    return {"rounds": [[list(p) for p in r] for r in schedule(count, max_rounds)],
            "bytes": max(4, min(PAIR_BYTES, int(largest)) // 4 * 4), "reps": PAIR_REPS, "rep_s": PAIR_REP_S,
            "tournament_rounds": count - 1 + count % 2}


# --- the nodes' answers -------------------------------------------------------------------------

_FINITE = Test(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"),
               "a number")
PAIR = Obj(round=Need(Test(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a round")),
           peer=Need(Test(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a node index")),
           ok=Need(bool), stage=TEXT, error=TEXT, gbps=Either(NONE, _FINITE), time_s=Either(NONE, _FINITE),
           connect_s=Either(NONE, _FINITE), retest=Either(NONE, bool))


def report_problem(report, ranks: Sequence[int]) -> Optional[str]:
    """Why a pairwise-only run's node report is not what the worker writes (its ranks measure no sizes, they
    carry "pairs"), or None."""
    wrong = problem(report, WORKER_REPORT, "the report")
    if wrong:
        return wrong
    got = [r["rank"] for r in report["ranks"]]
    if got != list(ranks):
        return f"it reports ranks {got!r:.80}, not the ranks {list(ranks)} it was given"
    return pairs_problem(report)


def pairs_problem(report) -> Optional[str]:
    """The "pairs" of a node's ranks, when there are any, are lists of pair results."""
    for r in report.get("ranks") or []:
        if isinstance(r, dict) and r.get("pairs") is not None:
            wrong = problem(r["pairs"], Each(PAIR), f"rank {r.get('rank')}: pairs")
            if wrong:
                return wrong
    return None


def node_pairs(report: Optional[dict]) -> Optional[List[dict]]:
    """The pair results of a node's report (its first rank that has them), None when it has none."""
    for r in (report or {}).get("ranks") or []:
        if isinstance(r.get("pairs"), list):
            return r["pairs"]
    return None


# --- the matrix ---------------------------------------------------------------------------------

def matrix(names: Sequence[str], reports: Dict[str, dict], given: dict, elapsed_s: Optional[float] = None) -> dict:
    """The node x node matrix from both ends of every pair: "gbps" (the slower end's best round trip, None when
    not measured), "errors" (why a pair failed, by either end; None when it passed or was not run). A node
    without pair results (it did not answer, never reached the store) is judged by its peers' ends. A link the
    nodes re-measured alone (it looked slow in its round) has the retest's figure (the slower end's), and
    "retested" [a, b, round gbps, retest gbps or None when the retest failed] says so."""
    n = len(names)
    gbps: List[List[Optional[float]]] = [[None] * n for _ in range(n)]
    errors: List[List[Optional[str]]] = [[None] * n for _ in range(n)]
    seen, again = ({name: {p["peer"]: p for p in node_pairs(reports.get(name)) or []
                           if p.get("peer") is not None and bool(p.get("retest")) == retest} for name in names}
                   for retest in (False, True))
    retested = []
    answered = {name: node_pairs(reports.get(name)) is not None for name in names}
    measured = 0
    for rnd in given.get("rounds") or []:
        for a, b in rnd:
            ends = [pair for pair in (seen[names[a]].get(b), seen[names[b]].get(a)) if pair is not None]
            if not ends or (len(ends) == 1 and answered[names[a]] and answered[names[b]]):
                continue  # not run (the time ran out before this round), or by one end only: not measured
            why = next((f"{p.get('stage') or 'transfer'}: {p.get('error') or 'failed'}" for p in ends
                        if not p.get("ok")), None)
            measured += 1
            if why is not None:
                errors[a][b] = errors[b][a] = why[:300]
                continue
            rates = [pair.get("gbps") for pair in ends if pair.get("gbps") is not None]
            gbps[a][b] = gbps[b][a] = round(min(rates), 6) if rates else None
            alone = [p for p in (again[names[a]].get(b), again[names[b]].get(a)) if p is not None]
            if alone and gbps[a][b] is not None and (len(alone) == 2 or len(ends) == 1):  # as the round: both ends
                # Measured again alone (it looked slow): that figure is the link's, the round's is kept beside it.
                # A retest that failed (a peer gone by then) leaves the round's figure.
                speed = None if not all(p.get("ok") for p in alone) else \
                    min((p["gbps"] for p in alone if p.get("gbps") is not None), default=None)
                retested.append([names[a], names[b], gbps[a][b], speed])
                if speed is not None:
                    gbps[a][b] = gbps[b][a] = round(speed, 6)
    rounds = len(given.get("rounds") or [])
    total = given.get("tournament_rounds") or rounds
    return {"nodes": list(names), "bytes": given.get("bytes"), "gbps": gbps, "errors": errors,
            "pairs_given": sum(len(r) for r in given.get("rounds") or []), "pairs_measured": measured,
            "rounds": rounds, "tournament_rounds": total, "sampled": rounds < total,
            "retested": retested, "elapsed_s": elapsed_s}


def findings(m: dict) -> dict:
    """What the matrix says: "failed_rows" (a node that fails with every peer it was paired with, while others
    pass), "failed_links" [a, b, why] (the other failed pairs), "stragglers" {node: {"gbps": its best link,
    "peers_median_gbps"}} (every link of the node SLOWER times below the median of the links between the others),
    "slow_links" [a, b, gbps, expected] (one link SLOWER times below the median of each end's other links, from
    SLOW_LINK_NODES nodes on, and still so when measured again alone: preflight.node.pairlinks.judged),
    "busy_links" [a, b, gbps, expected] (links that looked slow in their round, past the nodes' limit on retests,
    while every link measured again was fast alone: pairlinks.judged)."""
    names, gbps, errors = m["nodes"], m["gbps"], m["errors"]
    n = len(names)
    idx = range(n)
    failed = {(a, b) for a in idx for b in idx if a < b and errors[a][b]}
    tried = {a: [b for b in idx if b != a and (errors[a][b] or gbps[a][b] is not None)] for a in idx}
    passed_any = any(gbps[a][b] is not None for a in idx for b in idx if a < b)
    # When every pair fails, no row stands out: the nodes are not told apart (the failed links say it all).
    rows = [a for a in idx if len(tried[a]) >= 2 and all(errors[a][b] for b in tried[a]) and passed_any]
    links = [[names[a], names[b], errors[a][b]] for a, b in sorted(failed) if a not in rows and b not in rows]
    # Judged from the rounds' figures (every link measured with the other pairs' traffic), the retests then
    # clear the suspects that were fast alone.
    rates = {(a, b): gbps[a][b] for a in idx for b in idx if a < b and gbps[a][b] is not None}
    alone = {}
    where = {name: i for i, name in enumerate(names)}
    for a, b, in_round, again in m.get("retested") or []:
        link = tuple(sorted((where[a], where[b])))
        if again is not None and link in rates:
            rates[link], alone[link] = in_round, again
    stragglers = {names[x]: {"gbps": best, "peers_median_gbps": round(median, 6)}
                  for x, (best, median) in pairlinks.stragglers(rates).items()}
    slow, busy = ([[names[a], names[b], v, round(expected, 6)] for a, b, v, expected in links]
                  for links in pairlinks.judged(rates, n, alone))
    return {"failed_rows": [names[a] for a in rows], "failed_links": links, "stragglers": stragglers,
            "slow_links": slow, "busy_links": busy}
