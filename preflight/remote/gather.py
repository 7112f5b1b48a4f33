"""Facts from every node, in parallel, then the coordinated probes: what the checks read.

Each node runs one agent process (preflight.node.agent) for the whole run: it sends its facts, then
answers the probes' requests (clock samples, the main port, the shared folder). Every step has a
deadline: the program's start, its facts and the clock samples share one (--timeout), each probe
request has its own. A node's answers are never trusted: one that is late, of the wrong shape, not
JSON or nested too deeply is that node's failure, with the reason, and the others go on. Connections
and agents are closed at the end, also on Ctrl-C, which removes the temporary listener.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

from preflight import progress
from preflight.inputs.launchcmd import DEFAULT_PORT
from preflight.inputs.numbers import bounded_json_int, finite_json_float, refused_json_constant
from preflight.job.nccl import socket_interface
from preflight.node import agent, collector, launchfiles, paths
from preflight.runner import is_failed
from preflight.remote.shapes import (FILE, NONE, NUMBER, PATHS_OPEN, PATHS_PROBE, SECTIONS, kind as _kind, problem,
                                     typed as _typed)
from preflight.remote import openssh, transport
from preflight.remote.shipping import AGENT, shipped_command, shipped_input
from preflight.remote.ssh import load_ssh_settings
from preflight.remote.session import NodeError, run_with_deadline

CLOCK_SAMPLES = 8


@dataclass
class GatherOptions:
    python: str
    timeout: float = 30.0
    fanout: int = 64
    ssh_config: Optional[str] = None
    accept_new: bool = False
    ssh_client: Optional[str] = None  # "openssh" or "paramiko" (--ssh); None: transport.client's choice
    port: int = DEFAULT_PORT
    main_address: Optional[str] = None  # main_process_ip from the config: what workers connect to
    paths: Dict[str, str] = field(default_factory=dict)  # name -> path whose space each node reports
    shared_dir: Optional[str] = None  # a folder every node should see the same (a shared filesystem)
    ntp_server: Optional[str] = None
    progress: object = True  # a preflight.progress.Progress; True: its plain lines only, False: nothing
    # The all-reduce (COL), a probe over the nodes' open sessions after the port probe: an object with a port (None:
    # the main port) and run(nodes, head_address, options, paths: probes["paths"] or None) -> probes["collective"]
    # (collective.CollectiveOptions).
    collective: Optional[object] = None
    transport: str = "ssh"  # a name of preflight.remote.transport: "srun" runs job steps inside a SLURM allocation
    job: Optional[dict] = None  # what each node's launch would read (preflight.node.launchfiles.facts; job.view.request)
    job_files: Optional[Callable[[dict], List[str]]] = None  # the files a node's own config names (job.view.named_files)
    # the main port the head's own launch files set ({head: its facts} -> port), where the plan names none
    job_port: Optional[Callable[[dict], Optional[int]]] = None
    slurm_job: Optional[str] = None  # srun into this job from outside it (`doctor --slurm-job`)
    census: Optional[dict] = None  # `doctor`: the census of the running job (preflight.node.census); no probes then
    data_paths: bool = True  # the probes between every pair of nodes (NET007-NET011): routes, names, ports, path MTU
    early: Optional[object] = None  # the first nodes' sessions, begun before the plan was built (remote.early)


BY_HAND = "run the training interpreter (--python) there by hand: does it start, and does anything else write on its output?"


def node_json(line: str, what: str, **hooks):
    """A line from a node as JSON, the numbers as the collector writes them (finite floats, integers of
    at most 64 bits); NodeError("protocol") that names `what` otherwise, nesting past the recursion
    limit included."""
    try:
        return json.loads(line, parse_int=bounded_json_int, parse_float=finite_json_float,
                          parse_constant=refused_json_constant, **hooks)
    except RecursionError:
        raise NodeError("protocol", f"{what} is JSON nested too deeply", BY_HAND) from None
    except ValueError as exc:
        raise NodeError("protocol", f"{what} is not JSON as preflight's programs write it: {str(exc)[:200]}",
                        BY_HAND) from None


# The facts' sections and their types, checked once when a facts line is decoded, so that the checks can
# read each as what it is (a section that failed on the node is an object with its "error"); then what is
# inside each, against preflight.remote.shapes. REQUIRED are always sent by the collector; the others may be null
# or missing.
REQUIRED_SECTIONS = {"schema": int, "python": dict, "packages": dict, "host": dict, "env": dict, "storage": dict,
                     "limits": dict, "memory": dict, "clock": dict, "gpus": dict}
OTHER_SECTIONS = {"collected_at": NUMBER, "preflight": (str, NONE), "job": (dict, NONE), "fabric": (dict, NONE),
                  "census": (dict, NONE), "nccl_conf": (dict, NONE)}
# The sections the decoder shares among nodes: not those a node's own processes change after decoding (the files
# a job names are added to "job"), nor those that are the node's own by nature. A section seen in more forms than
# SHARED_FORMS (GPU serials, free space), or longer than SHARED_TEXT, is not shared either: the texts kept to
# recognise it would cost memory (a hostile node could send 64 of MAX_LINE each).
UNSHARED_SECTIONS = frozenset({"job", "census", "session", "host", "clock", "collected_at"})
SHARED_SECTIONS = (frozenset(REQUIRED_SECTIONS) | frozenset(OTHER_SECTIONS)) - UNSHARED_SECTIONS
SHARED_FORMS = 64
SHARED_TEXT = 1 << 20  # characters: a larger section is decoded for its node alone (a node's text is not kept)
_BLANK = re.compile(r"[ \t\n\r]*")  # what JSON allows between tokens
# Each request's answer: the keys it must have, and the types of the keys it may have.
ANSWER_KEYS = {"time": {"time": NUMBER}, "listen": {"bound": bool}, "unlisten": {}, "connect": {"ok": bool},
               "write": {"ok": bool}, "read": {"ok": bool}, "remove": {"ok": bool}, "files": {}}
ANSWER_OPTIONAL = {"error": (str, NONE), "holders": list, "seconds": NUMBER, "path": (str, NONE),
                   "source": (str, NONE), "peers": list}
PATH_ANSWERS = {"paths_open": PATHS_OPEN, "paths_probe": PATHS_PROBE}


def _shape(value: dict, required: dict, optional: dict) -> Optional[str]:
    """What is wrong with an object's keys (None: nothing)."""
    for key, types in required.items():
        if key not in value:
            return f"there is no {key!r}"
        if not _typed(value[key], types):
            return f"{key!r} is {_kind(value[key])}"
    for key, types in optional.items():
        if key in value and not _typed(value[key], types):
            return f"{key!r} is {_kind(value[key])}"
    return None


def _answer_problem(op: str, answer) -> Optional[str]:
    if not isinstance(answer, dict):
        return f"it is {_kind(answer)}, not an object"
    if op in PATH_ANSWERS:
        return problem(answer, PATH_ANSWERS[op], "it")
    if op == "files":  # the paths asked for, each with its entry
        return next(filter(None, (problem(entry, FILE, f"the entry for {path[:80]!r}")
                                  for path, entry in answer.items())), None)
    wrong = _shape(answer, ANSWER_KEYS.get(op, {}), ANSWER_OPTIONAL)
    if wrong is None and any(not isinstance(h, dict) for h in answer.get("holders") or ()):
        wrong = "'holders' are not objects"
    return wrong


@dataclass
class NodeState:
    name: str
    facts: Optional[dict] = None
    error: Optional[NodeError] = None
    clock: Optional[dict] = None  # offset_s: node minus this machine, bound_s, rtt_s
    connection: Optional[object] = None  # a connection of preflight.remote.transport
    agent: Optional[object] = None  # the process of the agent on it
    late: int = 0  # answers still owed to requests that timed out: they come first, and are skipped
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ask(self, request: dict, timeout: float) -> dict:
        """One request to the node's agent, one answer of the shape that request gets; NodeError naming the
        node past the deadline, for an answer of another shape, or when the session breaks."""
        op, agent, sent = request.get("op"), self.agent, False
        if agent is None:
            raise NodeError("protocol", f"the session with {self.name} is closed", BY_HAND)
        deadline = time.monotonic() + timeout
        try:
            while self.late:
                if agent.read_line(max(0.0, deadline - time.monotonic())) is None:
                    break
                self.late -= 1
            agent.send_line(json.dumps(request), max(0.001, deadline - time.monotonic()))
            sent = True
            line = agent.read_line(max(0.0, deadline - time.monotonic()))
        except NodeError as exc:
            if exc.kind != "timeout" or isinstance(exc, openssh.ReachError):  # not reached at all: SSH001's
                raise NodeError(exc.kind, f"{self.name}: {exc.message}", exc.remediation) from None
            self.late += sent
            raise NodeError("timeout", f"{self.name} did not answer {op!r} within {timeout:g} s",
                            "the node is overloaded or hung") from None
        except Exception as exc:  # the session broke under us (closed from another thread, the network)
            raise NodeError("protocol", f"the session with {self.name} broke: {type(exc).__name__}: {exc}",
                            "check the node and the network") from None
        if line is None:
            raise NodeError("protocol", f"the agent on {self.name} stopped", BY_HAND)
        answer = node_json(line, f"the answer of {self.name} to {op!r}")
        problem = _answer_problem(op, answer)
        if problem:
            raise NodeError("protocol", f"the answer of {self.name} to {op!r} is not the agent's: {problem}", BY_HAND)
        return answer

    def fail(self, error: NodeError) -> None:
        """This node is failed with `error` (the first reason stays)."""
        if self.error is None:
            self.error = error

    def close(self) -> None:
        """Ends the node's program and connection; idempotent, from any thread, never raises."""
        with self._lock:
            agent, connection, self.agent, self.connection = self.agent, self.connection, None, None
        if agent is not None:
            try:
                agent.send_line("done", 1.0)
            except Exception:
                pass
            try:
                agent.close()
            except Exception:
                pass
        if connection is not None:
            try:
                connection.close()
            except Exception:
                pass

    def to_context(self) -> dict:
        error = None
        if self.error is not None:
            error = {"kind": self.error.kind, "message": self.error.message, "remediation": self.error.remediation}
        return {"facts": self.facts, "error": error, "clock": self.clock}




def facts_decoder() -> Callable[[str], dict]:
    """node_json for the nodes' facts lines, sharing across nodes what they send alike: identical strings (keys,
    versions, environment values), and each section whose text is identical to another node's (the packages of
    one image, the same environment), decoded once, as one object. Thousands of nodes send mostly the same ones, and
    each would otherwise be its own copy in memory (peak RSS with 4,096 nodes' facts, scripts/bench_scale.py:
    182 -> 106 MB, strings alone); and a check that declares the sections it reads (registry.check's `reads`)
    is evaluated once per distinct set of them (runner). One decoder per run; the nodes' threads share it."""
    strings: Dict[str, str] = {}
    share = strings.setdefault
    sections: Dict[str, Dict[str, object]] = {name: {} for name in SHARED_SECTIONS}  # -> text -> its object

    def shared(value):
        if type(value) is str:
            return share(value, value) if len(value) <= 200 else value  # long text is rarely repeated
        if type(value) is list:  # objects inside were shared when they were decoded
            return [shared(v) for v in value]
        return value

    def pairs(items: list) -> dict:
        return {share(k, k): shared(v) for k, v in items}

    scan = json.scanner.make_scanner(json.JSONDecoder(object_pairs_hook=pairs, parse_int=bounded_json_int,
                                                      parse_float=finite_json_float,
                                                      parse_constant=refused_json_constant))

    def decode(line: str, what: str = "the facts"):
        try:
            doc = _top_level(line, scan, sections, share, shared)
        except (ValueError, StopIteration, RecursionError):
            doc = None
        return doc if doc is not None else node_json(line, what, object_pairs_hook=pairs)  # and its error

    return decode


def _top_level(line: str, scan: Callable, sections: Dict[str, Dict[str, object]], share: Callable,
               shared: Callable) -> Optional[dict]:
    """The object `line` holds, as json.loads reads it (the last of a repeated key wins), each value the object an
    earlier line's identical value was decoded as; None where the line is anything else (the caller decodes it
    whole for its error)."""
    at = _BLANK.match(line).end()
    if line[at:at + 1] != "{":
        return None
    doc: dict = {}
    at = _BLANK.match(line, at + 1).end()
    while line[at:at + 1] != "}" or doc:
        if line[at:at + 1] != '"':
            return None
        key, at = json.decoder.scanstring(line, at + 1)
        at = _BLANK.match(line, at).end()
        if line[at:at + 1] != ":":
            return None
        start = _BLANK.match(line, at + 1).end()
        forms = sections.get(key)
        # A section whose text another node sent is that node's object, not decoded again: an object or array
        # ends at its closing bracket, so the same characters from `start` are the same value, ending as there.
        known = next((form for form in tuple(forms.items()) if line.startswith(form[0], start)), None) if forms else None
        if known is not None:
            value, at = known[1], start + len(known[0])
        else:
            value, at = scan(line, start)
            if forms is not None and isinstance(value, (dict, list)) and len(forms) < SHARED_FORMS and \
                    at - start <= SHARED_TEXT:
                value = forms.setdefault(line[start:at], value)  # (another node's thread may have just added it)
            else:  # its strings shared as the objects' inside are (a list's items are not an object's)
                value = shared(value)
        doc[share(key, key)] = value
        at = _BLANK.match(line, at).end()
        if line[at:at + 1] == "}":
            break
        if line[at:at + 1] != ",":
            return None
        at = _BLANK.match(line, at + 1).end()
    return doc if _BLANK.match(line, at + 1).end() == len(line) else None


def checked_facts(facts, what: str = "the facts") -> dict:
    """The facts as decoded from a node, if they are an object whose sections are of their types (what
    every check reads them as); NodeError("protocol") otherwise."""
    wrong = f"they are {_kind(facts)}" if not isinstance(facts, dict) else \
        _shape(facts, REQUIRED_SECTIONS, OTHER_SECTIONS)
    if wrong:
        raise NodeError("protocol", f"{what} are not the collector's: {wrong}", BY_HAND)
    for name, shape in SECTIONS.items():
        section = facts.get(name)
        if is_failed(section):
            continue  # failed on the node: PKG003 says why, and no check reads it
        wrong = problem(section, shape, name) if name in facts else None
        if wrong:  # that section alone is unusable: the node's other facts are still read
            facts[name] = {"error": collector.SECTION_FAILED % name + f"what the node sent is not the collector's: {wrong}"}
    return facts


def _say(options: GatherOptions, text: str) -> None:
    progress.of(options.progress).say(text)


def _parallel(func: Callable, nodes: List[NodeState], options: GatherOptions,
              shown: Optional[progress.Activity] = None) -> list:
    """func over the nodes, `fanout` at a time; func keeps a node's failure to that node (it never raises).
    `shown`: the step on the status line, told when each node begins and ends (answered or failed)."""
    if not nodes:
        return []
    pool = ThreadPoolExecutor(max_workers=max(1, min(options.fanout, len(nodes))))

    def tracked(node: NodeState):
        shown.start(node.name)
        try:
            return func(node)
        finally:
            shown.done(node.name, node.error is None)

    try:
        return list(pool.map(tracked if shown is not None else func, nodes))
    finally:
        # On Ctrl-C, return at once: the caller closes the connections, which ends what still waits.
        pool.shutdown(wait=False, cancel_futures=True)


def gather(nodes: List[str], remote: bool, options: GatherOptions) -> tuple:
    """(facts, probes): the nodes over SSH or srun, or this machine alone in-process."""
    return gather_ssh(nodes, options) if remote else gather_local(nodes[0], options)


# --- the local node -----------------------------------------------------------------------------

def gather_local(name: str, options: GatherOptions) -> tuple:
    """This machine alone: facts, a zero clock offset, and whether the port is free. The facts are collected
    in-process, or, where --python names an interpreter other than this one, by that interpreter: the agent
    shipped to it as to a node (its packages are that interpreter's)."""
    if options.python and not _this_interpreter(options.python):
        node = NodeState(name)
        try:
            _collect(node, options.main_address or name, replace(options, transport="local", early=None),
                     facts_decoder())
        finally:
            node.close()
        if node.error is not None:
            return {name: node.to_context()}, {"head": {"name": name, "address": options.main_address or name}}
    else:
        node = NodeState(name, clock={"offset_s": 0.0, "bound_s": 0.0, "rtt_s": 0.0})
        node.facts = collector.collect({"head": options.main_address or name, "port": options.port,
                                        "paths": options.paths, "job": options.job, "census": options.census})
        job = node.facts.get("job")
        named = _named_files(job, options)
        if named:
            job["named"] = {p: launchfiles.read_file(p, job["cwd"], True) for p in named}
    if options.census:  # read only: the running job's port is left alone
        return {name: node.to_context()}, {"head": {"name": name, "address": options.main_address or name}}
    server = agent.bindable(options.port)
    listen = server if isinstance(server, dict) else {"bound": True}
    if not isinstance(server, dict):
        server.close()
    probes = {"port": {"head": name, "listen": listen, "workers": {}},
              "head": {"name": name, "address": options.main_address or name}}
    if options.ntp_server:
        probes["ntp"] = measure_ntp(options.ntp_server, options.timeout)
    return {name: node.to_context()}, probes


def _this_interpreter(python: str) -> bool:
    found = shutil.which(python)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


# --- over SSH -----------------------------------------------------------------------------------

def gather_ssh(names: List[str], options: GatherOptions) -> tuple:
    nodes = [NodeState(n) for n in names]
    options = replace(options, progress=progress.of(options.progress))  # one Progress for every step of the run
    started = time.monotonic()
    how = "srun" if options.transport == "srun" else "SSH"
    _say(options, f"reaching {len(nodes)} node(s) over {how} (fan-out {options.fanout}, timeout {options.timeout:g} s)")
    if options.transport == "ssh" and transport.client(options) == "paramiko":
        _paramiko_limits(options)
    # What the job uses as MASTER_ADDR: main_process_ip, else the head's address as SSH reaches it.
    head_address = options.main_address or (names[0] if options.transport == "srun" else _ssh_hostname(names[0], options))
    try:
        decode = facts_decoder()
        with options.progress.activity("census" if options.census else "facts", len(nodes)) as shown:
            _parallel(lambda n: _collect(n, head_address, options, decode, shown), nodes, options, shown)
        reached = [n for n in nodes if n.error is None]
        _say(options, f"{'census' if options.census else 'facts'} from {len(reached)}/{len(nodes)} node(s) in "
                      f"{time.monotonic() - started:.1f} s")
        if options.census:  # read only: the running job's port, folders and network are left alone
            return {n.name: n.to_context() for n in nodes}, {"head": {"name": names[0], "address": head_address}}
        if options.job_port is not None and nodes[0].error is None:
            options = replace(options, port=options.job_port({nodes[0].name: nodes[0].to_context()}) or options.port)
        probes = {"port": _probe_port(nodes, options), "head": {"name": names[0], "address": head_address}}
        if options.shared_dir:
            probes["shared_dir"] = _probe_shared_dir(nodes, options)
        if options.data_paths:
            probes["paths"] = _probe_paths(nodes, options)
        if options.ntp_server:
            probes["ntp"] = measure_ntp(options.ntp_server, options.timeout)
        if options.collective is not None:  # after the port probe: the slow part, only when COL is selected
            blocked = _not_reached(nodes) or _rendezvous_blocked(probes["port"], options)
            if blocked:
                probes["collective"] = {"not_run": blocked}
            else:
                _say(options, "all-reduce across the nodes (COL)")
                # what the data-path probes found broken names a failed run's nodes (collective.datapath)
                probes["collective"] = options.collective.run(nodes, head_address, options, probes.get("paths"))
    finally:
        options.progress.stop()  # the status line cleared, also on Ctrl-C
        if options.early is not None:
            options.early.close()
        _parallel(NodeState.close, nodes, options)
    return {n.name: n.to_context() for n in nodes}, probes


def _paramiko_limits(options: GatherOptions) -> None:
    """One line on stderr where the ssh_config uses what paramiko does not honour: its nodes may fail where
    `ssh NODE true` works, and the user is told so before, never left to find out."""
    from preflight.remote.ssh import SYSTEM_SSH_CONFIG, unhonoured

    found = unhonoured(options.ssh_config or os.path.expanduser("~/.ssh/config"))
    if not options.ssh_config:  # ssh reads the system's config after the user's; paramiko never reads it
        found += unhonoured(SYSTEM_SSH_CONFIG, read=False)
    if found:
        why = "--ssh paramiko" if options.ssh_client == "paramiko" else "no `ssh` on this machine: paramiko"
        shown = "; ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        print(f"preflight: {why} does not honour {shown}; OpenSSH's client (--ssh openssh) does", file=sys.stderr)


def _not_reached(nodes: List[NodeState]) -> Optional[str]:
    """The job cannot start without every node: running the all-reduce on the others would only hold
    back the verdict (by torch's import and a rendezvous) to test a group the job never forms."""
    missing = [n.name for n in nodes if n.error is not None]
    if missing:
        return f"not run: {', '.join(missing)} not reached (see SSH001); it runs once every node answers"
    return None


def _rendezvous_blocked(port_probe: dict, options: GatherOptions) -> Optional[str]:
    """Why the all-reduce would only wait for its deadline: its rendezvous port is taken or unreachable."""
    if options.collective.port not in (None, options.port):
        return None  # another port: the port probe says nothing about it
    listen = port_probe.get("listen") or {}
    if not listen.get("bound"):
        return f"not run: the main port {options.port} is not free on the head (see NET003)"
    unreachable = sorted(n for n, answer in port_probe["workers"].items() if not answer.get("ok"))
    if unreachable:
        return (f"not run: {', '.join(unreachable)} cannot reach the head's main port {options.port} "
                "(see NET004); the all-reduce would only wait for its deadline")
    return None


def _ssh_hostname(alias: str, options: GatherOptions) -> str:
    """The address the head's alias stands for, as the SSH client in use reads the config."""
    if transport.client(options) == "openssh":
        return openssh.settings(alias, options.ssh_config, min(options.timeout, 10.0)).get("hostname") or alias
    try:
        return load_ssh_settings(alias, options.ssh_config).hostname
    except Exception:  # an unreadable ssh_config is reported per node by the connection itself
        return alias


def _collect(node: NodeState, head: str, options: GatherOptions, decode: Callable[..., dict],
             shown: Optional[progress.Activity] = None) -> None:
    try:
        # The connection has its own deadlines; this one also bounds DNS and anything unforeseen.
        early = options.early.take(node.name, options.timeout * 2 + 1) if options.early is not None else None
        if early is None:
            node.connection = run_with_deadline(lambda: transport.connect(options.transport, node.name, options),
                                                options.timeout * 2 + 1)
        else:
            node.connection, node.agent = early
        if shown is not None:
            shown.reach(node.name)
        payload = {"head": head, "port": options.port, "paths": options.paths, "job": options.job,
                   "census": options.census}
        # One deadline for the start, the facts and the clock samples: a node that answers each request
        # just in time must not cost many timeouts.
        started = time.monotonic()
        deadline = started + options.timeout
        if node.agent is None:
            node.agent = node.connection.start(shipped_command(options.python), shipped_input(AGENT, payload),
                                               options.timeout)
        else:  # started early: its program waits for this line (one that has ended says why when read)
            try:
                node.agent.send_line(json.dumps(payload), options.timeout)
            except Exception:
                pass
        step, facts_s = "facts", 0.0
        try:
            line, printed = _facts_line(node, deadline)
            if line is None:
                status = node.agent.exit_status(2)
                if status in (126, 127):
                    here = options.transport == "local"
                    raise NodeError("python-missing", f"the interpreter {options.python} does not exist or cannot "
                                    f"run {'here' if here else 'there'} (exit {status})", "pass --python with the "
                                    f"path of the training interpreter{'' if here else ' on the nodes'}")
                said = node.agent.stderr_tail().strip()[-300:] or \
                    (f"no facts line; it printed: {printed.strip()[:200]}" if printed else "no output")
                raise NodeError("collector", f"the fact collector stopped (exit {status}): {said}", BY_HAND)
            what = f"the facts from {node.name}"
            node.facts = checked_facts(decode(line, what), what)
            facts_s = time.monotonic() - started
            node.facts["session"] = {"stdout": printed}
            job = node.facts.get("job")
            named = _named_files(job, options)
            if named:
                step = "the files its config names"
                job["named"] = node.ask({"op": "files", "paths": named, "cwd": job.get("cwd")},
                                        deadline - time.monotonic())
            if not options.census:
                step = "clock samples"
                node.clock = _clock_samples(node, deadline)
        except NodeError as exc:
            if exc.kind == "protocol" and node.name not in exc.message:
                raise NodeError(exc.kind, f"{node.name}: {exc.message}", exc.remediation) from None
            if exc.kind != "timeout" or isinstance(exc, openssh.ReachError):  # not reached at all: SSH001's
                raise
            got = f"its facts came after {facts_s:.1f} s; " if node.facts is not None else ""
            raise NodeError("timeout", f"{node.name} is too slow: no {step} within --timeout {options.timeout:g} s "
                            f"({got}the start, the facts and the clock samples share it)",
                            "find what slows the node (load, a hung filesystem, DNS), or raise --timeout") from None
    except NodeError as exc:
        node.fail(exc)
    except Exception as exc:  # anything else the node sent us: still a result, never a crash
        node.fail(NodeError("protocol", f"{node.name}: {type(exc).__name__}: {exc}", BY_HAND))


def _named_files(job, options: GatherOptions) -> List[str]:
    """The files a node's own config names, to be read in a second step (options.job_files decides)."""
    if not isinstance(job, dict) or options.job_files is None:
        return []
    try:
        return options.job_files(job)
    except Exception:  # a config no parser takes names nothing: JOB001 says what is wrong with it
        return []


PRINTED_LIMIT = 4096  # what a shell start-up file printed before the facts, kept for JOB009


def _facts_line(node: NodeState, deadline: float) -> tuple:
    """The collector's facts line, and what the session printed on stdout before it (a start-up file such
    as ~/.bashrc that echoes in non-interactive sessions), by the deadline (time.monotonic())."""
    printed = ""
    while True:
        line = node.agent.read_line(max(0.001, deadline - time.monotonic()))
        if line is not None and '{"schema"' in line and not line.startswith('{"schema"'):
            before, _, rest = line.partition('{"schema"')  # a banner without a newline before the facts
            printed, line = printed + before + "\n", '{"schema"' + rest
        if line is None or line.startswith('{"schema"'):
            return line, printed[:PRINTED_LIMIT] or None
        if len(printed) < PRINTED_LIMIT:
            printed = (printed + line + "\n")[:PRINTED_LIMIT]



def _clock_samples(node: NodeState, deadline: float) -> dict:
    """Several NTP-style samples inside one remote process, by the deadline; the one with the smallest round
    trip wins."""
    best = None
    for _ in range(CLOCK_SAMPLES):
        sent = time.time()
        remote = node.ask({"op": "time"}, deadline - time.monotonic())["time"]
        received = time.time()
        rtt = received - sent
        if best is None or rtt < best["rtt_s"]:
            best = {"offset_s": remote - (sent + received) / 2, "bound_s": rtt / 2, "rtt_s": rtt}
    return best


def _probe_ask(node: NodeState, request: dict, timeout: float) -> Optional[dict]:
    """A probe's request: the node's answer, or None when it has none in time or of the right shape; that
    node then fails with the reason (SSH001), and the probe leaves it out."""
    try:
        return node.ask(request, timeout)
    except NodeError as exc:
        node.fail(exc)
        return None


def _cleanup_ask(node: NodeState, request: dict, timeout: float) -> None:
    """Undo what a probe did (the listener, the token); best effort: closing the session ends it too."""
    try:
        node.ask(request, timeout)
    except NodeError:
        pass


def _probe_port(nodes: List[NodeState], options: GatherOptions) -> dict:
    """A temporary listener on the head's main port, and a connection to it from every worker."""
    head, workers = nodes[0], [n for n in nodes[1:] if n.error is None]
    result = {"head": head.name, "number": options.port, "listen": None, "workers": {}}
    if head.error is not None:
        return result
    result["listen"] = _probe_ask(head, {"op": "listen", "port": options.port}, options.timeout)
    if not (result["listen"] or {}).get("bound"):
        return result
    connect_timeout = min(options.timeout, 10.0)

    def connect(worker: NodeState) -> Optional[dict]:
        resolved = ((worker.facts or {}).get("host") or {}).get("head_resolves_to")
        if not isinstance(resolved, list) or not resolved or not isinstance(resolved[0], str):
            return {"ok": False, "error": f"cannot resolve the head {head.name}", "address": None}
        request = {"op": "connect", "address": resolved[0], "port": options.port, "timeout_s": connect_timeout}
        answer = _probe_ask(worker, request, connect_timeout + options.timeout)
        return None if answer is None else dict(answer, address=resolved[0])

    try:
        with options.progress.activity(f"main port {options.port}: connecting to the head", len(workers),
                                       reached="", answered="answered") as shown:
            answers = dict(zip([w.name for w in workers], _parallel(connect, workers, options, shown)))
        result["workers"] = {name: answer for name, answer in answers.items() if answer is not None}
    finally:
        _cleanup_ask(head, {"op": "unlisten"}, options.timeout)
    return result


def _probe_shared_dir(nodes: List[NodeState], options: GatherOptions) -> dict:
    """The head writes a token into the shared folder; every other node must read the same token."""
    head, others = nodes[0], [n for n in nodes[1:] if n.error is None]
    request = {"folder": options.shared_dir, "name": f".preflight-{secrets.token_hex(8)}",
               "token": secrets.token_hex(16)}
    result = {"path": options.shared_dir, "head": head.name, "write": None, "nodes": {}}
    if head.error is not None:
        return result
    result["write"] = _probe_ask(head, dict(request, op="write"), options.timeout)
    if not (result["write"] or {}).get("ok"):
        return result
    try:
        with options.progress.activity("shared folder", len(others), reached="", answered="read it") as shown:
            answers = _parallel(lambda n: _probe_ask(n, dict(request, op="read"), options.timeout), others, options,
                                shown)
        result["nodes"] = {n.name: answer for n, answer in zip(others, answers) if answer is not None}
    finally:
        _cleanup_ask(head, dict(request, op="remove"), options.timeout)
    return result


def measure_ntp(server: str, timeout: float) -> dict:
    """This machine's clock against an NTP server: offset_s is the server minus this machine."""
    import ntplib

    try:
        response = ntplib.NTPClient().request(server, version=3, timeout=min(timeout, 5))
    except (ntplib.NTPException, OSError) as exc:
        return {"server": server, "error": str(exc) or type(exc).__name__}
    return {"server": server, "offset_s": response.offset, "bound_s": response.delay / 2,
            "stratum": response.stratum}


# --- the data path between every pair: routes, names, an ephemeral port, the path MTU ------------------

PATH_PEERS = 32  # peers each node probes: every pair up to 33 nodes; above, a ring of the next 32 (every node is
# still dialled by 32 others, so a closed node or a node's bad route shows, at a cost that grows with N, not N^2)


def path_schedule(count: int, most: int = PATH_PEERS) -> List[List[int]]:
    """The peers (indices) each of `count` nodes probes: the next min(count - 1, most) nodes in a ring."""
    return [[(i + k) % count for k in range(1, min(count - 1, most) + 1)] for i in range(count)]


def own_address(facts: Optional[dict]) -> Optional[str]:
    """The IPv4 address the job's traffic uses on a node: that of the interface NCCL (with GPUs) or gloo binds
    there (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, else their default: job.nccl.socket_interface), else the
    source of its route to the head, else the first address of an interface other than loopback."""
    chosen = (socket_interface(facts or {}) or "").split()
    if len(chosen) == 2 and chosen[0] != "none" and "." in chosen[1] and not chosen[1].startswith("127."):
        return chosen[1]
    host = (facts or {}).get("host") or {}
    route = host.get("route_to_head")
    source = route.get("source") if isinstance(route, dict) else None
    if isinstance(source, str) and "." in source and not source.startswith("127."):
        return source
    for name, addresses in sorted((host.get("interfaces") or {}).items()):
        for address in addresses if name != "lo" else ():
            if "." in address and not address.startswith("127."):
                return address
    return None


def training_interface(facts: Optional[dict]) -> Optional[str]:
    """The interface that holds the node's own address (own_address)."""
    address, host = own_address(facts), (facts or {}).get("host") or {}
    return next((n for n, addrs in sorted((host.get("interfaces") or {}).items()) if address in addrs), None)


def training_mtu(facts: Optional[dict]) -> Optional[int]:
    link = (((facts or {}).get("host") or {}).get("links") or {}).get(training_interface(facts)) or {}
    mtu = link.get("mtu")
    return mtu if isinstance(mtu, int) and mtu >= paths.SMALLEST else None


def _probe_paths(nodes: List[NodeState], options: GatherOptions) -> dict:
    """Every reached node opens a listener and a datagram answerer on ephemeral ports; then each probes its
    scheduled peers at once (route, names, TCP to the listener, do-not-fragment datagrams of the path's MTU);
    then the listeners close. Each step under its deadline: a node that does not answer is left out."""
    started = time.monotonic()
    reached = [n for n in nodes if n.error is None]
    result = {"peers": {}, "opened": {}, "address": {}, "mtu": {}, "seconds": 0.0}
    if len(reached) < 2:
        return result
    # A SYN is resent after 1 s: 3 s is two tries, and a black-holed peer costs no more than that.
    step, wait = min(options.timeout, 3.0), min(options.timeout, 1.0)
    for node in reached:
        result["address"][node.name], result["mtu"][node.name] = own_address(node.facts), training_mtu(node.facts)
    opened = _parallel(lambda n: _probe_ask(n, {"op": "paths_open"}, options.timeout), reached, options)
    result["opened"] = {n.name: answer for n, answer in zip(reached, opened) if answer is not None}
    schedule = path_schedule(len(reached))

    def peers_of(i: int) -> List[dict]:
        asked = []
        for j in schedule[i]:
            peer, open_ = reached[j], result["opened"].get(reached[j].name) or {}
            address = result["address"][peer.name]
            if address is None or not open_.get("open"):
                continue
            host = (peer.facts or {}).get("host") or {}
            names = [peer.name] + ([host["hostname"]] if host.get("hostname") not in (None, peer.name) else [])
            mine, theirs = result["mtu"][reached[i].name], result["mtu"][peer.name]
            asked.append({"name": peer.name, "address": address, "names": names, "tcp_port": open_.get("tcp_port"),
                          "udp_port": open_.get("udp_port"), "mtu": min(mine, theirs) if mine and theirs else None})
        return asked

    try:
        def ask(i: int) -> Optional[dict]:
            node, asked = reached[i], peers_of(i)
            if node.name not in result["opened"] or not asked:
                return None
            budget = paths.probe_budget(len(asked), step, wait)
            answer = _probe_ask(node, {"op": "paths_probe", "peers": asked, "timeout_s": step, "wait_s": wait},
                                budget + options.timeout)
            return None if answer is None else answer["paths"]

        with options.progress.activity("data paths between the nodes", len(reached), reached="",
                                       answered="probed") as shown:
            index = {n.name: i for i, n in enumerate(reached)}
            answers = _parallel(lambda n: ask(index[n.name]), reached, options, shown)
        result["peers"] = {n.name: a for n, a in zip(reached, answers) if a is not None}
    finally:
        _parallel(lambda n: _cleanup_ask(n, {"op": "paths_close"}, options.timeout),
                  [n for n in reached if n.name in result["opened"] and n.error is None], options)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result

