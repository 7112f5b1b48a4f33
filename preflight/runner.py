"""Running selected checks over a plan: every check yields Results, none can kill the run."""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from preflight.node.collector import SECTION_FAILED
from preflight.inputs.documents import one_line
from preflight.registry import CheckSpec
from preflight.result import Finding, Result, Status, finding_key

SECTION_FAILED_PREFIX = SECTION_FAILED.split("%s")[0]


def is_failed(section: Any) -> bool:
    """Whether a facts section is the collector's word that it failed on the node (or was not of its shape)."""
    error = section.get("error") if isinstance(section, dict) else None  # (JSON: only a text can be the collector's)
    return isinstance(error, str) and error.startswith(SECTION_FAILED_PREFIX)


@dataclass(frozen=True)
class CheckContext:
    """What a check may look at. Checks do no I/O: everything is gathered before they run.

    facts: node name -> {"facts": collector document or None, "error": why the node could not be
    reached or None, "clock": {"offset_s", "bound_s", "rtt_s"} against this machine}.
    A node-scope check runs once per reachable node, with `node` set.
    """

    plan: Any
    facts: Mapping[str, Any] = field(default_factory=dict)
    probes: Mapping[str, Any] = field(default_factory=dict)
    node: Optional[str] = None

    @functools.cached_property  # read a dozen times by each of the checks on a node
    def fact(self) -> Mapping[str, Any]:
        """The facts document of `node`."""
        return self.facts[self.node]["facts"]

    @functools.cached_property  # (set in the instance's __dict__: a frozen dataclass allows it)
    def on_node(self) -> Dict[str, Optional["CheckContext"]]:
        """node -> this context for that node, None where the gathering could not use the node: made once per run
        for every node check, not once per check and node."""
        return {node: CheckContext(self.plan, self.facts, self.probes, node)
                if state.get("error") is None and state.get("facts") else None for node, state in self.facts.items()}

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """compute(), once per context and key: what several checks derive from a node's facts (its GPUs as the job
        selects them) is derived once per node. Checks do not change facts, so a node's context keeps its answer."""
        memos = self.__dict__.setdefault("_memos", {})
        if key not in memos:
            memos[key] = compute()
        return memos[key]

    @property
    def reachable(self) -> list:
        """The nodes the gathering could use (a new list each time: a check may change it)."""
        return [node for node, on_node in self.on_node.items() if on_node is not None]


class UndeclaredRead(Exception):
    """A check that declares the facts sections it reads (registry.check's `reads`) read another: a defect of
    the check, reported as its error."""


class DeclaredFacts(dict):
    """A node's facts as a check that declares what it reads sees them: those sections (of a section declared by
    its keys, `host.machine`, those keys), and UndeclaredRead for anything else (what it did not declare would
    be read as missing, silently)."""

    __slots__ = ("check", "declared", "where", "full")

    def __init__(self, check: str, doc: Mapping, declared: Mapping[str, Optional[Tuple[str, ...]]], where: str = ""):
        super().__init__((name, _declared_value(check, dict.__getitem__(doc, name), keys, f"{where}{name}."))
                         for name, keys in declared.items() if name in doc)
        self.check, self.declared, self.where, self.full = check, declared, where, bool(doc)

    def __bool__(self):  # `facts.get("env") or {}`: whether it holds anything (section_identity counts it)
        return self.full

    def _declared(self, key):
        if key not in self.declared:
            raise UndeclaredRead(f"{self.check} read {self.where}{key} of the facts, which its `reads` does not name")

    def __getitem__(self, key):
        self._declared(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._declared(key)
        return dict.get(self, key, default)

    def __contains__(self, key):
        self._declared(key)
        return dict.__contains__(self, key)

    def _whole(self, *_):
        raise UndeclaredRead(f"{self.check} read all of {self.where.rstrip('.') or 'the facts'}, not only what its "
                             f"`reads` names")

    keys = items = values = copy = __iter__ = __len__ = _whole


def _declared_value(check: str, value: Any, keys: Optional[Tuple[str, ...]], where: str) -> Any:
    if keys is None or type(value) is not dict:
        return value
    return DeclaredFacts(check, value, dict.fromkeys(keys), where)


def section_identity(value: Any, keys: Optional[Tuple[str, ...]]) -> Any:
    """What a check that declares a section (or these keys of it) reads of its value: a whole section as the object
    itself (its id: the gathering shares identical sections among nodes, and checks do not change facts, so the
    same id is the same value), a declared key of a section by its value (a node's own section, such as host, is
    never shared)."""
    if keys is None or type(value) is not dict:
        return id(value)
    return (bool(value), *[_value_identity(dict.get(value, key, _ABSENT)) for key in keys])


SCALARS = (str, int, bool, type(None))


def _value_identity(value: Any) -> Any:
    """A value as a key equal only for the same value of the same type (1, 1.0, True and "1" apart; a float by
    its repr: -0.0 is not 0.0); a list of scalars by its items; anything else by the object itself."""
    kind = type(value)
    if kind in SCALARS:
        return kind, value
    if kind is float:
        return kind, repr(value)
    if kind is list and len(value) <= 64 and all(type(item) in SCALARS for item in value):
        return kind, tuple((type(item), item) for item in value)
    return id(value)


_ABSENT = object()  # what the node did not send (not the same as what it sent as null)


class DeclaredContext:
    """A node's CheckContext for a check that declares the facts sections it reads: `fact` holds those alone, and
    whether the check also read what is the node's own (its name, every node's facts, the probes) is kept in
    `own`: findings made without them hold for any node whose sections are the same."""

    def __init__(self, ctx: CheckContext, check: str, declared: Mapping[str, Optional[Tuple[str, ...]]]):
        self._ctx, self.plan, self.own = ctx, ctx.plan, False
        self.fact = DeclaredFacts(check, ctx.fact, declared)
        self._memos: Dict[Any, Any] = {}

    def _owned(self, name: str):
        self.own = True
        return getattr(self._ctx, name)

    node = property(lambda self: self._owned("node"))
    facts = property(lambda self: self._owned("facts"))
    probes = property(lambda self: self._owned("probes"))
    on_node = property(lambda self: self._owned("on_node"))
    reachable = property(lambda self: self._owned("reachable"))

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """As CheckContext.memo, computed through this view (what it reads is declared, or owned, too)."""
        if key not in self._memos:
            self._memos[key] = compute()
        return self._memos[key]


def declared_context(spec: CheckSpec, ctx: CheckContext):
    """The context a node check runs in on ctx's node: a DeclaredContext where it declares what it reads and the
    node's facts are as decoded (a node with a failed section keeps its NodeFacts, which report it)."""
    if spec.reads is None or type(ctx.fact) is not dict:
        return ctx
    return DeclaredContext(ctx, spec.id, spec.paths)


class SectionFailed(Exception):
    """A check read a section of a node's facts that failed on the node: it cannot be evaluated there."""

    def __init__(self, node: str, section: str, error: str):
        super().__init__(error)
        self.node, self.section, self.error = node, section, error


class NodeFacts(dict):
    """A node's facts document whose sections that failed on the node ({"error": "collector section NAME failed
    on the node: ..."}) raise SectionFailed when a check reads them, instead of being read as values (a failed
    host section read as "hostname None does not resolve"). PKG003 reports the failure itself."""

    __slots__ = ("node",)

    def __init__(self, node: str, doc: Mapping):
        super().__init__(doc)
        self.node = node

    def _checked(self, key, value):
        if is_failed(value):
            raise SectionFailed(self.node, key, value["error"])
        return value

    def __getitem__(self, key):
        return self._checked(key, dict.__getitem__(self, key))

    def get(self, key, default=None):
        return self._checked(key, dict.get(self, key, default))


def failed_sections(doc: Mapping) -> List[str]:
    """The errors of the sections of a facts document that failed on the node."""
    return [v["error"] for v in dict.values(doc) if is_failed(v)]


def guarded(ctx: CheckContext) -> CheckContext:
    """ctx, with the facts of every node that has a failed section as NodeFacts (the others untouched: free
    when nothing failed)."""
    hit = {n for n, s in ctx.facts.items() if isinstance(s.get("facts"), dict) and failed_sections(s["facts"])}
    if not hit:
        return ctx
    facts = {n: dict(s, facts=NodeFacts(n, s["facts"])) if n in hit else s for n, s in ctx.facts.items()}
    return CheckContext(plan=ctx.plan, facts=facts, probes=ctx.probes, node=ctx.node)


# The check that reports a node the gathering could not use: a failure there, a skip everywhere else. Every
# kind not named here (the transport's, srun's, a protocol error) is SSH001's; "budget" is an error everywhere.
NODE_ERROR_CHECK = {"python-missing": "PKG003", "collector": "PKG003", "budget": None}


def node_error_check(kind: Optional[str]) -> Optional[str]:
    return NODE_ERROR_CHECK.get(kind, "SSH001")


def cause_of(ctx: "CheckContext", node: str) -> Optional[str]:
    """The check that reports why `node`'s facts are missing: a skip for that reason names it as `blocked_by`."""
    return node_error_check(((ctx.facts.get(node) or {}).get("error") or {}).get("kind"))


def run_check(spec: CheckSpec, ctx: CheckContext) -> List[Result]:
    """The check's Results, a node check's one per node and finding (`run` records them grouped)."""
    if spec.scope == "node":
        return [r for node in ctx.facts for r in _run_on_node(spec, ctx, node)]
    return _run(spec, ctx)


def _run_grouped(spec: CheckSpec, ctx: CheckContext) -> List[Result]:
    """A node check's Results on every node as `run` records them: its findings grouped as `grouped` groups
    run_check's Results (in the order first found, each naming its nodes in ctx's order), without making a Result
    per node and finding first (16,384 nodes x every node check). A check that declares the sections it reads is
    evaluated once per distinct set of them (the gathering shares identical sections among nodes), unless what it
    found was the node's own (DeclaredContext.own)."""
    names = list(ctx.on_node)
    found: Dict[tuple, list] = {}  # finding_key -> [(first node, position, the nodes, finding, its duration)]
    for indices, keyed in _evaluations(spec, ctx, names):
        for position, (f, key, duration) in enumerate(keyed):
            found.setdefault(key, []).append((indices[0], position, indices, f, duration))
    results = []
    # A finding's first node and position set its place (no two of its entries share them: their nodes are never
    # compared), as the per-node loop of run_check would first find it.
    for (_, _, indices, r, _), entries in sorted((min(entries), entries) for entries in found.values()):
        if len(entries) == 1 and not r.nodes:  # nearly every finding: one evaluation's, on the nodes it stands for
            nodes = tuple(map(names.__getitem__, indices))
        elif not any(e[3].nodes for e in entries):  # several evaluations': their nodes in ctx's order
            nodes = tuple(dict.fromkeys(map(names.__getitem__, sorted(i for e in entries for i in e[2]))))
        else:  # each node as run_check gives it: the nodes the finding names, else its own
            each = sorted((i, p, tuple(f.nodes) or (names[i],)) for _, p, indices, f, _ in entries for i in indices)
            nodes = each[0][2] if len(each) == 1 else tuple(dict.fromkeys(n for _, _, named in each for n in named))
        results.append(Result(spec.id, spec.name, r.status, nodes, r.message, r.remediation, dict(r.evidence),
                              sum(e[4] for e in entries)))
    return results


def _evaluations(spec: CheckSpec, ctx: CheckContext, names: List[str]) -> Iterable[Tuple[List[int], list]]:
    """Each evaluation of a node check: the nodes it stands for (indices into `names`, ascending) and what it
    found, as [(finding, finding_key, seconds)]."""
    for sections, indices in _parts(spec, ctx):
        for start, i in enumerate(indices):
            on_node = ctx.on_node[names[i]]
            if on_node is None:
                yield [i], [(r, finding_key(r), r.duration_s) for r in _run_on_node(spec, ctx, names[i])]
                continue
            view = DeclaredContext(on_node, spec.id, spec.paths) if sections is not None else on_node
            findings, each = _findings(spec, view)
            keyed = [(f, finding_key(f), each) for f in map(_recorded, findings)]
            if sections is not None and not view.own:  # it holds for every node with the same sections
                yield indices[start:], keyed
                break
            yield [i], keyed


def _parts(spec: CheckSpec, ctx: CheckContext) -> List[Tuple[Optional[tuple], List[int]]]:
    """ctx.on_node's nodes (by index) in parts that one evaluation may stand for: those with the same declared
    sections (section_identity), and each node the check is evaluated on alone (None): one the gathering could
    not use, one whose facts are not as decoded, every node of a check that does not declare its reads. Made once
    per run (ctx.memo) for each set of declared sections, from each section's identities on every node, also made
    once: not once per check and node (16,384 nodes x 25 checks)."""
    docs, numbers = ctx.memo(_parts, lambda: (
        [on_node.fact if on_node is not None and type(on_node.fact) is dict else None  # None: a node evaluated alone
         for on_node in ctx.on_node.values()], list(range(len(ctx.on_node)))))  # (one int per node, in every part)
    if spec.reads is None:
        return [(None, [i]) for i in numbers]

    def column(section: str, keys: Optional[Tuple[str, ...]]) -> list:
        """Each node's section_identity as a small number, the same for the same identity (kept for the run)."""
        values = [dict.get(doc, section, _ABSENT) if doc is not None else None for doc in docs]
        known: Dict[int, Any] = {}  # a section that nodes share: the identity of its keys worked out once
        identities = map(id, values) if keys is None else (
            known[id(v)] if id(v) in known else known.setdefault(id(v), section_identity(v, keys)) for v in values)
        classes: Dict[Any, int] = {}
        return [classes.setdefault(identity, len(classes)) for identity in identities]

    def parts() -> List[Tuple[Optional[tuple], List[int]]]:
        columns = [ctx.memo((section_identity, *path), lambda path=path: column(*path)) for path in spec.paths.items()]
        usable = [doc is not None for doc in docs]
        shared: Dict[tuple, List[int]] = {}
        for i, identity in compress(zip(numbers, zip(*columns) if columns else repeat(())), usable):
            part = shared.get(identity)
            if part is None:
                shared[identity] = [i]
            else:
                part.append(i)
        return [*shared.items(), *((None, [i]) for i, ok in zip(numbers, usable) if not ok)]
    return ctx.memo((_parts, tuple(spec.paths.items())), parts)


def _run_on_node(spec: CheckSpec, ctx: CheckContext, node: str) -> List[Result]:
    on_node = ctx.on_node[node]
    if on_node is None:
        error = ctx.facts[node].get("error") or {}
        if error.get("kind") == "budget":  # a deadline, not "not applicable": never silently a pass
            return [Result(spec.id, spec.name, Status.ERROR, (node,), f"not evaluated: {error['message']}",
                           error.get("remediation"), {}, 0.0)]
        return [_not_checked(spec, node, error)]
    return _run(spec, declared_context(spec, on_node), (node,))


def _not_checked(spec: CheckSpec, node: str, error: Mapping) -> Result:
    """A check skipped on a node the gathering could not use; `blocked_by` names the check that reports why."""
    return Result(spec.id, spec.name, Status.SKIP, (node,), f"node not checked: {error.get('message', 'no facts')}",
                  None, {"blocked_by": node_error_check(error.get("kind"))}, 0.0)


def _set_aside(exc: SectionFailed, ctx: CheckContext) -> Tuple[Dict[str, str], Optional[CheckContext]]:
    """The nodes a check that read a failed section cannot be evaluated on (node -> why), and the context to
    run it again in without them (None: nothing else to evaluate, as for a node check on its own node). A
    cluster check reads a section on every node: every node whose same section failed is set aside at once,
    so a check runs once more per failed section, never once per node."""
    failed = {exc.node: exc.error}
    if exc.node == ctx.node or exc.node not in ctx.facts or ctx.facts[exc.node].get("error") is not None:
        return failed, None
    if ctx.node is None:
        for node, state in ctx.facts.items():
            section = dict.get(state.get("facts") or {}, exc.section) if state.get("error") is None else None
            if is_failed(section):
                failed[node] = section["error"]
    unusable = {node: {"facts": None, "clock": None, "error": {"kind": "collector", "message": error,
                                                               "remediation": None}} for node, error in failed.items()}
    return failed, CheckContext(plan=ctx.plan, facts={**ctx.facts, **unusable}, probes=ctx.probes, node=ctx.node)


def _run(spec: CheckSpec, ctx: CheckContext, nodes: tuple = ()) -> List[Result]:
    """The check's Results; `nodes` for those whose finding names none (a node check's own node). A node check
    in the context of no node runs on every node, its Results grouped (_run_grouped): what `run` records."""
    if spec.scope == "node" and ctx.node is None:
        return _run_grouped(spec, ctx)
    findings, each = _findings(spec, ctx)
    return [Result(spec.id, spec.name, f.status, tuple(f.nodes) or nodes, f.message, f.remediation, dict(f.evidence),
                   each) for f in map(_recorded, findings)]


def _recorded(f: Finding) -> Finding:
    """A Finding as a Result records it. Messages quote what users wrote (keys, paths): one_line keeps each on one
    printable line."""
    message = one_line(f.message)
    remediation = one_line(f.remediation) if f.remediation is not None else None
    if message is f.message and remediation is f.remediation:  # most: nothing to escape, no copy
        return f
    return Finding(f.status, message, remediation, f.nodes, f.evidence)


def _findings(spec: CheckSpec, ctx: CheckContext) -> Tuple[List[Finding], float]:
    """What the check found in ctx (a broken check's error, the nodes it could not be evaluated on, a pass when
    it found nothing), and the seconds it took per finding."""
    started = time.perf_counter()
    set_aside: List[Finding] = []  # the nodes whose failed section the check read
    while True:
        try:
            findings = list(spec.func(ctx) or ())
            for finding in findings:
                if not isinstance(finding, Finding):
                    raise TypeError(f"yielded {type(finding).__name__}, expected a Finding")
        except SectionFailed as exc:
            findings = []
            failed, without = _set_aside(exc, ctx)
            set_aside += [Finding(Status.ERROR, f"not evaluated on {node}: {error}", "PKG003 reports the section that "
                                  "failed: fix what it names on the node (or report it as a defect of preflight)",
                                  nodes=(node,)) for node, error in failed.items()]
            if without is not None:
                ctx = without
                continue
        except Exception as exc:  # a broken check becomes an error result, never a crash
            findings = [
                Finding(
                    Status.ERROR,
                    f"check {spec.id} raised {type(exc).__name__}: {exc}",
                    "this is a defect in the check; report it with the input that triggered it",
                )
            ]
        break
    findings = set_aside + findings or [_nothing_found(spec, ctx)]
    return findings, (time.perf_counter() - started) / len(findings)


NO_PROBLEM = Finding(Status.PASS, "no problem found")
NO_NODE = Finding(Status.SKIP, "no node was reached: nothing to check (a pass needs evidence)")


def _nothing_found(spec: CheckSpec, ctx: CheckContext) -> Finding:
    """What a check that found nothing says: a pass, unless it is a cluster check that had no node to look at."""
    if spec.scope == "cluster" and ctx.facts and not ctx.reachable:
        return NO_NODE
    return NO_PROBLEM


def run(specs: Iterable[CheckSpec], ctx: CheckContext, deadline: Optional[float] = None,
        budget_s: Optional[float] = None) -> List[Result]:
    """Every check in turn. With a deadline (time.monotonic()), each check gets what is left of it, and a
    check that does not fit is skipped with the reason "budget of S s spent" (never an overrun)."""
    results: List[Result] = []
    specs = list(specs)
    ctx = guarded(ctx)
    for spec in specs:
        if deadline is None:
            results.extend(_run(spec, ctx))
        else:
            results.extend(_run_bounded(spec, ctx, deadline, budget_s))
    return unhidden(results, specs, ctx)


def grouped(results: Iterable[Result]) -> List[Result]:
    """The same finding of a check on several nodes as one Result naming them all, in the order first found
    (its duration the sum of theirs): a node check over 4,096 nodes says "pass" once, not once a node, and
    every result costs the reports. Results that differ in status, message, fix or evidence stay apart."""
    groups: Dict[tuple, list] = {}
    for r in results:
        key = (r.id, finding_key(r))
        group = groups.get(key)
        if group is None:
            groups[key] = [r, list(r.nodes), r.duration_s, 1]
        else:
            group[1] += r.nodes
            group[2] += r.duration_s
            group[3] += 1
    return [r if count == 1 else Result(r.id, r.name, r.status, tuple(dict.fromkeys(nodes)), r.message, r.remediation,
                                        r.evidence, duration)
            for r, nodes, duration, count in groups.values()]


def unhidden(results: List[Result], specs: List[CheckSpec], ctx: CheckContext) -> List[Result]:
    """A skip must not hide a failure that no selected check reports (`--only COL` with the head's port
    dropped: COL skips "see NET004", and NET004 did not run). A skip whose evidence names the check that
    reports its cause (`blocked_by`) stays a skip only when that check failed (or errored, or skipped for a
    cause that is itself reported); otherwise it becomes an error. And a node the gathering could not use,
    that no failure or error names, is an error of each selected cluster check that did not mention it."""
    blocked = [i for i, r in enumerate(results) if r.status is Status.SKIP and r.evidence.get("blocked_by")]
    unusable = {n: s.get("error") or {} for n, s in ctx.facts.items() if s.get("error") is not None or not s.get("facts")}
    if not blocked and not unusable:
        return results
    reported = {r.id for r in results if r.status in (Status.FAIL, Status.ERROR)}
    covered: set = set()
    changed = True
    while changed:  # a chain (COL002 -> COL001 -> NET004) is covered when its end is reported
        changed = False
        for i in blocked:
            if i not in covered and results[i].evidence["blocked_by"] in reported:
                covered.add(i)
                reported.add(results[i].id)
                changed = True
    ran = {s.id for s in specs}
    out = list(results)
    for i in blocked:
        if i not in covered:
            r = results[i]
            cause = r.evidence["blocked_by"]
            why = "was not selected" if cause not in ran else "does not report it"
            fixes = {(unusable.get(n) or {}).get("remediation") for n in r.nodes}  # the nodes' own, when one
            fix = (fixes.pop() if len(fixes) == 1 else None) or r.remediation or \
                f"run with {cause} selected (`--only {cause}`) for the cause and its fix"
            said = "" if cause == r.id else f" ({cause}, which reports the cause, {why})"
            out[i] = Result(r.id, r.name, Status.ERROR, r.nodes, f"not evaluated: {r.message}{said}", fix,
                            r.evidence, r.duration_s)
    named = {n for r in out if r.status in (Status.FAIL, Status.ERROR) for n in r.nodes}
    silent = [n for n in unusable if n not in named]
    if silent:
        mentioned: dict = {}
        for r in out:
            mentioned.setdefault(r.id, set()).update(r.nodes)
        for spec in specs:
            if spec.scope != "cluster":
                continue
            for node in silent:
                if node not in mentioned.get(spec.id, ()):
                    error, cause = unusable[node], node_error_check(unusable[node].get("kind"))
                    said = f" ({cause}, which reports it, was not selected)" if cause and cause not in ran else ""
                    out.append(Result(spec.id, spec.name, Status.ERROR, (node,), f"not evaluated on this node: "
                                      f"{error.get('message', 'no facts')}{said}", error.get("remediation"),
                                      {"blocked_by": cause} if cause else {}, 0.0))
    return out


def budget_skips(spec: CheckSpec, ctx: CheckContext, budget_s: Optional[float]) -> List[Result]:
    """The skip results of a check that the time budget has no room for."""
    message = f"budget of {budget_s:g} s spent" if budget_s is not None else "time budget spent"
    if spec.scope != "node" or not ctx.facts:
        return [Result(spec.id, spec.name, Status.SKIP, (), message, None, {}, 0.0)]
    results = []
    for node, state in ctx.facts.items():
        error = state.get("error") or {}
        if error.get("kind") == "budget":  # its facts never came: a deadline, never silently a pass
            results.extend(_run_on_node(spec, ctx, node))
        else:
            results.append(Result(spec.id, spec.name, Status.SKIP, (node,), message, None, {}, 0.0))
    return results


def _run_bounded(spec: CheckSpec, ctx: CheckContext, deadline: float, budget_s: Optional[float]) -> List[Result]:
    left = deadline - time.monotonic()
    if left <= 0:
        return grouped(budget_skips(spec, ctx, budget_s))
    box: dict = {}

    def target() -> None:
        box["results"] = _run(spec, ctx)  # never raises

    thread = threading.Thread(target=target, name=f"check-{spec.id}", daemon=True)
    thread.start()
    thread.join(left)
    if thread.is_alive() or "results" not in box:  # abandoned: a check does no I/O, it cannot hold anything
        return grouped(budget_skips(spec, ctx, budget_s))
    return box["results"]
