"""The result model: what a check finds, what the runner records, and the verdict."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


# Reports list the worst first.
SEVERITY = {Status.FAIL: 0, Status.ERROR: 1, Status.WARN: 2, Status.SKIP: 3, Status.PASS: 4}


class UsageError(Exception):
    """A bad invocation (options that do not go together, an empty selector): one line on stderr, exit 2."""


EXIT_READY = 0
EXIT_NOT_READY = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Finding:
    """What a check yields: the runner adds the check's ID, name and duration."""

    status: Status
    message: str
    remediation: Optional[str] = None
    nodes: Sequence[str] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)


def finding_key(finding) -> tuple:
    """What makes a Finding (or a Result) on one node the same as on another: its status, message, fix and
    evidence, by repr (1, 1.0, True and "1" stay apart, as the JSON document shows them; the same keys in
    another order only stay apart)."""
    return finding.status, finding.message, finding.remediation, repr(dict(finding.evidence))


def passed(message: str, **evidence: Any) -> Finding:
    return Finding(Status.PASS, message, evidence=evidence)


def warn(message: str, fix: Optional[str] = None, **evidence: Any) -> Finding:
    return Finding(Status.WARN, message, fix, evidence=evidence)


def fail(message: str, fix: Optional[str] = None, **evidence: Any) -> Finding:
    return Finding(Status.FAIL, message, fix, evidence=evidence)


def skip(reason: str, **evidence: Any) -> Finding:
    return Finding(Status.SKIP, reason, evidence=evidence)


@dataclass(frozen=True)
class Result:
    id: str
    name: str
    status: Status
    nodes: tuple
    message: str
    remediation: Optional[str]
    evidence: Mapping[str, Any]
    duration_s: float

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "status": self.status.value,
            "nodes": list(self.nodes),
            "message": self.message,
            "remediation": self.remediation,
            "evidence": dict(self.evidence),
            "duration_s": round(self.duration_s, 6),
        }


def counted(result: Result) -> int:
    """How many results `result` counts for in a report: one per node it concerns (the same finding on several
    nodes is one Result), one when it concerns none."""
    return len(result.nodes) or 1


def verdict(results: Iterable[Result]) -> str:
    statuses = {r.status for r in results}
    if statuses & {Status.FAIL, Status.ERROR}:
        return "fail"
    if Status.WARN in statuses:
        return "warn"
    return "pass"


def exit_code(verdict_: str, strict: bool) -> int:
    if verdict_ == "fail" or (strict and verdict_ == "warn"):
        return EXIT_NOT_READY
    return EXIT_READY
