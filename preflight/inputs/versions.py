"""Versions as pip compares them, and the table of known defects (known_defects.toml, beside this module) that
PKG008 judges each node's versions against.

Comparison is packaging's (the library pip vendors): `0.15.4` > `0.9.3`, a local label (`2.5.1+cu121`, `+cpu`,
`+rocm6.2`) never hides the release it labels, and a pre-release (NGC's `2.8.0a0+5228986c39.nv25.05`, a nightly's
`.dev20250101`) sorts below its release, so `==2.7.0` does not catch `2.7.0a0`. Ranges include pre-releases
(`>=2.4` holds NGC's `2.8.0a0`), which pip leaves out only when it chooses what to install."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from packaging.markers import InvalidMarker, Marker, UndefinedEnvironmentName, UndefinedComparison
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TABLE = Path(__file__).with_name("known_defects.toml")
# What a row may judge: the distributions (NCCL is the nvidia-nccl wheel torch depends on), torch's CUDA build,
# and what NVML reports (the driver and the CUDA version it runs).
PACKAGES = ("torch", "nccl", "deepspeed", "accelerate", "transformers", "peft", "trl", "flash-attn", "torch-cuda",
            "nvidia-driver", "cuda-driver", "python")
FROM_NVML = ("nvidia-driver", "cuda-driver")
STATUSES = ("warn", "fail")


def version(text) -> Optional[Version]:
    """The version text as pip reads it, None where pip would not (a missing or malformed Version)."""
    try:
        return Version(str(text).strip())
    except (InvalidVersion, TypeError):
        return None


def specifiers(spec: str) -> Optional[SpecifierSet]:
    """The PEP 440 specifiers SPEC as pip reads them (pre-releases included), None where pip would not."""
    try:
        return SpecifierSet(spec, prereleases=True)
    except InvalidSpecifier:
        return None


def within(text, spec: str, posts_affected: bool = False) -> bool:
    """Whether version TEXT is in the range SPEC (PEP 440 specifiers, pre-releases included). With
    POSTS_AFFECTED a .post release counts as the release it follows (`2.29.2.post1` as `2.29.2`)."""
    found = version(text)
    if found is None:
        return False
    wanted = SpecifierSet(spec, prereleases=True)
    if found in wanted:
        return True
    return posts_affected and found.is_postrelease and Version(found.base_version) in wanted


@dataclass(frozen=True)
class Defect:
    """One row of the table: a package's affected range, under its conditions, and where it is confirmed."""

    id: str
    package: str
    affected: str
    symptom: str
    source: str
    confirmed: str
    fixed: str = ""  # the release to move to; empty for a pair that a move of either package resolves
    fix: str = ""  # what else to do (a workaround, the other side of a pair)
    status: str = "warn"
    posts_affected: bool = False
    with_: Tuple[Tuple[str, str], ...] = ()  # other packages and the ranges they must be in too
    env: Tuple[Tuple[str, str], ...] = ()  # variables the node must set to these values
    workaround: Tuple[Tuple[str, str], ...] = ()  # variables whose values mean the workaround is in place
    python: str = ""
    needs: Tuple[str, ...] = ()  # the packages whose version the row reads

    def shown(self) -> str:
        conditions = [f"{p} {s}" for p, s in self.with_] + [f"{n}={v}" for n, v in self.env]
        conditions += [f"python {self.python}"] if self.python else []
        return f"{self.package} {self.affected}" + (f" with {', '.join(conditions)}" if conditions else "")


class TableError(ValueError):
    pass


def _pairs(row: dict, key: str, where: str, packages: bool = False) -> Tuple[Tuple[str, str], ...]:
    value = row.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TableError(f"{where}: {key} must be a table of strings")
    for name, spec in value.items():
        if packages and name not in PACKAGES:
            raise TableError(f"{where}: {key}.{name} is not one of {', '.join(PACKAGES)}")
        if packages:
            _spec(spec, f"{where}: {key}.{name}")
    return tuple(sorted(value.items()))


def _spec(spec: str, where: str) -> str:
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        raise TableError(f"{where}: {spec!r} is not a version range (PEP 440 specifiers, such as '>=2.4,<2.6')")
    return spec


def parse_table(text: str, path: str = str(TABLE)) -> Tuple[Defect, ...]:
    """The rows of a known-defects table; a TableError naming the file and the row for anything malformed."""
    try:
        rows = tomllib.loads(text).get("defect", [])
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{path}: not TOML ({str(exc).split(' (at ')[0]})")
    defects, seen = [], set()
    for n, row in enumerate(rows, 1):
        where = f"{path}: defect {row.get('id') or n}"
        missing = [k for k in ("id", "package", "affected", "symptom", "source", "confirmed") if not row.get(k)]
        if missing:
            raise TableError(f"{where}: {', '.join(missing)} missing")
        unknown = set(row) - {"id", "package", "affected", "symptom", "source", "confirmed", "fixed", "fix",
                              "status", "posts_affected", "with", "env", "workaround", "python"}
        if unknown:
            raise TableError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        if row["id"] in seen:
            raise TableError(f"{where}: the id is used twice")
        seen.add(row["id"])
        if row["package"] not in PACKAGES:
            raise TableError(f"{where}: package {row['package']!r} is not one of {', '.join(PACKAGES)}")
        if row.get("status", "warn") not in STATUSES:
            raise TableError(f"{where}: status must be one of {', '.join(STATUSES)}")
        if row.get("fixed") and version(row["fixed"]) is None:
            raise TableError(f"{where}: fixed {row['fixed']!r} is not a version")
        with_ = _pairs(row, "with", where, packages=True)
        defects.append(Defect(
            id=row["id"], package=row["package"], affected=_spec(row["affected"], f"{where}: affected"),
            symptom=row["symptom"], source=row["source"], confirmed=row["confirmed"], fixed=row.get("fixed", ""),
            fix=row.get("fix", ""), status=row.get("status", "warn"), posts_affected=bool(row.get("posts_affected")),
            with_=with_, env=_pairs(row, "env", where), workaround=_pairs(row, "workaround", where),
            python=_spec(row["python"], f"{where}: python") if row.get("python") else "",
            needs=(row["package"],) + tuple(p for p, _ in with_) + (("python",) if row.get("python") else ())))
    return tuple(defects)


@functools.lru_cache(maxsize=None)
def known_defects() -> Tuple[Defect, ...]:
    """The table shipped with preflight (read once)."""
    return parse_table(TABLE.read_text(encoding="utf-8"))


def judge(defect: Defect, found: Dict[str, Optional[str]], unknown: Dict[str, str], env: Dict[str, str]):
    """How a row stands on a node: "applies", "worked around", ("skipped", reason) or None (it does not apply).
    FOUND: the node's version of each package (None where it is not installed); UNKNOWN: the packages the node
    could not tell, with the reason (no NVML). A row is skipped only where all the node did tell matches."""
    conditions = ((defect.package, defect.affected, defect.posts_affected),) + tuple(
        (p, spec, False) for p, spec in defect.with_) + ((("python", defect.python, False),) if defect.python else ())
    pending = []
    for package, spec, posts in conditions:
        if package in unknown:
            pending.append(unknown[package])
        elif not within(found.get(package), spec, posts):
            return None
    if not all(env.get(name) == value for name, value in defect.env):
        return None
    if pending:
        return "skipped", pending[0]
    if defect.workaround and all(env.get(name) == value for name, value in defect.workaround):
        return "worked around"
    return "applies"


# --- what the installed distributions declare they need -----------------------------------------------------

def requirement_name(line) -> str:
    """The distribution a Requires-Dist line names, normalised as pip compares names ("" where unreadable)."""
    try:
        return Requirement(str(line)).name.lower().replace("_", "-").replace(".", "-")
    except InvalidRequirement:
        return ""


def unmet_requirements(requires: Dict[str, list], installed: Dict[str, Optional[str]], python: Optional[str]):
    """(distribution, its requirement, the installed version) for each requirement a distribution's metadata
    declares (Requires-Dist, with its markers as pip evaluates them on the node, the `torch` extra included: the
    one transformers asks for) that another installed distribution does not meet. Missing distributions are not
    judged here: importing the package says so at once."""
    unmet = []
    for owner, lines in sorted(requires.items()):
        for line in lines or ():
            name = requirement_name(line)
            if not name:
                continue  # pip would not have installed a distribution whose metadata it cannot read
            requirement = Requirement(str(line))
            have = installed.get(name)
            if not have or version(have) is None or not _applies(requirement.marker, python):
                continue
            if not requirement.specifier.contains(have, prereleases=True):
                unmet.append((owner, str(requirement).split(";")[0].strip(), name, have))
    return unmet


def _applies(marker: Optional[Marker], python: Optional[str]) -> bool:
    if marker is None:
        return True
    environment = {"extra": ""}
    if python:
        environment.update(python_version=".".join(python.split(".")[:2]), python_full_version=python)
    try:
        return any(marker.evaluate(dict(environment, extra=extra)) for extra in ("", "torch"))
    except (InvalidMarker, UndefinedEnvironmentName, UndefinedComparison):
        return False
