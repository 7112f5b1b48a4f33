"""What every test shares: the CLI run in-process (run_cli) and as a user runs it (run_subprocess,
preflight_json), a HF_HOME of the test's own, and the hooks of check_outcomes.py (the statuses each built-in
check was shown to give, for checks/test_every_check_fails_and_passes.py). The helpers beside this file
(cluster.py, node_facts.py, ...) are imported by bare name: pyproject's pytest `pythonpath` holds tests/."""
import json
import os
import subprocess
import sys

import pytest

from check_outcomes import (  # noqa: F401  (hooks: the statuses each built-in check was shown to give)
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol)
from preflight.cli import main


@pytest.fixture(autouse=True)
def no_default_accelerate_config(tmp_path_factory, monkeypatch):
    """Keep a developer's ~/.cache/huggingface/accelerate/default_config.yaml out of the tests."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def run_cli(capsys, *args):
    """The CLI in-process: (exit code, parsed JSON document or stdout text, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args else out), err


def run_subprocess(*args, env=None, **kwargs):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "preflight", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=full_env, **kwargs)


def preflight_json(*args):
    """Run `preflight ARGS --json` as a user would: (the JSON document, seconds it took). It must exit as its
    verdict says and never print a traceback."""
    import time

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "preflight", *map(str, args), "--json"], capture_output=True,
                          text=True, timeout=180)
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == (1 if doc["verdict"] == "fail" else 0)
    return doc, elapsed


def results(doc, check_id):
    """A check's results by node."""
    return {node: r for r in doc["results"] if r["id"] == check_id for node in r["nodes"]}
