"""Recorded sysfs / procfs trees (tests/fixtures/sysfs/*.json) laid out as files under a folder, for the
collector's fabric facts (fabric.SYSROOT stands where "/" stands on a node).

A recording: {"about": ..., "files": {PATH: TEXT}, "links": {PATH: TARGET}}, paths relative to the root
(a link's target too). A change maps PATH to new text, or to None to remove that file.
"""
import json
import os
import pathlib
from unittest import mock

from preflight.node import fabric

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "sysfs"


def lay_out(root: pathlib.Path, recording: str, change=None) -> pathlib.Path:
    doc = json.loads((FIXTURES / f"{recording}.json").read_text())
    files = dict(doc["files"], **(change or {}))
    for path, text in files.items():
        if text is None:
            continue
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    for path, target in doc.get("links", {}).items():
        link = root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        (root / target).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / target, link.parent), link)
    return root


def fabric_facts(root: pathlib.Path, recording: str, change=None) -> dict:
    """The fabric fact a node with this tree sends: built by the collector, through JSON."""
    lay_out(root, recording, change)
    with mock.patch.object(fabric, "SYSROOT", str(root)):
        return json.loads(json.dumps(fabric.facts()))
