"""Versions as pip compares them, and the table of known defects (known_defects.toml, beside this module) that
PKG008 judges each node's versions against.

Comparison is packaging's (the library pip vendors): `0.15.4` > `0.9.3`, a local label (`2.5.1+cu121`, `+cpu`,
`+rocm6.2`) never hides the release it labels, and a pre-release (NGC's `2.8.0a0+5228986c39.nv25.05`, a nightly's
`.dev20250101`) sorts below its release, so `==2.7.0` does not catch `2.7.0a0`. Ranges include pre-releases
(`>=2.4` holds NGC's `2.8.0a0`), which pip leaves out only when it chooses what to install."""
from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from packaging.markers import InvalidMarker, Marker, UndefinedEnvironmentName, UndefinedComparison
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TABLE = Path(__file__).with_name("known_defects.toml")
# What a row may judge: the distributions (NCCL is the one torch loads: preflight.node.packages), torch's CUDA build,
# and what NVML reports (the driver and the CUDA version it runs).
PACKAGES = ("torch", "nccl", "deepspeed", "accelerate", "transformers", "peft", "trl", "flash-attn", "bitsandbytes",
            "torch-cuda", "nvidia-driver", "cuda-driver", "python")
FROM_NVML = ("nvidia-driver", "cuda-driver")
STATUSES = ("warn", "fail")
# What a row's `when` may ask of the job, and the values each condition takes: a list of choices (the job's value
# is one of them), or a boolean. `code` is text: a condition only the training code decides, never known before
# launch. preflight.inputs.settings.job_conditions and PKG008 read the job's answers.
CONDITIONS = {
    "precision": ("fp16", "bf16", "fp32"), "zero_stage": (0, 1, 2, 3), "fsdp_version": (1, 2), "optimizer": str,
    "launcher": ("deepspeed", "accelerate", "torchrun", "srun", "mpirun", "python"),
    "rdzv_backend": str, "deepspeed_multinode_launcher": ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh",
                                                          "slurm"),
    "machine": str, "net_plugin": str, "deepspeed_env": ("both", "one", "none"),
    "offload_optimizer": bool, "offload_param": bool, "gradient_clipping": bool, "moe": bool, "container": bool,
    "sys_nice": bool, "code": "text",
}


def version(text) -> Optional[Version]:
    """The version text as pip reads it, None where pip would not (a missing or malformed Version)."""
    return _read(text) if type(text) is str else _read.__wrapped__(text)


@functools.lru_cache(maxsize=1024)  # the same few texts on thousands of nodes (a Version is never changed)
def _read(text) -> Optional[Version]:
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
    when: Tuple[Tuple[str, Any], ...] = ()  # the job's conditions (CONDITIONS): each must hold
    needs: Tuple[str, ...] = ()  # the packages whose version the row reads

    def shown(self) -> str:
        conditions = [f"{p} {s}" for p, s in self.with_] + [f"{n}={v}" for n, v in self.env]
        conditions += [f"python {self.python}"] if self.python else []
        conditions += [condition_text(name, value) for name, value in self.when]
        return f"{self.package} {self.affected}" + (f" with {', '.join(conditions)}" if conditions else "")


def condition_text(name: str, value: Any) -> str:
    """A `when` condition as the docs and messages say it: "ZeRO stage 1 or 2", "no offload param"."""
    if name == "code":
        return f"code that {value}"
    if isinstance(value, bool):
        return name.replace("_", " ") if value else f"no {name.replace('_', ' ')}"
    label = {"zero_stage": "ZeRO stage", "deepspeed_env": ".deepspeed_env in"}.get(name, name.replace("_", " "))
    values = value if isinstance(value, (tuple, list)) else (value,)  # a row's choices, or the job's one value
    return f"{label} {' or '.join(str(v) for v in values)}"


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


def _when(row: dict, where: str) -> Tuple[Tuple[str, Any], ...]:
    """The row's job conditions, each checked against CONDITIONS: a list of choices becomes a tuple."""
    value = row.get("when", {})
    if not isinstance(value, dict):
        raise TableError(f"{where}: when must be a table")
    conditions = []
    for name, wanted in sorted(value.items()):
        kind = CONDITIONS.get(name)
        if kind is None:
            raise TableError(f"{where}: when.{name} is not one of {', '.join(CONDITIONS)}")
        if kind is bool or kind == "text":
            if not isinstance(wanted, bool if kind is bool else str) or wanted == "":
                raise TableError(f"{where}: when.{name} must be {'true or false' if kind is bool else 'text'}")
            conditions.append((name, wanted))
            continue
        choices = wanted if isinstance(wanted, list) else [wanted]
        allowed = kind if isinstance(kind, tuple) else None
        bad = [c for c in choices if isinstance(c, bool) or not (c in allowed if allowed else isinstance(c, str) and c)]
        if not choices or bad:
            raise TableError(f"{where}: when.{name} must list " + (', '.join(map(str, allowed)) if allowed
                                                                   else "names") + f", not {bad or wanted!r}")
        conditions.append((name, tuple(choices)))
    return tuple(conditions)


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
                              "status", "posts_affected", "with", "env", "workaround", "python", "when"}
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
            python=_spec(row["python"], f"{where}: python") if row.get("python") else "", when=_when(row, where),
            needs=(row["package"],) + tuple(p for p, _ in with_) + (("python",) if row.get("python") else ())))
    return tuple(defects)


@functools.lru_cache(maxsize=None)
def known_defects() -> Tuple[Defect, ...]:
    """The table shipped with preflight (read once)."""
    return parse_table(TABLE.read_text(encoding="utf-8"))


def judge(defect: Defect, found: Dict[str, Optional[str]], unknown: Dict[str, str], env: Dict[str, str],
          job: Optional[Dict[str, Any]] = None):
    """How a row stands on a node: "applies", "worked around", ("skipped", reason) or None (it does not apply).
    FOUND: the node's version of each package (None where it is not installed); JOB: the job's answer to each
    condition (CONDITIONS) it gave; UNKNOWN: the packages and conditions that could not be told, with the reason
    (no NVML, no DeepSpeed config given). A row is skipped only where all that was told matches."""
    conditions = ((defect.package, defect.affected, defect.posts_affected),) + tuple(
        (p, spec, False) for p, spec in defect.with_) + ((("python", defect.python, False),) if defect.python else ())
    job = job or {}
    pending = []
    for package, spec, posts in conditions:
        if package in unknown:
            pending.append(unknown[package])
        elif not within(found.get(package), spec, posts):
            return None
    if not all(env.get(name) == value for name, value in defect.env):
        return None
    for name, wanted in defect.when:
        if name == "code":
            pending.append(f"only the training code tells whether it {wanted}")
        elif name in job:
            if not meets(job[name], wanted):
                return None
        else:
            pending.append(unknown.get(name) or f"the job's {name.replace('_', ' ')} is not known")
    if pending:
        return "skipped", "; ".join(dict.fromkeys(pending))
    if defect.workaround and all(env.get(name) == value for name, value in defect.workaround):
        return "worked around"
    return "applies"


def meets(value: Any, wanted: Any) -> bool:
    """Whether the job's VALUE for a condition is what the row asks: the boolean itself, or one of its choices
    (a job's several values, such as the net plugins it loads, meet it when one of them does)."""
    if isinstance(wanted, bool):
        return value is wanted
    return any(v in wanted for v in (value if isinstance(value, (tuple, list, set, frozenset)) else (value,)))


# --- what the installed distributions declare they need -----------------------------------------------------

def requirement_name(line) -> str:
    """The distribution a Requires-Dist line names, normalised as pip compares names ("" where unreadable)."""
    try:
        return normalized(Requirement(str(line)).name)
    except InvalidRequirement:
        return ""


# Extras that never describe how a library runs with another (tooling, tests, docs, everything at once).
NOT_RUNTIME_EXTRAS = ("dev", "test", "tests", "testing", "quality", "docs", "doc", "all", "benchmark", "benchmarks",
                      "style", "lint", "typing")
# Where an extra's lower bound is enforced at run time although pip never checked it: (library, the required
# distribution) -> the code that refuses an older one.
ENFORCED_BY = {
    ("transformers", "accelerate"): "transformers refuses it at import (dependency_versions_check.py, "
                                    "require_version_core, whenever accelerate is installed)",
    ("transformers", "deepspeed"): "transformers refuses it when its DeepSpeed integration starts "
                                   "(integrations/deepspeed.py, dep_version_check)",
}


@dataclass(frozen=True)
class Unmet:
    """A declared requirement the node's installed version does not meet."""

    owner: str  # the distribution that declares it
    requirement: str  # as its metadata writes it, without the marker
    name: str  # the distribution it names
    have: str  # the version installed
    extras: Tuple[str, ...]  # () for a hard requirement (pip check refuses it), else the extras that add it
    lower: bool  # the installed version is below a lower bound (>=, >, ~=, ==) of the requirement

    @property
    def enforced_by(self) -> str:
        return ENFORCED_BY.get((self.owner, self.name), "")


def runtime_extra(extra: str, installed: Dict[str, Optional[str]]) -> bool:
    """Whether an extra describes how its library runs with another that is installed ([torch], [deepspeed],
    [sentencepiece] with that distribution on the node), never tooling ([dev], [test], [quality], [docs], [all])."""
    name = normalized(extra)
    if name in NOT_RUNTIME_EXTRAS or name.startswith(tuple(f"{e}-" for e in NOT_RUNTIME_EXTRAS)):
        return False
    return bool(installed.get(name))


def normalized(name: str) -> str:
    return str(name).lower().replace("_", "-").replace(".", "-")


def unmet_requirements(requires: Dict[str, list], installed: Dict[str, Optional[str]], python: Optional[str]):
    """Unmet, for each requirement a distribution's metadata declares (Requires-Dist, its markers evaluated as pip
    evaluates them on the node) that another installed distribution does not meet: a hard one (no extra, what
    `pip check` reads), or one of an extra named after a distribution that is installed (runtime_extra). Missing
    distributions are not judged here: importing the package says so at once."""
    unmet: Dict[Tuple[str, str], Unmet] = {}  # one per requirement: transformers repeats one in several extras
    for owner, lines in sorted(requires.items()):
        for line in lines or ():
            name = requirement_name(line)
            if not name:
                continue  # pip would not have installed a distribution whose metadata it cannot read
            requirement = Requirement(str(line))
            have = installed.get(name)
            if not have or version(have) is None:
                continue
            extra = _extra_applying(requirement.marker, python, installed)
            if extra is None or requirement.specifier.contains(have, prereleases=True):
                continue
            failing = [s for s in requirement.specifier if not s.contains(have, prereleases=True)]
            lower = any(_below(spec, version(have)) for spec in failing)
            text = str(requirement).split(";")[0].strip()
            seen = unmet.get((owner, text))
            if seen is None or not extra:  # a hard requirement is the one to say
                unmet[(owner, text)] = Unmet(owner, text, name, have, (extra,) if extra else (), lower)
            elif seen.extras and extra not in seen.extras:
                unmet[(owner, text)] = replace(seen, extras=seen.extras + (extra,))
    return list(unmet.values())


def _below(spec, have: Version) -> bool:
    """Whether a specifier the version fails is a lower bound it is below (not a cap or an exclusion above it)."""
    if spec.operator in (">=", ">"):
        return True
    bound = version(spec.version.replace(".*", "")) if spec.operator in ("~=", "==", "===") else None
    return bound is not None and have < bound


EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _extra_applying(marker: Optional[Marker], python: Optional[str], installed) -> Optional[str]:
    """"" where the requirement is a hard one on the node, the runtime extra that adds it, or None."""
    if marker is None:
        return ""
    environment = {"extra": ""}
    if python:
        environment.update(python_version=".".join(python.split(".")[:2]), python_full_version=python)
    try:
        if marker.evaluate(environment):
            return ""
        for extra in EXTRA.findall(str(marker)):
            if runtime_extra(extra, installed) and marker.evaluate(dict(environment, extra=extra)):
                return extra
    except (InvalidMarker, UndefinedEnvironmentName, UndefinedComparison):
        pass
    return None
