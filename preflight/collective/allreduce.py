"""The all-reduce smoke test across the nodes (the COL checks): correctness, joins, bandwidth, bisect.

Each node gets a new session on its existing SSH connection that runs preflight.node.allreduce with the
training interpreter: one process per rank, torch imported there and nowhere else, one JSON line back
per node. Rank 0 lives on the head and serves the rendezvous on the main port (or --col-port), at the
address each node resolved for the head.

The phase has one hard deadline, --timeout + PHASE_MARGIN_S from its start, kept from both sides: each
rank's store, init and collective timeouts and the node process's kill deadline (inside), and the
controller closing every session at the run's end (outside; a closed session kills its ranks). Within it:

1. the full run over every node that was reached (a node without torch is blamed without running);
2. when it fails and the reports name nodes at fault (torch does not import, a process died, nothing
   reached the head's rendezvous), a rerun without them, so that the others get a verdict of their own;
3. when a run fails without naming anyone (a hang, wrong values): what the data-path probes found broken
   before the run (preflight.collective.datapath: a node's own route or firewall, a pair's closed port or path
   MTU) names those nodes at once; else the pairwise phase's matrix
   (preflight.collective.pairwise; measured by the run's own workers at the rendezvous, else in a run of its
   own) names the failed links or the node that fails with every peer; when it names none, or the run is
   below --min-busbw, a bisect: the head with halves of the other nodes, down to pairs, as far as the time
   allows.

Each run has a token of its own that every rank must find in the store (preflight.node.allreduce): a run
whose port another run (or another process) holds ends with doc["clash"], which blames no node.
A node's report is checked for the shape the worker writes; any other answer is that node's failure. Before
it, the worker says when its slowest rank reaches the rendezvous and each size (a few short lines): the status
line shows the run at its slowest node's place and names the nodes that moved least recently first; such a
line that is not of the shape the worker writes is ignored (it decides nothing).

run_collective returns a plain dict (probes["collective"]); the checks in checks/col.py read it.
"""
from __future__ import annotations

import json
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from preflight import progress
from preflight.collective import datapath, nccllog, pairwise
from preflight.collective.options import DEFAULT_SIZES, format_size
from preflight.inputs.numbers import is_int, is_number
from preflight.remote.shapes import worker_report_problem
from preflight.remote.shipping import ALLREDUCE, shipped_command, shipped_input
from preflight.remote.session import NodeError

PHASE_MARGIN_S = 4.0  # the phase ends within --timeout + this (and the sessions are closed within 1 s more)
FULL_SHARE = 0.6  # of the phase, at most, for the first run; the rest is for a rerun or a bisect
RETURN_S = 1.0  # time for a node's line to come back after its worker's own deadline
ABORT_GRACE_S = 1.5  # how long an aborted node has to send its line
MIN_RUN_S = 4.0  # below this, a run cannot even import torch and meet: do not start one
MAX_RERUNS = 2
PAIR_SHARE = 0.6  # of the time left after a failed run, for the pairwise phase alone (the bisect gets the rest)
TAIL_CHARS = 1200

# Kinds of rank failure that name their own node, and make waiting for the others pointless.
OWN_FAULT = ("start", "import", "died", "no-answer", "slow-import", "protocol")
STOPS_THE_RUN = OWN_FAULT + ("error", "clash")


# --- options ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveOptions:
    backend: str = "auto"  # auto: nccl when every node has GPUs (facts "gpus"), else gloo
    procs_per_node: Optional[int] = None  # None: 1 for gloo; for nccl the planned processes per node, else its GPUs
    planned_per_node: Optional[int] = None  # the job's processes per node, when the plan says
    sizes: Tuple[int, ...] = DEFAULT_SIZES  # bytes, smallest first
    port: Optional[int] = None  # None: the main port
    min_busbw_gbps: Optional[float] = None

    def run(self, nodes, head_address: str, options, paths: Optional[dict] = None) -> dict:
        """The all-reduce phase, as gather runs a probe over the nodes' open sessions (run_collective); paths: the
        data-path probe's document when it ran before (probes["paths"])."""
        return run_collective(nodes, head_address, options, paths)


def options_from_args(plan, args) -> CollectiveOptions:
    """The collective's options from the command line and the plan (engine.gather_for)."""
    world, _ = plan.world_size
    nodes = len(plan.nodes) or 1
    planned = world // nodes if world and world % nodes == 0 and world >= nodes else None
    return CollectiveOptions(
        backend=getattr(args, "backend", None) or "auto",
        procs_per_node=getattr(args, "col_procs_per_node", None),
        planned_per_node=planned,
        sizes=getattr(args, "col_sizes", None) or DEFAULT_SIZES,
        port=getattr(args, "col_port", None),
        min_busbw_gbps=plan.limits.min_busbw_gbps,
    )


def gpu_count(facts: Optional[dict]) -> int:
    """The GPUs a node's facts list: "gpus" as a list, or as NVML's {"available", "devices": [...]}."""
    gpus = (facts or {}).get("gpus")
    if isinstance(gpus, dict):
        gpus = gpus.get("devices") if gpus.get("available", True) else None
    return len(gpus) if isinstance(gpus, list) else 0


def choose_backend(requested: str, facts: Sequence[Optional[dict]]) -> str:
    """auto: nccl when every node's facts list GPUs, else gloo; gloo and nccl are taken as asked."""
    if requested in ("gloo", "nccl"):
        return requested
    return "nccl" if facts and all(gpu_count(f) > 0 for f in facts) else "gloo"


def local_processes(options: CollectiveOptions, backend: str, facts: Sequence[Optional[dict]]) -> int:
    """Processes per node: as asked; gloo 1; nccl one per planned GPU (else each node's GPUs, the fewest)."""
    if options.procs_per_node:
        return options.procs_per_node
    if backend != "nccl":
        return 1
    if options.planned_per_node:
        return options.planned_per_node
    counts = [gpu_count(f) for f in facts]
    return max(1, min(counts)) if counts else 1


# --- figures ------------------------------------------------------------------------------------

def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor, 2(n-1)/n: what each link carries per byte reduced."""
    return 2.0 * (world_size - 1) / world_size if world_size > 0 else 0.0


def busbw(algbw_gbps: float, world_size: int) -> float:
    return algbw_gbps * bus_factor(world_size)


def figures(sizes: Sequence[dict]) -> Optional[dict]:
    """The sweep as reported by a rank: every size, and the largest measured one's bandwidth."""
    if not sizes:
        return None
    largest = max(sizes, key=lambda s: s["bytes"])
    return {"bytes": largest["bytes"], "algbw_gbps": largest["algbw_gbps"], "busbw_gbps": largest["busbw_gbps"],
            "per_size": [{k: s[k] for k in ("bytes", "iters", "time_s", "algbw_gbps", "busbw_gbps")} for s in sizes]}


# --- diagnosis (pure) ---------------------------------------------------------------------------

def failed_ranks(report: dict) -> List[dict]:
    return [r for r in report.get("ranks") or [] if not r.get("ok")]


def node_fault(report: dict) -> Optional[dict]:
    """The failure that names this node itself (torch does not import, the worker did not start or answer,
    a rank process died), or None."""
    if report.get("kind") in OWN_FAULT:
        return {"kind": report["kind"], "stage": report.get("stage"), "error": report.get("error"),
                "tail": report.get("tail")}
    for rank in failed_ranks(report):
        if rank.get("kind") in OWN_FAULT:
            return {"kind": rank["kind"], "stage": rank.get("stage"), "error": rank.get("error"),
                    "tail": rank.get("tail"), "rank": rank.get("rank")}
    return None


def still_importing(report: dict) -> bool:
    return any(r.get("kind") == "killed" and r.get("stage") == "import" for r in failed_ranks(report))


def stops_the_run(report: dict) -> bool:
    """A failure after which the other ranks would only wait for their timeout."""
    if report.get("kind") in STOPS_THE_RUN:
        return True
    return any(r.get("kind") in STOPS_THE_RUN for r in failed_ranks(report))


def port_clash(reports: Dict[str, dict], head: str) -> Optional[str]:
    """Why the run's rendezvous port was not its own (another run's store, a process holding it), or None;
    the head's rank 0 says it first."""
    nodes = sorted(reports, key=lambda n: n != head)
    for name in nodes:
        for rank in failed_ranks(reports[name]):
            if rank.get("kind") == "clash":
                return rank.get("error") or "the rendezvous port is held by another process"
    return None


def diagnose(run: dict, head: str) -> Dict[str, dict]:
    """The nodes a failed run names as at fault: {node: {"kind", "error", "tail", ...}}; {} when it names
    none (everyone timed out after meeting, or the values were wrong: then only a bisect can tell)."""
    if run.get("ok"):
        return {}
    reports = run["reports"]
    blamed = {}
    for node in run["nodes"]:
        fault = node_fault(reports.get(node) or {"kind": "no-answer", "error": "no report"})
        if fault is not None:
            blamed[node] = fault
    # Still importing torch at the deadline, while others got further: that node is too slow to start.
    importing = [n for n in run["nodes"] if n not in blamed and still_importing(reports[n])]
    if importing and len(importing) < len(run["nodes"]):
        for node in ([head] if head in importing else importing):
            blamed[node] = {"kind": "slow-import", "stage": "import", "tail": _tail_of(reports[node]),
                            "error": f"torch was still being imported when the run's deadline came "
                                     f"({run.get('budget_s')} s), while other nodes were waiting for it"}
        if head in importing:
            return blamed
    # The rendezvous: ranks that never reached the store on the head.
    missed = {}
    for node in run["nodes"]:
        if node in blamed:
            continue
        ranks = [r for r in failed_ranks(reports[node]) if r.get("stage") == "store" and r.get("kind") != "aborted"]
        if ranks:
            missed[node] = ranks[0]
    if missed:
        workers = [n for n in run["nodes"] if n != head]
        address = f"{run.get('master_addr')}:{run.get('port')}"
        if head in missed or (workers and all(w in missed or w in blamed for w in workers)):
            first = missed.get(head) or next(iter(missed.values()))
            who = "no rank, not even the head's own," if head in missed else "no other node"
            blamed[head] = {"kind": "rendezvous", "stage": "store", "error": f"{who} could connect to the "
                            f"rendezvous at {address} on the head: {first.get('error')}", "tail": first.get("tail"),
                            "unreached_by": sorted(missed)}
        else:
            for node, rank in missed.items():
                blamed[node] = {"kind": "rendezvous", "stage": "store", "error": f"could not connect to the "
                                f"rendezvous at {address} on the head {head}: {rank.get('error')}",
                                "tail": rank.get("tail")}
    return blamed


# --- bisect (pure: the test is passed in) -------------------------------------------------------

def halves(nodes: Sequence[str]) -> Tuple[List[str], List[str]]:
    middle = (len(nodes) + 1) // 2
    return list(nodes[:middle]), list(nodes[middle:])


def bisect(head: str, workers: Sequence[str], test: Callable[[List[str]], dict],
           have_time: Callable[[], bool]) -> dict:
    """Find the workers that make a group with the head fail (or run slowly).

    test(group) runs the head plus `group` and returns {"bad": bool, ...}. Halves are tested one after the
    other (they share the head's link), and only a bad half is split further. Returns {"suspects": nodes
    (the head when every worker fails with it), "tests": [...], "complete": False when time ran out before
    the suspects were single nodes, "inconclusive": True when every half passed (the fault needs the
    whole group)}."""
    tests: List[dict] = []
    complete = True
    inconclusive = False

    def probe(group: List[str]) -> Optional[bool]:
        if not have_time():
            return None
        outcome = dict(test(list(group)))
        outcome["nodes"] = [head] + list(group)
        tests.append(outcome)
        return bool(outcome.get("bad"))

    def search(group: List[str]) -> List[str]:
        nonlocal complete, inconclusive
        if len(group) <= 1:
            return list(group)
        bad: List[str] = []
        clean = 0
        for half in halves(group):
            verdict = probe(half)
            if verdict is None:  # out of time: the whole half stays suspect
                complete = False
                bad.extend(half)
            elif verdict:
                bad.extend(search(half))
            else:
                clean += 1
        if clean == 2:
            inconclusive = True
            return list(group)
        return bad

    suspects = search(list(workers))
    singles = [t for t in tests if len(t["nodes"]) == 2]
    if workers and len(workers) == 1:
        suspects = [head] + list(workers)  # one pair: the head and the worker cannot be told apart
    elif (len(workers) > 1 and complete and not inconclusive and set(suspects) == set(workers)
          and len(singles) == len(workers) and all(t.get("bad") for t in singles)):
        suspects = [head]  # every worker fails with the head: the head (or its link) it is
    return {"suspects": suspects, "tests": tests, "complete": complete, "inconclusive": inconclusive}


# --- running a group over SSH -------------------------------------------------------------------

class _Phase:
    def __init__(self, nodes, head_address: str, options, backend: str, procs: int):
        self.nodes = {n.name: n for n in nodes}
        self.head = nodes[0].name
        self.head_address = head_address
        self.options = options
        self.col: CollectiveOptions = options.collective
        self.backend, self.procs = backend, procs
        self.port = self.col.port or options.port
        self.started = time.monotonic()
        self.deadline = self.started + options.timeout + PHASE_MARGIN_S
        self.runs: List[dict] = []
        self.clash: Optional[str] = None  # set by the first run whose port is not its own

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def master_addr(self, name: str) -> str:
        resolved = ((self.nodes[name].facts or {}).get("host") or {}).get("head_resolves_to")
        return resolved[0] if isinstance(resolved, list) and resolved else self.head_address

    def run(self, names: List[str], budget: float, sizes: Sequence[int], purpose: str) -> dict:
        """One all-reduce over `names` (the first is rank 0's node), its workers measuring the pairwise phase at
        the rendezvous first (a full run or a rerun); purpose "pairwise": that phase alone, one gloo rank per
        node. Every session closed on return."""
        budget = max(0.0, min(budget, self.left()))
        alone = purpose == "pairwise"
        procs, backend = (1, "gloo") if alone else (self.procs, self.backend)
        pairs = pairwise.spec(len(names), max(sizes or [pairwise.PAIR_BYTES])) \
            if len(names) > 1 and purpose != "bisect" else None
        world = len(names) * procs
        started = time.monotonic()
        deadline = started + budget
        env: Dict[str, str] = {}  # NCCL_DEBUG is the worker's to set: it keeps the user's (preflight.node.allreduce)
        reports: Dict[str, dict] = {}
        sessions: Dict[str, object] = {}
        stop = threading.Event()
        lock = threading.Lock()
        token = secrets.token_hex(8)  # this run's, not the phase's: a previous run's store may still be closing

        def node_run(index: int, name: str) -> None:
            ranks = list(range(index * procs, (index + 1) * procs))
            payload = {"master_addr": self.master_addr(name), "master_port": self.port, "world_size": world,
                       "ranks": ranks, "backend": backend, "sizes": list(sizes), "timeout_s": self.options.timeout,
                       "budget_s": max(1.0, budget - RETURN_S), "env": env, "run": token, "progress": True}
            if pairs:
                payload["pairs"] = pairs
            if alone:
                payload["mode"] = "pairs"
            try:
                report = self._node_report(name, ranks, payload, deadline, stop, sessions, lock,
                                           lambda position: moved(name, position))
            except Exception as exc:  # whatever the node sent: its failure, never a thread's traceback
                report = _protocol_failure(f"preflight could not read it: {type(exc).__name__}: {exc}")
            with lock:
                reports[name] = report
            shown.done(name, bool(report.get("ok")))
            if not report.get("ok") and stops_the_run(report):
                stop.set()

        def place(position: Tuple[int, int]) -> str:
            stage, size = position
            if stage == 2:
                return f"size {size} of {len(sizes)} ({format_size(sizes[size - 1])})"
            if stage == 1:
                return "rendezvous"
            return f"importing torch, rendezvous, sizes to {format_size(max(sizes))}" if sizes else \
                "importing torch, rendezvous, pairs of nodes"

        positions = {name: (0, 0) for name in names}  # (0 import, 1 rendezvous, 2 sweep; size), from the lines

        def moved(name: str, position: Tuple[int, int]) -> None:
            with lock:
                if name in reports or position <= positions[name]:
                    return
                positions[name] = position
                shown.moved(name)  # under the lock: two nodes' lines never show their places out of order
                shown.note("starting ranks", place(min(positions[n] for n in names if n not in reports)))

        step = f"bisect step {1 + sum(r['purpose'] == 'bisect' for r in self.runs)}" if purpose == "bisect" else (
            "full run" if purpose == "full" else "pairs of nodes" if alone else f"rerun {purpose}")
        shown = self.shown = progress.of(self.options.progress).activity(  # the status line while this run lasts
            f"all-reduce {step} ({world} {backend} ranks)", len(names), "started",
            "reported", limit=budget, short="all-reduce" + {"full": "", "bisect": f" {step}",
                                                            "pairwise": " pairs"}.get(purpose, " rerun"))
        shown.note("starting ranks", place((0, 0)))
        shown.starts(names)
        threads = [threading.Thread(target=node_run, args=(i, n), daemon=True) for i, n in enumerate(names)]
        for thread in threads:
            thread.start()
        for thread in threads:  # each returns by the deadline; this bounds a start that hangs
            thread.join(max(0.0, deadline + 0.5 - time.monotonic()))
        shown.close()
        with lock:
            for proc in sessions.values():  # a closed session kills the node's ranks
                try:
                    proc.close()
                except Exception:
                    pass
            final = {n: reports.get(n) or {"ok": False, "kind": "no-answer", "stage": None, "ranks": [],
                                           "error": "the worker did not answer", "tail": None} for n in names}
        ok = all(final[n].get("ok") for n in names)
        rank0 = next(iter(final[names[0]].get("ranks") or []), {})
        clash = None if ok else port_clash(final, names[0])
        self.clash = self.clash or clash
        run = {"purpose": purpose, "nodes": list(names), "world_size": world, "ok": ok, "port": self.port,
               "clash": clash,
               "master_addr": self.master_addr(names[0]), "budget_s": round(budget, 3),
               "elapsed_s": round(time.monotonic() - started, 3), "sizes": list(sizes),
               "figures": figures(rank0.get("sizes") or []) if ok else None,
               "skipped_sizes": rank0.get("skipped_sizes") or [], "sum_check": rank0.get("check"), "reports": final,
               "pairwise": pairwise.matrix(names, final, pairs, run_elapsed(final)) if pairs else None}
        self.runs.append(run)
        return run

    def _node_report(self, name: str, ranks: List[int], payload: dict, deadline: float, stop: threading.Event,
                     sessions: dict, lock: threading.Lock, moved: Callable[[Tuple[int, int]], None]) -> dict:
        """Start the node's worker and read its report (checked: of the shape the worker writes)."""
        try:
            proc = self.nodes[name].connection.start(shipped_command(self.options.python),
                                                     shipped_input(ALLREDUCE, payload))
        except Exception as exc:
            report = {"ok": False, "kind": "start", "stage": "start", "ranks": [],
                      "error": f"could not start the worker: {exc}", "tail": None}
        else:
            with lock:
                sessions[name] = proc
            self.shown.reach(name)
            report = self._read(proc, deadline, stop, ranks, len(payload["sizes"]), moved,
                                payload.get("mode") == "pairs")
        report["master_addr"] = payload["master_addr"]
        return report

    def _read(self, proc, deadline: float, stop: threading.Event, ranks: List[int], sizes: int,
              moved: Callable[[Tuple[int, int]], None], pairs_only: bool = False) -> dict:
        """The node's report line (its lines of progress before it go to `moved`), or why there is none."""
        abort_sent = False
        while True:
            now = time.monotonic()
            if stop.is_set() and not abort_sent:
                abort_sent = True
                try:
                    proc.send_line("abort")
                except Exception:
                    pass
                deadline = min(deadline, now + ABORT_GRACE_S)
            if now >= deadline:
                return {"ok": False, "kind": "aborted" if abort_sent else "no-answer", "stage": None, "ranks": [],
                        "error": "stopped: another node had failed" if abort_sent else
                        "no answer before the deadline", "tail": _stderr(proc)}
            try:
                line = proc.read_line(min(0.2, deadline - now))
            except NodeError:
                continue
            except Exception as exc:
                return {"ok": False, "kind": "no-answer", "stage": None, "ranks": [],
                        "error": f"the session broke: {exc}", "tail": _stderr(proc)}
            if line is None:
                status = proc.exit_status(2)
                if status in (126, 127):
                    error = f"the interpreter {self.options.python} does not exist or cannot run there (exit {status})"
                else:
                    error = f"the worker stopped without a report (exit {status})"
                return {"ok": False, "kind": "start", "stage": "start", "ranks": [], "error": error,
                        "tail": _stderr(proc)}
            try:
                report = json.loads(line)
            except ValueError:
                continue  # not ours (a shell's greeting); the worker's line follows
            except RecursionError:
                return _protocol_failure("it is nested deeper than any report", _stderr(proc))
            if is_number(report):
                continue  # a greeting that happens to be a number
            if isinstance(report, dict) and set(report) == {"progress"}:
                position = progress_position(report["progress"], ranks, sizes)
                if position is not None:
                    moved(position)
                continue
            wrong = pairwise.report_problem(report, ranks) if pairs_only else \
                worker_report_problem(report, ranks) or pairwise.pairs_problem(report)
            if wrong:
                return _protocol_failure(wrong, _stderr(proc))
            report.setdefault("kind", None)
            return report


def run_elapsed(reports: Dict[str, dict]) -> Optional[float]:
    """The pairwise phase's cost: the slowest node's time in it (its ranks' "pairs_s")."""
    times = [r.get("pairs_s") for report in reports.values() for r in report.get("ranks") or []
             if is_number(r.get("pairs_s")) and not isinstance(r.get("pairs_s"), bool)]
    return round(max(times), 3) if times else None


def progress_position(line, ranks: Sequence[int], sizes: int) -> Optional[Tuple[int, int]]:
    """Where a line of progress puts its node: (1, 0) at the rendezvous, (2, n) at the n-th of `sizes`; None
    when the line is not of the shape the worker writes (it is then ignored)."""
    if not isinstance(line, dict) or line.get("rank") not in ranks or line.get("sizes") != sizes:
        return None
    size = line.get("size")
    if not is_int(size) or isinstance(line.get("rank"), bool):
        return None
    if line.get("stage") == "rendezvous" and size == 0:
        return (1, 0)
    if line.get("stage") == "sweep" and 1 <= size <= sizes:
        return (2, size)
    return None


def _protocol_failure(why: str, tail: Optional[str] = None) -> dict:
    return {"ok": False, "kind": "protocol", "stage": "report", "ranks": [], "tail": tail,
            "error": f"the all-reduce worker's report is not what preflight's worker writes: {why}"}


def _stderr(proc) -> Optional[str]:
    try:
        return proc.stderr_tail(TAIL_CHARS) or None
    except Exception:
        return None


# --- the phase ----------------------------------------------------------------------------------

def _torch_missing(node) -> bool:
    versions = ((node.facts or {}).get("packages") or {}).get("versions")
    return isinstance(versions, dict) and not versions.get("torch")


def run_collective(nodes, head_address: str, options, paths: Optional[dict] = None) -> dict:
    """The all-reduce phase over gather's NodeStates (the first is the head); options: GatherOptions with
    .collective set; paths: the data-path probe's document, when it ran (what it found broken names the nodes
    of a failed run at once: preflight.collective.datapath). Returns the document COL001/COL002 read."""
    col: CollectiveOptions = options.collective
    reached = [n for n in nodes if n.error is None and n.connection is not None and n.facts is not None]
    backend = choose_backend(col.backend, [n.facts for n in reached])
    procs = local_processes(col, backend, [n.facts for n in reached])
    phase = _Phase(nodes, head_address, options, backend, procs)
    head = nodes[0].name
    doc = {"backend": backend, "procs_per_node": procs, "port": phase.port, "sizes": list(col.sizes),
           "timeout_s": options.timeout, "deadline_s": options.timeout + PHASE_MARGIN_S,
           "min_busbw_gbps": col.min_busbw_gbps, "head": head, "python": options.python,
           "nodes": [n.name for n in nodes], "untested": {}, "blamed": {}, "passed": [], "cleared": [],
           "result": None, "bisect": None, "clash": None, "runs": phase.runs}
    for node in nodes:
        if node not in reached:
            reason = node.error.message if node.error is not None else "no facts"
            doc["untested"][node.name] = f"not reached: {reason}"
    for node in reached:
        if _torch_missing(node):
            doc["blamed"][node.name] = {"kind": "import", "stage": "import", "tail": None,
                                        "error": f"cannot import torch: no torch distribution is installed for "
                                                 f"{options.python}"}
    group = [n.name for n in reached if n.name not in doc["blamed"]]
    broken = datapath.broken(paths, {n.name: n.facts or {} for n in reached})
    try:
        _drive(phase, doc, group, head, broken)
    finally:
        doc["duration_s"] = round(time.monotonic() - phase.started, 3)
    return doc


def _drive(phase: _Phase, doc: dict, group: List[str], head: str, broken: Optional[Dict[str, dict]] = None) -> None:
    """The runs, reruns and bisects of the phase; broken: the nodes the data-path probes named
    (datapath.broken), which a failed run that names nobody blames without a pairwise run or a bisect."""
    col = phase.col
    if head not in group:
        for name in group:
            doc["untested"][name] = f"the head {head} cannot take part, so no group can meet"
        return
    total = phase.left()
    run = None
    for attempt in range(1 + MAX_RERUNS):
        if len(group) < 2 and attempt > 0:
            for name in group:
                doc["untested"][name] = "no other node left to test with"
            return
        budget = max(MIN_RUN_S, FULL_SHARE * total) if attempt == 0 else phase.left()
        if phase.left() < MIN_RUN_S:
            for name in group:
                doc["untested"][name] = "no time left for another run (raise --timeout)"
            return
        run = phase.run(group, budget, col.sizes, "full" if attempt == 0 else "without " + ", ".join(
            sorted(set(doc["nodes"]) - set(group))))
        if run["ok"]:
            break
        if run["clash"]:  # the port is not this run's: no node is at fault, and no rerun can tell more
            _clashed(phase, doc, group)
            return
        blamed = diagnose(run, head)
        if not blamed:
            break
        doc["blamed"].update(blamed)
        if head in blamed:
            for name in group:
                if name not in doc["blamed"]:
                    doc["untested"][name] = f"the head {head} failed, so no group can meet"
            return
        group = [n for n in group if n not in blamed]
    else:
        for name in group:
            doc["untested"][name] = "still failing after reruns without the nodes at fault"
        return
    if run["ok"]:
        doc["pairwise"] = run.get("pairwise")
        doc["passed"] = list(group)
        doc["result"] = {"nodes": list(group), "world_size": run["world_size"], **run["figures"]} \
            if run["figures"] else {"nodes": list(group), "world_size": run["world_size"], "bytes": None,
                                    "algbw_gbps": None, "busbw_gbps": None, "per_size": []}
        doc["result"]["skipped_sizes"] = run["skipped_sizes"]
        doc["result"]["sum_check"] = run.get("sum_check")
        doc["result"]["nccl"] = nccl_transport(run)
        slow = (col.min_busbw_gbps is not None and run["figures"] is not None and run["world_size"] > 1
                and run["figures"]["busbw_gbps"] < col.min_busbw_gbps)
        doc["result"]["below_threshold"] = bool(slow)
        if slow and len(group) > 1:
            size = run["figures"]["bytes"]
            doc["bisect"] = dict(reason="slow", **_bisect(phase, group, head, [size],
                                                          lambda r: not r["ok"] or r["figures"] is None or
                                                          r["figures"]["bytes"] < size or
                                                          r["figures"]["busbw_gbps"] < col.min_busbw_gbps))
            if phase.clash:  # another run took the port half-way: the bisect's figures say nothing
                doc["bisect"] = None
                doc["clash"] = phase.clash
        return
    if all(still_importing(run["reports"][n]) for n in group):
        for name in group:
            doc["untested"][name] = (f"the time ran out while torch was being imported on every node "
                                     f"({run['budget_s']} s): raise --timeout")
        return
    # Failed, and the reports name nobody: a hang after meeting, or wrong values. Bisect on the smallest size.
    summary = _run_summary(run)
    doc["failed_run"] = summary
    if len(group) < 2:
        doc["blamed"].update({n: {"kind": "failed", "stage": summary["stage"], "error": summary["error"],
                                  "tail": _tail_of(run["reports"].get(n))} for n in group})
        return
    if _paths_named(doc, group, summary, run, broken or {}) or _links_named(phase, doc, group, summary, run):
        return
    doc["bisect"] = dict(reason="failed", **_bisect(phase, group, head, [min(col.sizes)], lambda r: not r["ok"]))
    if phase.clash:
        doc["bisect"] = None
        _clashed(phase, doc, group)
        return
    suspects = doc["bisect"]["suspects"]
    for name in group:
        if name in suspects:
            doc["blamed"][name] = {"kind": "bisect", "stage": summary["stage"], "error": summary["error"],
                                   "tail": _tail_of(run["reports"].get(name)), "suspects": suspects}
        else:
            doc["cleared"].append(name)  # passed the bisect with the head


def _paths_named(doc: dict, group: List[str], summary: dict, failed: dict, broken: Dict[str, dict]) -> bool:
    """After a failed run that names nobody: the nodes of the group the data-path probes found broken, as they
    name them (a node's own route or firewall names it alone, a broken pair its two ends), are blamed and the
    others cleared (True: neither a pairwise run nor a bisect finds them again); False when they name none."""
    named = {n: found for n, found in broken.items() if n in group}
    if not named:
        return False
    if (failed.get("pairwise") or {}).get("pairs_measured"):
        doc["pairwise"] = failed["pairwise"]  # measured by the run's own workers: COL004 shows it
    for name in group:
        if name in named:
            doc["blamed"][name] = dict(named[name], kind="path", stage=summary["stage"], error=summary["error"],
                                       tail=_tail_of(failed["reports"].get(name)))
        else:
            doc["cleared"].append(name)  # reached every peer it probed, and no probe names it
    return True


def _links_named(phase: _Phase, doc: dict, group: List[str], summary: dict, failed: dict) -> bool:
    """After a failed run that names nobody: the pairs its workers measured at the rendezvous, else (none
    measured) the pairwise phase alone, in PAIR_SHARE of the time left. When the matrix names failed links or a
    node that fails with every peer, those nodes are blamed and the others cleared (True: no bisect is
    needed); else the bisect follows (False)."""
    found = failed.get("pairwise")
    if not found or not found["pairs_measured"]:
        if phase.left() < MIN_RUN_S:
            return False
        run = phase.run(list(group), max(MIN_RUN_S, PAIR_SHARE * phase.left()), [], "pairwise")
        if run.get("clash") or not run.get("pairwise"):
            return False
        found = run["pairwise"]
    doc["pairwise"] = found
    said = pairwise.findings(found)
    links = {}
    for a, b, why in said["failed_links"]:
        links.setdefault(a, []).append([b, why])
        links.setdefault(b, []).append([a, why])
    rows = said["failed_rows"]
    if not rows and not links:
        return False
    for name in group:
        if name in rows:
            doc["blamed"][name] = {"kind": "link-row", "stage": summary["stage"], "error": summary["error"],
                                   "tail": _tail_of(failed["reports"].get(name)), "peers": [
                                       n for n in group if n != name]}
        elif name in links:
            doc["blamed"][name] = {"kind": "link", "stage": summary["stage"], "error": summary["error"],
                                   "tail": _tail_of(failed["reports"].get(name)), "links": links[name]}
        else:
            doc["cleared"].append(name)  # passed with every peer it met in pairs
    return True


def nccl_transport(run: dict) -> Dict[str, dict]:
    """{node: what NCCL says it chose (preflight.collective.nccllog.summary) and "debug", the user's NCCL_DEBUG when
    theirs} from each node's local rank 0 (with nccl; {} with gloo)."""
    chosen = {}
    for name in run["nodes"]:
        nccl = next(iter(run["reports"][name].get("ranks") or []), {}).get("nccl")
        if nccl:
            chosen[name] = dict(nccllog.summary("\n".join(nccl["lines"])), debug=nccl.get("debug"))
    return chosen


def _clashed(phase: _Phase, doc: dict, group: List[str]) -> None:
    doc["clash"] = phase.clash
    for name in group:
        doc["untested"][name] = f"the rendezvous port {phase.port} was not this run's (port clash)"


def _bisect(phase: _Phase, group: List[str], head: str, sizes: List[int], bad: Callable[[dict], bool]) -> dict:
    workers = [n for n in group if n != head]
    planned = max(2, 2 * math.ceil(math.log2(max(2, len(workers)))))

    def test(members: List[str]) -> dict:
        remaining = phase.left()
        budget = max(MIN_RUN_S, remaining / max(1, planned - len(tests_done)))
        run = phase.run([head] + members, min(budget, remaining), sizes, "bisect")
        tests_done.append(run)
        figs = run["figures"] or {}
        return {"bad": bad(run), "ok": run["ok"], "busbw_gbps": figs.get("busbw_gbps"),
                "algbw_gbps": figs.get("algbw_gbps"), "bytes": figs.get("bytes"), "elapsed_s": run["elapsed_s"],
                "failure": None if run["ok"] else _run_summary(run)["error"]}

    tests_done: List[dict] = []
    return bisect(head, workers, test, lambda: phase.left() >= MIN_RUN_S and not phase.clash)


def _tail_of(report: Optional[dict]) -> Optional[str]:
    if not report:
        return None
    tails = [r.get("tail") for r in failed_ranks(report) if r.get("tail")]
    return (tails[0] if tails else report.get("tail")) or None


def _run_summary(run: dict) -> dict:
    """The first failure of a run, for messages: stage and error."""
    for name in run["nodes"]:
        report = run["reports"][name]
        for rank in failed_ranks(report):
            if rank.get("kind") != "aborted":
                return {"node": name, "stage": rank.get("stage"), "kind": rank.get("kind"), "error": rank.get("error")}
        if report.get("kind") not in (None, "aborted"):
            return {"node": name, "stage": report.get("stage"), "kind": report.get("kind"),
                    "error": report.get("error")}
    return {"node": None, "stage": None, "kind": None, "error": "failed"}
