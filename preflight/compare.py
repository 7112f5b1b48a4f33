"""Comparing one value across nodes: the majority, and the nodes that differ from it."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Mapping, Tuple

from preflight.inputs.inventory import fold
from preflight.result import Finding, finding_key


def odd_ones_out(values: Mapping[str, Any], head: str = None,
                 weights: Mapping[str, int] = None) -> Tuple[Any, Dict[str, Any]]:
    """(the value most nodes have, {node: its other value}). A tie goes to the head's value. With weights,
    each node of `values` stands for that many nodes (a group of nodes whose values are all the same)."""
    keys = {n: _key(v) for n, v in values.items()}  # once per node: thousands of nodes, dozens of values each
    if weights is None:
        counts = Counter(keys.values())
    else:
        counts = Counter()
        for n, k in keys.items():
            counts[k] += weights[n]
    if not counts:
        return None, {}
    top = max(counts.values())
    leaders = [k for k, c in counts.items() if c == top]
    reference = keys[head] if head in values and keys[head] in leaders else leaders[0]
    majority = next(v for n, v in values.items() if keys[n] == reference)
    return majority, {n: v for n, v in values.items() if keys[n] != reference}


def _key(value: Any) -> str:
    return repr(value)


def nodes_with(values: Mapping[str, Any], value: Any) -> List[str]:
    return [n for n, v in values.items() if _key(v) == _key(value)]


def holders(values: Mapping[str, Any], value: Any) -> str:
    """'n[01-63] have' or 'n01 has': the nodes with that value, for a message. Build it once per value, not
    once per odd node: folding thousands of names is the cost."""
    nodes = nodes_with(values, value)
    return f"{fold(nodes)} {'has' if len(nodes) == 1 else 'have'}"


def grouped(judge: Callable[[str], Iterable[Finding]], nodes: Iterable[str]) -> List[Finding]:
    """judge(node) for each node, the same finding on several nodes given once with all of them: a check
    over thousands of nodes says "pass" once, not once a node (every result costs the reports). Empty
    when there is no node: the caller says why (never an empty pass)."""
    groups: Dict[tuple, list] = {}
    for node in nodes:
        for finding in judge(node):
            key = finding_key(finding)
            groups.setdefault(key, [finding, []])[1].append(node)
    return [Finding(finding.status, finding.message, finding.remediation, nodes=tuple(members),
                    evidence=finding.evidence) for finding, members in groups.values()]
