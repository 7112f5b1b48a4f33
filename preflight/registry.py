"""Declaring checks, and finding them through the `preflight.checks` entry-point group.

Built-in checks and third-party checks are found the same way: every module named by an entry
point in that group is imported, and each function in it declared with `@check` is registered.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ENTRY_POINT_GROUP = "preflight.checks"
SCOPES = ("config", "node", "cluster")
ID_PATTERN = re.compile(r"^[A-Z]{2,8}[0-9]{3}$")
NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
TAG_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]*$")
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

    @property
    def family(self) -> str:
        return self.id[:-3]


def check(id: str, name: str, scope: str, tags: Sequence[str] = ()) -> Callable:
    """Declare a check: `@check("CFG001", "accelerate-keys", "config", tags=["accelerate"])`.

    The function takes a CheckContext and yields Findings. Its docstring has three paragraphs:
    what it checks, why it matters, how to fix.
    """

    def declare(func: Callable) -> Callable:
        setattr(func, MARK, _spec(func, id, name, scope, tuple(tags)))
        return func

    return declare


def _spec(func: Callable, id: str, name: str, scope: str, tags: Tuple[str, ...]) -> CheckSpec:
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
    paragraphs = [p.replace("\n", " ") for p in inspect.cleandoc(func.__doc__ or "").split("\n\n") if p.strip()]
    if len(paragraphs) != 3:
        raise bad("docstring must have three paragraphs: what it checks, why it matters, how to fix")
    return CheckSpec(id, name, scope, tags, *paragraphs, func=func, module=func.__module__)


def checks_in(module) -> List[CheckSpec]:
    """The checks a module declares, in the order they appear in its source."""
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
    from importlib.metadata import entry_points

    modules, problems = [], []
    names: Dict[int, str] = {}  # one reading per distribution: the built-ins are a dozen entry points of one
    found = [(_distribution(ep, names), ep) for ep in _group(entry_points())]
    # Built-ins first, so that a plugin can never take over a built-in ID.
    for dist, ep in sorted(found, key=lambda pair: (pair[0] != "preflight", pair[1].value)):
        try:
            modules.append((dist, ep.load()))
        except Exception as exc:  # a broken plugin must not stop the run
            problems.append(f"plugin {ep.name!r} ({ep.value}) from {dist} failed to load: {type(exc).__name__}: {exc}")
    registry = build(modules)
    return Registry(registry.checks, tuple(problems) + registry.problems)


def _distribution(ep, names: Dict[int, str]) -> str:
    """The name of the distribution that declares `ep`, from its metadata's header: Distribution.name runs the
    e-mail parser over the whole file, long description included (5 ms a time for preflight's own README)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    if id(dist) not in names:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        header = text.split("\n\n", 1)[0]
        name = next((line.split(":", 1)[1].strip() for line in header.splitlines() if line.startswith("Name:")), "")
        names[id(dist)] = name or dist.name
    return names[id(dist)]


def _group(eps):
    if hasattr(eps, "select"):
        return eps.select(group=ENTRY_POINT_GROUP)
    return eps.get(ENTRY_POINT_GROUP, [])  # Python 3.9


class SelectionError(ValueError):
    pass


def select(checks: Sequence[CheckSpec], only: Sequence[str] = (), skip: Sequence[str] = ()) -> List[CheckSpec]:
    """Filter by IDs, ID prefixes (CLK, PKG001), names or tags; a selector that matches nothing is an error."""

    def matches(spec: CheckSpec, selector: str) -> bool:
        return spec.id.startswith(selector.upper()) or selector in spec.tags or selector == spec.name

    for selector in list(only) + list(skip):
        if not any(matches(spec, selector) for spec in checks):
            raise SelectionError(f"selector {selector!r} matches no check ID, ID prefix, name or tag (see `preflight list`)")
    chosen = [s for s in checks if not only or any(matches(s, sel) for sel in only)]
    return [s for s in chosen if not any(matches(s, sel) for sel in skip)]


def parse_selectors(text: Optional[str]) -> List[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]
