"""SLURM node state for `preflight node --drain/--undrain`: drain this node with a `preflight:` reason when
it fails, return it to service only when preflight (not someone else) drained it.

scontrol is always run with a list of arguments, never through a shell, and with a deadline.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from typing import List, Optional, Sequence, Tuple

REASON_PREFIX = "preflight:"
REASON_MAX = 100  # characters: sinfo -R shows a reason column of about this much


class SlurmError(Exception):
    """scontrol could not be run or refused: said in one line."""


def scontrol_path() -> Optional[str]:
    return shutil.which("scontrol")


def node_name() -> str:
    """This node's name in SLURM: $SLURMD_NODENAME (set in prologs and job steps), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def drain_reason(result) -> str:
    """`preflight: ID name: message`, on one line, at most REASON_MAX characters."""
    text = f"{REASON_PREFIX} {result.id} {result.name}: {result.message}"
    text = re.sub(r"\s+", " ", text.replace('"', "'")).strip()
    return text if len(text) <= REASON_MAX else text[:REASON_MAX - 3].rstrip() + "..."


def first_failure(results: Sequence):
    """The first failing result, else the first error (both make the verdict fail)."""
    for wanted in ("fail", "error"):
        for r in results:
            if getattr(r.status, "value", r.status) == wanted:
                return r
    return None


def _scontrol(args: List[str], timeout: float) -> str:
    path = scontrol_path()
    if path is None:
        raise SlurmError("scontrol is not on PATH")
    try:
        proc = subprocess.run([path, *args], capture_output=True, text=True, timeout=max(timeout, 0.5),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {args[0]} gave no answer within {timeout:g} s") from None
    except OSError as exc:
        raise SlurmError(f"cannot run scontrol: {exc}") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"scontrol {' '.join(args[:2])} failed (exit {proc.returncode}): "
                         f"{said[-1] if said else 'no message'}")
    return proc.stdout


def node_state(name: str, timeout: float = 10.0) -> Tuple[str, str]:
    """(State, Reason) of a node from `scontrol show node NAME` ('' when none)."""
    text = _scontrol(["show", "node", name], timeout)
    state = re.search(r"\bState=(\S+)", text)
    # Reason runs to the end of its line: "Reason=preflight: FS001 ... [root@2026-01-01T00:00:00]"
    reason = re.search(r"\bReason=(.*)$", text, re.MULTILINE)
    return (state.group(1) if state else ""), (reason.group(1).strip() if reason else "")


def drain(name: str, reason: str, timeout: float = 10.0) -> None:
    _scontrol(["update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"], timeout)


def undrain(name: str, timeout: float = 10.0) -> Tuple[bool, str]:
    """Resume the node if preflight drained it: (resumed, what happened, in words)."""
    state, reason = node_state(name, timeout)
    if "DRAIN" not in state.upper():
        return False, f"node {name} is not drained (State={state or 'unknown'}): nothing to undo"
    if not reason.startswith(REASON_PREFIX):
        return False, (f"node {name} stays drained: its reason {reason or '(none)'!r} was not set by preflight "
                       "(resume it by hand: scontrol update NodeName=... State=RESUME)")
    _scontrol(["update", f"NodeName={name}", "State=RESUME"], timeout)
    return True, f"node {name} returned to service (it was drained with {reason!r})"


JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?(\+[0-9]+)?")  # as squeue shows them: 42, 42_7 (array), 42+1 (het)


def job_details(jobid: str, timeout: float) -> str:
    """`scontrol show job --details JOBID`: the allocation's GRES on each node and its BatchHost, for the
    allocation check (preflight.inputs.allocation reads the text)."""
    if not JOB_ID.fullmatch(jobid or ""):
        raise SlurmError(f"{jobid!r} is not a SLURM job ID")
    return _scontrol(["show", "job", "--details", jobid], timeout)


def job_nodes(jobid: str, timeout: float) -> List[str]:
    """The nodes of a running SLURM job (`scontrol show job JOBID`), for `doctor --slurm-job` from a login node."""
    from preflight.inputs.documents import InputError
    from preflight.inputs.inventory import expand, validate

    if not JOB_ID.fullmatch(jobid or ""):
        raise InputError("--slurm-job", f"{jobid!r} is not a SLURM job ID (digits, as squeue shows them)")
    try:
        text = _scontrol(["show", "job", "--oneliner", jobid], timeout)
    except SlurmError as exc:
        raise InputError("--slurm-job", f"job {jobid}: {exc}") from None
    state = re.search(r"\bJobState=(\S+)", text)
    nodes = re.search(r"(?<![A-Za-z])NodeList=(\S+)", text)
    if state and state.group(1) != "RUNNING":
        raise InputError("--slurm-job", f"job {jobid} is {state.group(1)}, not RUNNING: it has no live processes to read")
    if not nodes or nodes.group(1) in ("(null)", ""):
        raise InputError("--slurm-job", f"job {jobid} has no nodes (scontrol show job: NodeList={nodes.group(1) if nodes else '?'})")
    return validate(expand(nodes.group(1), "NodeList"), f"job {jobid}'s NodeList")


# --- the example scripts of the SLURM gate ------------------------------------------------------------------

SCRIPTS = ("prolog", "healthcheck", "epilog")
SCRIPT_DEFAULT = "/opt/preflight/bin/preflight"  # the PREFLIGHT the shipped scripts name


def write_scripts(folder: str, preflight: str) -> List[str]:
    """The prolog, health check and epilog shipped with preflight, written to FOLDER as preflight-NAME.sh
    (executable) with PREFLIGHT defaulting to the `preflight` given; the paths written. A file already there with
    other content is an InputError naming it: an admin's edited script is never overwritten."""
    from importlib import resources

    from preflight.inputs.documents import InputError

    if not os.path.isdir(folder):
        raise InputError(folder, "is not a folder (create it, or name the one slurm.conf's scripts live in)")
    texts = {}
    for name in SCRIPTS:
        text = resources.files("preflight.gate").joinpath("slurm_scripts", f"{name}.sh").read_text()
        texts[os.path.join(folder, f"preflight-{name}.sh")] = text.replace(
            f"PREFLIGHT=${{PREFLIGHT:-{SCRIPT_DEFAULT}}}", f"PREFLIGHT=${{PREFLIGHT:-{preflight}}}")
    for path, text in texts.items():  # all three judged before any is written
        if os.path.lexists(path):
            try:
                with open(path, encoding="utf-8") as existing:
                    same = existing.read(1 << 20) == text
            except (OSError, UnicodeDecodeError):
                same = False
            if not same:
                raise InputError(path, "exists with other content; not overwritten (remove it, or write to another "
                                 "folder and compare)")
    written = []
    for path, text in texts.items():
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(path, 0o755)
        written.append(path)
    return written
