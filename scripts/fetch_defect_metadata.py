#!/usr/bin/env python3
"""Fetch, once, the real metadata of the releases the known-defects tests stage, and keep it as a fixture.

For each row of preflight/inputs/known_defects.toml: the newest release of its package inside the affected
range, the fixed release (else the first release above the range), the newest release below the range (a clean
one), and the newest release inside the range of each package the row pairs it with; and every release of the
stack's main libraries uploaded in the year before the fetch (the healthy stacks the tests stage, with the
newest release of the others), with its upload date from PyPI's JSON API. Each release's metadata
(Name, Version, Requires-Dist with its markers and extras, Requires-Python) is what pip reads:
`pip install --dry-run --no-deps --ignore-installed --report`, which fetches the metadata only (a wheel's
.metadata file; an sdist's, such as flash-attn's, is built); an sdist whose build fails here (old DeepSpeed)
gives the metadata it ships. Written to
tests/fixtures/known_defects/releases.json; run again after the table changes (a network is needed; the tests
are not).

    .venv/bin/python scripts/fetch_defect_metadata.py [--pip .venv/bin/pip]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packaging.version import Version  # noqa: E402

from preflight.inputs.versions import known_defects, specifiers, version  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "known_defects" / "releases.json"
# The distribution on PyPI for each package a row judges (NCCL: the wheel torch's CUDA 12 builds require).
DISTRIBUTION = {"torch": "torch", "nccl": "nvidia-nccl-cu12", "deepspeed": "deepspeed", "accelerate": "accelerate",
                "transformers": "transformers", "peft": "peft", "trl": "trl", "flash-attn": "flash-attn",
                "bitsandbytes": "bitsandbytes"}
# Releases of torch whose Requires-Dist names the NCCL wheel they load: the NCCL rows stage torch with one of them.
# pip as a user's machine runs it: PyPI's own releases, not a local wheel folder or index this machine adds (its
# torch 2.13.0+cpu has none of the CUDA wheel's Requires-Dist) and no constraints file.
PIP_ENV = dict({k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")},
               PIP_CONFIG_FILE=os.devnull, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")  # flash-attn: metadata only
TORCH_FOR_NCCL = ("2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.0", "2.7.1", "2.8.0", "2.9.1",
                  "2.10.0", "2.11.0")


def releases(pip: str, dist: str) -> list:
    """The final releases pip can see for DIST, oldest first."""
    out = subprocess.run([pip, "index", "versions", dist], capture_output=True, text=True, timeout=120,
                         env=PIP_ENV).stdout
    line = next((x for x in out.splitlines() if x.startswith("Available versions:")), "")
    found = [version(v) for v in line.split(":", 1)[1].split(",")] if line else []
    return sorted(v for v in found if v is not None and not v.is_prerelease and not v.is_devrelease)


# The libraries whose releases of the last year the healthy-stack test stages one by one.
RECENT = ("torch", "deepspeed", "accelerate", "transformers", "peft", "trl")


def uploaded(dist: str) -> dict:
    """version -> the date its first file was uploaded (PyPI's JSON API)."""
    with urllib.request.urlopen(f"https://pypi.org/pypi/{dist}/json", timeout=60) as answer:
        releases = json.load(answer)["releases"]
    return {v: min(f["upload_time"] for f in files)[:10] for v, files in releases.items() if files}


TRIES = 4  # releases tried for one slot, best first, when pip cannot read a release's metadata (an old sdist)


def candidates(row, available: dict) -> dict:
    """The real releases a row's tests may stage, best first: affected (the newest inside the range), fixed (the
    row's, else the first above the range), clean (the newest below it), and each paired package inside its
    range (the newest)."""
    spec = specifiers(row.affected)
    mine = available.get(DISTRIBUTION.get(row.package, ""), [])
    inside = [v for v in mine if v in spec]
    above = [v for v in mine if inside and v > inside[-1] and v not in spec]
    fixed = [version(row.fixed)] if row.fixed and version(row.fixed) in mine else above
    below = [v for v in mine if inside and v < inside[0] and v not in spec]
    slots = {"affected": inside[::-1], "fixed": fixed[:1] + [v for v in above if v not in fixed[:1]], "clean": below[::-1]}
    if not DISTRIBUTION.get(row.package):
        slots = {}
    for package, paired in row.with_:
        slots[f"with:{package}"] = [v for v in available.get(DISTRIBUTION.get(package, ""), [])
                                    if v in specifiers(paired)][::-1]
    return {slot: [str(v) for v in found[:TRIES]] for slot, found in slots.items()}


def metadata(pip: str, wanted: set) -> dict:
    """{dist: {version: {"requires_dist": [...], "requires_python": ...}}} for each (dist, version), fetched in
    rounds of one release per distribution (pip takes one release of a name at a time); a round pip refuses is
    fetched again one release at a time, and a release that still fails is said and left out."""
    found: dict = {}
    queue: dict = {}
    for dist, ver in sorted(wanted):
        queue.setdefault(dist, []).append(ver)
    while any(queue.values()):
        group = [(dist, versions.pop()) for dist, versions in queue.items() if versions]
        if not _fetch(pip, group, found):
            for one in group:
                if (len(group) == 1 or not _fetch(pip, [one], found)) and not _from_sdist(pip, *one, found):
                    print(f"  not fetched: {one[0]}=={one[1]}", file=sys.stderr)
    return found


def _from_sdist(pip: str, dist: str, ver: str, found: dict) -> bool:
    """The metadata an sdist ships, for a release whose metadata pip cannot build here (an old DeepSpeed's
    setup.py imports pydantic 1): its PKG-INFO's Requires-Dist, else its egg-info requires.txt as setuptools
    turns it into Requires-Dist ([extra] sections -> extra == "extra", [:marker] sections -> the marker)."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([pip, "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest", folder,
                               f"{dist}=={ver}"], capture_output=True, text=True, timeout=900, env=PIP_ENV)
        archives = list(Path(folder).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            return False
        with tarfile.open(archives[0]) as sdist:
            names = sdist.getnames()
            info = next((n for n in names if n.count("/") == 1 and n.endswith("/PKG-INFO")), None)
            header = sdist.extractfile(info).read().decode().split("\n\n", 1)[0] if info else ""
            requires = [line.split(":", 1)[1].strip() for line in header.splitlines()
                        if line.startswith("Requires-Dist:")]
            listed = next((n for n in names if n.endswith(".egg-info/requires.txt")), None)
            if not requires and listed:
                requires = _requires_txt(sdist.extractfile(listed).read().decode())
    python = next((line.split(":", 1)[1].strip() for line in header.splitlines()
                   if line.startswith("Requires-Python:")), None)
    found.setdefault(dist, {})[ver] = {"requires_dist": requires, "requires_python": python}
    print(f"  {dist} {ver} (from its sdist)", file=sys.stderr)
    return True


def _requires_txt(text: str) -> list:
    """An egg-info requires.txt as the Requires-Dist lines setuptools writes for it."""
    lines, marker = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            extra, _, condition = line[1:-1].partition(":")
            parts = ([f"({condition})" if extra else condition] if condition else []) + (
                [f'extra == "{extra}"'] if extra else [])
            marker = " and ".join(parts)
            continue
        lines.append(f"{line}; {marker}" if marker else line)
    return lines


def _fetch(pip: str, group: list, found: dict) -> bool:
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        done = subprocess.run([pip, "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
                               "--no-build-isolation", "--report", report.name] + [f"{d}=={v}" for d, v in group],
                              capture_output=True, text=True, env=PIP_ENV, timeout=900)
        if done.returncode != 0:
            return False
        for item in json.load(open(report.name))["install"]:
            meta = item["metadata"]
            name = meta["name"].lower().replace("_", "-")
            found.setdefault(name, {})[meta["version"]] = {"requires_dist": meta.get("requires_dist") or [],
                                                           "requires_python": meta.get("requires_python")}
            print(f"  {name} {meta['version']}", file=sys.stderr)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pip", default=str(ROOT / ".venv" / "bin" / "pip"))
    args = parser.parse_args()
    available = {d: releases(args.pip, d) for d in sorted(set(DISTRIBUTION.values()))}
    today = datetime.date.today()
    year_ago = (today - datetime.timedelta(days=365)).isoformat()
    # slot -> (distribution, its candidate releases, best first)
    slots = {}
    for row in known_defects():
        for slot, found in candidates(row, available).items():
            package = slot.split(":", 1)[1] if slot.startswith("with:") else row.package
            slots[(row.id, slot)] = (DISTRIBUTION.get(package), found)
    for torch in TORCH_FOR_NCCL:
        slots[("nccl-pins", torch)] = ("torch", [torch])
    recent = {}
    for dist in RECENT:
        dates, seen = uploaded(dist), {str(v) for v in available[dist]}
        recent[dist] = sorted((v for v, day in dates.items() if day >= year_ago and v in seen), key=Version)
        slots.update(((f"recent:{dist}", v), (dist, [v])) for v in recent[dist])
    for dist in sorted(set(DISTRIBUTION.values())):
        slots[("newest", dist)] = (dist, [str(v) for v in available[dist][::-1][:TRIES]])
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    have, failed = old.get("metadata", {}), {tuple(x) for x in old.get("unreadable", [])}
    for attempt in range(TRIES):
        wanted = {(dist, found[attempt]) for dist, found in slots.values() if dist and len(found) > attempt
                  and not any(v in have.get(dist, {}) for v in found[:attempt])}
        missing = {(d, v) for d, v in wanted if v not in have.get(d, {}) and (d, v) not in failed}
        for dist, by_version in metadata(args.pip, missing).items():
            have.setdefault(dist, {}).update(by_version)
        failed |= {(d, v) for d, v in missing if v not in have.get(d, {})}

    def pick(dist, found):
        return next((v for v in found if v in have.get(dist, {})), None)

    rows = {}
    for (row_id, slot), (dist, found) in slots.items():
        if row_id in ("nccl-pins", "newest") or row_id.startswith("recent:"):
            continue
        picks = rows.setdefault(row_id, {"affected": None, "fixed": None, "clean": None, "with": {}})
        if slot.startswith("with:"):
            picks["with"][slot[5:]] = pick(dist, found) if dist else None
        else:
            picks[slot] = pick(dist, found)
    for row in known_defects():
        rows.setdefault(row.id, {"affected": None, "fixed": None, "clean": None, "with": {}})
    recent = {dist: [v for v in found if v in have.get(dist, {})] for dist, found in recent.items()}
    newest = {dist: pick(dist, found) for (kind, dist), (_, found) in slots.items() if kind == "newest"}
    used = {(d, v) for d, found in slots.values() for v in found if d and v in have.get(d, {})}
    kept = {d: {v: have[d][v] for v in sorted(have[d], key=Version) if (d, v) in used} for d in sorted(have)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"fetched": today.isoformat(), "rows": rows, "recent": recent, "newest": newest,
                               "unreadable": sorted(failed), "metadata": {d: v for d, v in kept.items() if v}},
                              indent=1, sort_keys=True) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {sum(map(len, kept.values()))} releases of {len(kept)} distributions; "
          f"{len(failed)} whose metadata pip could not read: {', '.join(f'{d}=={v}' for d, v in sorted(failed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
