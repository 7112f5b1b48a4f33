"""Renderers over the same list of Results: the terminal report and the JSON document."""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import List, Sequence, TextIO, Tuple

from preflight.result import SEVERITY, Result, Status

STYLE = {
    Status.FAIL: "bold red",
    Status.ERROR: "bold magenta",
    Status.WARN: "yellow",
    Status.SKIP: "dim",
    Status.PASS: "green",
}
VERDICT_STYLE = {"pass": "bold green", "warn": "bold yellow", "fail": "bold red"}


def to_json(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> str:
    """The JSON document with one result per line: greppable, and each line from CPython's C encoder
    (an indented document takes the pure-Python one, several times slower at thousands of nodes)."""
    head = _ENCODER.encode({"schema": 1, "verdict": verdict, "duration_s": round(duration_s, 6),
                            "nodes": list(nodes), "results": []})
    if not results:
        return head
    lines = ",\n".join([_ENCODER.encode(r.to_json()) for r in results])
    return "".join([head[:-len("]}")], "\n", lines, "\n]}"])  # the results between the brackets of `[]}`


_ENCODER = json.JSONEncoder(default=str)  # one for every line: json.dumps(default=...) makes one per call


def fold_nodes(nodes: Sequence[str]) -> str:
    from preflight.inventory import fold as fold_names

    return fold_names(nodes) if nodes else ""


def fold(results: Sequence[Result]) -> List[Tuple[Result, Tuple[str, ...]]]:
    """Identical findings on several nodes become one line with a node range, worst first."""
    groups = {}  # key -> (the first result, the nodes of all): a list, as adding tuples is quadratic
    for r in results:
        key = (r.id, r.status, r.message, r.remediation)
        if key in groups:
            groups[key][1].extend(r.nodes)
        else:
            groups[key] = (r, list(r.nodes))
    return sorted(((r, tuple(nodes)) for r, nodes in groups.values()), key=lambda g: (SEVERITY[g[0].status], g[0].id))


def summary(results: Sequence[Result]) -> str:
    counts = Counter(r.status for r in results)
    words = [(Status.FAIL, "failed", "failed"), (Status.ERROR, "error", "errors"), (Status.WARN, "warning", "warnings"),
             (Status.PASS, "passed", "passed"), (Status.SKIP, "skipped", "skipped")]
    return ", ".join(f"{counts[s]} {one if counts[s] == 1 else many}" for s, one, many in words if counts[s]) or "no checks ran"


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def terminal(results: Sequence[Result], verdict: str, duration_s: float, stream: TextIO = None) -> None:
    stream = stream or sys.stdout
    lines = []  # (text, style) pairs per line
    folded = {}  # many lines concern the same nodes (all of them): fold each set once
    for result, nodes in fold(results):
        head = [(f"{result.status.value.upper():5} ", STYLE[result.status]), (f"{result.id} {result.name}", "bold")]
        if nodes:
            if nodes not in folded:
                folded[nodes] = fold_nodes(nodes)
            head.append((f" [{folded[nodes]}]", "cyan"))
        head.append((f"  {result.message}", ""))
        lines.append(head)
        if result.remediation and result.status in (Status.FAIL, Status.ERROR, Status.WARN):
            lines.append([("      fix: ", "bold"), (result.remediation, "")])
    lines.append(
        [("verdict: ", "bold"), (verdict.upper(), VERDICT_STYLE[verdict]), (f"  {summary(results)} in {duration_s:.2f} s", "")]
    )
    if use_color(stream):
        from rich.console import Console
        from rich.text import Text

        console = Console(file=stream, highlight=False, soft_wrap=True)
        for parts in lines:
            console.print(Text.assemble(*parts))
    else:
        for parts in lines:
            stream.write("".join(text for text, _ in parts) + "\n")
