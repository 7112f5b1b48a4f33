"""NCCL RAS's verdict on a job (doctor, RUN011): from what RAS answered on the nodes (preflight.node.ras asks it and
reduces its answers), the ranks behind the others in a communicator, a rank that launched another collective, and
the ranks RAS cannot reach or considers dead; each with its node, rank and pid where the census has its process.

RAS's own documentation (NCCL's troubleshooting/ras page) says ranks a collective apart in one answer are normal
(collectives outpace RAS's queries, some ranks routinely arrive later), and an answer that does not change across
queries may mean a stuck communicator. So a rank is blamed only where RAS's two answers, a second apart, are the
same for its communicator and no rank's stack moved in between (RUN006's rule): a job that moves, or a slow rank,
is not blamed. Pure functions: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from preflight.job.flight import Blame

ADVICE = "NCCL 2.24+ runs RAS unless NCCL_RAS_ENABLE=0; give each job on a node its own NCCL_RAS_ADDR"


@dataclass
class Answer:
    """What RAS at one address answered on one node: its snapshots (preflight.node.ras.parse), oldest first."""
    node: str
    address: str
    version: Optional[str]
    format: Optional[str]
    snapshots: List[Mapping[str, Any]]
    error: Optional[str]
    absent: bool
    interval_s: float

    def said(self) -> str:
        return f"NCCL {self.version or '?'} RAS at {self.address} on {self.node}"

    def twice(self) -> str:
        return f"RAS's two answers {self.interval_s:g} s apart (NCCL {self.version or '?'}, {self.address} on {self.node})"


@dataclass
class Place:
    """A process RAS names, as the census knows it: its node (from RAS's host), the job's rank and its stack's line
    where the census has the process there."""
    node: Optional[str]
    rank: Optional[int]
    at: Optional[str] = None
    pid: Optional[int] = None  # its pid on the node (RAS's is the one it sees itself: a container's own)


Locate = Callable[[Optional[str], Optional[int], str], Place]  # (host, pid, the node that asked) -> Place


def answers(raw_by_node: Mapping[str, Any]) -> Tuple[List[Answer], Dict[str, str]]:
    """(every answer the nodes got, in their order; node -> why it has none)."""
    found, none = [], {}
    for node, raw in raw_by_node.items():
        if not isinstance(raw, dict):
            continue
        if raw.get("skipped") or raw.get("error"):
            none[node] = str(raw.get("skipped") or raw.get("error"))
        for a in raw.get("answers") or ():
            found.append(Answer(node, str(a.get("address")), a.get("version"), a.get("format"),
                                [s for s in a.get("snapshots") or () if isinstance(s, dict)], a.get("error"),
                                bool(a.get("absent")), float(a.get("interval_s") or 1.0)))
    return found, none


def _who(who: Mapping[str, Any], place: Place, comm: str) -> str:
    """As RUN010 names a rank ("rank 2 on gpu2 (pid 4242)"), else by RAS's own words."""
    pid = f"pid {place.pid or who.get('pid')}" if place.pid or who.get("pid") else "pid not known"
    if place.rank is not None:
        return f"rank {place.rank} on {place.node} ({pid})"
    where = place.node or who.get("host")
    return f"rank {who.get('rank')} of communicator {comm}{' on ' + where if where else ''} ({pid})"


def _ranks(members: Optional[List[Mapping[str, Any]]], count: int) -> str:
    if not members:
        return f"{count} rank{'s' if count > 1 else ''}"
    ranks = sorted(str(m.get("rank")) for m in members)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks[:16])}{' ...' if len(ranks) > 16 else ''}"


def judge(answer: Answer, locate: Locate, moving: bool) -> Tuple[List[Blame], List[str]]:
    """(what holds the job, with proof; what RAS shows where nothing is blamed) from one node's answer."""
    if not answer.snapshots:
        return [], []
    first, last = answer.snapshots[0], answer.snapshots[-1]
    twice = len(answer.snapshots) > 1
    before = {c.get("hash"): c for c in first.get("comms") or ()}
    blames: List[Blame] = []
    notes: List[str] = []
    named = set()  # (pid, host) of the processes a communicator's missing rank named
    for comm in last.get("comms") or ():
        label = f"NCCL communicator {comm.get('hash')}"
        if not twice or moving or before.get(comm.get("hash")) != comm:
            why = ("one answer only" if not twice else "the ranks' stacks moved" if moving else
                   "its counts moved between RAS's two answers")
            notes.append(f"{label}: {_summary(comm)} ({why}: not proof of a hang)")
            continue
        for m in comm.get("missing") or ():
            named.add((m.get("pid"), m.get("host")))
        blames += _missing(answer, comm, label, locate, last)
        blames += _counts(answer, comm, label, locate, notes)
        for e in comm.get("errors") or ():
            notes.append(f"{label}: RAS reports {_who(e, locate(e.get('host'), e.get('pid'), answer.node), label)}: "
                         f"{e.get('error') or ', '.join(f'{k} {e[k]}' for k in ('init_state', 'async_error') if k in e)}")
    for kind, key in (("dead", "dead"), ("missing", "unreachable")):
        # NCCL 2.24 and 2.25 name a missing rank by its number only: its process is named in these lists.
        if not twice or moving or first.get(key) != last.get(key):
            continue
        for pid, host in last.get(key) or ():
            if (pid, host) not in named:
                blames.append(_gone(answer, kind, {"rank": None, "pid": pid, "host": host}, None,
                                    locate(host, pid, answer.node)))
    if last.get("timeouts"):
        notes.append(f"RAS timed out {last['timeouts']} time(s) gathering the communicators' data")
    return blames, notes


def _summary(comm: Mapping[str, Any]) -> str:
    parts = [f"{op} counts " + ", ".join(f"{_ranks(g.get('ranks'), g['count'])} at {g['value']}" for g in groups)
             for op, groups in (comm.get("ops") or {}).items()]
    missing = comm.get("missing") or ()
    if missing:
        parts.append(f"{_ranks(list(missing), len(missing))} missing")
    return "; ".join(parts) or "its ranks agree"


def _missing(answer: Answer, comm: Mapping[str, Any], label: str, locate: Locate,
             last: Mapping[str, Any]) -> List[Blame]:
    blames = []
    for m in comm.get("missing") or ():
        if not (m.get("unresponsive") or m.get("dead")):
            continue  # reachable, but not (or no longer) a member: a communicator made or torn down
        if m.get("pid") is None and m.get("host") is None and (last.get("dead") or last.get("unreachable")):
            continue  # named by its process (NCCL 2.24, 2.25)
        blames.append(_gone(answer, "dead" if m.get("dead") else "missing", m, (comm, label),
                            locate(m.get("host"), m.get("pid"), answer.node)))
    return blames


def _gone(answer: Answer, kind: str, who: Mapping[str, Any], comm: Optional[tuple], place: Place) -> Blame:
    """A rank RAS cannot reach (kind "missing") or considers dead (a minute unreachable: kind "dead")."""
    label = comm[1] if comm else "the job"
    name = _who(who, place, comm[0].get("hash") if comm else "?") if who.get("rank") is not None or place.rank \
        is not None else f"the process {who.get('pid')} on {place.node or who.get('host')}"
    usual = (comm[0].get("usual") or {}) if comm else {}
    others = f" (they launched {', '.join(f'{v} {op}' for op, v in usual.items())})" if usual else ""
    what = "is considered dead by RAS (unreachable for a minute)" if kind == "dead" else "does not answer RAS"
    rank = place.rank if place.rank is not None else who.get("rank")
    return Blame(
        kind, str(comm[0].get("hash")) if comm else "", max(usual.values()) if usual else 0,
        next(iter(usual), "") if usual else "", rank, place.node, place.pid or who.get("pid"), place.at,
        f"{name} {what}: {label} misses its data in {answer.twice()}, while the other ranks stand still{others}",
        f"look at rank {rank}{' on ' + place.node if place.node else ''}: "
        + ("its process is gone or frozen: read its log and dmesg there (the OOM killer), then restart the job"
           if kind == "dead" else "it hangs outside NCCL or is stopped (its stack: preflight doctor; its log)"),
        {"kind": kind, "rank": rank, "comm_rank": who.get("rank"), "pid": place.pid or who.get("pid"),
         "ras_pid": who.get("pid"), "host": who.get("host"),
         "comm": comm[0].get("hash") if comm else None, "source": answer.said()})


def _counts(answer: Answer, comm: Mapping[str, Any], label: str, locate: Locate, notes: List[str]) -> List[Blame]:
    """The ranks a stuck communicator's counts set apart: one that launched more of one op and fewer of another
    (mismatch), else those at the lowest count of an op while others are ahead (behind)."""
    ops = comm.get("ops") or {}
    usual = {op: max(groups, key=lambda g: (g["count"], g["value"]))["value"] for op, groups in ops.items()}
    below: Dict[tuple, tuple] = {}
    above: Dict[tuple, tuple] = {}
    for op, groups in ops.items():
        for g in groups:
            for w in g.get("ranks") or ():
                key = (w.get("rank"), w.get("pid"), w.get("host"))
                if g["value"] < usual[op]:
                    below.setdefault(key, (op, g, w))
                elif g["value"] > usual[op]:
                    above.setdefault(key, (op, g, w))
    blames = []
    crossed = [k for k in below if k in above]
    for key in crossed:
        (low_op, low, w), (high_op, high, _) = below[key], above[key]
        place = locate(w.get("host"), w.get("pid"), answer.node)
        others = next((g for g in ops[low_op] if g["value"] == usual[low_op]), None)
        they = _ranks(others.get("ranks") if others else None, others["count"] if others else 0)
        blames.append(_blame(
            "mismatch", comm, usual[low_op], high_op, w, place, answer,
            f"{_who(w, place, comm.get('hash'))} launched {high_op} #{high['value']} of {label} where {they} launched "
            f"{low_op} #{usual[low_op]}, which it never launched (it launched {low['value']}), the same in "
            f"{answer.twice()}: the collectives do not match, so the job hangs",
            f"look at rank {place.rank if place.rank is not None else w.get('rank')}"
            f"{' at ' + place.at if place.at else ''}: every rank must launch the same collectives in the same order",
            expected_op=low_op))
    crossed_set = set(crossed)
    done = set()  # a rank behind in two ops is named once
    for op, groups in ops.items():
        apart = [w for g in groups if g["value"] != usual[op] for w in g.get("ranks") or ()
                 if (w.get("rank"), w.get("pid"), w.get("host")) not in crossed_set]
        unlisted = any(g["ranks"] is None for g in groups if g["value"] != usual[op])
        if not apart and not unlisted:
            continue  # the ranks that launched another op account for it
        low, high = groups[0], groups[-1]
        if low.get("ranks") is None:
            notes.append(f"{label}: {low['count']} ranks launched {op} up to {low['value']}, "
                         f"{_ranks(high.get('ranks'), high['count'])} up to {high['value']}: RAS's text does not say "
                         "which ranks are behind (NCCL 2.28.7+ does, in JSON)")
            continue
        for w in low["ranks"]:
            key = (w.get("rank"), w.get("pid"), w.get("host"))
            if key in crossed_set or key in done:
                continue
            done.add(key)
            place = locate(w.get("host"), w.get("pid"), answer.node)
            rank = place.rank if place.rank is not None else w.get("rank")
            blames.append(_blame(
                "behind", comm, low["value"] + 1, op, w, place, answer,
                f"{_who(w, place, comm.get('hash'))} never launched {op} #{low['value'] + 1} of {label}: it launched "
                f"{low['value']}, while {_ranks(high.get('ranks'), high['count'])} launched {high['value']}, the same "
                f"in {answer.twice()}: the communicator is stuck",
                f"look at rank {rank}{' at ' + place.at if place.at else ''}: it issued fewer collectives than the "
                "others (a rank-dependent branch, an uneven number of buckets, batches or steps, an early exit)",
                count=low["value"], others=high["value"]))
    return blames


def _blame(kind: str, comm: Mapping[str, Any], seq: int, op: str, who: Mapping[str, Any], place: Place,
           answer: Answer, message: str, remedy: str, **more: Any) -> Blame:
    """A rank RAS's counts set apart, with the evidence RUN010's blames carry (kind, rank, pid, op, seq) and RAS's
    own (its communicator, its rank and pid there, where RAS was asked)."""
    pid = place.pid or who.get("pid")
    return Blame(kind, str(comm.get("hash")), seq, op, place.rank, place.node, pid, place.at, message, remedy,
                 {"kind": kind, "rank": place.rank, "comm_rank": who.get("rank"), "pid": pid, "ras_pid": who.get("pid"),
                  "host": who.get("host"), "comm": comm.get("hash"), "op": op, "seq": seq, **more,
                  "source": answer.said()})
