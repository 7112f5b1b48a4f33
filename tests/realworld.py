"""The corpus of published job files (tests/fixtures/realworld, indexed in its index/*.toml): each file linted as a
user would lint it on a laptop (another folder, an empty HOME, no SLURM or launcher variables, none of the files
it names present), and what came out. tests/checks/test_realworld_corpus.py holds the results to the files'
labels; `python tests/realworld.py [PATH-PART ...]` prints them."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent / "fixtures" / "realworld"
OPTION = {"sbatch": "--sbatch", "k8s": "--k8s", "accelerate": "--config", "deepspeed": "--deepspeed"}
KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT", "TMPDIR")
WARNINGS = ROOT / "warnings.txt"  # the warnings accepted, one `path<TAB>check id` per warning


@dataclass
class Entry:
    path: str
    kind: str
    repo: str
    commit: str
    upstream: str
    label: str = "works"
    evidence: str = ""
    defect: str = ""
    expect: List[str] = field(default_factory=list)  # broken: the check ID and words the finding must contain
    block: str = ""
    note: str = ""


@dataclass
class Outcome:
    code: int
    results: List[dict]
    stderr: str

    def with_status(self, *statuses: str) -> List[dict]:
        return [r for r in self.results if r["status"] in statuses]


def entries() -> List[Entry]:
    found = []
    for index in sorted((ROOT / "index").glob("*.toml")):
        with open(index, "rb") as handle:
            for item in tomllib.load(handle).get("file", []):
                found.append(Entry(**item))
    return found


@contextlib.contextmanager
def as_a_user():
    """Another folder, an empty HOME, and only the environment a fresh login has."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pf-corpus-") as folder:
        home = Path(folder) / "home"
        work = Path(folder) / "work"
        home.mkdir()
        work.mkdir()
        os.environ.clear()
        os.environ.update({k: v for k, v in saved_env.items() if k in KEEP})
        os.environ.update({"HOME": str(home), "USER": "user"})
        os.chdir(work)
        try:
            yield
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)


def lint(entry: Entry) -> Outcome:
    """`preflight lint --json OPTION FILE` in-process, as a user would run it."""
    from preflight.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["lint", "--json", OPTION[entry.kind], str(ROOT / entry.path)])
    text = out.getvalue()
    doc = json.loads(text) if text.strip().startswith("{") else {"results": []}
    return Outcome(code, doc["results"], err.getvalue())


def lint_all(selected: List[Entry]) -> Dict[str, Outcome]:
    with as_a_user():
        return {e.path: lint(e) for e in selected}


def accepted_warnings() -> Dict[Tuple[str, str], int]:
    """The warnings the corpus is allowed, counted by (path, check id)."""
    counts: Dict[Tuple[str, str], int] = {}
    if WARNINGS.exists():
        for line in WARNINGS.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                path, check_id = line.split("\t")[:2]
                counts[(path, check_id)] = counts.get((path, check_id), 0) + 1
    return counts


def warnings_of(outcomes: Dict[str, Outcome]) -> Dict[Tuple[str, str], int]:
    counts: Dict[Tuple[str, str], int] = {}
    for path, outcome in outcomes.items():
        for r in outcome.with_status("warn"):
            counts[(path, r["id"])] = counts.get((path, r["id"]), 0) + 1
    return counts


if __name__ == "__main__":
    chosen = [e for e in entries() if not sys.argv[1:] or any(part in e.path or part == e.kind for part in sys.argv[1:])]
    outcomes = lint_all(chosen)
    for e in chosen:
        o = outcomes[e.path]
        bad = o.with_status("fail", "error", "warn")
        if bad or o.code not in (0, 1):
            print(f"== {e.path} [{e.kind}, {e.label}] exit {o.code} {o.stderr.strip()[:200]}")
            for r in bad:
                print(f"   {r['status'].upper():5} {r['id']} {r['message'][:300]}")
