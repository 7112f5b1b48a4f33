"""Renderers over the same list of Results: the terminal report and the JSON document; a table a result carries
in its evidence (JOB001's launch plan, RUN001's census) drawn as a table whose differing cells stand out."""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from dataclasses import replace
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Set, TextIO, Tuple

from preflight import __version__
from preflight.result import SEVERITY, Result, Status, counted

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
    head = _ENCODER.encode({"schema": 1, "preflight": __version__, "verdict": verdict, "duration_s": round(duration_s, 6),
                            "nodes": list(nodes), "results": []})
    if not results:
        return head
    lines = ",\n".join([_ENCODER.encode(r.to_json()) for r in results])
    return "".join([head[:-len("]}")], "\n", lines, "\n]}"])  # the results between the brackets of `[]}`


_ENCODER = json.JSONEncoder(default=str)  # one for every line: json.dumps(default=...) makes one per call


def fold_nodes(nodes: Sequence[str]) -> str:
    from preflight.inputs.inventory import fold as fold_names

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
    counts = Counter()
    for r in results:
        counts[r.status] += counted(r)
    words = [(Status.FAIL, "failed", "failed"), (Status.ERROR, "error", "errors"), (Status.WARN, "warning", "warnings"),
             (Status.PASS, "passed", "passed"), (Status.SKIP, "skipped", "skipped")]
    return ", ".join(f"{counts[s]} {one if counts[s] == 1 else many}" for s, one, many in words if counts[s]) or "no checks ran"


# Tables that results carry in their evidence (JOB001's launch plan, RUN001's census, CKPT001's files of the
# checkpoint and the ranks that load them): key -> (title, the columns whose cells are not compared with the
# rest of their column, the width the terminal cuts a cell to). The launch plan's node, rank and config path
# differ by design (config_sha compares what the path holds); the census and the checkpoint's files compare
# nothing; a ZeRO shard's name, whole, is 46 characters.
CELL_MAX = 40
TABLES = {"launch_plan": ("launch plan", ("node", "machine_rank", "config"), CELL_MAX),
          "census": ("census", None, CELL_MAX), "resume_files": ("what the job resumes from", None, 64)}


class EvidenceTable(NamedTuple):
    title: str
    columns: List[str]
    rows: List[List[Any]]  # the values, in the columns' order
    differs: Set[Tuple[int, int]]  # (row, column) of each cell unlike its column's most common value
    cell_max: int = CELL_MAX  # the terminal cuts a longer cell in the middle


def evidence_tables(results: Sequence[Result]) -> List[EvidenceTable]:
    """The tables among the results' evidence, each kind once (its first), in TABLES' order (columns: the first
    row's keys, in order), with the cells a user would otherwise compare by hand."""
    found = (_evidence_table(key, next((r.evidence[key] for r in results if isinstance(r.evidence.get(key), list)),
                                       None)) for key in TABLES)
    return [table for table in found if table is not None]


def _evidence_table(key: str, table: Optional[list]) -> Optional[EvidenceTable]:
    # a dict first: typing's isinstance check costs 1 us a row (doctor's census of 16,384 nodes is 147,456 rows)
    rows = [row for row in table or () if type(row) is dict or isinstance(row, Mapping)]
    if not rows:
        return None
    title, uncompared, cell_max = TABLES[key]
    columns = list(rows[0])
    values = [[row.get(c) for c in columns] for row in rows]
    differs = set()
    for j, column in enumerate(columns):
        if uncompared is None or column in uncompared:
            continue
        seen = [repr(row[j]) for row in values]  # repr: hashable, and 1, True and "1" stay apart
        common = Counter(seen).most_common(1)[0][0]  # ties go to the first seen: the first row's value wins
        differs.update((i, j) for i, value in enumerate(seen) if value != common)
    return EvidenceTable(title, columns, values, differs, cell_max)


class LinkMatrix(NamedTuple):
    nodes: List[str]
    cells: List[List[Tuple[str, str, str]]]  # (kind: self, failed, slow, straggler, fast, none; text; title)
    named: Set[str]  # the rows COL004 names (a straggler, a node failing with every peer, an end of a bad link)


LINK_MATRIX_MAX = 64  # nodes: above, the matrix stays in the JSON evidence (a page of N^2 cells helps nobody)


def link_matrix(results: Sequence[Result]) -> Optional[LinkMatrix]:
    """COL004's node x node matrix (its first result's evidence), each cell classed for drawing: a failed pair,
    a link of a straggler, a slow link (COL004's own findings), the others fast. None without one, or above
    LINK_MATRIX_MAX nodes."""
    from preflight.collective.pairwise import findings

    found = next((r.evidence["matrix"] for r in results if r.id == "COL004" and isinstance(
        r.evidence.get("matrix"), Mapping)), None)
    if not found or len(found.get("nodes") or []) > LINK_MATRIX_MAX:
        return None
    try:
        said = findings(found)
    except (KeyError, IndexError, TypeError):  # not the phase's matrix
        return None
    nodes, gbps, errors = list(found["nodes"]), found["gbps"], found["errors"]
    slow = {frozenset(link[:2]) for link in said["slow_links"]}
    stragglers = set(said["stragglers"])
    named = stragglers | set(said["failed_rows"]) | {n for link in said["failed_links"] for n in link[:2]}
    cells = []
    for i, a in enumerate(nodes):
        row = []
        for j, b in enumerate(nodes):
            where = f"{a} - {b}"
            if i == j:
                row.append(("self", "", a))
            elif errors[i][j]:
                row.append(("failed", "\u2715", f"{where}: failed: {errors[i][j]}"))
            elif gbps[i][j] is None:
                row.append(("none", "\u00b7", f"{where}: not measured"))
            else:
                kind = "straggler" if {a, b} & stragglers else "slow" if frozenset((a, b)) in slow else "fast"
                row.append((kind, f"{gbps[i][j]:.3g}", f"{where}: {gbps[i][j]:.3g} GB/s"))
        cells.append(row)
    return LinkMatrix(nodes, cells, named)


def table_cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _cut(text: str, width: int) -> str:
    """A long cell cut in the middle: the end of a path tells more than its start."""
    if len(text) <= width:
        return text
    head = (width - 1) // 3
    return f"{text[:head]}\u2026{text[head - width + 1:]}"


def table_lines(plan: EvidenceTable, color: bool) -> List[List[Tuple[str, str]]]:
    """The plan as an aligned table of (text, style) parts: differing cells in bold red, and without colour
    marked with a trailing '*' (explained on a line under the table)."""
    mark = "" if color else "*"
    shown = _shown_rows(plan)
    table = [[c.replace("_", " ") for c in plan.columns]]
    table += [[_cut(table_cell(v), plan.cell_max) + (mark if (i, j) in plan.differs else "") for j, v in enumerate(row)]
              for i, row in ((i, plan.rows[i]) for i in shown)]
    widths = [max(len(row[j]) for row in table) for j in range(len(plan.columns))]
    last = len(widths) - 1
    lines = [[(f"{plan.title}:", "bold")]]
    for i, row in zip([-1, *shown], table):  # the header is row -1: no cell of it differs
        parts = [("  ", "")]
        for j, text in enumerate(row):
            pad = " " * (widths[j] - len(text) + 2) if j < last else ""
            for piece, style in ((text, "bold red" if (i, j) in plan.differs else "bold" if i < 0 else ""),
                                 (pad, "bold" if i < 0 else "")):
                if style == parts[-1][1]:  # one part per run of a style: rich takes twice as long with a part per cell
                    parts[-1] = (parts[-1][0] + piece, style)
                else:
                    parts.append((piece, style))
        lines.append(parts)
    if len(shown) < len(plan.rows):
        lines.append([(f"  ... and {len(plan.rows) - len(shown):,} more rows (the JSON report, --json, has every "
                       "row)", "")])
    if plan.differs and not color:
        lines.append([("  * differs from the other nodes", "")])
    return lines


TABLE_ROWS = 1024  # a terminal table's rows at most (doctor's census of 16,384 nodes is 147,456 of them)


def _shown_rows(plan: EvidenceTable) -> List[int]:
    """The rows a terminal shows: all of them up to TABLE_ROWS; past it, those with a differing cell and the
    first of the others, TABLE_ROWS in all, in their order."""
    if len(plan.rows) <= TABLE_ROWS:
        return list(range(len(plan.rows)))
    odd = set(sorted({i for i, _ in plan.differs})[:TABLE_ROWS])
    first = [i for i in range(TABLE_ROWS) if i not in odd][:TABLE_ROWS - len(odd)]
    return sorted(odd.union(first))


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def passes(results: Sequence[Result]) -> List[Tuple[Result, Tuple[str, ...]]]:
    """One line per check that passed: its nodes together, and its message when every node had the same one."""
    checks = {}  # id -> (the first result, its nodes in order, its distinct messages)
    for r in results:
        if r.status is Status.PASS:
            first, nodes, messages = checks.setdefault(r.id, (r, {}, {}))
            nodes.update(dict.fromkeys(r.nodes))
            messages[r.message] = None
    return [(first if len(messages) == 1 else
             replace(first, message=f"passed with {len(messages)} different messages (-v lists them)"), tuple(nodes))
            for first, nodes, messages in (checks[cid] for cid in sorted(checks))]


def skip_reason(message: str) -> str:
    """What a skip is counted under: its message up to the first ': ' outside brackets (the statement; what
    follows explains it, and differs from node to node), after the file it is about (`train.slurm:12: `), if it
    begins with one."""
    depth, start = 0, 0
    for i, char in enumerate(message):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth = max(0, depth - 1)
        elif char == ":" and not depth and message[i + 1:i + 2] == " ":
            place = message[start:i]
            if " " not in place and ("/" in place or "." in place) and message[i + 2:]:  # a file, not a statement
                start = i + 2
                continue
            return place
    return message[start:]


SKIP_REASONS = 5  # on the one line of skips; -v lists every skip
NOT_GIVEN = re.compile(r"no [^()]+ given(?: \([^()]*\))?")


def skip_line(results: Sequence[Result]) -> Optional[str]:
    """The skips as one line of counts by reason, the commonest first (as pytest's short summary counts
    them); None without a skip."""
    reasons = Counter()
    for r in results:
        if r.status is Status.SKIP:
            reasons[skip_reason(r.message)] += counted(r)
    if not reasons:
        return None
    # "no batch script given (--sbatch)", "no Kubernetes manifest given (--k8s)", ...: inputs the user may never
    # have meant to give, folded into one entry that names their flags
    flags, not_given = [], 0
    for why in [w for w in reasons if NOT_GIVEN.fullmatch(w)]:
        not_given += reasons.pop(why)
        flags += re.findall(r"--[a-z][a-z0-9-]*", why)
    if not_given:
        reasons[f"for inputs not given ({', '.join(dict.fromkeys(flags))})" if flags else "for inputs not given"] = \
            not_given
    common = reasons.most_common()  # ties in the order first seen
    line = f"{sum(reasons.values())} skipped: " + ", ".join(f"{n} {why}" for why, n in common[:SKIP_REASONS])
    rest = common[SKIP_REASONS:]
    if rest:
        line += (f"; {sum(n for _, n in rest)} more for {len(rest)} other reason{'s' if len(rest) > 1 else ''}"
                 " (-v lists every skip)")
    return line


def terminal(results: Sequence[Result], verdict: str, duration_s: float, stream: TextIO = None,
             verbose: bool = False) -> None:
    """Failures, errors and warnings first, each with its fix; then a line per check that passed and one line
    of skips counted by reason; the verdict last. `verbose` lists every result instead, folded by finding."""
    stream = stream or sys.stdout
    color = use_color(stream)
    lines = []  # (text, style) pairs per line
    folded = {}  # many lines concern the same nodes (all of them): fold each set once
    if verbose:
        groups = fold(results)
    else:  # the passes as passes() sums them: fold only the problems (at thousands of nodes, few of the results)
        groups = fold([r for r in results if r.status in (Status.FAIL, Status.ERROR, Status.WARN)]) + passes(results)
    for result, nodes in groups:
        head = [(f"{result.status.value.upper():5} ", STYLE[result.status]), (f"{result.id} {result.name}", "bold")]
        if nodes:
            if nodes not in folded:
                folded[nodes] = fold_nodes(nodes)
            head.append((f" [{folded[nodes]}]", "cyan"))
        head.append((f"  {result.message}", ""))
        lines.append(head)
        if result.remediation and result.status in (Status.FAIL, Status.ERROR, Status.WARN):
            lines.append([("      fix: ", "bold"), (result.remediation, "")])
    skipped = None if verbose else skip_line(results)
    if skipped:
        lines.append([(skipped, STYLE[Status.SKIP])])
    for table in evidence_tables(results):
        lines += table_lines(table, color)
    lines.append(
        [("verdict: ", "bold"), (verdict.upper(), VERDICT_STYLE[verdict]), (f"  {summary(results)} in {duration_s:.2f} s", "")]
    )
    if color:
        from rich.console import Console
        from rich.text import Text

        console = Console(file=stream, highlight=False, soft_wrap=True)
        # one print: rich's cost per print made a print per line the most of a 1,000-node launch plan's time
        console.print(Text("\n").join(Text.assemble(*parts) for parts in lines))
    else:
        for parts in lines:
            stream.write("".join(text for text, _ in parts) + "\n")
