"""The flight recorder's verdict on a job (doctor): from every rank's records (preflight.node.flightrec reads and
reduces them on the nodes), which rank is behind, which issued another collective, which left no record.

torch's own analyser (torch/distributed/flight_recorder/fr_trace.py; components/builder.py matches every rank's
entries by collective sequence id, components/types.py `Op.match` says what must agree) reads the same files
after the fact; here the question is narrower: which rank holds the others, with proof. A rank is blamed only
where the records show a collective that some rank waited in past its own timeout: a snapshot of a job that
moves, or of a rank that is merely slow, shows ranks apart by a collective or two, none past its timeout.
Pure functions: no I/O.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.node.flightrec import LIBRARY

# The settings that make torch keep and write the records (doctor's advice when there are none): the ring
# buffer (TORCH_FR_BUFFER_SIZE, 0 by default: nothing is recorded), where each rank writes PREFIX<rank>, and
# NCCL's watchdog writing them when a collective times out. gloo does not write them by itself (torch 2.13):
# the job calls torch._C._distributed_c10d._dump_fr_trace() in its own timeout handler.
SETTINGS = ("TORCH_FR_BUFFER_SIZE=2000", "TORCH_FR_DUMP_TEMP_FILE=/a/local/or/shared/path/fr_",
            "TORCH_NCCL_DUMP_ON_TIMEOUT=1")
# Ops whose input sizes may differ between ranks (types.py Op.match leaves them out of the size test).
UNEVEN = frozenset(("all_to_all", "all_to_all_single", "all_to_all_v_single", "all_to_allv", "scatter", "gather"))


@dataclass(frozen=True)
class Entry:
    seq: int
    op: str
    sizes: Optional[tuple]
    dtypes: Optional[tuple]
    state: Optional[str]
    created_ns: Optional[int]
    timeout_ms: Optional[int]
    frames: Tuple[tuple, ...]

    @property
    def at(self) -> Optional[str]:
        """The user's line that issued it (the innermost frame outside the libraries): file:line (function)."""
        user = next((f for f in self.frames if f[1] and not LIBRARY.search(f[1])), None)
        return f"{os.path.basename(user[1])}:{user[2]} ({user[0]})" if user else None

    def signature(self) -> tuple:
        """What every rank's entry of one collective must share (types.py Op.match: its type, its input sizes
        but for the ops whose ranks send uneven parts, its dtypes)."""
        return self.op, None if self.op in UNEVEN else self.sizes, self.dtypes

    def shown(self) -> str:
        sizes = "" if self.sizes is None else " " + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in self.sizes)
        return f"{self.op}{sizes}{' ' + '/'.join(self.dtypes) if self.dtypes else ''}"


@dataclass
class Group:
    pg: str
    desc: Optional[str]
    ranks: Optional[tuple]
    entries: Dict[int, Entry]
    enqueued: Optional[int] = None
    completed: Optional[int] = None  # pg_status: NCCL's last completed; gloo counts a collective that failed too

    @property
    def top(self) -> int:
        """The last collective this rank entered in the group."""
        return max([self.enqueued or 0, *self.entries])


@dataclass
class Record:
    rank: int
    path: str
    dumped_ns: int  # the file's modification time: when the rank wrote it
    groups: Dict[str, Group]
    nodes: Tuple[str, ...]  # where it was read (several: a shared folder)
    node: Optional[str] = None  # the rank's node: where its process runs, else the one node its file is on
    pid: Optional[int] = None  # its process, while it runs

    def who(self) -> str:
        where = f" on {self.node}" if self.node else " (node not known: its file is in a folder every node sees)"
        return f"rank {self.rank}{where} ({f'pid {self.pid}' if self.pid else 'not running'})"


@dataclass
class Blame:
    kind: str  # mismatch, behind, missing, all-waiting
    pg: str
    seq: int
    op: str
    rank: Optional[int]
    node: Optional[str]
    pid: Optional[int]
    at: Optional[str]  # the line the record points at: the blamed rank's own, or where the others wait
    message: str
    remedy: str
    evidence: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Records:
    """Every rank's records across the nodes, and what could not be read."""
    records: List[Record]
    errors: List[Tuple[str, str, str]]  # (node, path, why)
    looked: Dict[str, List[str]]  # node -> the prefixes looked at
    stale: Dict[str, List[str]]  # node -> files older than the rank that would have written them
    live: Mapping[int, Sequence[Tuple[str, int]]] = field(default_factory=dict)  # rank -> [(node, pid)] running
    world: Optional[int] = None  # the running ranks' WORLD_SIZE: the ranks of a group whose records omit them
    server_dumps: Dict[str, str] = field(default_factory=dict)  # node -> torch's debug-server dump in the folder


def gather(raw_by_node: Mapping[str, Any], live: Mapping[int, Sequence[Tuple[str, int]]],
           world: Optional[int] = None) -> Records:
    """The records from each node's census ("flight_recorder"), one per rank: a file read on several nodes (a
    shared folder) counts once. `live`: rank -> [(node, pid)] of the running ranks, from the census; `world`:
    their WORLD_SIZE."""
    found: Dict[int, Dict[tuple, Tuple[List[str], Mapping[str, Any]]]] = {}
    errors, looked, stale, server_dumps = [], {}, {}, {}
    for node, raw in raw_by_node.items():
        if not isinstance(raw, dict):
            continue
        looked[node] = [str(p.get("prefix")) for p in raw.get("looked") or () if isinstance(p, dict)]
        server_dumps.update((node, str(p["server_dump"])) for p in raw.get("looked") or ()
                            if isinstance(p, dict) and p.get("server_dump"))
        stale[node] = [str(p) for p in raw.get("stale") or ()]
        for problem in raw.get("errors") or ():
            errors.append((node, str(problem.get("path")), str(problem.get("error"))))
        for dump in raw.get("dumps") or ():
            key = (dump.get("size"), dump.get("mtime_ns"), dump.get("path"))
            nodes, _ = found.setdefault(dump["rank"], {}).setdefault(key, ([], dump))
            nodes.append(node)
    records = []
    for rank, copies in sorted(found.items()):
        # Two different files for one rank: the newer is its last word (an older run's file elsewhere).
        key = max(copies, key=lambda k: k[1] or 0)
        nodes, dump = copies[key]
        running = list(live.get(rank) or ())
        record = Record(rank=rank, path=str(dump.get("path")), dumped_ns=dump.get("mtime_ns") or 0,
                        groups={g["pg"]: _group(g) for g in dump.get("groups") or ()}, nodes=tuple(nodes))
        on_node = [(n, pid) for n, pid in running if n in nodes]
        if len(on_node) == 1:
            record.node, record.pid = on_node[0]
        elif len(nodes) == 1 and not running:
            record.node = nodes[0]
        elif len(running) == 1:
            record.node, record.pid = running[0]
        records.append(record)
    return Records(records, errors, looked, stale, live, world, server_dumps)


def _group(raw: Mapping[str, Any]) -> Group:
    entries = {}
    for e in raw.get("entries") or ():
        entries[e["seq"]] = Entry(e["seq"], str(e.get("op") or "?"),
                                  tuple(tuple(s) for s in e["sizes"]) if e.get("sizes") is not None else None,
                                  tuple(str(d) for d in e["dtypes"]) if e.get("dtypes") is not None else None,
                                  e.get("state"), e.get("created_ns"), e.get("timeout_ms"),
                                  tuple(tuple(f) for f in e.get("frames") or ()))
    return Group(raw["pg"], raw.get("desc"), tuple(raw["ranks"]) if raw.get("ranks") is not None else None, entries,
                 raw.get("enqueued"), raw.get("completed"))


def waited_out(entry: Optional[Entry], dumped_ns: int) -> bool:
    """Whether the rank's records show it waiting in this collective past its timeout: not completed (NCCL marks
    its entries completed; gloo leaves them "scheduled" in torch 2.13) and issued at least its timeout before
    the rank wrote them (a dump on timeout, as NCCL's watchdog and a job's handler write it)."""
    if entry is None or entry.state == "completed" or not entry.created_ns or not entry.timeout_ms or not dumped_ns:
        return False
    return dumped_ns - entry.created_ns >= entry.timeout_ms * 1_000_000


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}{' ...' if len(ranks) > 16 else ''}"


def _pg(group: Group) -> str:
    return f"process group {group.pg}" + (f" ({group.desc})" if group.desc and group.desc != "undefined" else "")


def judge(found: Records) -> Tuple[List[Blame], List[str]]:
    """(what holds the job, with proof; what the records show where nothing is blamed), per process group."""
    by_rank = {r.rank: r for r in found.records}
    blames, notes = [], []
    for pg in sorted({pg for r in found.records for pg in r.groups}, key=lambda p: (len(p), p)):
        holders = {r.rank: r.groups[pg] for r in found.records if pg in r.groups}
        group = next(iter(holders.values()))
        mismatch = _mismatch(pg, holders, by_rank)
        if mismatch:
            blames.extend(mismatch)
            continue
        tops = {rank: g.top for rank, g in holders.items()}
        last = max(tops.values())
        leaders = sorted(r for r in tops if tops[r] == last)
        waiting = [r for r in leaders if waited_out(holders[r].entries.get(last), by_rank[r].dumped_ns)]
        if not waiting:
            furthest = holders[leaders[0]].entries.get(last)
            notes.append(f"{_pg(group)}: {_ranks(leaders)} at collective #{last}" +
                         (f", {_ranks([r for r in tops if tops[r] < last])} before it" if len(leaders) < len(tops)
                          else "") + (" (none waited in it past its timeout: slow, or still moving)"
                                      if len(leaders) < len(tops) or furthest is None or furthest.state != "completed"
                                      else ""))
            continue
        entry = holders[waiting[0]].entries[last]
        past = f" past {'their' if len(waiting) > 1 else 'its'} {entry.timeout_ms / 1000:g} s timeout"
        waited = f"{_ranks(waiting)} waited in {entry.op} #{last} of {_pg(group)}" \
            f"{' at ' + entry.at if entry.at else ''}{past}"
        behind = sorted(r for r in tops if tops[r] < last)
        for rank in behind:
            record = by_rank[rank]
            if record.dumped_ns < entry.created_ns:  # written before the others entered #last: proves nothing
                notes.append(f"{_pg(group)}: rank {rank}'s records were written before the others entered #{last}")
                continue
            never = tops[rank] + 1
            issued = next((holders[r].entries[never] for r in leaders if never in holders[r].entries), None)
            own = holders[rank].entries.get(tops[rank])
            op = issued.op if issued else entry.op
            theirs = f"{op} #{never}" + (f" at {issued.at}" if issued and issued.at else "") if never < last else ""
            blames.append(Blame(
                "behind", pg, never, op, rank, record.node, record.pid, own.at if own else None,
                f"{record.who()} never entered {op} #{never} of {_pg(group)}: its last collective was #{tops[rank]}"
                f"{' (' + own.op + (' at ' + own.at if own.at else '') + ')' if own else ''}, while "
                + (f"{_ranks(leaders)} waited in " if leaders == waiting and not theirs else
                   f"{_ranks(leaders)} went on to {theirs + ' and ' if theirs else ''}") + f"{entry.op} #{last}"
                f"{' at ' + entry.at if entry.at else ''}"
                + (past if leaders == waiting and not theirs else f", where {_ranks(waiting)} waited{past}"),
                f"look at rank {rank}{' at ' + own.at if own and own.at else ''}: it issued fewer collectives than the "
                "others (a rank-dependent branch, an uneven number of buckets, batches or steps, an early exit)",
                {"kind": "behind", "rank": rank, "pid": record.pid, "pg": pg, "seq": never, "op": op,
                 "last_seq": tops[rank], "waiting": waiting}))
        # gloo writes no group's ranks (torch 2.13: pg_config {"": {"ranks": "[]"}}): the default group's are the
        # running job's world; another group's are not known, and no rank is said to be missing from it.
        expected = Counter(g.ranks for g in holders.values() if g.ranks).most_common(1)
        default = group.desc == "default_pg"
        members = set(expected[0][0]) if expected else set(range(found.world)) if found.world and default else set()
        if not members:
            notes.append(f"{_pg(group)}: its records do not list its ranks, so a rank without records is not named")
        missing = sorted(members - set(holders))
        for rank in missing:
            record = by_rank.get(rank)
            running = list(found.live.get(rank) or ())
            if record is None:  # no file: where it runs, when it does
                record = Record(rank, "", 0, {}, (), *(running[0] if len(running) == 1 else (None, None)))
            who = record.who() if record.node else f"rank {rank}" + (f" (pid {record.pid})" if record.pid else "")
            blames.append(Blame(
                "missing", pg, last, entry.op, rank, record.node, record.pid,
                entry.at, f"{who} has no record of {_pg(group)}"
                f"{' (no file of it on any node read)' if not record.path else ''}, "
                f"while {waited}: rank {rank} is not in it (it never entered it, or its records were not written)",
                f"look at what rank {rank} does instead of {entry.op} #{last} (its stack: preflight doctor while it "
                "runs; its log), and have every rank write its records on timeout",
                {"kind": "missing", "rank": rank, "pid": record.pid, "pg": pg, "seq": last,
                 "op": entry.op, "waiting": waiting}))
        # Every rank at the same place: stuck only where none says it completed it (gloo leaves its entries
        # "scheduled", so a job idle since its last collective would look the same by its entries alone).
        done = [r for r in waiting if holders[r].completed is not None and holders[r].completed >= last]
        if not behind and not missing and len(waiting) == len(tops) and not done:
            blames.append(Blame(
                "all-waiting", pg, last, entry.op, None, None, None, entry.at,
                f"every rank recorded ({_ranks(waiting)}) waited in {entry.op} #{last} of {_pg(group)} past its "
                f"timeout, and none is behind: the transport (NCCL/gloo, the network) or a rank without records "
                "holds them", "rerun with NCCL_DEBUG=INFO, or `preflight check` the nodes (the all-reduce)",
                {"kind": "all-waiting", "pg": pg, "seq": last, "op": entry.op, "waiting": waiting}))
    return blames, notes


def _mismatch(pg: str, holders: Mapping[int, Group], by_rank: Mapping[int, Record]) -> List[Blame]:
    """The first collective whose ranks' entries disagree (op, sizes, dtypes): the ranks apart from the
    majority are blamed, every rank when there is none (two ranks, two ops)."""
    group = next(iter(holders.values()))
    for seq in sorted({s for g in holders.values() for s in g.entries}):
        have = {rank: g.entries[seq] for rank, g in holders.items() if seq in g.entries}
        variants = Counter(e.signature() for e in have.values()).most_common()
        if len(have) < 2 or len(variants) < 2:
            continue
        majority = variants[0][0] if variants[0][1] > variants[1][1] else None
        usual = next((e for e in have.values() if e.signature() == majority), None)
        blames = []
        for rank, e in sorted(have.items()):
            if majority is not None and e.signature() == majority:
                continue
            record = by_rank[rank]
            others = sorted(r for r in have if r != rank and (majority is None or have[r].signature() == majority))
            theirs = usual if usual is not None else have[others[0]]
            blames.append(Blame(
                "mismatch", pg, seq, e.op, rank, record.node, record.pid, e.at,
                f"{record.who()} issued {e.shown()} as collective #{seq} of {_pg(group)}"
                f"{' at ' + e.at if e.at else ''}, where {_ranks(others)} issued {theirs.shown()}"
                f"{' at ' + theirs.at if theirs.at else ''}: the collectives do not match, so the job hangs (or "
                "mixes up data)", f"look at rank {rank}{' at ' + e.at if e.at else ''}: every rank must issue the same "
                "collectives in the same order, with the same shapes and dtypes",
                {"kind": "mismatch", "rank": rank, "pid": record.pid, "pg": pg, "seq": seq, "op": e.op,
                 "expected_op": theirs.op, "sizes": e.sizes, "expected_sizes": theirs.sizes}))
        return blames
    return []
