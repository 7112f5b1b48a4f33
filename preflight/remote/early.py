"""The first nodes reached while the head still builds its plan.

Before its first connection the head loads the checks, reads the configs and builds the plan (0.2-0.3 s of a
one-node run). `check` and `launch` on --hosts over SSH start the first `fanout` nodes' sessions meanwhile:
each node's Python starts and loads the shipped modules, then waits for its options line
(shipping.shipped_bundle), which gather sends once the plan says what it is. This module imports only what
reaching a node needs, so that the sessions begin before the rest of the head is imported.
"""
from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import Dict, List, Optional

from preflight.remote import transport
from preflight.remote.session import NodeError
from preflight.remote.shipping import AGENT, shipped_bundle, shipped_command


def reaching(args) -> dict:
    """The options of gather.GatherOptions that say how the nodes are reached, from the command line."""
    return {"python": getattr(args, "python", sys.executable), "timeout": getattr(args, "timeout", 30.0),
            "fanout": getattr(args, "fanout", 64), "ssh_config": getattr(args, "ssh_config", None),
            "accept_new": getattr(args, "ssh_accept_new", False), "ssh_client": getattr(args, "ssh", None),
            "transport": transport_for(args)}


def transport_for(args) -> str:
    """`check --slurm` and `doctor --slurm` inside an allocation reach the nodes with srun job steps; everything else
    over SSH (`launch` too: it starts the launcher on each node over SSH)."""
    if args.command in ("check", "doctor") and getattr(args, "slurm", False):
        from preflight.remote import srun

        if srun.usable():
            return "srun"
    return "ssh"


FIRST_WAIT_S = 1.0  # the head waits no longer than this for its first session's key exchange


def start(args) -> Optional["EarlyStart"]:
    """An EarlyStart for `check` and `launch` on --hosts over SSH; None otherwise, or for hosts that are not valid
    (the run says why)."""
    if args.command not in ("check", "launch") or getattr(args, "hosts", None) is None:
        return None
    from preflight.inputs import inventory

    options = SimpleNamespace(**reaching(args))
    if options.transport != "ssh":
        return None
    try:
        names = inventory.validate(inventory.expand(args.hosts, "--hosts"), "--hosts")
    except Exception:
        return None
    started = EarlyStart(names, options)
    # With paramiko, Python's threads share one interpreter lock, and until its key exchange is done the first
    # session is CPU on the head (paramiko's import, the exchange itself): the rest of the head's start-up would
    # slow it as much as it overlaps it. From then on the session waits for the node's sshd (authentication, the
    # exec request: 100 ms of a one-node run), and the head builds the bundle, loads the checks and makes its
    # plan meanwhile. OpenSSH's exchange runs in ssh's own process: handshaken is set at once.
    started.handshaken.wait(min(FIRST_WAIT_S, options.timeout))
    shipped_bundle(AGENT)
    return started


class EarlyStart:
    """The sessions of the first `fanout` nodes, each started on a thread of its own. gather takes a node's
    session, or the failure of its start, with take(); close() ends those not taken."""

    def __init__(self, names: List[str], options):
        self.options, self._lock, self._closed = options, threading.Lock(), False
        self.handshaken = threading.Event()  # one node's key exchange is done, or its start has failed
        self._nodes: Dict[str, dict] = {}
        for name in list(dict.fromkeys(names))[:max(1, options.fanout)]:
            box = self._nodes[name] = {"done": threading.Event()}
            threading.Thread(target=self._start, args=(name, box), daemon=True).start()

    def _start(self, name: str, box: dict) -> None:
        try:
            box["connection"] = transport.connect(self.options.transport, name, self.options, self.handshaken.set)
            box["agent"] = box["connection"].start(shipped_command(self.options.python), shipped_bundle(AGENT),
                                                   self.options.timeout)
        except BaseException as exc:  # raised again where the node is gathered
            box["error"] = exc
        with self._lock:
            box["done"].set()
            unwanted = box.get("abandoned") or self._closed
        self.handshaken.set()
        if unwanted:
            _close_session(box)

    def take(self, name: str, timeout: float) -> Optional[tuple]:
        """(connection, agent) of `name`, once started; None when it was not started early; the NodeError
        of its start, or a timeout past `timeout` s (as run_with_deadline)."""
        with self._lock:
            box = None if self._closed else self._nodes.pop(name, None)
        if box is None:
            return None
        if not box["done"].wait(timeout):
            with self._lock:
                box["abandoned"] = not box["done"].is_set()
            if box["abandoned"]:
                raise NodeError("timeout", f"no answer within {timeout:g} s", "the node is hung or overloaded")
        if "error" in box:
            _close_session(box)
            raise box["error"]
        return box["connection"], box["agent"]

    def close(self) -> None:
        """Ends every session not taken (idempotent); one still starting ends once it has started."""
        with self._lock:
            self._closed, boxes = True, [b for b in self._nodes.values() if b["done"].is_set()]
            self._nodes = {}
        for box in boxes:
            _close_session(box)


def _close_session(box: dict) -> None:
    for part in ("agent", "connection"):
        try:
            if box.get(part) is not None:
                box[part].close()
        except Exception:
            pass
