"""Running selected checks over a plan: every check yields Results, none can kill the run."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional

from preflight.registry import CheckSpec
from preflight.result import Finding, Result, Status


@dataclass(frozen=True)
class CheckContext:
    """What a check may look at. Checks do no I/O: everything is gathered before they run."""

    plan: Any
    facts: Optional[Mapping[str, Any]] = None  # node name -> facts document
    probes: Optional[Mapping[str, Any]] = None  # probe name -> probe results


def run_check(spec: CheckSpec, ctx: CheckContext) -> List[Result]:
    started = time.perf_counter()
    try:
        findings = list(spec.func(ctx) or ())
        for finding in findings:
            if not isinstance(finding, Finding):
                raise TypeError(f"yielded {type(finding).__name__}, expected a Finding")
    except Exception as exc:  # a broken check becomes an error result, never a crash
        findings = [
            Finding(
                Status.ERROR,
                f"check {spec.id} raised {type(exc).__name__}: {exc}",
                "this is a defect in the check; report it with the input that triggered it",
            )
        ]
    if not findings:
        findings = [Finding(Status.PASS, "no problem found")]
    elapsed = (time.perf_counter() - started) / len(findings)
    return [
        Result(spec.id, spec.name, f.status, tuple(f.nodes), f.message, f.remediation, dict(f.evidence), elapsed)
        for f in findings
    ]


def run(specs: Iterable[CheckSpec], ctx: CheckContext) -> List[Result]:
    results: List[Result] = []
    for spec in specs:
        results.extend(run_check(spec, ctx))
    return results
