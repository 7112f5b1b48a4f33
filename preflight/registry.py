"""Declaring checks, and finding them through the `preflight.checks` entry-point group.

Built-in checks and third-party checks are found the same way: every module named by an entry
point in that group is imported, and each function in it declared with `@check` is registered.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ENTRY_POINT_GROUP = "preflight.checks"
SCOPES = ("config", "node", "cluster")
ID_PATTERN = re.compile(r"^[A-Z]{2,8}[0-9]{3}$")
NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
TAG_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]*$")
READ_PATTERN = re.compile(r"^[a-z_]+(\.[A-Za-z0-9_]+)?$")  # a facts section, or a key of one: host.machine
MARK = "__preflight_check__"


class CheckDefinitionError(Exception):
    """A check declared wrongly; the message names the module."""


@dataclass(frozen=True)
class CheckSpec:
    id: str
    name: str
    scope: str
    tags: Tuple[str, ...]
    what: str
    why: str
    fix: str
    func: Callable
    module: str
    # A node check's facts sections, when it reads nothing else of its node (runner: evaluated once per distinct
    # set of them); None: it may read anything.
    reads: Optional[Tuple[str, ...]] = None

    @functools.cached_property
    def paths(self) -> Dict[str, Optional[Tuple[str, ...]]]:
        """`reads` as section -> None (all of it) or the keys declared of it (made once per check)."""
        paths: Dict[str, Optional[set]] = {}
        for name in self.reads or ():
            section, _, key = name.partition(".")
            if not key:
                paths[section] = None
            elif section not in paths or paths[section] is not None:
                paths.setdefault(section, set()).add(key)
        return {section: tuple(sorted(keys)) if keys is not None else None for section, keys in paths.items()}

    @property
    def family(self) -> str:
        return self.id[:-3]


def check(id: str, name: str, scope: str, tags: Sequence[str] = (), reads: Optional[Sequence[str]] = None) -> Callable:
    """Declare a check: `@check("CFG001", "accelerate-keys", "config", tags=["accelerate"])`.

    The function takes a CheckContext and yields Findings. Its docstring has three paragraphs:
    what it checks, why it matters, how to fix. A node check may name the sections of its node's facts it
    reads (`reads=["packages", "env"]`): it then reads nothing else of the node but the plan (another section
    raises), and nodes whose sections are the same objects (the gathering shares identical ones) share its
    findings, each for its own node.
    """

    def declare(func: Callable) -> Callable:
        setattr(func, MARK, _spec(func, id, name, scope, tuple(tags), reads))
        return func

    return declare


def _spec(func: Callable, id: str, name: str, scope: str, tags: Tuple[str, ...],
          reads: Optional[Sequence[str]] = None) -> CheckSpec:
    where = f"{func.__module__}.{func.__qualname__}"

    def bad(problem: str) -> CheckDefinitionError:
        return CheckDefinitionError(f"check {id!r} in {where}: {problem}")

    if not isinstance(id, str) or not ID_PATTERN.match(id):
        raise bad("ID must be an upper-case family prefix and three digits, such as CFG001")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise bad(f"name {name!r} must be kebab-case, such as clock-skew")
    if scope not in SCOPES:
        raise bad(f"scope {scope!r} must be one of {', '.join(SCOPES)}")
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.match(tag):
            raise bad(f"tag {tag!r} must be lower-case words joined by '-'")
    if reads is not None and (scope != "node" or isinstance(reads, str) or
                              not all(isinstance(r, str) and READ_PATTERN.match(r) for r in reads)):
        raise bad("reads names a node check's facts sections or keys of one, such as reads=['packages', 'host.machine']")
    paragraphs = [p.replace("\n", " ") for p in inspect.cleandoc(func.__doc__ or "").split("\n\n") if p.strip()]
    if len(paragraphs) != 3:
        raise bad("docstring must have three paragraphs: what it checks, why it matters, how to fix")
    return CheckSpec(id, name, scope, tags, *paragraphs, func=func, module=func.__module__,
                     reads=tuple(reads) if reads is not None else None)


def checks_in(module) -> List[CheckSpec]:
    """The checks a module declares, in the order they appear in its source. A package (a family split into
    modules by topic) declares those of the modules it imports too, module by module in the order of their
    names: they are the package's checks, registered under its name (the module its entry point names)."""
    specs = _declared_in(module)
    if hasattr(module, "__path__"):
        found = {id(spec.func) for spec in specs}
        prefix = module.__name__ + "."
        inside = [m for m in vars(module).values() if inspect.ismodule(m) and m.__name__.startswith(prefix)]
        for submodule in sorted(inside, key=lambda m: m.__name__):
            for spec in _declared_in(submodule):
                if id(spec.func) not in found:
                    found.add(id(spec.func))
                    specs.append(replace(spec, module=module.__name__))
    return specs


def _declared_in(module) -> List[CheckSpec]:
    specs = [getattr(obj, MARK) for obj in vars(module).values() if callable(obj) and hasattr(obj, MARK)]
    # The code object's line number, not inspect.getsourcelines: that tokenizes every file (0.1 s at start-up).
    return sorted(specs, key=lambda s: getattr(getattr(s.func, "__code__", None), "co_firstlineno", 0))


@dataclass(frozen=True)
class Registry:
    checks: Tuple[CheckSpec, ...]
    problems: Tuple[str, ...]  # plugins that could not be loaded, and checks that were rejected

    def get(self, check_id: str) -> Optional[CheckSpec]:
        return next((c for c in self.checks if c.id == check_id.upper()), None)


def build(modules: Iterable[Tuple[str, object]]) -> Registry:
    """Register the checks of (distribution, module) pairs, rejecting duplicate IDs and names."""
    by_id, by_name, problems = {}, {}, []
    for dist, module in modules:
        for spec in checks_in(module):
            other = by_id.get(spec.id) or by_name.get(spec.name)
            if other is not None:
                problems.append(
                    f"check {spec.id} ({spec.name}) in {spec.module} from {dist} is not registered: "
                    f"{other.id} ({other.name}) in {other.module} already uses that ID or name"
                )
                continue
            by_id[spec.id] = by_name[spec.name] = spec
    checks = sorted(by_id.values(), key=lambda s: s.id)
    return Registry(tuple(checks), tuple(problems))


def load() -> Registry:
    """Import every module in the entry-point group; a plugin that fails is reported, not fatal."""
    modules, problems = [], []
    # Built-ins first, so that a plugin can never take over a built-in ID.
    for dist, ep in sorted(entry_points(), key=lambda pair: (pair[0] != "preflight", pair[1].value)):
        try:
            module = ep.load()
        except (Exception, SystemExit) as exc:  # a broken plugin must not stop the run, nor end it
            problems.append(f"plugin {ep.name!r} ({ep.value}) from {dist} failed to load: {type(exc).__name__}: {exc}")
            continue
        if inspect.ismodule(module):
            modules.append((dist, module))
        else:
            problems.append(f"plugin {ep.name!r} ({ep.value}) from {dist} names {type(module).__name__}, not a module")
    registry = build(modules)
    return Registry(registry.checks, tuple(problems) + registry.problems)


@dataclass(frozen=True)
class EntryPoint:
    """A line `name = module[:attribute] [extras]` of a distribution's entry_points.txt."""
    name: str
    value: str

    def load(self):
        module, _, attribute = self.value.split("[", 1)[0].partition(":")
        found = importlib.import_module(module.strip())
        for part in filter(None, attribute.strip().split(".")):
            found = getattr(found, part)
        return found


def entry_points() -> List[Tuple[str, EntryPoint]]:
    """(distribution's name, entry point) for each entry point in ENTRY_POINT_GROUP, read as importlib.metadata
    reads entry_points.txt, from the distributions it would walk (collector.installed_distributions)."""
    from preflight.node.packages import distribution_file, distribution_key, installed_distributions, name_and_version

    found, seen = [], set()
    for folder in installed_distributions():
        key = distribution_key(folder)
        if key in seen:  # the first of a name on sys.path, as import finds it (importlib.metadata's _unique)
            continue
        seen.add(key)
        text = distribution_file(folder, "entry_points.txt")
        if not text or f"[{ENTRY_POINT_GROUP}]" not in text:
            continue
        dist, section = name_and_version(folder)[0] or os.path.basename(folder), None
        for line in (line.strip() for line in text.splitlines()):
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1].strip()
            elif section == ENTRY_POINT_GROUP and "=" in line and not line.startswith("#"):
                name, value = line.split("=", 1)
                found.append((dist, EntryPoint(name.strip(), value.strip())))
    return found


class SelectionError(ValueError):
    pass


def select(checks: Sequence[CheckSpec], only: Sequence[str] = (), skip: Sequence[str] = (),
           known: Optional[Sequence[CheckSpec]] = None) -> List[CheckSpec]:
    """Filter CHECKS (what a command runs) by IDs, ID prefixes (CLK, PKG001), names or tags. A selector that
    matches no check of KNOWN (the whole registry; default CHECKS) is an error; one that matches only checks the
    command does not run is not (a profile's skip = ["CLK002"] holds for `check` and means nothing to `lint`),
    unless --only selects nothing the command runs."""

    def matches(spec: CheckSpec, selector: str) -> bool:
        return spec.id.startswith(selector.upper()) or selector in spec.tags or selector == spec.name

    for selector in list(only) + list(skip):
        if not any(matches(spec, selector) for spec in (known or checks)):
            raise SelectionError(f"selector {selector!r} matches no check ID, ID prefix, name or tag (see `preflight list`)")
    chosen = [s for s in checks if not only or any(matches(s, sel) for sel in only)]
    if only and not chosen:
        raise SelectionError(f"--only {','.join(only)} selects no check this command runs (see `preflight list` "
                             "for each check's scope: config checks run in lint, node and cluster checks in check)")
    return [s for s in chosen if not any(matches(s, sel) for sel in skip)]


def parse_selectors(text: Optional[str]) -> List[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]
