"""Which nodes the job runs on: from --hosts, a hostfile or SLURM. The first node is the head (rank 0)."""
from __future__ import annotations

import itertools
import os
import re
from typing import List, Optional, Sequence, Tuple

from preflight.inputs.documents import InputError

NODE_NAME = re.compile(r"^[A-Za-z0-9_.:\[\]-]+$")  # what ssh_config aliases, names and addresses use


MAX_HOSTS = 100_000  # a target larger than any cluster is a mistake: refused before it is expanded


def expand(text: str, source: str) -> List[str]:
    """A hostlist expression (`gpu[001-004],gpu010`) as a list of names."""
    import hostlist

    size = HostPattern(text, source).size  # counted without expanding: node[0-99999999] allocates nothing
    if size > MAX_HOSTS:
        raise InputError(source, f"host list {text[:60]!r} names {size} hosts, more than {MAX_HOSTS}")
    try:
        names = hostlist.expand_hostlist(text.strip(), allow_duplicates=True)  # validate says "listed twice"
    except hostlist.BadHostlist as exc:
        raise InputError(source, f"bad host list {text!r}: {exc}") from None
    return names


class HostPattern:
    """A hostlist expression (`gpu[001-064],login*`), matched against names without being expanded: the
    syntax of python-hostlist (a top-level comma separates alternatives; each [..] holds numbers N or ranges
    N-M, zero-padded to N's width), and the shell's wildcards `*` and `?` in the text outside brackets
    when `wildcards`. Bad syntax is an InputError naming `source`."""

    def __init__(self, text: str, source: str, wildcards: bool = False):
        self.text = text.strip()
        self.alternatives: List[Tuple[re.Pattern, List[List[Tuple[int, int, int]]]]] = []
        self.size = 0
        for part in _split_top(self.text, source):
            regex, groups, size = "", [], 1
            for literal, bracket in re.findall(r"([^\[]*)(\[[^\]]*\])?", part):
                regex += "".join(".*" if c == "*" and wildcards else "." if c == "?" and wildcards else re.escape(c)
                                 for c in literal)
                if bracket:
                    ranges = [_range(r, text, source) for r in bracket[1:-1].split(",")]
                    groups.append(ranges)
                    regex += r"(\d+)"
                    size *= sum(high - low + 1 for low, high, _ in ranges)
            self.alternatives.append((re.compile(regex), groups))
            self.size += size

    def matches(self, name: str) -> bool:
        for regex, groups in self.alternatives:
            found = regex.fullmatch(name)
            if found and all(_in(digits, ranges) for digits, ranges in zip(found.groups(), groups)):
                return True
        return False


def _split_top(text: str, source: str) -> List[str]:
    """The alternatives of a hostlist expression: split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise InputError(source, f"bad host list {text[:60]!r}: {'nested' if depth > 1 else 'unbalanced'} brackets")
        if c == "," and depth == 0:
            if text[start:i]:
                parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InputError(source, f"bad host list {text[:60]!r}: unbalanced brackets")
    return parts


def _range(text: str, whole: str, source: str) -> Tuple[int, int, int]:
    """N or N-M of a rangelist: (low, high, width: N's digits, the width every name is padded to)."""
    found = re.fullmatch(r"(\d{1,30})(?:-(\d{1,30}))?", text)
    if not found:
        raise InputError(source, f"bad host list {whole[:60]!r}: bad range {text[:40]!r}")
    low, high = int(found.group(1)), int(found.group(2) or found.group(1))
    if high < low:
        raise InputError(source, f"bad host list {whole[:60]!r}: {text!r} starts above its end")
    return low, high, len(found.group(1))


def _in(digits: str, ranges: List[Tuple[int, int, int]]) -> bool:
    if len(digits) > 30:
        return False
    number = int(digits)
    return any(low <= number <= high and digits == "%0*d" % (width, number) for low, high, width in ranges)


PORT_SUFFIX = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]+)):(?P<port>\d+)$")


def _ssh_destination(name: str) -> Optional[str]:
    """Why `user@node`, `node:port` or `ssh://...` is not a node name here, with the ssh_config lines that say
    it: the name is also the node's name in the report, in the job's hostfile and to the other nodes, where a
    user or a port has no place (OpenSSH itself reads `node:2222` as a host of that name)."""
    text = name[len("ssh://"):].rstrip("/") if name.lower().startswith("ssh://") else name
    user, at, host = text.rpartition("@")
    m = PORT_SUFFIX.match(host)
    port = m.group("port") if m else None
    host = (m.group("v6") or m.group("host")) if m else host
    if not at and port is None and text == name:
        return None
    lines = "".join(f"; {line}" for line, given in (("User " + user, at), ("Port " + str(port), port)) if given)
    return (f"{name!r}: list the node as {host} and say how to reach it in ssh_config (~/.ssh/config or "
            f"--ssh-config's file): Host {host}{lines}")


def validate(names: Sequence[str], source: str) -> List[str]:
    if not names:
        raise InputError(source, "no hosts given")
    seen = set()
    for name in names:
        if not name or not name.strip():
            raise InputError(source, "an empty host name")
        written = _ssh_destination(name)
        if written:
            raise InputError(source, written)
        if not NODE_NAME.match(name):
            raise InputError(source, f"{name!r} is not a host name, address or ssh_config alias")
        if name in seen:
            raise InputError(source, f"host {name!r} is listed twice")
        seen.add(name)
    return list(names)


def from_slurm() -> List[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise InputError("--slurm", "SLURM_JOB_NODELIST is not set: run inside an allocation (salloc, sbatch)")
    return validate(expand(nodelist, "SLURM_JOB_NODELIST"), "SLURM_JOB_NODELIST")


def head_first(names: List[str], main_process_ip: Optional[str]) -> List[str]:
    """accelerate's main_process_ip names the head: when it is one of the nodes, it goes first."""
    if main_process_ip in names:
        return [main_process_ip] + [n for n in names if n != main_process_ip]
    return names


def fold(names: Sequence[str]) -> str:
    """n01,n02,n03 -> n[01-03] (names hostlist cannot fold are listed as they are)."""
    numbered = _fold_numbered(names)
    if numbered is not None:
        return numbered
    import hostlist

    try:
        return hostlist.collect_hostlist(list(names))
    except Exception:
        return ",".join(names)


# A name as hostlist splits it to fold: what comes before its last number (no digit at its end), and that number.
NUMBERED = re.compile(r"([^\s\[\],]*?)([0-9]+)")


def _fold_numbered(names: Sequence[str]) -> Optional[str]:
    """hostlist.collect_hostlist's answer for the usual cluster without its general walk (milliseconds at
    4,096 names, and a report folds many sets): names that are one prefix and a number. As collect_hostlist_1
    does, the numbers are taken in order (by value, then width), duplicates dropped, and a run goes on while the
    next number, written as wide as its first, is a name (node9999 runs on to node10000; n1 and n01 stay apart);
    a single name stays as it is. None for any other names."""
    first = NUMBERED.fullmatch(names[0]) if names else None
    if first is None:
        return None
    prefix = first.group(1)
    if not all(map(str.startswith, names, itertools.repeat(prefix))):
        return None
    tails = {name[len(prefix):] for name in names}
    digits = "".join(tails)
    if not (digits.isascii() and digits.isdigit() and all(tails)):
        return None
    if len(tails) == 1:
        return names[0]
    widths = {len(tail) for tail in tails}
    if len(widths) == 1:  # the usual cluster (node0001-node16384): a run is the next numbers, each as wide
        width = widths.pop()
        numbers = sorted(map(int, tails))
        runs, low = [], numbers[0]
        for before, number in zip(numbers, numbers[1:]):
            if number != before + 1:
                runs.append((low, before, width))
                low = number
        runs.append((low, numbers[-1], width))
        return _ranges(prefix, runs)
    remaining, runs = set(tails), []
    for number, width, text in sorted((int(tail), len(tail), tail) for tail in tails):
        if text not in remaining:  # inside a run already taken
            continue
        low = number
        while text in remaining:  # each number written once
            remaining.discard(text)
            number += 1
            text = f"{number:0{width}d}"
        runs.append((low, number - 1, width))
    return _ranges(prefix, runs)


def _ranges(prefix: str, runs: List[Tuple[int, int, int]]) -> str:
    return prefix + "[" + ",".join(f"{a:0{w}d}" if a == b else f"{a:0{w}d}-{b:0{w}d}" for a, b, w in runs) + "]"
