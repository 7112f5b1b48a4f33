"""The corpus of published job files (tests/fixtures/realworld, its README.md and index/*.toml), each linted as a
user would lint it: from another folder, with an empty HOME and none of the files it names (tests/realworld.py).
A file labelled `works` gets no FAIL and no error, and only the warnings tests/fixtures/realworld/warnings.txt
accepts; a file labelled `broken` gets the finding its entry names. The warnings are printed per file: their
number goes down, not up (a warning that no longer comes is taken out of warnings.txt)."""
from __future__ import annotations

import re
from collections import Counter

import pytest

import realworld

ENTRIES = realworld.entries()
KINDS = ("sbatch", "k8s", "accelerate", "deepspeed")


@pytest.fixture(scope="module")
def outcomes():
    return realworld.lint_all(ENTRIES)


def test_the_corpus_is_the_size_the_issue_asks_for():
    kinds = Counter(e.kind for e in ENTRIES)
    assert kinds["sbatch"] >= 150 and kinds["k8s"] >= 60, kinds
    assert kinds["accelerate"] + kinds["deepspeed"] >= 250, kinds
    assert len({e.repo for e in ENTRIES}) >= 40


def test_every_entry_names_its_source_and_a_file_that_is_there():
    paths = [e.path for e in ENTRIES]
    assert len(paths) == len(set(paths)), [p for p, n in Counter(paths).items() if n > 1]
    for e in ENTRIES:
        assert e.kind in KINDS and e.label in ("works", "broken"), e
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e.repo) and re.fullmatch(r"[0-9a-f]{40}", e.commit), e
        assert e.upstream and (realworld.ROOT / e.path).is_file(), e
        if e.label == "broken":
            assert e.evidence.startswith("https://") and e.defect and len(e.expect) >= 2, e
    indexed = {realworld.ROOT / p for p in paths}
    unindexed = [p for p in realworld.ROOT.rglob("*") if p.is_file() and p not in indexed and p.parent.name != "index"
                 and p.name not in ("README.md", realworld.WARNINGS.name)]
    assert not unindexed, unindexed[:10]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.label == "works"], ids=lambda e: e.path)
def test_a_file_that_works_as_published_gets_no_fail(outcomes, entry):
    outcome = outcomes[entry.path]
    assert "Traceback" not in outcome.stderr and "failed to load" not in outcome.stderr, outcome.stderr
    assert outcome.code in (0, 1), f"exit {outcome.code}: {outcome.stderr}"
    bad = [f"{r['status']} {r['id']}: {r['message']}" for r in outcome.with_status("fail", "error")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.label == "broken"], ids=lambda e: e.path)
def test_a_broken_file_gets_its_cause(outcomes, entry):
    check_id, *words = entry.expect
    found = [r for r in outcomes[entry.path].with_status("fail", "warn") if r["id"] == check_id]
    assert any(all(w in r["message"] for w in words) for r in found), (entry.defect, found)


def test_the_warnings_are_the_ones_accepted_and_no_more(outcomes):
    got, accepted = realworld.warnings_of(outcomes), realworld.accepted_warnings()
    works = {e.path for e in ENTRIES if e.label == "works"}
    for path in sorted(works):
        for r in outcomes[path].with_status("warn"):
            print(f"{path}: WARN {r['id']} {r['message'][:200]}")
    print(f"{sum(n for (p, _), n in got.items() if p in works)} warnings over {len(works)} files that work")
    new = {k: n - accepted.get(k, 0) for k, n in got.items() if k[0] in works and n > accepted.get(k, 0)}
    gone = {k: n - got.get(k, 0) for k, n in accepted.items() if n > got.get(k, 0)}
    assert not new, f"new warnings (read each as the file's author would; accept one in {realworld.WARNINGS}): {new}"
    assert not gone, f"warnings that no longer come: take them out of {realworld.WARNINGS}: {gone}"
