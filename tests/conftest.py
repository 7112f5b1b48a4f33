"""What every test shares: the CLI run in-process (run_cli) and as a user runs it (run_subprocess,
preflight_json), a HF_HOME of the test's own, the run's test cluster (cluster.py, shared_cluster), and the hooks
of check_outcomes.py (the statuses each built-in check was shown to give, for
checks/test_every_check_fails_and_passes.py). The helpers beside this file
(cluster.py, node_facts.py, ...) are imported by bare name: pyproject's pytest `pythonpath` holds tests/."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from check_outcomes import (  # noqa: F401  (hooks: the statuses each built-in check was shown to give)
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_logfinish, pytest_runtest_logreport,
    pytest_runtest_protocol, pytest_testnodedown)
from cluster import shared_cluster  # noqa: F401  (fixture: the run's one test cluster, which cluster_up hands out)
from preflight.cli import main

# How the suite is shared between pytest-xdist's workers (scripts/test runs it on two).
pytest_plugins = ("workers",)

# DeepSpeed on the CPU builds its shared-memory op (deepspeed_shm_comm) with torch's JIT builder in every process
# that starts it; the build is kept per environment, not in ~/.cache, so two clones' environments do not rebuild it
# over each other (about 35 s each time).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(scope="session")
def dist(tmp_path_factory):
    """(wheel, sdist) built by setuptools' own build backend from a copy of the tracked files: once for the run,
    for each test that installs the distribution."""
    root = Path(__file__).resolve().parents[1]
    out, tree = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("tree") / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split("\n")
    for name in filter(None, files):
        if (root / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, tree / name)
    build = ("import sys; from setuptools import build_meta as b; out = sys.argv[1];"
             "w = b.build_wheel(out); s = b.build_sdist(out); print('built:', w, s)")
    proc = subprocess.run([sys.executable, "-c", build, out], capture_output=True, text=True, timeout=600, cwd=tree)
    assert proc.returncode == 0, f"building the distribution: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    wheel, sdist = [line for line in proc.stdout.splitlines() if line.startswith("built: ")][-1].split()[1:]
    return out / wheel, out / sdist


@pytest.fixture(autouse=True)
def no_default_accelerate_config(tmp_path_factory, monkeypatch):
    """Keep a developer's ~/.cache/huggingface/accelerate/default_config.yaml out of the tests."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def signalled_child():
    """preexec_fn of a child a test will send SIGHUP (or SIGINT) to: those signals at their default there. A run
    under nohup ignores SIGHUP, an ignored signal stays ignored across exec, and a shell started so cannot even
    trap it: without this the test would measure how the suite was started."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
