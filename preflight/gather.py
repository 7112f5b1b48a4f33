"""Facts from every node, in parallel, then the coordinated probes: what the checks read.

Every step has a deadline; a node that fails is recorded with the reason and the others go on.
Connections are opened once per node, used by every phase, and closed at the end (also on Ctrl-C).
"""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from preflight import collector, fsprobe, portprobe
from preflight.transport import (
    NodeError,
    SSHConnection,
    load_ssh_settings,
    run_with_deadline,
    shipped_command,
    shipped_input,
)

CLOCK_SAMPLES = 8


@dataclass
class GatherOptions:
    python: str
    timeout: float = 30.0
    fanout: int = 64
    ssh_config: Optional[str] = None
    accept_new: bool = False
    port: int = 29500
    main_address: Optional[str] = None  # main_process_ip from the config: what workers connect to
    paths: Dict[str, str] = field(default_factory=dict)  # name -> path whose space each node reports
    shared_dir: Optional[str] = None  # a folder every node should see the same (a shared filesystem)
    ntp_server: Optional[str] = None
    progress: bool = True


@dataclass
class NodeState:
    name: str
    facts: Optional[dict] = None
    error: Optional[NodeError] = None
    clock: Optional[dict] = None  # offset_s: node minus this machine, bound_s, rtt_s
    connection: Optional[SSHConnection] = None

    def to_context(self) -> dict:
        error = None
        if self.error is not None:
            error = {"kind": self.error.kind, "message": self.error.message, "remediation": self.error.remediation}
        return {"facts": self.facts, "error": error, "clock": self.clock}


def _source(module) -> str:
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


def _say(options: GatherOptions, text: str) -> None:
    if options.progress:
        print(f"preflight: {text}", file=sys.stderr, flush=True)


# --- the local node -----------------------------------------------------------------------------

def gather_local(name: str, options: GatherOptions) -> tuple:
    """This machine alone, in-process: facts, a zero clock offset, and whether the port is free."""
    facts = collector.collect({"head": options.main_address or name, "port": options.port, "paths": options.paths})
    node = NodeState(name, facts=facts, clock={"offset_s": 0.0, "bound_s": 0.0, "rtt_s": 0.0})
    probes = {"port": {"head": name, "listen": _local_bind(options.port), "workers": {}},
              "head": {"name": name, "address": options.main_address or name}}
    if options.ntp_server:
        probes["ntp"] = measure_ntp(options.ntp_server, options.timeout)
    return {name: node.to_context()}, probes


def _local_bind(port: int) -> dict:
    server = portprobe.bindable(port)
    if isinstance(server, dict):
        return server
    server.close()
    return {"bound": True}


# --- over SSH -----------------------------------------------------------------------------------

def gather_ssh(names: List[str], options: GatherOptions) -> tuple:
    nodes = [NodeState(n) for n in names]
    started = time.monotonic()
    _say(options, f"reaching {len(nodes)} node(s) over SSH (fan-out {options.fanout}, timeout {options.timeout:g} s)")
    # What the job uses as MASTER_ADDR: main_process_ip, else the head's address as SSH reaches it.
    head_address = options.main_address or _ssh_hostname(names[0], options)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(options.fanout, len(nodes)))) as pool:
            list(pool.map(lambda n: _collect(n, head_address, options), nodes))
        reached = sum(1 for n in nodes if n.error is None)
        _say(options, f"facts from {reached}/{len(nodes)} node(s) in {time.monotonic() - started:.1f} s; probing the main port")
        probes = {"port": _probe_port(nodes, options), "head": {"name": names[0], "address": head_address}}
        if options.shared_dir:
            probes["shared_dir"] = _probe_shared_dir(nodes, options)
        if options.ntp_server:
            probes["ntp"] = measure_ntp(options.ntp_server, options.timeout)
    finally:
        for node in nodes:
            if node.connection is not None:
                node.connection.close()
    return {n.name: n.to_context() for n in nodes}, probes


def _ssh_hostname(alias: str, options: GatherOptions) -> str:
    try:
        return load_ssh_settings(alias, options.ssh_config).hostname
    except Exception:  # an unreadable ssh_config is reported per node by the connection itself
        return alias


def _collect(node: NodeState, head: str, options: GatherOptions) -> None:
    try:
        def connect():
            settings = load_ssh_settings(node.name, options.ssh_config)
            return SSHConnection(settings, options.timeout, options.accept_new, options.ssh_config).connect()

        # The connection has its own deadlines; this one also bounds DNS and anything unforeseen.
        node.connection = run_with_deadline(connect, options.timeout * 2 + 1)
        payload = {"head": head, "port": options.port, "paths": options.paths}
        process = _start(node, collector, payload, options)
        try:
            line = process.read_line(options.timeout)
            if line is None:
                status = process.exit_status(2)
                if status in (126, 127):
                    raise NodeError("python-missing", f"the interpreter {options.python} does not exist or cannot "
                                    f"run there (exit {status})",
                                    "pass --python with the path of the training interpreter on the nodes")
                raise NodeError("collector", f"the fact collector stopped (exit {status}): "
                                f"{process.stderr_tail().strip()[-300:]}", "run the training interpreter there by hand")
            node.facts = json.loads(line)
            node.clock = _clock_samples(process, options.timeout)
            process.send_line("done")
        finally:
            process.close()
    except NodeError as exc:
        node.error = exc
    except Exception as exc:  # anything else the node sent us: still a result, never a crash
        node.error = NodeError("protocol", f"{type(exc).__name__}: {exc}", "run the collector there by hand")


def _start(node: NodeState, module, payload: dict, options: GatherOptions):
    return node.connection.start(shipped_command(options.python), shipped_input(_source(module), payload))


def _clock_samples(process, timeout: float) -> dict:
    """Several NTP-style samples inside one remote process; the one with the smallest round trip wins."""
    best = None
    for _ in range(CLOCK_SAMPLES):
        sent = time.time()
        process.send_line("t")
        remote = float(process.read_line(timeout))
        received = time.time()
        rtt = received - sent
        if best is None or rtt < best["rtt_s"]:
            best = {"offset_s": remote - (sent + received) / 2, "bound_s": rtt / 2, "rtt_s": rtt}
    return best


def _probe_port(nodes: List[NodeState], options: GatherOptions) -> dict:
    """A temporary listener on the head's main port, and a connection to it from every worker."""
    head, workers = nodes[0], [n for n in nodes[1:] if n.error is None]
    result = {"head": head.name, "listen": None, "workers": {}}
    if head.error is not None:
        return result
    deadline = options.timeout + 5
    try:
        listener = _start(head, portprobe, {"mode": "listen", "port": options.port, "deadline_s": deadline}, options)
        result["listen"] = json.loads(listener.read_line(options.timeout) or "{}")
    except (NodeError, ValueError) as exc:
        result["listen"] = {"bound": False, "error": str(exc), "holders": []}
        return result
    try:
        if not result["listen"].get("bound"):
            return result

        def connect(worker: NodeState) -> None:
            address = _head_address(worker)
            if address is None:
                result["workers"][worker.name] = {"ok": False, "error": f"cannot resolve the head {head.name}",
                                                  "address": None}
                return
            payload = {"mode": "connect", "address": address, "port": options.port,
                       "timeout_s": min(options.timeout, 10.0)}
            try:
                process = _start(worker, portprobe, payload, options)
                try:
                    answer = json.loads(process.read_line(options.timeout + 1) or "{}")
                finally:
                    process.close()
            except (NodeError, ValueError) as exc:
                answer = {"ok": False, "error": str(exc)}
            answer["address"] = address
            result["workers"][worker.name] = answer

        with ThreadPoolExecutor(max_workers=max(1, min(options.fanout, len(workers) or 1))) as pool:
            list(pool.map(connect, workers))
    finally:
        try:
            listener.send_line("done")
            listener.read_line(2)
        except Exception:
            pass
        listener.close()
    return result


def _head_address(worker: NodeState) -> Optional[str]:
    resolved = (worker.facts or {}).get("host", {}).get("head_resolves_to")
    return resolved[0] if isinstance(resolved, list) and resolved else None


def _ask(node: NodeState, module, payload: dict, options: GatherOptions) -> dict:
    """Run a one-answer program on a node; its JSON answer, or the error as one."""
    try:
        process = _start(node, module, payload, options)
        try:
            return json.loads(process.read_line(options.timeout) or "{}")
        finally:
            process.close()
    except (NodeError, ValueError) as exc:
        return {"ok": False, "error": str(exc)}


def _probe_shared_dir(nodes: List[NodeState], options: GatherOptions) -> dict:
    """The head writes a token into the shared folder; every other node must read the same token."""
    import secrets

    head, others = nodes[0], [n for n in nodes[1:] if n.error is None]
    base = {"folder": options.shared_dir, "name": f".preflight-{secrets.token_hex(8)}"}
    token = secrets.token_hex(16)
    result = {"path": options.shared_dir, "head": head.name, "write": None, "nodes": {}}
    if head.error is not None:
        return result
    result["write"] = _ask(head, fsprobe, dict(base, mode="write", token=token), options)
    if not result["write"].get("ok"):
        return result
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(options.fanout, len(others) or 1))) as pool:
            answers = pool.map(lambda n: _ask(n, fsprobe, dict(base, mode="read", token=token), options), others)
            result["nodes"] = dict(zip([n.name for n in others], answers))
    finally:
        _ask(head, fsprobe, dict(base, mode="remove"), options)
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
