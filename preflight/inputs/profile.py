"""Profiles: thresholds, version pins, checks to skip and per-host expectations, kept in a file.

A profile is `preflight.toml`, or the `[tool.preflight]` table of a `pyproject.toml`. Anything wrong in
it (an unknown key at any level, a value of the wrong type) is an InputError: exit 2, one line that
names the file, the line where it can be found, and the key.
"""
from __future__ import annotations

import math
import os
import sys
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from preflight.inputs.documents import InputError, read_text
from preflight.inputs.inventory import HostPattern

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

WHAT = "profile"
PYPROJECT_TABLE = ("tool", "preflight")


# --- pins: versions as pip compares them (preflight.inputs.versions) ----------------------------------

OPERATORS = ("===", "==", "!=", "~=", ">=", "<=", ">", "<")


@dataclass(frozen=True)
class Pin:
    """A package and its specifiers: `torch = "2.13.0"` (exactly), `accelerate = ">=1.10,<2"`."""

    package: str
    spec: str  # as written
    specifiers: str  # PEP 440: a bare "2.13.0" is "==2.13.0"

    def allows(self, version: str) -> bool:
        from preflight.inputs.versions import within  # packaging: imported only where pins are judged

        return within(version, self.specifiers)


def parse_pin(package: str, spec: str) -> Optional[Pin]:
    """None when `spec` is not a comma-separated list of (operator) versions pip would read."""
    from preflight.inputs.versions import specifiers

    clauses = []
    for part in spec.split(","):
        part = part.strip()
        clauses.append(part if part.startswith(OPERATORS) else "==" + part)
    written = ",".join(clauses)
    return Pin(normal_name(package), spec, written) if specifiers(written) is not None else None


def normal_name(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()


# --- the profile ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostExpectation:
    """One [[hosts]] entry: what the nodes its pattern names must have."""

    pattern: str  # a hostlist expression (gpu[001-064]), names may hold shell wildcards (gpu*)
    matcher: HostPattern  # matched without expanding: node[0-99999999] is one regular expression, not 10^8 names
    gpus: Optional[int] = None
    gpu_model: Optional[str] = None  # a part of the NVML name, any case: "H100" matches "NVIDIA H100 80GB HBM3"
    line: Optional[int] = None

    def matches(self, node: str) -> bool:
        short = node.split(".")[0] if not node.replace(".", "").isdigit() else node
        return any(self.matcher.matches(n) for n in {node, short})


@dataclass(frozen=True)
class Profile:
    path: str
    thresholds: Tuple[Tuple[str, float], ...] = ()  # as written: (key, value)
    pins: Tuple[Pin, ...] = ()
    skip: Tuple[str, ...] = ()
    hosts: Tuple[HostExpectation, ...] = ()
    skip_line: Optional[int] = None  # where checks.skip is, for an error about one of its selectors
    memory: Tuple[Tuple[str, Any], ...] = ()  # [memory]: model, gpu_memory, host_memory, seq_len (preflight.inputs.models)

    def limits(self, base):
        """`base` (a plan.Limits) with this profile's thresholds."""
        changes = {}
        for key, value in self.thresholds:
            field_name, scale = THRESHOLDS[key][1], THRESHOLDS[key][2]
            changes[field_name] = int(value * scale) if scale != 1 else value
        return replace(base, **changes)

    def expectation(self, node: str) -> Optional[HostExpectation]:
        """The first [[hosts]] entry whose pattern names `node`."""
        return next((h for h in self.hosts if h.matches(node)), None)


# key -> (TOML types accepted, Limits field, factor to the field's unit)
NUMBER, INTEGER = (int, float), (int,)
THRESHOLDS: Dict[str, Tuple[tuple, str, float]] = {
    "clock_warn_s": (NUMBER, "clock_warn_s", 1),
    "clock_fail_s": (NUMBER, "clock_fail_s", 1),
    "shm_fail_mib": (NUMBER, "shm_fail_bytes", 2**20),
    "shm_warn_mib": (NUMBER, "shm_warn_bytes", 2**20),
    "nofile_warn": (INTEGER, "nofile_warn", 1),
    "disk_warn_gib": (NUMBER, "disk_warn_bytes", 2**30),
    "min_busbw_gbps": (NUMBER, "min_busbw_gbps", 1),
}
MAX_THRESHOLD = 2**63  # in the field's unit (bytes, seconds, files): what the kernel's counters can hold
SECTIONS = ("thresholds", "pins", "checks", "hosts", "memory")
CHECKS_KEYS = ("skip",)
HOSTS_KEYS = ("hosts", "gpus", "gpu_model")


def find(directory: str = ".") -> Optional[str]:
    """The profile a run uses without --profile: ./preflight.toml, else ./pyproject.toml when it has a
    [tool.preflight] table."""
    own = os.path.join(directory, "preflight.toml")
    if os.path.isfile(own):
        return own
    pyproject = os.path.join(directory, "pyproject.toml")
    if os.path.isfile(pyproject):
        try:
            text = read_text(pyproject, "pyproject.toml")
        except InputError:
            return None  # not ours to judge: a pyproject we cannot read has no profile for us
        try:
            data = tomllib.loads(text)
        except (ValueError, RecursionError) as exc:  # malformed, too deep, an integer past the digit limit
            if "tool.preflight" in text:  # a profile meant for us, not used: said, and the run goes on
                print(f"preflight: warning: {pyproject}: not read ({_toml_problem(exc)}); its [tool.preflight] "
                      "profile is not used", file=sys.stderr)
            return None
        if isinstance(data.get("tool"), dict) and "preflight" in data["tool"]:
            return pyproject
    return None


def load(path: str) -> Profile:
    text = read_text(path, WHAT)
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        at = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        raise InputError(path, _toml_problem(exc), int(at.group(1)) if at else None) from None
    prefix: Tuple[str, ...] = ()
    if os.path.basename(path) == "pyproject.toml":
        table = data.get("tool", {}).get("preflight") if isinstance(data.get("tool"), dict) else None
        if table is None:
            raise InputError(path, "has no [tool.preflight] table")
        data, prefix = table, PYPROJECT_TABLE
    return _Reader(path, text, prefix).profile(data)


def _toml_problem(exc: BaseException) -> str:
    """What tomllib refused, in one line without its position (given as the line) or Python's advice."""
    if isinstance(exc, RecursionError):
        return "TOML nesting is too deep"
    if not isinstance(exc, tomllib.TOMLDecodeError):  # int() past its digit limit
        return "malformed TOML: an integer with thousands of digits"
    return "malformed TOML: " + (re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc)) or "syntax error")


class _Reader:
    """Validation of the parsed TOML against the schema, with the line of a bad key found in the text."""

    def __init__(self, path: str, text: str, prefix: Tuple[str, ...]):
        self.path, self.lines, self.prefix = path, text.splitlines(), prefix

    def error(self, keys: Tuple[Any, ...], problem: str) -> InputError:
        return InputError(self.path, problem, self.line_of(keys))

    def line_of(self, keys: Tuple[Any, ...]) -> Optional[int]:
        """The line of a key, searched in the text: each key after the previous one's line; an int is the
        n-th [[table]] of an array of tables."""
        start, found = 0, None
        if self.prefix:  # pyproject.toml: from the first [tool.preflight...] header
            header = re.compile(r"^\s*\[\[?\s*tool\.preflight\b")
            start = next((i for i, l in enumerate(self.lines) if header.match(l)), 0)
        previous = None
        for key in keys:
            if isinstance(key, int):
                header = re.compile(r"^\s*\[\[\s*(?:tool\.preflight\.)?%s\s*\]\]" % re.escape(str(previous)))
                hits = [i for i, l in enumerate(self.lines) if i >= (found or start) and header.match(l)]
                if len(hits) <= key:
                    return found + 1 if found is not None else None
                found = start = hits[key]
            else:
                name = re.escape(str(key))
                pattern = re.compile(r"^\s*\[\[?\s*(?:[\w.\"'-]+\.)?[\"']?%s[\"']?\s*\]\]?|"
                                     r"(?:^|[{,])\s*[\"']?%s[\"']?\s*=" % (name, name))
                hit = next((i for i in range(start, len(self.lines)) if pattern.search(self.lines[i])), None)
                if hit is None:
                    return found + 1 if found is not None else None
                found = start = hit
            previous = key
        return found + 1 if found is not None else None

    def table(self, value: Any, keys: Tuple[Any, ...], allowed: Tuple[str, ...], what: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.error(keys, f"{what} must be a table, found {_kind(value)}")
        for key in value:
            if key not in allowed:
                where = f" in {what}" if keys or self.prefix else ""
                raise self.error(keys + (key,), f"unknown key {key!r}{where}; known there: {', '.join(allowed)}")
        return value

    def typed(self, value: Any, keys: Tuple[Any, ...], types: tuple, what: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, types):
            raise self.error(keys, f"{_dotted(keys)} must be {what}, found {_kind(value)} {value!r}")
        return value

    def positive(self, value: Any, keys: Tuple[Any, ...], types: tuple, what: str, scale: float = 1) -> Any:
        self.typed(value, keys, types, what)
        if not value > 0:
            raise self.error(keys, f"{_dotted(keys)} must be positive, found {value!r}")
        if not math.isfinite(value * scale) or value * scale > MAX_THRESHOLD:  # inf, 1e308 GiB: no limit is that
            raise self.error(keys, f"{_dotted(keys)} must be a finite number a node can reach, found {value!r}")
        return value

    def profile(self, data: Mapping[str, Any]) -> Profile:
        self.table(data, (), SECTIONS, "[tool.preflight]" if self.prefix else "the profile")
        thresholds = []
        raw = self.table(data.get("thresholds", {}), ("thresholds",), tuple(THRESHOLDS), "[thresholds]")
        for key, value in raw.items():
            types = THRESHOLDS[key][0]
            thresholds.append((key, self.positive(value, ("thresholds", key), types,
                                                  "a whole number" if types == INTEGER else "a number",
                                                  THRESHOLDS[key][2])))
        pins = []
        raw = data.get("pins", {})
        if not isinstance(raw, dict):
            raise self.error(("pins",), f"[pins] must be a table, found {_kind(raw)}")
        for package, spec in raw.items():
            self.typed(spec, ("pins", package), (str,), 'a version string such as "2.13.0" or ">=1.10,<2"')
            pin = parse_pin(package, spec)
            if pin is None:
                raise self.error(("pins", package), f"pins.{package} {spec!r} is not a version specifier: use "
                                 "versions with ==, !=, >=, <=, >, <, ~= (comma-separated, as pip reads them), "
                                 "such as \">=1.10,<2\"")
            pins.append(pin)
        checks = self.table(data.get("checks", {}), ("checks",), CHECKS_KEYS, "[checks]")
        skip = checks.get("skip", [])
        if not isinstance(skip, list) or not all(isinstance(s, str) and s.strip() for s in skip):
            raise self.error(("checks", "skip"), f"checks.skip must be a list of check IDs, ID prefixes, names or "
                             f"tags, such as [\"CLK002\", \"SYS\"], found {skip!r}")
        hosts = data.get("hosts", [])
        if not isinstance(hosts, list):
            raise self.error(("hosts",), "hosts must be an array of tables ([[hosts]]), found " + _kind(hosts))
        return Profile(self.path, tuple(thresholds), tuple(pins), tuple(s.strip() for s in skip),
                       tuple(self.host(entry, i) for i, entry in enumerate(hosts)),
                       self.line_of(("checks", "skip")) if skip else None, self.memory(data.get("memory", {})))

    def memory(self, value: Any) -> Tuple[Tuple[str, Any], ...]:
        """[memory]: strings or numbers, read by preflight.inputs.models.inputs (which says what a bad one is)."""
        from preflight.inputs.models import PROFILE_KEYS

        table = self.table(value, ("memory",), PROFILE_KEYS, "[memory]")
        for key, item in table.items():
            self.typed(item, ("memory", key), (str, int, float), 'a string or a number, such as "7B" or "80GB"')
        return tuple(table.items())

    def host(self, entry: Any, index: int) -> HostExpectation:
        keys = ("hosts", index)
        self.table(entry, keys, HOSTS_KEYS, f"[[hosts]] entry {index + 1}")
        if "hosts" not in entry:
            raise self.error(keys, f"[[hosts]] entry {index + 1} has no hosts = \"PATTERN\" (such as \"gpu[001-064]\")")
        pattern = self.typed(entry["hosts"], keys + ("hosts",), (str,), 'a host pattern such as "gpu[001-064]"')
        try:
            matcher = HostPattern(pattern, self.path, wildcards=True)
        except InputError as exc:
            raise self.error(keys + ("hosts",), f"hosts: {exc.problem}") from None
        if not matcher.alternatives:
            raise self.error(keys + ("hosts",), "hosts is an empty pattern")
        gpus = entry.get("gpus")
        if gpus is not None:
            self.typed(gpus, keys + ("gpus",), INTEGER, "a whole number")
            if gpus < 0:
                raise self.error(keys + ("gpus",), f"hosts.gpus must be 0 or more, found {gpus}")
        model = entry.get("gpu_model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise self.error(keys + ("gpu_model",), f"hosts.gpu_model must be a GPU name such as \"H100\", found {model!r}")
        return HostExpectation(pattern, matcher, gpus, model.strip() if model else None, self.line_of(keys))


def _dotted(keys: Tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in keys if not isinstance(k, int))


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)
