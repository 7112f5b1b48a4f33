"""Recorded sysfs / procfs trees (tests/fixtures/sysfs/*.json) laid out as files under a folder, for the
collector's fabric facts (fabric.SYSROOT stands where "/" stands on a node).

A recording: {"about": ..., "files": {PATH: TEXT}, "links": {PATH: TARGET}, "binary": {PATH: {"size": N,
"at": {OFFSET: HEX}}}}, paths relative to the root (a link's target too); a binary file (a PCI device's config
space) is N zero bytes with the given bytes at their offsets (hexadecimal, as `lspci -xxxx` prints them). A
change maps PATH to new text, to None to remove that file (or link), or to bytes.
"""
import json
import os
import pathlib
from unittest import mock

from preflight.node import fabric

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "sysfs"


def lay_out(root: pathlib.Path, recording: str, change=None) -> pathlib.Path:
    doc = json.loads((FIXTURES / f"{recording}.json").read_text())
    files = dict(doc["files"], **{path: binary(spec) for path, spec in doc.get("binary", {}).items()})
    files.update(change or {})
    for path, text in files.items():
        if text is None:
            continue
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)
    for path, target in doc.get("links", {}).items():
        if path in files and files[path] is None:  # a change removes this link too
            continue
        link = root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        (root / target).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / target, link.parent), link)
    return root


def binary(spec: dict) -> bytes:
    data = bytearray(spec["size"])
    for offset, text in spec.get("at", {}).items():
        chunk = bytes.fromhex(text)
        start = int(offset, 16)
        data[start:start + len(chunk)] = chunk
    return bytes(data)


def fabric_facts(root: pathlib.Path, recording: str, change=None) -> dict:
    """The fabric fact a node with this tree sends: built by the collector, through JSON."""
    lay_out(root, recording, change)
    with mock.patch.object(fabric, "SYSROOT", str(root)):
        return json.loads(json.dumps(fabric.facts()))
