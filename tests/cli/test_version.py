"""One version, from preflight.__version__: the distribution's (pyproject reads it), `preflight --version`, the
JSON report and every node's facts, shipped with the collector by the head."""
import json
import subprocess
import sys
from pathlib import Path

import preflight
from preflight.remote import shipping

ROOT = Path(__file__).resolve().parents[2]


def test_version_line_names_the_distribution_and_the_version():
    proc = subprocess.run([sys.executable, "-m", "preflight", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"preflight-multinode {preflight.__version__}\n", proc


def test_the_distribution_reads_its_version_from_the_package():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == preflight.DISTRIBUTION == "preflight-multinode"
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "preflight.__version__"}


def test_shipped_facts_carry_the_version_of_the_head_that_shipped_them(tmp_path):
    # The node runs the shipped bundle under an interpreter that has no preflight at all (-I -S: no site
    # packages, no PYTHONPATH, and a working directory without the source tree).
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    stdin = shipping.shipped_input(shipping.AGENT, {"head": "127.0.0.1", "port": 29500}) + "done\n"
    command = shipping.shipped_command(str(bare))
    proc = subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    facts = json.loads(proc.stdout.splitlines()[0])
    assert facts["preflight"] == preflight.__version__, proc.stderr
